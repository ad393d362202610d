"""The prompt runner: a model's prompt jobs gathered into padded onnxruntime calls, one part of its engine.

A job is (new token ids, its cached state).  The engine (service/engine.py) takes jobs and hands the runner, each
turn, those its plan runs (service/plan.py); this is the prompt jobs' part of the engine's work: the pieces a job
runs in, the calls a group of jobs is split into by length, and settling each job's Future.  Rows are laid out as
the graph's codec wants (service/kvcache.py: padded on the left under the attention mask, or each row from slot 0
with its length), so each row's result equals the same job run alone.  A job whose deadline has passed is dropped
before it runs; results are cut back to each row's own slots.  The calls themselves (feeds, onnxruntime) are the
executor's (service/executor.py), which the engine hands in.

One engine turn takes at most the token budget of new prompt tokens (Batching.batch_tokens, --batch-tokens: rows x
padded length): jobs past it wait for the next turn, and a prompt longer than the budget runs in pieces, each
piece's cache carried into the next (a KV-cached forward equals the whole one); a prompt of a model whose RoPE
frequencies follow the length (LoadedModel.whole_prompts) runs whole, since every key of it is rotated for the
whole prompt's length.  The decode batch steps once per turn, so a burst of long prompts delays the running streams
by one budget's worth of prefill per token, not by every prompt at once; the budget also bounds the largest call's
memory (its logits are tokens x vocabulary).  A job's first piece may start past the tokens the prefix cache holds
for its prompt (service/prefix.py): their state is its past, as if they were a first piece already run; a finished
prompt's whole blocks go in.  "A piece" is always a part of one prompt that one call runs.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np

from service.artifacts import LoadedModel
from service.errors import DeadlineExceeded
from service.jobs import Job, MapRequest, Result
from service.prefix import PrefixCache, chain, reusable, root_of, wants
from service.stats import EngineStats

log = logging.getLogger(__name__)


class Runs(Protocol):
    """What runs a group of jobs' calls (service.executor.Executor)."""

    def run(self, jobs: list[Job]) -> list[Result]: ...


