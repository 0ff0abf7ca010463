"""A BERT sequence classifier (transformers' BertForSequenceClassification, built from a
BertConfig with random init) trained with ZeRO-2, AdamW at lr 1e-4, batch 8, on 2 CPU processes.

    python examples/bert_classifier/train.py                            # tiny BERT, ~1 min on 2 CPU cores
    python examples/bert_classifier/train.py --stage 1 --max-steps 1000
    python examples/bert_classifier/train.py --accelerator cuda --devices 8 --hidden-size 768 \\
        --layers 12 --heads 12 --seq-len 128 --precision bf16-mixed

No download: the task is telling 64-byte windows of the Python standard library's source from
windows in which a quarter of the bytes were replaced by random characters (labels: 1 clean,
0 corrupted), over byte ids, so no tokenizer either. Needs `pip install "zero-strategy[models]"`.
"""

from __future__ import annotations

import argparse
import functools

import lightning as L
import torch

from zero_strategy import ZeroStrategy, estimate_memory
from zero_strategy.data import CorruptedSourceDataModule
from zero_strategy.models import ClassifierModule, bert_for_classification


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage (1 or 2)")
    parser.add_argument("--precision", default="32-true",
                        help="Lightning precision: 32-true, bf16-mixed or 16-mixed")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8, help="per device")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    L.seed_everything(0)
    data = CorruptedSourceDataModule(seq_len=args.seq_len, batch_size=args.batch_size)
    net = bert_for_classification(num_labels=2, max_position_embeddings=args.seq_len, hidden_size=args.hidden_size,
                                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                  intermediate_size=4 * args.hidden_size)
    model = ClassifierModule(net, num_classes=2,
                             optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.01))
    trainer = L.Trainer(
        strategy=ZeroStrategy(stage=args.stage), accelerator=args.accelerator, devices=args.devices,
        precision=args.precision, max_steps=args.max_steps, val_check_interval=100, limit_val_batches=32,
        logger=False, enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=data)
    final = trainer.validate(model, datamodule=data, verbose=False)[0]

    n = sum(p.numel() for p in model.parameters())
    measured = trainer.strategy.memory_stats()
    expected = estimate_memory(n, stage=args.stage, world_size=trainer.world_size, precision=args.precision)
    print(f"[rank {trainer.global_rank}] {n:,} parameters; bytes on this rank, measured vs ZeRO formula:")
    for key in ("params", "grads", "optimizer_states", "master_params", "total"):
        print(f"[rank {trainer.global_rank}]   {key:<17}{measured[key]:>12,} {expected[key]:>12,}")
    if trainer.is_global_zero:
        print(f"validation accuracy: {final['val/acc']:.3f} (chance: 0.500)")
    torch.distributed.destroy_process_group()  # gloo's threads can abort an exiting interpreter


if __name__ == "__main__":
    main()
