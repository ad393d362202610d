"""What one model's engine counts: one object, given to every part of the engine when it is built (service/engine.py).

Tests and benchmarks read these; the metrics observe each call's rows and each step's streams through the two
callbacks.  Nothing here decides anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    on_call: Callable[[int], None] | None = None  # with the rows of every onnxruntime call (the metrics' batch size)
    on_step: Callable[[int], None] | None = None  # with the rows of every decode step
    # with a speculative step's drafts the model made and those it did not (the metrics' speculative tokens)
    on_drafts: Callable[[int, int], None] | None = None
    turns: int = 0  # engine turns that did something
    rows_run: int = 0  # rows sent to onnxruntime
    pieces: int = 0  # calls that ran a part of a prompt, not all of it (prompts over the token budget)
    steps: int = 0  # decode steps
    rebuilds: int = 0  # decode batch rebuilds (joins, leaves, growth): the only copies of its caches
    taken_out: int = 0  # rows that left the batch with their state (ahead of their reader, or rotated)
    accepted: int = 0  # draft tokens of speculative steps that the model made (service/batch.py)
    rejected: int = 0  # draft tokens it did not make (their positions given back)
    # seconds of the engine's thread for the decode batch, by what it did (bench's serving_cost reads them): running
    # prompts between two steps while the batch had rows, inside onnxruntime, choosing and handing out tokens,
    # rebuilding the batch
    seconds: dict[str, float] = field(default_factory=lambda: {"wait": 0.0, "run": 0.0, "tokens": 0.0, "regroup": 0.0})

    def call(self, rows: int) -> None:
        self.rows_run += rows
        if self.on_call is not None:
            self.on_call(rows)

    def step(self, rows: int) -> None:
        self.steps += 1
        if self.on_step is not None:
            self.on_step(rows)

    def speculated(self, accepted: int, rejected: int) -> None:
        self.accepted += accepted
        self.rejected += rejected
        if self.on_drafts is not None:
            self.on_drafts(accepted, rejected)
