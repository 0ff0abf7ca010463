"""Where a training step's time goes, measured as the step runs.

[Note: the step breakdown]
Every engine (one ``Collectives`` and its subgroups) keeps a ``StepBreakdown`` that cuts each
training step's time, from the end of the step before to the end of this one's optimizer step, into
parts that add up to it exactly:

- three *phases*, entered and left by the engine's hooks: ``forward`` (the module's forward, or the
  front end's training step around it), ``backward`` (from the gradient reaching the forward's
  outputs to the end of the gradient reduction that closes the backward pass) and ``optimizer``
  (from the first reduction of the step, ``reduce_gradients``, to the end of ``step``);
- the *waits*: the time the rank spent blocked in a collective or a copy it had to wait for, which
  nothing hid, by what it waited for: ``gather`` (stage 3's all-gathers of units), ``reduce`` (the
  gradients' reduce-scatters), ``step_gather`` (the all-gathers of the updated parameters after the
  step), ``comm_other`` (the small all-reduces and broadcasts: which parameters got gradients, the
  norm, the overflow flag, the buffers) and ``offload`` (waits for host-device copies, on CUDA);
- ``forward``, ``backward`` and ``optimizer`` are each phase's time less the waits inside it (its
  computation, and what its Python does), and ``rest`` is the time outside the three phases less the
  waits there: data loading, the loss outside the module, logging, ``zero_grad``, the loop itself.

A wait is timed once, at the outermost ``Pending.wait`` (engine/comm/collectives.py): what
completes a collective after it arrived (gloo's sum of a reduce-scatter, a dequantization, the
order guard's check) is part of it. Communication that overlapped computation costs nothing here;
the bytes it moved are ``comm_stats()``'s.

The clock is the host's (``time.perf_counter``) on CPU. On CUDA every mark is an event recorded on
the current stream, so a part is the time the device's compute stream spent in it: a wait is the
stall the stream took behind an NCCL collective (``wait()`` only orders the streams), or behind the
host when the host blocked with the stream drained. The events are read once the step's last one
has completed (at a later step's end, or when the figures are asked for), never forcing a sync.

What it costs: two clock reads per phase and per wait, and a few list appends; on CUDA one event per
mark, reused. The first step of an engine (or after ``reset``) also counts the model's FLOPs (see
[Note: counting FLOPs] in engine/diagnose/flops.py) and is left out of ``sums``.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .flops import FlopCount, in_backward

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
PHASES = (FORWARD, BACKWARD, OPTIMIZER)
GATHER, REDUCE, STEP_GATHER, COMM_OTHER, OFFLOAD = "gather", "reduce", "step_gather", "comm_other", "offload"
WAITS = (GATHER, REDUCE, STEP_GATHER, COMM_OTHER, OFFLOAD)
REST = "rest"
PARTS = (FORWARD, BACKWARD, GATHER, REDUCE, STEP_GATHER, COMM_OTHER, OPTIMIZER, OFFLOAD, REST)
"""The parts of a step, in the order a table shows them; they add up to the step's time."""

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "barrier")
"""Collective kinds the waits are also filed under (``comm_stats(times=True)``)."""

HISTORY = 4096
"""Steps kept in ``records`` (the sums cover every step)."""


@dataclass
class StepTimes:
    """One training step's time, in seconds, by part (``PARTS``), and what the step consumed."""

    index: int  # the steps recorded before this one since the engine was made
    seconds: dict[str, float]
    total: float
    waited: dict[str, float]  # the waits, by collective kind
    samples: int = 0  # the first dimension of the forwards' first input tensor, summed over the micro-batches
    tokens: Optional[int] = None  # its elements, when it holds integers (token ids)


class _HostClock:
    """``time.perf_counter``: a mark is a number."""

    @staticmethod
    def stamp() -> float:
        return time.perf_counter()

    @staticmethod
    def seconds(a: float, b: float) -> float:
        return b - a

    @staticmethod
    def ready(stamp: float) -> bool:
        return True

    @staticmethod
    def wait(stamp: float) -> None:
        pass

    @staticmethod
    def reuse(stamps: list) -> None:
        pass


