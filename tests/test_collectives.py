"""The engine's collectives on 4 gloo ranks, whole and split into pairs: the reduce-scatter (an
all-to-all and a sum on gloo: [Note: reduce-scatter on gloo]) and the all-gather (broadcasts or
gloo's own: [Note: all-gather on gloo]), with and without the order guard's header, give exactly the sums and concatenations they stand for,
each path is taken where the note says (broadcasts only when every rank computes on one thread, so
ranks with other thread counts still run the same collectives), and the bytes counted are those of
the collective."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_strategy.engine import Collectives
from zero_strategy.engine.comm import collectives as collectives_module
from zero_strategy.engine.diagnose.header import Header
from zero_strategy.engine.comm.volume import sent_bytes

from .distributed import run_distributed

SMALL, LARGE = 1000, collectives_module.BROADCAST_GATHER_BYTES // 4 + 1000  # fp32 elements per rank


def _exact_values(n: int, seed: int) -> torch.Tensor:
    """Small integers in fp32: every sum of them is exact, in any order."""
    return torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(seed)).float()


def _check(rank: int, world_size: int) -> dict:
    broadcasts = []
    real_broadcast = dist.broadcast

    def counting_broadcast(*args, **kwargs):
        broadcasts.append(1)
        return real_broadcast(*args, **kwargs)

    dist.broadcast = counting_broadcast
    try:
        found: dict = {}
        # threads per rank: all one, all two, and only rank 0 on one (the ranks must agree on gloo's own)
        for setting, threads in (("1 threads", 1), ("2 threads", 2), ("mixed threads", 1 if rank == 0 else 2)):
            torch.set_num_threads(threads)
            whole = Collectives()  # a new one asks the ranks again (the answer is kept per instance)
            for name, comm in (("whole", whole), ("pairs", whole.consecutive(2))):
                n = comm.world_size
                members = comm.global_ranks
                for numel in (SMALL, LARGE):
                    key = f"{name}/{numel}/{setting}"
                    # all-gather: every member's own values, concatenated in rank order
                    before = len(broadcasts)
                    out = torch.full((n * numel,), float("nan"))
                    mine = _exact_values(numel, 100 + rank)
                    comm.all_gather(out, mine).wait()
                    want = torch.cat([_exact_values(numel, 100 + r) for r in members])
                    found[f"gather {key}"] = (torch.equal(out, want), len(broadcasts) - before)
                    # in place: the input is this rank's chunk of the output
                    out = torch.full((n * numel,), float("nan"))
                    out.view(n, -1)[comm.rank].copy_(mine)
                    comm.all_gather(out, out.view(n, -1)[comm.rank]).wait()
                    found[f"gather in place {key}"] = torch.equal(out, want)
                    # with the order guard's header ([Note: the collective header]): the same chunks, by the
                    # same path, and every member's words checked once waited
                    seen: list = []
                    words = torch.tensor([dist.get_rank(), numel, 7, -1], dtype=torch.int32)
                    out = torch.full((n * numel,), float("nan"))
                    before = len(broadcasts)
                    comm.all_gather(out, mine, header=Header(words, seen.append)).wait()
                    got_words = seen[0].tolist() if len(seen) == 1 else None
                    found[f"gather with header {key}"] = (
                        torch.equal(out, want) and got_words == [[r, numel, 7, -1] for r in members],
                        len(broadcasts) - before)
                    # reduce-scatter: chunk k of the sum over members lands on member k
                    inputs = {r: _exact_values(n * numel, 200 + r) for r in members}
                    want_chunk = sum(inputs[r] for r in members).view(n, -1)[comm.rank]
                    for how in ("scratch", "no scratch", "in place"):
                        x = inputs[dist.get_rank()].clone()
                        out = x.view(n, -1)[comm.rank] if how == "in place" else torch.empty(numel)
                        scratch = torch.empty_like(x) if how == "scratch" else None
                        comm.reduce_scatter(out, x, scratch=scratch).wait()
                        found[f"reduce-scatter {how} {key}"] = torch.equal(out, want_chunk)
        torch.set_num_threads(1)
        # the bytes of the collectives, whichever way they ran
        whole = Collectives()
        whole.begin_step()
        whole.all_gather(torch.empty(world_size * LARGE), torch.zeros(LARGE)).wait()
        whole.reduce_scatter(torch.empty(LARGE), torch.zeros(world_size * LARGE)).wait()
        whole.end_step()
        nbytes = world_size * LARGE * 4
        found["bytes"] = (whole.comm_stats()["all_gather"], whole.comm_stats()["reduce_scatter"],
                          sent_bytes("all_gather", nbytes, world_size), sent_bytes("reduce_scatter", nbytes, world_size))
        return found
    finally:
        dist.broadcast = real_broadcast
        torch.set_num_threads(1)


def test_reduce_scatter_and_all_gather_are_exact_and_take_the_path_the_notes_give():
    results = run_distributed(_check, 4)
    for rank, found in enumerate(results):
        sent_gather, sent_scatter, want_gather, want_scatter = found.pop("bytes")
        assert (sent_gather, sent_scatter) == (want_gather, want_scatter), rank
        assert want_scatter == want_gather == 3 * LARGE * 4  # (n-1)/n of the full buffer, both
        for key, value in found.items():
            if key.startswith("gather ") and not key.startswith("gather in place"):
                exact, broadcasts = value
                assert exact, (rank, key)
                size = 4 if "whole/" in key else 2
                by_broadcasts = f"/{LARGE}/1 threads" in key  # every rank on one thread, and large
                assert broadcasts == (size if by_broadcasts else 0), (rank, key, broadcasts)
            else:
                assert value, (rank, key)
