"""What a collective is for, carried inside the collective itself.

[Note: the collective header]
Two ranks' collectives pair in the order they are issued, whatever each was meant for: when one
rank skips a stage-3 unit, its all-gather of the next unit meets the others' all-gather of the
skipped one and, if the two have the same size (a transformer's blocks all have), completes with
mixed data. So every stage-3 all-gather sends, after this rank's chunk, ``HEADER_BYTES`` more: four
int32 words naming what this rank issued it for (pass, gather number in the pass, unit and phase,
the unit it came from: see ``encode``). The words travel as raw bits, viewed as the buffer's own
dtype (16 bytes are 8 bf16 elements, 4 fp32, 16 uint8 of a quantized row), so they are exact
whatever that dtype (bf16 holds integers exactly only up to 256) and no quantization touches them:
a quantized gather sends them beside its packed rows, unquantized. The header must never pair with
another gather's chunk: gloo ends the process when two ranks' collectives of one kind differ in
size, with no message of ours, where two of different kinds merely wait (and the store comparison of
[Note: order guard] tells). So on NCCL the chunk and the header go in one coalesced group of two
all-gathers. On gloo a gather in a pass of 1 MiB or more sends no header at all: the guard keeps
the words and compares them later, in bulk, inside a collective the step already makes (see [Note:
headers left out on gloo] in engine/comm/order_guard.py), since there a header would need either a collective
of its own (beside the gather's broadcasts: [Note: all-gather on gloo] in engine/comm/collectives.py) or a
staged copy of every chunk. A smaller gather, or one outside the passes (a state dict,
gathered_parameters), sends it: beside broadcasts in an all-gather issued just before them, a
collective of another kind than theirs, checked before they are waited for; otherwise in one
all-gather of each rank's chunk and header side by side, into a buffer of its own from which the
chunks are copied out once the header is checked: that buffer while the gather lasts, and one copy
of the unit. gloo's coalesced all-gather, which
carried both in one collective before, corrupts the heap now and then while gloo's two worker threads run
collectives at once (torch 2.13: ``malloc(): unaligned tcache chunk detected`` in a gloo thread, in
about one run in three of test_fabric.py on a loaded 2-core host and twice in at most 90 repeated
bf16 stage-3 Fabric runs; none in 120 such runs, or 8 of test_fabric.py, without it; see also
pytorch/pytorch#65231). Two plain all-gathers, header then chunk, were tried as well: a rank one
collective ahead of the others paired its chunk with their header, and gloo ended the processes.
Every rank receives every rank's header and compares them when the gather is waited for, before
anything reads the gathered weights (see [Note: order guard] in engine/comm/order_guard.py). Cost: 16 bytes per
rank in each all-gather's output, so 16 (n - 1) bytes more sent per rank per all-gather: 16,368
bytes at 1,024 ranks (none in a pass's gathers of 1 MiB or more on gloo, 16 more in the step's
all-reduce),
counted by ``comm_stats()`` and predicted by the communication model (comm_model.py).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

WORDS = 4
HEADER_BYTES = WORDS * 4
"""Bytes each rank adds to an all-gather's output (a multiple of every element size up to 16)."""

_PHASE_BITS = 4  # phases of order_guard.PHASES: fewer than 16


def encode(passes: int, seq: int, unit: int, phase: int, context: int) -> tuple[int, int, int, int]:
    """The four int32 words of a gather's header (a tuple: most never become a tensor, see [Note:
    headers left out on gloo] in engine/comm/order_guard.py)."""
    return passes, seq, (unit << _PHASE_BITS) | phase, context


def decode(words: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
    """(passes, seq, unit, phase, context) of each row of ``words`` (n, 4), by rank."""
    out = []
    for passes, seq, unit_phase, context in words.tolist():
        out.append((passes, seq, unit_phase >> _PHASE_BITS, unit_phase & ((1 << _PHASE_BITS) - 1), context))
    return out


class Header:
    """One gather's header: ``words`` to send, and ``check``, called with every rank's words (an
    int32 tensor (n, 4), by rank) once an all-gather carrying them completed; ``waiting(seconds)``,
    called while a wait for the gather lasts (see ``Watchdog.wait``); ``defer``, where set, called
    instead of sending the words where they would need a collective of their own (see [Note: headers left out on gloo]
    in engine/comm/order_guard.py)."""

    __slots__ = ("words", "check", "waiting", "defer", "_left_out")

    def __init__(self, words: tuple[int, ...], check: Callable[[torch.Tensor], None],
                 waiting: Optional[Callable[[float], None]] = None,
                 defer: Optional[Callable[[], None]] = None) -> None:
        self.words = words
        self.check = check
        self.waiting = waiting
        self.defer = defer
        self._left_out = False

    def leave_out(self) -> None:
        """This gather goes without its header: hand the words to ``defer`` (once per gather, however
        many all-gathers it takes)."""
        if self.defer is not None and not self._left_out:
            self._left_out = True
            self.defer()

    def send_as(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The words' raw bits as a 1-d tensor of ``dtype``."""
        return torch.tensor(self.words, dtype=torch.int32).to(device, non_blocking=True).view(torch.uint8).view(dtype)

    @staticmethod
    def receive_buffer(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Room for ``n`` ranks' headers in ``dtype``: shape (n, HEADER_BYTES / element size)."""
        size = torch.empty(0, dtype=dtype).element_size()
        return torch.empty((n, HEADER_BYTES // size), dtype=dtype, device=device)

    def received(self, buffer: torch.Tensor) -> None:
        """Check what arrived in a ``receive_buffer``."""
        self.check(buffer.view(torch.uint8).view(torch.int32).view(-1, WORDS))
