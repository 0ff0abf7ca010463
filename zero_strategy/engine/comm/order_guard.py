"""Stage 3: every rank must gather the same unit at the same moment; say so when one does not.

[Note: order guard]
A stage-3 all-gather has a partner on every other rank only if every rank runs the same units in
the same order. When one rank skips a unit (a data-dependent branch) or runs one twice, its
all-gathers pair with other units' on the other ranks: with equal sizes the parameters are silently
wrong, with unequal ones the job hangs. So every unit's all-gathers carry a tag, (pass, gather
number in the pass, unit, phase, the unit it came from), in a header inside the collective itself
(see [Note: the collective header] in engine/diagnose/header.py), and when a gather is waited for,
before anything reads the gathered weights, every rank compares every rank's tag: any difference
is an ``UnitOrderError`` on every rank (all of them received the same tags), naming what each rank
was doing. The header costs no collective of its own, so every pass is checked, and outside passes
too (state dicts, gathered_parameters). (The guard used to issue an all-gather of its own per unit
gather, 3-6% of a step, and so checked only one pass in ``check_unit_order_every`` after the first
ten; that setting is now accepted and ignored, with a warning.) On the host (gloo) the tags are
compared at once, except those of a pass's gathers of 1 MiB or more, which carry no header and are
compared in bulk at the step (see [Note: headers left out on gloo] below). On CUDA they are
compared at the end of each pass (``flush``), which already
waits for the device, so the check never stalls the stream; there a divergence is named at the end
of its pass, before the optimizer step, and one that makes NCCL hang before that is left to
NCCL's own timeout. The tags are those of the gathers this rank issues: prefetches included, which
follow the same history on every rank.

When the tags differ because the ranks are in different parts of the program (one entered
``generate()`` where the other ended validation), the error says so first, from the boundaries the
ranks posted (see [Note: the rank board] in engine/diagnose/rank_board.py). A rank that has joined (``Join``, see
engine/join.py) replays a forward and backward of its own on the others' cue, so its tags are those of a
rank in step and the guard accepts it; the board notes it as joined, for messages.

[Note: headers left out on gloo]
On gloo a header costs more than its bytes for a large gather: one of 1 MiB or more goes as one
broadcast per rank straight into the gathered buffer ([Note: all-gather on gloo] in engine/comm/collectives.py),
which no header can join (its own small all-gather beside them cost 2-9% of a step), or, with
several threads per rank, would be staged beside its header and copied out (1.23-1.28x a step with
8 MiB blocks at two threads per rank; RESULTS.md, issue 34). So on gloo a gather in a pass of 1 MiB
or more sends no header (a smaller one still does, checked at once: staging it costs little, within
this host's noise): the guard keeps its tag and compares the tags kept on every rank later, in bulk,
by a digest (64 bits of BLAKE2b over them; ranks in step keep the same tags, so their digests are
equal, and different tags collide with chance 2^-63):
- at the optimizer step, in the tally of the step's all-reduce (see [Note: the step's tally] in
  engine/diagnose/tally.py), which every step makes anyway: no collective more, 16 bytes more in it;
- at the end of a pass that no backward ended (evaluation, generation), or of any pass once more
  than ``LEFT_OUT_MAX`` tags wait, with one all-reduce of 16 bytes of its own.
Digests that differ mean that some rank's gathers differ: every rank posts its kept tags on the
store and raises the UnitOrderError of the first gather that differed, before the step updates
anything. Mixed weights may have been computed with in the meantime (forward, backward, the
gradients' reduce-scatters), never stepped with. Ranks that part by a gather's *count* meet
collectives of different kinds first; there too the kept tags are compared before the kinds are
named (``Collectives.explain``); the tags also go in the groups' histories that a long wait
compares ([Note: collectives that differ] in engine/diagnose/divergence.py). A gather outside the passes (a state
dict, gathered_parameters) sends its header, checked at once: its weights may be written to a file
right after. NCCL sends every header (one coalesced group, no copy), and so does gloo where the
guard is switched to compare at the end of each pass as on CUDA (``deferred``, a test's switch).
"""

from __future__ import annotations

import array
import functools
import hashlib
import itertools
import weakref
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..diagnose import rank_board
from ..diagnose.header import Header, decode, encode
from ..diagnose.tally import NAME_WAIT_S, agreed, word_bytes
from ..diagnose.watchdog import out_of_step
from .collectives import Collectives

PHASES = ("forward", "backward", "prefetch for forward", "prefetch for backward", "recomputation in backward",
          "gathered_parameters or a state dict", "a leaf just learned")
FORWARD, BACKWARD, PREFETCH_FORWARD, PREFETCH_BACKWARD, RECOMPUTE, OUTSIDE, LEARNED = range(len(PHASES))
_DOING = (  # what a rank was doing when it gathered ``unit``; ``context`` is the unit it came from
    "starting the forward of {unit} (the unit it ran before: {context})",
    "starting the backward of {unit}",
    "prefetching {unit} while starting the forward of {context}",
    "prefetching {unit} while starting the backward of {context}",
    "recomputing the forward of {unit} in backward",
    "gathering {unit} outside forward and backward (gathered_parameters, a state dict)",
    "gathering {unit}, a leaf learned where the ranks asked for different units (engine/params/leaves.py)",
)

