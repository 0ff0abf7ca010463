"""Stage 3 with nothing but its defaults, as users meet it, against DDP and torch FSDP2 (2 gloo ranks).

    python benchmarks/bench_stage3_defaults.py [--models mlp,gpt2,bert] [--steps 16] [--guard-steps 16]
                                               [--malloc glibc,mmap,thp,hugetlb]

For each model (the 8-block 1024-4096-1024 MLP of 67.1M parameters, transformers' GPT-2 small and
BERT-base built from their default configs, random init) and each variant, a fresh pair of
processes builds the model (seed 0), trains ``--steps`` steps of fp32 AdamW on the same batches,
and reports per rank: the process's peak resident memory (VmHWM, imports and model init included),
the same over the resident memory before the model was built, the resident memory after the first
and the last step, the median step time, and for ZeRO-3 ``memory_stats()`` against the formula 16
bytes x parameters / N. Variants:

- ``ddp``: torch DistributedDataParallel;
- ``zero3``: ``ZeroConfig(stage=3)`` with no other option, the engine ``Trainer(strategy="zero_stage_3")``
  runs (units chosen by size: see [Note: default units] in zero_strategy/engine/params/plan.py);
- ``zero3_heap`` (only when asked for): the same with ``cpu_mmap_threshold_mb=None``, glibc's malloc
  left as it comes (see [Note: glibc's mmap threshold] in zero_strategy/engine/buffers/malloc.py);
- ``fsdp2``: ``fully_shard`` on each block (the MLP's blocks, GPT2Block, BertLayer) and the root.

[Note: resident memory on glibc]
glibc's malloc keeps freed memory in its heap and hands it out again, and for blocks it once
served with mmap it raises the size above which it uses mmap (up to 32 MiB). A variant whose step
allocates and frees large buffers in a changing order (stage 3's gathered units, gradients staged
for the reduce-scatter, each op's outputs) fragments that heap, and its resident memory grows over
the first tens of steps although the bytes in use do not: a run of 4 steps shows less than a run
of 20. So the steps default to 16, the resident memory after the first and last step is printed,
and ``--malloc mmap`` runs every variant also with ``MALLOC_MMAP_THRESHOLD_=131072`` (blocks from
128 KiB go to mmap and back to the system when freed: the resident memory is the bytes in use,
and every large allocation costs fresh pages, which the step time shows); ``--malloc thp`` sets
``THP_MEM_ALLOC_ENABLE=1`` instead, with which torch allocates blocks of 2 MiB and more aligned to
2 MiB and asks for transparent huge pages for them (fewer, larger page faults); ``--malloc hugetlb``
sets ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4194304`` (glibc 2.35 and
later: blocks from 4 MiB go to mmap and back when freed, and glibc asks for transparent huge pages
for its heap and those maps, so fresh memory takes fewer, larger page faults).

The losses of the first steps are compared with DDP's. Then the ZeRO-3 processes time the order
guard ([Note: order guard]): ``--guard-steps`` more steps with the guard's headers in the all-gathers
and without, in turn (the same model, interleaved), printing the ratio of their medians (see also
bench_order_header.py, which reports the spread across rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

VARIANTS = ("ddp", "zero3", "zero3_heap", "fsdp2")
DEFAULT_VARIANTS = "ddp,zero3,fsdp2"


class Block(nn.Module):
    def __init__(self, d: int = 1024) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):  # (B, d) -> (B, d)
        return x + self.fc2(torch.relu(self.fc1(x)))


def build(name: str) -> tuple[nn.Module, type]:
    """The model and the class of its blocks (FSDP2's fully_shard units)."""
    if name == "mlp":
        return nn.Sequential(*[Block() for _ in range(8)]), Block
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config), transformers.models.gpt2.modeling_gpt2.GPT2Block
    config = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config), transformers.models.bert.modeling_bert.BertLayer


