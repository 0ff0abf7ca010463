"""zero-consolidate: turn a sharded checkpoint directory into one regular Lightning checkpoint, or a Hugging Face model.

    zero-consolidate outputs/zero-train/<run>/checkpoints/last.ckpt model.ckpt
    zero-consolidate CKPT_DIR --hf OUT_DIR [--dtype bf16] [--max-shard-size 5GB]   # for from_pretrained(OUT_DIR)
    zero-consolidate CKPT_DIR model.ckpt --safetensors model.safetensors   # also the weights alone
    zero-consolidate CKPT_DIR weights.ckpt --weights-only                  # no optimizer state
    zero-consolidate DEEPSPEED_DIR model.ckpt [--tag global_step1000]      # a DeepSpeed ZeRO checkpoint

A DeepSpeed checkpoint directory (``engine.save_checkpoint``'s, or Lightning's DeepSpeedStrategy's)
is read without DeepSpeed: the fp32 weights from its master partitions, the optimizer state in
torch's layout; --tag picks a save other than the one its ``latest`` file names.

The output holds the full fp32 state_dict (tied and frozen weights included) and, unless
--weights-only, the optimizer states in torch's layout, so LitModule.load_from_checkpoint(OUT),
torch.load(OUT, weights_only=True) and Trainer.fit(ckpt_path=OUT) with DDP or ZeRO all read it.
--hf writes the Hugging Face layout instead (or as well): config.json (the one the model had when
the checkpoint was saved, or --config), model.safetensors or model-0000k-of-0000n.safetensors shards
of at most --max-shard-size with model.safetensors.index.json, under the model's own key names (the
LightningModule's attribute prefix, such as "model.", stripped; --prefix names it where the module
held no transformers model or several), tied weights once as transformers writes them. It reads
and writes one tensor at a time, so memory stays near one tensor, not the model. A peft model is
written with its LoRA adapters merged into the base weights, and its adapter alone goes into
OUT_DIR/adapter (adapter_model.safetensors and adapter_config.json, for PeftModel.from_pretrained;
--adapter-dir NAME elsewhere inside OUT_DIR, --no-adapter to leave it out). --dtype converts every
tensor (default: the checkpoint's most precise values, the fp32 masters of a mixed-precision run).
It checks each part it reads against its checksum (the optimizer state, which it does not read,
is not checked); a damaged one fails the export, leaving an earlier export in OUT_DIR as it was.

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
from typing import Optional, Sequence, Union

from ..checkpoint import (CheckpointError, consolidate_checkpoint, consolidate_deepspeed_checkpoint,
                          is_deepspeed_checkpoint)
from ..checkpoint.hf_export import Exported, export_hf_checkpoint
from ..checkpoint.store import UnverifiedCheckpointWarning


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="zero-consolidate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("ckpt_dir", help="a sharded checkpoint directory written by ZeroStrategy, or a DeepSpeed one")
    parser.add_argument("out", nargs="?", help="the checkpoint file to write (optional with --hf)")
    parser.add_argument("--hf", metavar="OUT_DIR",
                        help="write a Hugging Face model directory (from_pretrained's layout)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="--hf: the dtype of every tensor written")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="--hf: shard files of at most SIZE "
                        "(5GB, 500MB, 2GiB; default 5GB); one model.safetensors when the model fits one")
    parser.add_argument("--config", metavar="PATH",
                        help="--hf: the config.json to write (a file, or a model directory)")
    parser.add_argument("--prefix", help="--hf: the attribute path of the model inside the LightningModule, stripped "
                        "from the keys (such as 'model.'; '' for none); default: the transformers model's")
    parser.add_argument("--adapter-dir", default="adapter", metavar="NAME",
                        help="--hf, peft models: the folder inside OUT_DIR for the adapter alone (default adapter)")
    parser.add_argument("--no-adapter", action="store_true", help="--hf, peft models: do not export the adapter alone")
    parser.add_argument("--safetensors", metavar="PATH", help="also write the weights alone as safetensors")
    parser.add_argument("--weights-only", action="store_true", help="leave out optimizer, scheduler and callback state")
    parser.add_argument("--tag", help="DeepSpeed checkpoints: the save to read (default: the one 'latest' names)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the checksums (for a huge checkpoint you trust): damaged bytes are written out as they are")
    args = parser.parse_args(argv)
    if args.out is None and args.hf is None:
        parser.error("give the checkpoint file to write, or --hf OUT_DIR for a Hugging Face model directory")
    start = time.perf_counter()
    try:
        out = _consolidate(args)
    except (CheckpointError, ValueError, OSError) as err:  # the checkpoint, a bad option, or the file system
        print(f"zero-consolidate: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a bug, or a checkpoint this version cannot read: the traceback is for the report
        traceback.print_exc()
        print(f"zero-consolidate: error: unexpected {type(err).__name__}: {err} (the traceback above is for a bug "
              "report)", file=sys.stderr)
        return 2
    if isinstance(out, Exported):
        adapter = f"; the adapter alone in {out.adapter}" if out.adapter is not None else ""
        print(f"wrote {out.path}: {out.tensors} tensors, {out.bytes / 2**20:.1f} MiB in {len(out.files)} file"
              f"{'s' if len(out.files) > 1 else ''}{adapter}, in {time.perf_counter() - start:.1f} s")
        return 0
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s"
          + (f"; weights also in {args.safetensors}" if args.safetensors else ""))
    return 0


def _consolidate(args: argparse.Namespace) -> Union[Path, Exported]:
    """Run the conversion, showing the checkpoint's own warnings (no checksums) as this tool's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnverifiedCheckpointWarning)
        try:
            if args.hf is not None:
                if is_deepspeed_checkpoint(args.ckpt_dir):
                    raise CheckpointError(f"--hf reads this package's sharded checkpoints; {args.ckpt_dir} is a "
                                          "DeepSpeed one: consolidate it to a file first, or load it into a run and "
                                          "call its strategy's save_pretrained.")
                exported = export_hf_checkpoint(args.ckpt_dir, args.hf, dtype=args.dtype,
                                             max_shard_size=args.max_shard_size, config=args.config,
                                             prefix=args.prefix, verify=not args.no_verify,
                                             adapter_dir=None if args.no_adapter else args.adapter_dir)
                if args.out is None:
                    return exported
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