class PromptRunner:
    """A model's prompt jobs: their pieces within the token budget, their calls, their results."""

    def __init__(self, model: LoadedModel, budget: int, prefix: PrefixCache, stats: EngineStats):
        self.model, self.budget, self.stats = model, budget, stats
        # the prefix cache (a registry's, shared by its models): prompts start on the blocks of recent prompts' keys
        # and values (service/prefix.py), on models where a reused block equals a cold run's
        self.prefix = prefix
        self.reuse, self.root = self.prefix.on and reusable(model), root_of(model)
        self.whole_prompts = model.whole_prompts  # a length-dependent RoPE scaling: every prompt runs in one call

    def close(self) -> None:
        """The model is gone: its blocks leave the prefix cache."""
        self.prefix.purge(self.root)

    # --- the prompt jobs' part of an engine turn -------------------------------------------------------------

    def _divides(self, job: Job) -> bool:
        """Whether the job may run in pieces: not one wanting full maps (every row must span the same keys), nor
        any of a model whose RoPE frequencies follow the length (every key of a prompt is rotated for the whole
        prompt's length, which a piece's call does not see)."""
        return job.divisible and not self.whole_prompts

    def piece(self, job: Job) -> int:
        """The new tokens of the job's next piece: what is left, up to the budget where it may run in pieces."""
        left = len(job.ids) - job.done
        return min(left, self.budget, job.max_piece or left) if self._divides(job) else left

    def execute(self, jobs: list[Job], executor: Runs) -> None:
        """Run the next piece of every live job (not cancelled, deadline not passed) and settle the futures of the
        jobs whose last piece ran; the others stay pending (the engine runs their next piece)."""
        now = time.monotonic()
        live = []
        for job in jobs:
            if job.done == 0 and not job.future.set_running_or_notify_cancel():
                continue
            if job.deadline is not None and now > job.deadline:
                job.future.set_exception(DeadlineExceeded("deadline passed while queued; the work was not run"))
                continue
            live.append(job)
        if not live:
            return
        for job in live:
            self._start(job)
        longest = max(self.piece(j) for j in live)
        calls = {}  # each job's next piece, as a job of its own
        for job in live:
            n = min(len(job.ids) - job.done, longest) if self._divides(job) else len(job.ids) - job.done
            last = job.done + n == len(job.ids)
            calls[id(job)] = Job(job.ids[job.done:job.done + n], job.state, job.piece_attention(job.done, n),
                                 job.deadline, job.want_state or not last or self._stores(job),
                                 job.last_only, enqueued=job.enqueued)
            self.stats.pieces += not (last and job.done == 0)
        owner = {id(calls[id(j)]): j for j in live}
        try:
            for group in self.buckets([calls[id(j)] for j in live]):
                for piece, result in zip(group, executor.run(group), strict=True):
                    self._advance(owner[id(piece)], piece, result)
        except Exception as err:  # never let one bad batch kill the loop
            log.exception("batch of %d failed on model %s", len(live), self.model.name)
            for job in live:
                if not job.future.done():
                    job.future.set_exception(err)

    def _start(self, job: Job) -> None:
        """A job's first piece: where it may, it starts on the prefix cache's longest match of its prompt."""
        if not self.reuse or job.done:
            return
        ok, job.prefix_key = wants(job)
        if not ok:
            return
        job.hashes = chain(self.root, job.ids)
        hit = self.prefix.lookup(self.model.name, self.root, job.ids, job.hashes, job.prefix_key)
        if hit is not None:
            job.state, job.done, job.reduced = hit.state, hit.tokens, list(hit.items)

    def _stores(self, job: Job) -> bool:
        """Whether the job's last piece fetches its state for the prefix cache (blocks or items it lacks)."""
        return bool(job.hashes) and self.prefix.missing(job.hashes, job.prefix_key)

    def _advance(self, job: Job, piece: Job, result: Result) -> None:
        """Carry a piece's result into its job; the job's result once its last piece has run."""
        first, job.done = job.done, job.done + len(piece.ids)
        if job.attention is MapRequest.PROFILE:  # the piece's rows summed now, the running sum is the result's
            result.attentions = job.add_profile(result.attentions, first)
        if job.reduce is not None and not job.last_only:  # the piece's rows reduced now, its logits let go
            job.reduced += job.reduce(result.logits, first)
            result.logits = result.logits[-1:]
        if job.done < len(job.ids):
            if not job.parts:
                job.parts = [[], 0.0, result.queue_ms]
            if not job.last_only and job.reduce is None:  # an earlier piece's last logits are nobody's
                job.parts[0].append(result.logits)
            job.parts[1] += result.compute_ms
            job.state = result.state
            return
        if job.parts:  # the whole prompt's logits, as one call would give them
            logits, compute_ms, queue_ms = job.parts
            result = Result(np.concatenate(logits + [result.logits]), result.attentions, result.state, queue_ms,
                            compute_ms + result.compute_ms, result.batch_size)
            job.parts = []
        if job.hashes and result.state is not None:  # its whole blocks (and items) for later prompts
            self.prefix.insert(self.root, job.ids, job.hashes, result.state, job.prefix_key,
                               job.reduced if job.prefix_key is not None else None)
            result.state = result.state if job.want_state else None
        if job.reduce is not None:
            result.reduced, job.reduced = job.reduced, []
        job.future.set_result(result)

    @staticmethod
    def buckets(jobs: list[Job], slack: float = 1.25, extra: int = 8) -> list[list[Job]]:
        """Split a gathered batch into runs of similar length, so a short prompt is not padded to the longest
        one: a group grows while its longest job is within slack x its shortest (+ extra positions).  Jobs that
        want attention maps never share a call with jobs that do not: a call computes maps for every row it holds,
        and runs the exact graph instead of the fast one (a profile: the profile graph)."""
        groups: list[list[Job]] = []

        def maps(j: Job) -> tuple[bool, bool]:
            return j.attention is not MapRequest.NONE, j.attention is MapRequest.PROFILE

        for job in sorted(jobs, key=lambda j: (maps(j), j.length)):
            if groups and maps(job) == maps(groups[-1][0]) and job.length <= slack * groups[-1][0].length + extra:
                groups[-1].append(job)
            else:
                groups.append([job])
        return groups