def loss_of(name: str, model: nn.Module, step: int, rank: int, batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name == "mlp":
        x, y = torch.randn(batch, 1024, generator=g), torch.randn(batch, 1024, generator=g)
        return F.mse_loss(model(x), y)
    ids = torch.randint(0, 30000, (batch, seq), generator=g)
    if name == "gpt2":
        return model(input_ids=ids, labels=ids).loss
    return model(input_ids=ids, labels=torch.randint(0, 2, (batch,), generator=g)).loss


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def run(rank: int, world: int, port: int, args: argparse.Namespace, model_name: str, variant: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zero_strategy import ZeroConfig, ZeroOptimizer, count_parameters, estimate_memory, memory_stats
    from zero_strategy.engine import shard_module

    baseline = _kib("VmRSS")
    torch.manual_seed(0)
    model, block_class = build(model_name)
    numel = sum(p.numel() for p in model.parameters())
    sharder = None
    if variant == "ddp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        forward = nn.parallel.DistributedDataParallel(model)
    elif variant.startswith("zero3"):
        config = ZeroConfig(stage=3) if variant == "zero3" else ZeroConfig(stage=3, cpu_mmap_threshold_mb=None)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sharder = shard_module(model, config)
        opt = ZeroOptimizer(inner, config, sharder=sharder)
        forward = model
    else:
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if isinstance(module, block_class):
                fully_shard(module)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        forward = model
    times, losses = [], []

    def step(i: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        loss = loss_of(model_name, forward, i, rank, args.batch, args.seq)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dist.barrier()
        losses.append(loss.item())
        return time.perf_counter() - start

    rss_after = []
    for i in range(args.steps):
        times.append(step(i))
        rss_after.append(_kib("VmRSS"))
    result = {"peak_rss": _kib("VmHWM"), "peak_over_baseline": _kib("VmHWM") - baseline, "step_s": times,
              "rss_first": rss_after[0], "rss_last": rss_after[-1],
              "losses": losses[: args.steps], "params": numel}
    if sharder is not None:
        stats = memory_stats(model, [opt])
        result.update(model_state=stats["total"], formula=estimate_memory(count_parameters(model), stage=3,
                                                                          world_size=world)["total"],
                      units=len(sharder.units), largest_unit=max(sum(g.layout.numel for g in u.groups)
                                                                 for u in sharder.units))
        on, off = [], []
        for i in range(args.guard_steps):  # the order guard on and off in turn, on the same model
            sharder.guard.enabled = i % 2 == 0
            (on if sharder.guard.enabled else off).append(step(args.steps + i))
        sharder.guard.enabled = True
        result.update(guard_on=on, guard_off=off)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MALLOC_ENV = {"glibc": {}, "mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}, "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
              "hugetlb": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4194304"}}
"""What each ``--malloc`` choice sets in the ranks' environment (read by glibc when they start)."""


def measure(args: argparse.Namespace, model_name: str, variant: str, malloc: str = "glibc") -> list[dict]:
    saved = dict(os.environ)
    os.environ.update(MALLOC_ENV[malloc])  # spawned ranks start with this environment
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result")
            mp.start_processes(run, args=(2, _free_port(), args, model_name, variant, out), nprocs=2,
                               start_method="spawn")
            return [json.load(open(f"{out}.{r}")) for r in range(2)]
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,gpt2,bert")
    parser.add_argument("--steps", type=int, default=16, help="see [Note: resident memory on glibc]")
    parser.add_argument("--malloc", default="glibc", help="comma-separated: glibc (as it comes), mmap "
                        "(MALLOC_MMAP_THRESHOLD_=131072), thp (THP_MEM_ALLOC_ENABLE=1: torch allocates blocks from "
                        "2 MiB aligned, as transparent huge pages), hugetlb (GLIBC_TUNABLES: mmap from 4 MiB, huge pages); "
                        "see [Note: resident memory on glibc]")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of {','.join(VARIANTS)}")
    parser.add_argument("--guard-steps", type=int, default=16, help="steps timing the order guard (on/off in turn)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample (GPT-2, BERT)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.malloc.split(",") if m not in MALLOC_ENV]
    args.variants = args.variants.split(",")
    if not {"ddp", "zero3"} <= set(args.variants) or any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants {','.join(args.variants)}: choose among {', '.join(VARIANTS)}, ddp and zero3 among them")
    if unknown:
        parser.error(f"--malloc {','.join(unknown)}: choose among {', '.join(MALLOC_ENV)}, comma-separated")
    print(f"2 gloo ranks, 1 thread each, fp32 AdamW, batch {args.batch} (x {args.seq} tokens for GPT-2/BERT), "
          f"{args.steps} steps; torch {torch.__version__}")
    for model_name in args.models.split(","):
        for malloc in args.malloc.split(","):
            results = {v: measure(args, model_name, v, malloc) for v in args.variants}
            ddp = results["ddp"]
            print(f"\n{model_name}: {ddp[0]['params'] / 1e6:.1f}M parameters, malloc: {malloc} "
                  f"{MALLOC_ENV[malloc] or '(as it comes)'}")
            print(f"{'variant':8} {'peak RSS/rank':>14} {'vs DDP':>7} {'over baseline':>14} {'vs DDP':>7} "
                  f"{'RSS after step 1':>17} {'after last':>11} {'step':>8} {'max |loss - DDP|':>17}")
            for variant, ranks in results.items():
                peak = max(r["peak_rss"] for r in ranks)
                over = max(r["peak_over_baseline"] for r in ranks)
                step = statistics.median(t for r in ranks for t in r["step_s"][1:] or r["step_s"])
                diff = max(abs(a - b) for r, d in zip(ranks, ddp) for a, b in zip(r["losses"], d["losses"]))
                print(f"{variant:8} {peak / 2**20:11.0f} MiB {peak / max(x['peak_rss'] for x in ddp):6.2f}x "
                      f"{over / 2**20:11.0f} MiB {over / max(x['peak_over_baseline'] for x in ddp):6.2f}x "
                      f"{max(r['rss_first'] for r in ranks) / 2**20:13.0f} MiB "
                      f"{max(r['rss_last'] for r in ranks) / 2**20:7.0f} MiB {step:7.3f}s {diff:17.2e}")
        z = results["zero3"][0]
        print(f"zero3 model state (memory_stats) {z['model_state'] / 2**20:.0f} MiB per rank = "
              f"{z['model_state'] / z['formula']:.3f} x the formula 16 x params / N ({z['formula'] / 2**20:.0f} MiB); "
              f"{z['units']} units, the largest {z['largest_unit'] / 1e6:.2f}M elements")
        if args.guard_steps < 2:
            continue
        ratios = [statistics.median(r["guard_on"]) / statistics.median(r["guard_off"]) for r in results["zero3"]]
        print("order guard (headers in the all-gathers, every pass): a step's time with it over without, per rank: "
              + ", ".join(f"{x:.3f}" for x in ratios))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
