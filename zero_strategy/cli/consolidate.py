"""zero-consolidate: turn a sharded checkpoint directory into one regular Lightning checkpoint.

    zero-consolidate outputs/zero-train/<run>/checkpoints/last.ckpt model.ckpt
    zero-consolidate CKPT_DIR model.ckpt --safetensors model.safetensors   # also the weights alone
    zero-consolidate CKPT_DIR weights.ckpt --weights-only                  # no optimizer state

The output holds the full fp32 state_dict (tied and frozen weights included) and, unless
--weights-only, the optimizer states in torch's layout, so LitModule.load_from_checkpoint(OUT),
torch.load(OUT, weights_only=True) and Trainer.fit(ckpt_path=OUT) with DDP or ZeRO all read it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

from ..checkpoint import CheckpointError, consolidate_checkpoint


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="zero-consolidate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("ckpt_dir", help="a sharded checkpoint directory written by ZeroStrategy")
    parser.add_argument("out", help="the checkpoint file to write")
    parser.add_argument("--safetensors", metavar="PATH", help="also write the weights alone as safetensors")
    parser.add_argument("--weights-only", action="store_true", help="leave out optimizer, scheduler and callback state")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        out = consolidate_checkpoint(args.ckpt_dir, args.out, args.safetensors, weights_only=args.weights_only)
    except (CheckpointError, FileNotFoundError) as err:
        print(f"zero-consolidate: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s"
          + (f"; weights also in {args.safetensors}" if args.safetensors else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