LEFT_OUT_MAX = 4096
"""Tags of gathers without their header kept at most until a pass's end compares them (see [Note:
headers left out on gloo])."""


class OrderGuard:
    """Tags every gather and compares the tags every rank sent (see [Note: order guard])."""

    def __init__(self, comm: Collectives, unit_names: Sequence[str], device: torch.device,
                 wait_s: float = 5.0) -> None:
        self.comm = comm
        self.wait_s = wait_s  # ``unit_order_wait``: see _waiting_long
        self.names = list(unit_names)
        self.device = device
        self.deferred = device.type == "cuda"
        self.enabled = comm.world_size > 1
        self.passes = 0  # passes begun: forward (and backward) of the whole module, or a step around it
        self.seq = 0  # gathers in the current pass
        self._unchecked: list[tuple[torch.Tensor, torch.Tensor]] = []  # deferred: (any difference, tags)
        self._left_out: list[tuple[int, ...]] = []  # tags of gathers sent without their header, not compared yet
        self._checks = 0  # comparisons of left-out tags passed (the same on ranks in step)
        self.leaves_out = False  # some gather went without its header
        self.advise: Optional[Callable[[list[int]], str]] = None  # the sharder's: which module to name a leaf
        OrderGuard.made += 1  # every rank makes its guards in the same order; the group's first rank and size
        self._made = OrderGuard.made
        self._key = f"gather/{OrderGuard.made}/{comm.global_rank(0)}+{comm.world_size}"  # tell subgroups apart
        self._members = {comm.global_rank(r) for r in range(comm.world_size)}
        comm.guards.append(weakref.ref(self))  # see Collectives.explain

    made = 0  # guards made in this process: the store's posts of one guard are not another's

    def begin_pass(self) -> None:
        self.flush()
        self.passes += 1
        self.seq = 0

    def header(self, unit: int, phase: int, context: int = -1) -> Optional[Header]:
        """The header of ``unit``'s all-gathers (None when the guard is off). ``context`` is the unit
        whose hook asks (see ``_DOING``), -1 for none."""
        if not self.enabled:
            return None
        self.seq += 1
        words = encode(self.passes, self.seq, unit, phase, context)
        defer = None if phase == OUTSIDE or self.deferred else functools.partial(self._leave_out, words)
        return Header(words, self._received, lambda waited: waited >= self.wait_s and self._waiting_long(words),
                      defer)

    # ---- headers left out: see [Note: headers left out on gloo] --------------------------

    def _leave_out(self, words: tuple[int, ...]) -> None:
        self._left_out.append(words)
        self.leaves_out = True

    def digest(self) -> int:
        """The digest of the tags left out since the last comparison, a positive int64 (0: none)."""
        if not self._left_out:
            return 0
        raw = array.array("q", itertools.chain.from_iterable(self._left_out)).tobytes()
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1 | 1

    def checked(self) -> None:
        """Every rank's ``digest`` was found equal to this one's."""
        self._left_out.clear()
        self._checks += 1

    def end_pass(self, step_follows: bool) -> None:
        """A pass ended: compare the deferred tags, and the left-out ones unless a step will (its
        backward ended: ``step_follows``) and not too many wait."""
        self.flush()
        if self._left_out and (not step_follows or len(self._left_out) > LEFT_OUT_MAX):
            digest = self.digest()
            sent = word_bytes(digest)
            reduced = sent.clone()
            self.comm.all_reduce(reduced, dist.ReduceOp.MAX,
                                 what=lambda: f"all-reduce of the digest of stage-3 gathers (pass {self.passes})")
            if not agreed(sent, reduced):
                self.explain_left_out()
                raise out_of_step(
                    f"ZeRO stage 3: the ranks gathered different units in the passes up to pass {self.passes} (the "
                    "digests of their gathers differ; the gathers themselves could not be read from the other ranks "
                    "in time). Every rank must run the same stage-3 units in the same order, whatever its data.",
                    self.comm.scope)
            self.checked()

    def explain_left_out(self, lengths_too: bool = True) -> None:
        """The ranks are out of step: post the tags left out since the last comparison, read the other
        ranks' (for at most NAME_WAIT_S) and raise UnitOrderError at the first gather that differed
        (with ``lengths_too``, also where one rank's tags end and another's go on). Returns when no
        gather here went without its header, when the tags could not be read, or when they agree."""
        board = rank_board.board()
        if not (self.leaves_out and board.enabled):
            return
        mine = self._left_out
        # every rank's: ranks in step keep the same tags, whatever their groups (hybrid sharding)
        posted = board.exchange(f"left_out/{self._made}/{self._checks}",
                                ";".join(",".join(map(str, tag)) for tag in mine), NAME_WAIT_S)
        kept = {board.rank: mine, **{r: [tuple(int(v) for v in tag.split(",")) for tag in text.split(";") if tag]
                                     for r, text in posted.items()}}
        for i in range(max(len(tags) for tags in kept.values())):
            row = {r: tags[i] if i < len(tags) else None for r, tags in kept.items()}
            if len(set(row.values()) - {None}) > 1 or (lengths_too and len(set(row.values())) > 1):
                self._raise_differing(row)

    def _waiting_long(self, words: tuple[int, ...]) -> None:
        """A wait for a gather has lasted ``wait_s`` (``unit_order_wait``): the ranks' collectives may
        differ in size or kind, so that no header arrives. Post this gather's tag on the store and
        compare it with the ones the others posted for the same gather number, whatever group theirs
        went over (the secondary partition's, say): a difference is an UnitOrderError, a match or
        nothing yet goes on waiting (see [Note: order guard]; the collectives' own histories are
        compared too: [Note: collectives that differ] in engine/diagnose/divergence.py)."""
        board = rank_board.board()
        if not board.enabled:
            return
        mine = list(words)
        try:
            board.post(self._key, ",".join(map(str, mine)))
            posted = {r: [int(v) for v in text.split(",")] for r, text in board.posted(self._key).items()}
        except Exception:  # the store is gone or slow: the watchdog goes on
            return
        same_point = {r: t for r, t in posted.items() if r in self._members and t[:2] == mine[:2]}
        if any(t != mine for t in same_point.values()):
            self.explain_left_out(lengths_too=False)  # an earlier gather may have differed already
            self._raise_differing({board.rank: tuple(mine), **{r: tuple(t) for r, t in same_point.items()}})

    def _received(self, tags: torch.Tensor) -> None:
        """Every rank's tag of one all-gather, (ranks, 4) int32, once it completed."""
        if self.deferred:
            self._unchecked.append(((tags != tags[:1]).any(), tags))
        else:
            self._compare(tags)

    def flush(self) -> None:
        """Compare the deferred tags (one device sync for all of them)."""
        if self._unchecked:
            unchecked, self._unchecked = self._unchecked, []
            if bool(torch.stack([differ for differ, _ in unchecked]).any()):
                for _, tags in unchecked:
                    self._compare(tags.cpu())

    def _compare(self, tags: torch.Tensor, ranks: Optional[Sequence[int]] = None) -> None:
        if bool((tags == tags[0]).all()):
            return
        ranks = ranks or [self.comm.global_rank(r) for r in range(len(tags))]  # global ranks, as the store's
        self._raise_differing(dict(zip(ranks, map(tuple, tags.tolist()))))

    def doing(self, words: tuple[int, ...]) -> str:
        """What a gather's tag says its rank was doing."""
        passes, seq, unit, phase, context = decode(torch.tensor([words], dtype=torch.int32))[0]
        doing = _DOING[phase].format(unit=self._name(unit), context=self._name(context)) \
            if 0 <= phase < len(_DOING) else f"phase {phase} of {self._name(unit)}"
        return f"{doing} (pass {passes}, gather {seq} in it)"

    def _raise_differing(self, tags: dict[int, Optional[tuple[int, ...]]]) -> None:
        """UnitOrderError naming each rank's tag (global rank -> its words; None: it gathered nothing more)."""
        lines = [f"  rank {rank}: " + (self.doing(tags[rank]) if tags[rank] is not None
                                       else "no further gather (it went on to other work)") for rank in sorted(tags)]
        board = rank_board.board()
        cause = board.divergence()
        if cause is not None:
            raise out_of_step(f"ZeRO stage 3: the ranks are not in step: {cause}\nThe gathers that differed:\n"
                              + "\n".join(lines) + "\n" + board.describe(), self.comm.scope)
        raise out_of_step(
            f"ZeRO stage 3: the ranks gathered different units at the same point (this rank's pass {self.passes}):\n"
            + "\n".join(lines) + "\n"
            "Every rank must run the same stage-3 units in the same order, whatever its data: a module skipped on one "
            "rank (a data-dependent branch), or called more often on one rank, leaves the others waiting for its "
            "parameters. Run every unit on every rank (compute the branch everywhere and multiply its result by 0 "
            "where it is not wanted), or make the module inside which the ranks part a leaf, with leaf_modules=[its "
            "class] (or DeepSpeed's set_z3_leaf_modules): nothing inside it is gathered on its own then."
            + self._advice(tags) + " Or keep such a module out of the units: with shard_modules naming other "
            "classes, its parameters stay in the root unit, gathered for the whole step.", self.comm.scope)

    def _advice(self, tags: dict[int, Optional[tuple[int, ...]]]) -> str:
        """The sharder's words on which module to name (``advise``): the one holding the units the tags name."""
        if self.advise is None:
            return ""
        rows = [decode(torch.tensor([t], dtype=torch.int32))[0] for t in tags.values() if t is not None]
        units = [u for row in rows for u in (row[2], row[4]) if u >= 0]  # what each gathered, and came from
        try:
            return self.advise(units)
        except Exception:  # noqa: BLE001 - advice must never hide the error itself
            return ""

    def _name(self, unit: int) -> str:
        return repr(self.names[unit]) if 0 <= unit < len(self.names) else "none"
