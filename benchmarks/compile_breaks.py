"""Graph breaks of torch.compile on a ZeRO stage-3 model: how many graphs and breaks dynamo makes.

    python benchmarks/compile_breaks.py [--model gpt2|mlp] [--layers N]

One process (a world of one: the hooks and their graph breaks are the same at any world size),
transformers' GPT-2 built from its config (random init) with ``ZeroConfig(stage=3)`` and nothing
else, or the stage benchmark's residual MLP; ``torch._dynamo.explain`` on one forward, eager and
sharded, printing the graph count, the break count and the break reasons. See [Note: compiled
modules] in zero_strategy/engine/parameters.py for why each unit's gather and release is a break.
"""

from __future__ import annotations

import argparse
import collections

import torch


def build(name: str, layers: int) -> tuple[torch.nn.Module, torch.Tensor]:
    if name == "gpt2":
        import transformers

        config = transformers.GPT2Config(n_layer=layers, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config), torch.randint(0, config.vocab_size, (2, 64))
    from benchmarks.stages_variants import ResidualMLP

    return ResidualMLP(1024, layers), torch.randn(4, 1024)


def explain(model: torch.nn.Module, x: torch.Tensor, label: str) -> None:
    torch._dynamo.reset()
    out = torch._dynamo.explain(model)(x)
    reasons = collections.Counter(str(b.reason).splitlines()[0][:110] for b in out.break_reasons)
    print(f"{label}: {out.graph_count} graphs, {out.graph_break_count} graph breaks, {out.op_count} ops captured")
    for reason, count in reasons.most_common():
        print(f"  {count} x {reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "mlp"])
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    from zero_strategy import ZeroConfig
    from zero_strategy.engine import shard_module

    torch.manual_seed(0)
    model, x = build(args.model, args.layers)
    model.eval()
    with torch.no_grad():
        explain(model, x, f"{args.model}, eager (no sharding)")
        sharder = shard_module(model, ZeroConfig(stage=3))
        print(f"stage 3 with its default units: {len(sharder.units)} units")
        explain(model, x, f"{args.model}, ZeRO stage 3")


if __name__ == "__main__":
    main()
