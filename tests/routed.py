"""Models whose calls depend on the data, as users write them, for stage 3 without options (issue 52):
mixture-of-experts layers (a router and an ``nn.ModuleList`` of experts, each run only on the tokens
routed to it), DeepSeek's shared + routed experts, experts chosen without a router, a block applied a
per-rank number of times, and a branch taken on some ranks. Their Linear layers hold at least
``param_persistence_threshold``'s 100,000 elements, so that ``ZeroConfig(stage=3)`` shards them.

Each model's forward records what it called in ``record`` lists (one entry per forward, which the
tests read): which experts ran (and how often), how deep, whether the branch was taken."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D, FF, EXPERTS, TOKENS = 128, 800, 4, 3  # a Linear of D x FF: 102,400 weights, over the default threshold


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, FF)
        self.down = nn.Linear(FF, D)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoEGate(nn.Module):
    """DeepSeek's gate: a module holding its own (experts, D) weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, D) / D**0.5)

    def forward(self, x):
        return x @ self.weight.t()


class MoELayer(nn.Module):
    """Top-k routing over a ModuleList of experts; each expert runs on the tokens routed to it, once per
    routing slot in which any token chose it (so top-2 may call one expert twice). ``gate``: "linear"
    (Mixtral), "module" (DeepSeek's MoEGate) or "hash" (no router: the token's first feature decides)."""

    def __init__(self, top_k: int, gate: str = "linear", shared: bool = False) -> None:
        super().__init__()
        self.top_k, self.hashed = top_k, gate == "hash"
        self.gate = nn.Linear(D, EXPERTS, bias=False) if gate == "linear" else MoEGate() if gate == "module" else None
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.shared_expert = Expert() if shared else None
        self.record: list = []

    def forward(self, x):  # (T, D)
        if self.hashed:
            idx = (x[:, :self.top_k].detach() * 1000).long().abs() % EXPERTS  # (T, k)
            weights = torch.full(idx.shape, 1.0 / self.top_k)
        else:
            weights, idx = torch.softmax(self.gate(x), -1).topk(self.top_k, -1)  # (T, k)
        out = self.shared_expert(x) if self.shared_expert is not None else torch.zeros_like(x)
        called = []
        for slot in range(self.top_k):
            for e, expert in enumerate(self.experts):
                rows = (idx[:, slot] == e).nonzero().squeeze(1)
                if rows.numel():
                    called.append(e)
                    out = out.index_add(0, rows, weights[rows, slot, None] * expert(x[rows]))
        self.record.append(called)  # one list per forward
        return out


class MoEBlock(nn.Module):
    def __init__(self, top_k: int, gate: str, shared: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.moe = MoELayer(top_k, gate, shared)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class MoENet(nn.Module):
    def __init__(self, top_k: int = 1, gate: str = "linear", shared: bool = False, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList(MoEBlock(top_k, gate, shared) for _ in range(layers))
        self.head = nn.Linear(D, 4)

    @property
    def record(self) -> list:
        return [b.moe.record for b in self.blocks]

    def forward(self, x, depth=None):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class AdaptiveDepth(nn.Module):
    """One block applied ``depth`` times, ``depth`` chosen per rank and step (adaptive computation)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.block = Expert()
        self.head = nn.Linear(D, 4)
        self.record: list = []

    def forward(self, x, depth=None):
        h = self.inp(x)
        self.record.append(depth)
        for _ in range(depth):
            h = h + self.block(h)
        return self.head(h)


class GatedBlock(nn.Module):
    """``extra`` runs only where the batch asks for it (its first feature's sign): on some ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.extra, self.last = Expert(), Expert(), Expert()
        self.record: list = []

    def forward(self, x):
        h = x + self.first(x)
        taken = bool(x[0, 0] > 0)
        self.record.append(taken)
        if taken:
            h = h + self.extra(h)
        return h + self.last(h)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(2))
        self.head = nn.Linear(D, 4)

    @property
    def record(self) -> list:
        return [b.record for b in self.blocks]

    def forward(self, x, depth=None):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


MODELS = {  # name: (factory, whether a rule of the plan sees it: else the leaves are learned)
    "top1": (lambda: MoENet(top_k=1), True),
    "top2": (lambda: MoENet(top_k=2), True),  # an expert called twice on a rank, now and then
    "shared-routed": (lambda: MoENet(top_k=2, gate="module", shared=True), True),  # DeepSeek's
    "hashed": (lambda: MoENet(top_k=1, gate="hash"), False),  # no router: learned
    "adaptive-depth": (AdaptiveDepth, False),
    "branch": (Branchy, False),
}


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rank ``rank``'s batch at ``step`` (micro-batch ``micro``): (x, y, depth)."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    x, y = torch.randn(TOKENS, 8, generator=g), torch.randn(TOKENS, 4, generator=g)
    return x, y, 1 + (rank + step) % 3


def batch_of(step: int, ranks: list[int], micro: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The batches of ``ranks`` (of a run over more ranks) as one: a run over fewer ranks sees the
    batches of the ranks it stands for."""
    parts = [batch(step, r, micro) for r in ranks]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), parts[0][2]


def loss_of(model, x, y, depth) -> torch.Tensor:
    return F.mse_loss(model(x, depth), y)