class _EventClock:
    """CUDA events recorded on the current stream of ``device``, kept for reuse once read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.cuda.Event] = []

    def stamp(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @staticmethod
    def seconds(a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        return a.elapsed_time(b) / 1e3

    @staticmethod
    def ready(stamp: torch.cuda.Event) -> bool:
        return stamp.query()

    @staticmethod
    def wait(stamp: torch.cuda.Event) -> None:
        stamp.synchronize()

    def reuse(self, stamps: list) -> None:
        self._free.extend(stamps)


@dataclass
class _Window:
    """The marks of one step, read when its last one has completed."""

    start: Any
    end: Any = None
    phases: list[tuple[str, Any, Any]] = field(default_factory=list)  # (phase, start, end)
    waits: list[tuple[str, str, Optional[str], Any, Any]] = field(default_factory=list)  # (part, kind, phase, a, b)
    samples: int = 0
    tokens: Optional[int] = 0


_current: list[Optional["StepBreakdown"]] = [None]  # the breakdown whose phase was entered last (see active())


def active() -> Optional["StepBreakdown"]:
    """The breakdown of the engine that entered a phase last in this process: where a wait that has no
    engine at hand (a copy to the host) is filed. None before any did, or when it is off."""
    current = _current[0]
    return current if current is not None and current.enabled else None


class StepBreakdown:
    """Where each step's time goes (see [Note: the step breakdown]). Off until ``enable``."""

    def __init__(self) -> None:
        self.enabled = False
        self.clock: Any = _HostClock()
        self.flops = FlopCount()
        self.records: deque[StepTimes] = deque(maxlen=HISTORY)
        self.recorded = 0  # steps recorded since made
        self.sums = {part: 0.0 for part in (*PARTS, "total")}  # over every recorded step but the first
        self.summed = 0
        self.samples = 0  # over the summed steps
        self.tokens: Optional[int] = 0
        self._unread: deque[_Window] = deque()
        self._window = _Window(start=None)
        self._phase: Optional[str] = None
        self._depth = 0
        self._phase_start: Any = None
        self._waiting = 0  # waits in progress, nested: only the outermost is timed
        self._watched: set[int] = set()

    # ---- switching on and off ------------------------------------------------------------------

    def enable(self, on: bool, device: torch.device) -> None:
        """Measure (``on``) on ``device``'s clock from now, or stop measuring. Idempotent."""
        if on and not self.enabled:
            self.clock = _EventClock(device) if device.type == "cuda" else _HostClock()
            self.enabled = True
            self.reset()
        elif not on:
            self.enabled = False

    def reset(self) -> None:
        """Drop what was measured since the last step ended (set-up, an evaluation loop) and start
        the next step's time now; a FLOP count in progress starts again at the next training forward."""
        if not self.enabled:
            return
        self._phase, self._depth = None, 0
        self._window = _Window(start=self.clock.stamp())
        self.flops.abort()

    # ---- phases --------------------------------------------------------------------------------

    def enter(self, phase: str) -> None:
        """A phase begins; one of another kind still open ends here. Entering the open phase again nests."""
        if not self.enabled:
            return
        if self._phase == phase:
            self._depth += 1
            return
        now = self.clock.stamp()
        self._close(now)
        self._phase, self._depth, self._phase_start = phase, 1, now
        _current[0] = self

    def leave(self, phase: str) -> None:
        """``phase`` ends, if it is the open one (and this is its outermost leave)."""
        if not self.enabled or self._phase != phase:
            return
        self._depth -= 1
        if self._depth == 0:
            self._close(self.clock.stamp())

    def _close(self, now: Any) -> None:
        if self._phase is not None:
            if self._phase == FORWARD:
                self.flops.forward_ended()
            self._window.phases.append((self._phase, self._phase_start, now))
            self._phase = None

    # ---- waits ---------------------------------------------------------------------------------

    def wait_began(self) -> Any:
        """A wait begins: its start mark, or None when it is inside another (or the breakdown is off)."""
        self._waiting += 1
        return self.clock.stamp() if self._waiting == 1 and self.enabled else None

    def wait_ended(self, start: Any, part: str, kind: Optional[str]) -> None:
        """The wait begun at ``start`` ended: filed under ``part`` (one of ``WAITS``) and ``kind``."""
        self._waiting -= 1
        if start is not None:
            self._window.waits.append((part, kind or "other", self._phase, start, self.clock.stamp()))

    def mark(self) -> tuple[_Window, int]:
        """Where the waits of the step in progress are now, for ``waited_since``."""
        return self._window, len(self._window.waits)

    def waited_since(self, mark: tuple[_Window, int], part: str) -> float:
        """Seconds of ``part`` waited for since ``mark`` was taken in this step (on CUDA, waiting for the
        waits' events)."""
        window, start = mark
        total = 0.0
        for waited, _, _, a, b in window.waits[start:] if window is self._window else ():
            if waited == part:
                self.clock.wait(b)
                total += self.clock.seconds(a, b)
        return total

    @contextlib.contextmanager
    def waiting(self, part: str, kind: Optional[str] = None) -> Iterator[None]:
        """Time the block as a wait of ``part``."""
        start = self.wait_began()
        try:
            yield
        finally:
            self.wait_ended(start, part, kind)

    # ---- the forward pass of a training step ----------------------------------------------------

    def forward_began(self, inputs: Any, module: Optional[nn.Module] = None) -> None:
        """A forward of the training step begins (the module's, or the front end's step around it):
        the forward phase; with grad enabled, the FLOPs counter started (``module``: what it runs, to
        check that it is not compiled) and, for the outermost, its batch counted."""
        if not self.enabled or in_backward():
            return
        outermost = self._phase != FORWARD
        self.enter(FORWARD)
        if torch.is_grad_enabled():
            if outermost:
                self._count_batch(inputs)
            self.flops.forward_began(module)  # (unless it counts already)

    def forward_ended(self, output: Any) -> None:
        """The forward that ``forward_began`` opened returned ``output``: the FLOP count stops, the phase
        ends (the outermost), and the backward phase begins when a gradient reaches any of its tensors."""
        if not self.enabled or in_backward():
            return
        self.flops.forward_ended()  # each forward's end, before any backward (see [Note: counting FLOPs])
        self.leave(FORWARD)
        if self._phase is None and torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._backward_reached, mode="any")

    def _backward_reached(self, grad: Any) -> None:
        self.enter(BACKWARD)

    def _count_batch(self, inputs: Any) -> None:
        first = next((t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        if first is None:
            return
        self._window.samples += int(first.shape[0])
        if self._window.tokens is not None:
            integral = not (first.is_floating_point() or first.is_complex()) and first.dim() >= 2
            self._window.tokens = self._window.tokens + first.numel() if integral else None

    def watch(self, module: nn.Module) -> list:
        """Hook ``module``'s forward as the forward phase (``forward_began`` / ``forward_ended``);
        the hooks' handles (none when it is watched already)."""
        if id(module) in self._watched:
            return []
        self._watched.add(id(module))
        eager = torch._dynamo.disable  # plain Python, as the sharder's hooks (see [Note: compiled modules])

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            self.forward_began((args, kwargs), mod)

        def after(mod: nn.Module, args: tuple, output: Any) -> None:
            self.forward_ended(output)

        return [module.register_forward_pre_hook(eager(before), prepend=True, with_kwargs=True),
                module.register_forward_hook(eager(after), always_call=True)]

    def unwatch(self, module: nn.Module) -> None:
        self._watched.discard(id(module))

    # ---- the end of a step ----------------------------------------------------------------------

    def end_step(self) -> None:
        """A training step (its optimizer step) ended: its time becomes a record, once its marks are
        read (at once on CPU; on CUDA once its last event has completed)."""
        if not self.enabled:
            return
        now = self.clock.stamp()
        self._close(now)
        window, self._window = self._window, _Window(start=now)
        window.end = now
        self.flops.step_ended()
        if window.start is not None:
            self._unread.append(window)
        self._read(block=False)

    def flush(self) -> None:
        """Read every ended step's marks now (on CUDA: wait for their events)."""
        self._read(block=True)

    def _read(self, block: bool) -> None:
        clock = self.clock
        while self._unread:
            window = self._unread[0]
            if not clock.ready(window.end):
                if not block:
                    return
                clock.wait(window.end)
            self._unread.popleft()
            self._record(window)
            if isinstance(clock, _EventClock):  # each event once; the step's end is the next one's start: kept
                marks = {id(s): s for s in (window.start, *(s for _, a, b in window.phases for s in (a, b)),
                                            *(s for *_, a, b in window.waits for s in (a, b)))}
                marks.pop(id(window.end), None)
                clock.reuse(list(marks.values()))

    def _record(self, window: _Window) -> None:
        seconds = self.clock.seconds
        walls = dict.fromkeys(PHASES, 0.0)
        for phase, a, b in window.phases:
            walls[phase] += seconds(a, b)
        waits, inside, kinds = dict.fromkeys(WAITS, 0.0), dict.fromkeys((*PHASES, None), 0.0), {}
        for part, kind, phase, a, b in window.waits:
            took = seconds(a, b)
            waits[part] += took
            inside[phase] += took
            kinds[kind] = kinds.get(kind, 0.0) + took
        total = seconds(window.start, window.end)
        parts = {**{phase: walls[phase] - inside[phase] for phase in PHASES}, **waits,
                 REST: total - sum(walls.values()) - inside[None]}
        record = StepTimes(self.recorded, {part: parts[part] for part in PARTS}, total, kinds, window.samples,
                           window.tokens if window.samples else None)
        self.records.append(record)
        if self.recorded > 0:  # the first step warms up (and counts the FLOPs): left out of the sums
            for part in PARTS:
                self.sums[part] += record.seconds[part]
            self.sums["total"] += total
            self.samples += record.samples
            self.tokens = self.tokens + record.tokens if self.tokens is not None and record.tokens is not None \
                else None
            self.summed += 1
        self.recorded += 1

    def last(self) -> Optional[StepTimes]:
        """The last step read (on CUDA the steps are read a little late: ``flush`` first)."""
        return self.records[-1] if self.records else None
