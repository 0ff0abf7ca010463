"""The order in which ranks say why the job ended (see "Rank 0 speaks first" in
[Note: a failed rank fails the job], zero_strategy/frontend/job_end.py), on a board kept in memory:
a child that stops with a problem prints it, then, when its launcher (rank 0) posted ``watched``,
waits for rank 0's ``told`` post before its process exits (Lightning kills rank 0 once a child has
exited non-zero); rank 0 prints and posts ``told`` before it waits for its children; without a
watching launcher (torchrun, a pool of workers) nobody waits. The launched jobs that end this way are in test_uneven.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from zero_strategy.frontend import job_end


class Board:
    """Two ranks' posts in one dict, as the process group's store would hold them."""

    enabled = True
    world_size = 2

    def __init__(self, rank: int, shared: dict, events: list) -> None:
        self.rank, self.shared, self.events = rank, shared, events

    def post(self, what: str, text: str) -> None:
        self.events.append((self.rank, "post", what))
        self.shared[(self.rank, what)] = text

    def posted(self, what: str) -> dict[int, str]:
        return {r: t for (r, w), t in list(self.shared.items()) if w == what and r != self.rank}

    def mark(self, label: str) -> None:
        pass

    def divergence(self, *args, **kwargs):
        return "rank 0 entered generate() where rank 1 ended validation" if self.rank == 1 else None


class Exited(Exception):
    pass


@pytest.fixture
def ending(monkeypatch):
    shared, events = {}, []

    def end(rank: int, children=None):
        board = Board(rank, shared, events)
        monkeypatch.setattr(job_end.rank_board, "board", lambda: board)
        monkeypatch.setattr(job_end, "_state", {**job_end._state, "failure": None, "children": children,
                                                "launcher": 0, "limit_s": None})
        monkeypatch.setattr(job_end, "POLL_S", 0.01)

        def exit_(code):
            events.append((rank, "exit", code))
            raise Exited(code)
        monkeypatch.setattr(job_end.os, "_exit", exit_)
        with pytest.raises(Exited):
            job_end._at_exit()
    return end, shared, events


def test_a_child_with_a_problem_exits_only_after_rank_0_has_told(ending, capsys):
    end, shared, events = ending
    shared[(0, "watched")] = "yes"

    def rank_0_tells_later():
        time.sleep(0.3)
        events.append((0, "post", "told"))
        shared[(0, "told")] = "yes"
    threading.Thread(target=rank_0_tells_later).start()
    started = time.monotonic()
    end(1)
    assert time.monotonic() - started >= 0.3
    assert events.index((0, "post", "told")) < events.index((1, "exit", 1))
    assert "rank 1: the job failed: rank 0 entered generate() where rank 1 ended validation" in capsys.readouterr().err


def test_a_child_waits_for_rank_0_at_most_the_grace_period(ending, monkeypatch):
    end, shared, events = ending
    shared[(0, "watched")] = "yes"
    monkeypatch.setattr(job_end, "GRACE_S", 0.2)
    started = time.monotonic()
    end(1)
    assert 0.2 <= time.monotonic() - started < 5
    assert events[-1] == (1, "exit", 1)


def test_without_a_watching_launcher_a_child_exits_at_once(ending, monkeypatch):
    end, _, events = ending
    monkeypatch.setattr(job_end, "GRACE_S", 30.0)
    started = time.monotonic()
    end(1)
    assert time.monotonic() - started < 5
    assert events[-1] == (1, "exit", 1)


def test_rank_0_prints_and_posts_told_before_it_waits_for_its_children(ending, monkeypatch, capsys):
    end, shared, events = ending
    shared[(1, "end")] = "failed: RuntimeError: rank 1 broke"
    seen_when_ending_children = []

    def end_children(board, problem, failed):
        seen_when_ending_children.append((capsys.readouterr().err, dict(shared)))
        return problem
    monkeypatch.setattr(job_end, "_end_children", end_children)
    end(0, children=lambda: [])
    printed, posts = seen_when_ending_children[0]
    assert "rank 0: the job failed: rank 1 failed: RuntimeError: rank 1 broke" in printed
    assert posts[(0, "told")] == "yes"
