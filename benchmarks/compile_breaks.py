"""Graph breaks of torch.compile on a ZeRO stage-3 model: how many graphs and breaks dynamo makes.

    python benchmarks/compile_breaks.py [--model gpt2|mlp] [--layers N] [--recompile-limit 64]

One process (a world of one: the hooks and their graph breaks are the same at any world size),
transformers' GPT-2 built from its config (random init) with ``ZeroConfig(stage=3)`` and nothing
else, or the stage benchmark's residual MLP; ``torch._dynamo.explain`` on one forward, eager and
sharded, printing the graph count, the break count and the break reasons, and the ops in the graphs
``torch.compile`` runs in one forward (a counting backend: a block's graph counts once per block).
See [Note: compiled modules] in zero_strategy/engine/params/flat_parameters.py for why each unit's gather and
release is a break, and why deep transformers need a higher ``recompile_limit``.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

if not __package__:  # run as a script: the repository root on sys.path (see bench_stages.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    graphs, executed = compiled_ops(model, x)
    print(f"{label}: dynamo.explain: {out.graph_count} graphs, {out.graph_break_count} graph breaks, {out.op_count} "
          f"ops captured; torch.compile: {graphs} graphs, {executed} ops run compiled in a forward")
    for reason, count in reasons.most_common():
        print(f"  {count} x {reason}")


def compiled_ops(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(graphs compiled, ops run compiled in one forward) of ``torch.compile(model)``, by a counting
    backend, the second call timed (the first compiles). explain() follows one frame's breaks; a
    graph reused by every block counts once there and once per block here."""
    torch._dynamo.reset()
    graphs, executed = [0], [0]

    def backend(gm: torch.fx.GraphModule, inputs) -> object:
        graphs[0] += 1
        ops = sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))

        def run(*args):
            executed[0] += ops
            return gm.forward(*args)
        return run

    compiled = torch.compile(model, backend=backend)
    compiled(x)
    executed[0] = 0
    compiled(x)
    return graphs[0], executed[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "mlp"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--recompile-limit", type=int, help="torch._dynamo.config.recompile_limit (default: torch's, 8)")
    args = parser.parse_args()
    if args.recompile_limit is not None:
        torch._dynamo.config.recompile_limit = args.recompile_limit
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
