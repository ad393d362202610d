"""The engine's decision (service/engine.py's schedule part): pure functions of what the engine holds.

Given the pending prompt pieces (each one's new tokens), the decode batch's rows and the streams outside it, the
step count and the settings (service/settings.py: Batching, Tuning), `schedule` says what one engine step does:

- which pending jobs run their next piece: oldest first, up to max_batch rows and max_tokens new tokens (rows x
  the longest piece); a first job past the budget runs alone (it may not run in pieces);
- how the decode batch changes at this boundary (None: it stays): finished, cancelled and expired rows leave;
  rows `lookahead` tokens ahead of their readers leave with their state while another reader waits for a token or
  a stream waits to come in; with more streams than max_batch rows, rows that ran `rotate` steps give way to the
  oldest waiting; new streams wait up to `gather` steps to join together while prompts are still being prefilled;
- whether the batch then steps (some row to step, none too far ahead of its reader).

Nothing here reads a clock, a lock or onnxruntime: tests give it states and read its answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from service.settings import Tuning


class Lane(Protocol):
    """A stream as the decision sees it (service.generation.Generation is one)."""

    since: int  # the step count when it last entered or left the batch

    @property
    def queued(self) -> int:  # tokens its reader has not taken yet
        ...


@dataclass(frozen=True)
class Regroup:
    """The batch at a step boundary: rows kept (old indices), rows leaving with their state, streams coming in
    (indices into those outside the batch)."""

    keep: list[int]
    out: list[int]
    enter: list[int]


@dataclass(frozen=True)
class Plan:
    prompts: int  # pending jobs (oldest first) whose next piece runs
    regroup: Regroup | None  # None: the batch stays as it is
    step: bool  # the batch steps (after the regroup)

    @property
    def idle(self) -> bool:
        return not self.prompts and self.regroup is None and not self.step


def prompts(pieces: Sequence[int], max_batch: int, max_tokens: int) -> int:
    """How many pending jobs (oldest first; pieces[i]: the new tokens of job i's next call) the next call takes."""
    taken, longest = 0, 0
    for piece in pieces:
        if taken >= max_batch or (taken and (taken + 1) * max(longest, piece) > max_tokens):
            break
        taken, longest = taken + 1, max(longest, piece)
    return taken


def regroup(rows: Sequence[Lane], live: Sequence[int], outside: Sequence[Lane], steps: int, max_rows: int,
            tuning: Tuning, prompts_waiting: bool, shrink: bool = False) -> Regroup | None:
    """How the batch changes at this boundary (module docstring); live: the rows still going on (the others
    leave); shrink: streams outside the batch have gone and its cache holds far more than the rest need."""
    look = tuning.lookahead
    ahead = [b for b in live if rows[b].queued >= look]
    ready = [b for b in live if rows[b].queued < look]
    waiting = sorted((i for i, s in enumerate(outside) if s.queued <= look // 2), key=lambda i: outside[i].since)
    starving = any(rows[b].queued == 0 for b in ready)
    keep, out = (ready, ahead) if ahead and (starving or waiting) else (list(live), [])
    room = max_rows - len(keep)
    if len(waiting) > room:  # oldest rows first, as many as streams wait beyond the room
        due = sorted((b for b in keep if steps - rows[b].since >= tuning.rotate),
                     key=lambda b: rows[b].since)[:len(waiting) - room]
        keep, out, room = [b for b in keep if b not in due], out + due, room + len(due)
    enter = waiting[:max(room, 0)]
    if (enter and keep and not out and len(live) == len(rows) and prompts_waiting
            and all(steps - outside[i].since < tuning.gather for i in enter)):
        enter = []  # more prompts are being prefilled: their streams join together, one rebuild for several
    if len(live) == len(rows) and not out and not enter:
        return Regroup(keep, [], []) if shrink else None
    return Regroup(keep, out, enter)


def steps(rows: Sequence[Lane], lookahead: int) -> bool:
    """Whether a batch of these rows steps: some row, and none `lookahead` tokens ahead of its reader."""
    return bool(rows) and all(s.queued < lookahead for s in rows)


def schedule(pieces: Sequence[int], rows: Sequence[Lane], live: Sequence[int], outside: Sequence[Lane], steps_run: int,
             max_batch: int, max_tokens: int, tuning: Tuning, shrink: bool = False) -> Plan:
    """One engine step's work (module docstring)."""
    change = regroup(rows, live, outside, steps_run, max_batch, tuning, bool(pieces), shrink)
    after = rows if change is None else [rows[b] for b in change.keep] + [outside[i] for i in change.enter]
    return Plan(prompts(pieces, max_batch, max_tokens), change, steps(after, tuning.lookahead))
