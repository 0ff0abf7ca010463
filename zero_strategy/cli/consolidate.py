"""zero-consolidate: turn a sharded checkpoint directory into one regular Lightning checkpoint.

    zero-consolidate outputs/zero-train/<run>/checkpoints/last.ckpt model.ckpt
    zero-consolidate CKPT_DIR model.ckpt --safetensors model.safetensors   # also the weights alone
    zero-consolidate CKPT_DIR weights.ckpt --weights-only                  # no optimizer state
    zero-consolidate DEEPSPEED_DIR model.ckpt [--tag global_step1000]      # a DeepSpeed ZeRO checkpoint

A DeepSpeed checkpoint directory (``engine.save_checkpoint``'s, or Lightning's DeepSpeedStrategy's)
is read without DeepSpeed: the fp32 weights from its master partitions, the optimizer state in
torch's layout; --tag picks a save other than the one its ``latest`` file names.

The output holds the full fp32 state_dict (tied and frozen weights included) and, unless
--weights-only, the optimizer states in torch's layout, so LitModule.load_from_checkpoint(OUT),
torch.load(OUT, weights_only=True) and Trainer.fit(ckpt_path=OUT) with DDP or ZeRO all read it.
Every part of the checkpoint is checked against the checksum its save recorded before anything
is written; a damaged file is an error (--no-verify writes it out anyway). Any failure prints
"zero-consolidate: error: ..." and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Optional, Sequence

from ..checkpoint import (CheckpointError, consolidate_checkpoint, consolidate_deepspeed_checkpoint,
                          is_deepspeed_checkpoint)
from ..checkpoint.store import UnverifiedCheckpointWarning


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="zero-consolidate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("ckpt_dir", help="a sharded checkpoint directory written by ZeroStrategy, or a DeepSpeed one")
    parser.add_argument("out", help="the checkpoint file to write")
    parser.add_argument("--safetensors", metavar="PATH", help="also write the weights alone as safetensors")
    parser.add_argument("--weights-only", action="store_true", help="leave out optimizer, scheduler and callback state")
    parser.add_argument("--tag", help="DeepSpeed checkpoints: the save to read (default: the one 'latest' names)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the checksums (for a huge checkpoint you trust): damaged bytes are written out as they are")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        out = _consolidate(args)
    except (CheckpointError, OSError) as err:  # the checkpoint, or the file system (missing, full, not allowed)
        print(f"zero-consolidate: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a bug, or a checkpoint this version cannot read: the traceback is for the report
        traceback.print_exc()
        print(f"zero-consolidate: error: unexpected {type(err).__name__}: {err} (the traceback above is for a bug "
              "report)", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s"
          + (f"; weights also in {args.safetensors}" if args.safetensors else ""))
    return 0


def _consolidate(args: argparse.Namespace) -> Path:
    """Run the conversion, showing the checkpoint's own warnings (no checksums) as this tool's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnverifiedCheckpointWarning)
        try:
            if is_deepspeed_checkpoint(args.ckpt_dir):  # its zip files' CRCs are checked whatever --no-verify says
                return consolidate_deepspeed_checkpoint(args.ckpt_dir, args.out, tag=args.tag,
                                                        safetensors_path=args.safetensors,
                                                        weights_only=args.weights_only)
            if args.tag is not None:
                raise CheckpointError(f"--tag={args.tag!r} picks a save of a DeepSpeed checkpoint, but {args.ckpt_dir} "
                                      "is not one; leave --tag out.")
            return consolidate_checkpoint(args.ckpt_dir, args.out, args.safetensors, weights_only=args.weights_only,
                                          verify=not args.no_verify)
        finally:
            for w in caught:
                if issubclass(w.category, UnverifiedCheckpointWarning):
                    print(f"zero-consolidate: warning: {w.message}", file=sys.stderr)
                else:
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)


if __name__ == "__main__":
    sys.exit(main())
