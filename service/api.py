"""The worker's domain logic in plain Python types: predict, generate, score.

gRPC servicers convert protobuf to these calls and back; every error is a service.errors class, so the one
mapping to status codes lives in the servicer.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import numpy as np

from model import tokenizer
from service.artifacts import LoadedModel
from service.errors import Cancelled, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from service.metrics import Metrics
from service.scheduler import Job, Result, Scheduler


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 512
    max_message_bytes: int = 64 * 1024 * 1024
    max_top_k: int = 256
    max_streams: int = 64  # Generate streams open at once; more get RESOURCE_EXHAUSTED
    max_request_s: float = 300.0  # server-side cap on any request's deadline (0 = none beyond the client's)


@dataclass
class Predicted:
    ids: list[int]
    pieces: list[str]
    top: list[tuple[int, float, float]]  # (token id, probability, log-probability)
    attention: list[tuple[int, int, np.ndarray]] = field(default_factory=list)  # (layer, head, map)
    result: Result | None = None
    total_ms: float = 0.0


@dataclass
class Comparison:
    model: str
    variant: str
    top: list[tuple[int, float, float]] = field(default_factory=list)
    permuted_top: list[tuple[int, float, float]] = field(default_factory=list)
    total_variation: float = 0.0
    kl: float = 0.0
    js: float = 0.0
    top1_changed: bool = False
    error: str = ""


def permute_default(text: str | None, ids: list[int] | None) -> tuple[str | None, list[int] | None]:
    """The prompt's words in reverse order ("dog bites man" -> "man bites dog"); ids reversed."""
    if text is not None:
        return " ".join(reversed(text.split(" "))), None
    return None, list(reversed(ids or []))


def divergences(logp: np.ndarray, logq: np.ndarray) -> tuple[float, float, float]:
    """Total variation, KL(p || q) and Jensen-Shannon between two next-token distributions (log space)."""
    p, q = np.exp(logp), np.exp(logq)
    m = 0.5 * (p + q)
    logm = np.log(np.maximum(m, 1e-300))
    kl = float(np.sum(p * (logp - logq)))
    js = float(0.5 * np.sum(p * (logp - logm)) + 0.5 * np.sum(q * (logq - logm)))
    return float(0.5 * np.abs(p - q).sum()), kl, js


def top_of(logp: np.ndarray, k: int) -> list[tuple[int, float, float]]:
    order = np.argsort(-logp, kind="stable")[:k]
    return [(int(i), float(math.exp(logp[i])), float(logp[i])) for i in order]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class Models:
    """The loaded models with their schedulers; the entry point of every request."""

    def __init__(self, models: dict[str, LoadedModel], limits: Limits, max_batch: int = 8,
                 max_wait_ms: float = 2.0, max_queue: int = 64, metrics: Metrics | None = None):
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.batching = (max_batch, max_wait_ms, max_queue)
        self.models: dict[str, LoadedModel] = {}
        self._lock = threading.Lock()
        self.streams = 0  # open Generate streams
        self.shutting_down = False
        for m in models.values():
            self.install(m)

    # --- the set of models: install, replace, remove (a reload), without dropping in-flight requests -------

    def start_scheduler(self, m: LoadedModel) -> LoadedModel:
        if m.scheduler is None:
            m.scheduler = Scheduler(m, *self.batching, on_batch=self.metrics.batch_size.labels(m.name).observe)
        return m

    def warm_up(self, m: LoadedModel, timeout: float = 120.0) -> None:
        """One request through the model's own scheduler: raises if the artifact cannot really run."""
        self.start_scheduler(m)
        m.scheduler.submit(Job(np.asarray(tokenizer.encode("warm up"), np.int64), None, True, None)).result(timeout)

    def install(self, m: LoadedModel) -> LoadedModel | None:
        """Serve `m` under its name; a model it replaces is retired (closed once its last request finishes)."""
        self.start_scheduler(m)
        with self._lock:
            old = self.models.get(m.name)
            self.models[m.name] = m
            self.metrics.watch_queue(m.name, m.scheduler.queue.qsize)
        if old is not None:
            self._retire(old)
        return old

    def remove(self, name: str) -> LoadedModel | None:
        with self._lock:
            old = self.models.pop(name, None)
        if old is not None:
            self._retire(old)
        return old

    def _retire(self, m: LoadedModel) -> None:
        with self._lock:
            m.retired = True
            idle = m.active == 0
        if idle:
            self._close_later(m)

    @staticmethod
    def _close_later(m: LoadedModel) -> None:
        """Close a retired model's scheduler off the request thread (close() joins its batching thread)."""
        threading.Thread(target=m.scheduler.close, name=f"retire-{m.name}", daemon=True).start()

    def _not_found(self, name: str) -> NotFound:
        return NotFound(f"unknown model {name!r}; served models: {', '.join(sorted(self.models))}")

    @contextmanager
    def acquire(self, name: str) -> Iterator[LoadedModel]:
        """The named model for one request; a reload that replaces it meanwhile waits for this request to end
        before closing its scheduler.  Refused while shutting down (work in flight carries on)."""
        if self.shutting_down:
            raise Unavailable("server is shutting down")
        with self._lock:
            m = self.models.get(name)
            if m is not None:
                m.active += 1
        if m is None:
            raise self._not_found(name)
        try:
            yield m
        finally:
            with self._lock:
                m.active -= 1
                close = m.retired and m.active == 0
            if close:
                self._close_later(m)

    @contextmanager
    def stream_slot(self) -> Iterator[None]:
        with self._lock:
            if self.streams >= self.limits.max_streams:
                raise ResourceExhausted(f"{self.streams} Generate streams are open, the server's limit is "
                                        f"{self.limits.max_streams}; retry when one finishes")
            self.streams += 1
        try:
            yield
        finally:
            with self._lock:
                self.streams -= 1

    def close(self) -> None:
        self.shutting_down = True
        with self._lock:
            current = list(self.models.values())
        for m in current:
            m.scheduler.close()

    def get(self, name: str) -> LoadedModel:
        """The named model (for requests that use its session directly, e.g. KServe ModelInfer)."""
        if self.shutting_down:
            raise Unavailable("server is shutting down")
        m = self.models.get(name)
        if m is None:
            raise self._not_found(name)
        return m

    # --- inputs -----------------------------------------------------------------------------------------

    def tokens(self, model: LoadedModel, text: str | None, ids: list[int] | None, extra: int = 0) -> list[int]:
        """The prompt's tokens, checked against the server's limits and this model's vocabulary and positions."""
        toks = self._plain_tokens(text, ids, model.vocab_size)
        limit = model.max_positions
        if limit is not None and len(toks) + extra > limit:
            raise InvalidArgument(f"prompt of {len(toks)} tokens exceeds model {model.name}'s max_positions={limit}")
        return toks

    def run(self, model: LoadedModel, ids: list[int], state: list[np.ndarray] | None, want_attentions: bool,
            deadline: float | None, want_state: bool = True) -> Result:
        job = Job(np.asarray(ids, np.int64), state, want_attentions, deadline, want_state)
        future = model.scheduler.submit(job)
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0) + 5.0
        return future.result(timeout=timeout)

    def run_masked(self, model: LoadedModel, ids: np.ndarray, mask: np.ndarray,
                   want_attentions: bool) -> dict[str, np.ndarray]:
        """A caller-padded batch (KServe ModelInfer) straight through the session; no past."""
        feeds = {"input_ids": ids, "attention_mask": mask}
        for spec, tensor in zip(model.state, model.empty_state(len(ids)), strict=True):
            feeds[spec["input"]] = tensor
        names = ["logits"] + (["attentions"] if want_attentions else [])
        return dict(zip(names, model.session.run(names, feeds), strict=True))

    # --- Predict ----------------------------------------------------------------------------------------

    def predict(self, name: str, text: str | None, ids: list[int] | None, top_k: int = 5, attention: str = "none",
                layers: list[int] | None = None, heads: list[int] | None = None,
                deadline: float | None = None) -> Predicted:
        start = time.monotonic()
        with self.acquire(name) as model:
            top_k = top_k or 5
            if not 1 <= top_k <= min(self.limits.max_top_k, model.vocab_size):
                cap = min(self.limits.max_top_k, model.vocab_size)
                raise InvalidArgument(f"top_k must be in [1, {cap}], got {top_k}")
            layers = self._indices(layers, model.n_layers, "layer")
            heads = self._indices(heads, model.n_heads, "head")
            toks = self.tokens(model, text, ids)
            if attention != "none":
                rows = len(toks) if attention == "full" else 1
                size = 4 * len(layers) * len(heads) * rows * len(toks)
                if size > self.limits.max_message_bytes * 0.9:
                    raise ResourceExhausted(
                        f"attention maps would take {size} bytes, over the {self.limits.max_message_bytes}-byte "
                        "message limit; request attention=LAST_ROW, fewer layers/heads, or a shorter prompt")
            result = self.run(model, toks, None, attention != "none", deadline, want_state=False)
            logp = log_softmax(result.logits[-1])
            order = np.argsort(-logp, kind="stable")[:top_k]
            top = [(int(i), float(math.exp(logp[i])), float(logp[i])) for i in order]
            maps = []
            if attention != "none":
                att = result.attentions if attention == "full" else result.attentions[:, :, -1:, :]
                maps = [(layer, head, att[layer, head]) for layer in layers for head in heads]
            return Predicted(toks, tokenizer.pieces(toks), top, maps, result, (time.monotonic() - start) * 1000)

    @staticmethod
    def _indices(values: list[int] | None, n: int, what: str) -> list[int]:
        if not values:
            return list(range(n))
        bad = [v for v in values if not 0 <= v < n]
        if bad:
            raise InvalidArgument(f"{what} index {bad[0]} is out of range [0, {n})")
        return list(dict.fromkeys(values))

    # --- Compare ----------------------------------------------------------------------------------------

    def compare(self, text: str | None, ids: list[int] | None, permuted_text: str | None,
                permuted_ids: list[int] | None, names: list[str] | None = None, top_k: int = 5,
                deadline: float | None = None) -> tuple[list[int], list[int], list[Comparison]]:
        """Every named model (default: all) on the prompt and on the same tokens in another order, side by side.

        All jobs are queued before any is awaited, so the models' schedulers run them in parallel.  A model that
        cannot take the prompt (beyond its positions) reports that in its row; the others still answer."""
        names = list(dict.fromkeys(names)) if names else sorted(self.models)
        with ExitStack() as stack:
            chosen = [stack.enter_context(self.acquire(n)) for n in names]
            return self._compare(chosen, text, ids, permuted_text, permuted_ids, top_k, deadline)

    def _compare(self, chosen: list[LoadedModel], text, ids, permuted_text, permuted_ids, top_k,
                 deadline) -> tuple[list[int], list[int], list[Comparison]]:
        top_k = top_k or 5
        if not 1 <= top_k <= self.limits.max_top_k:
            raise InvalidArgument(f"top_k must be in [1, {self.limits.max_top_k}], got {top_k}")
        if permuted_text is None and not permuted_ids:
            permuted_text, permuted_ids = permute_default(text, ids)
        vocab = min(m.vocab_size for m in chosen)
        toks = self._plain_tokens(text, ids, vocab)
        perm = self._plain_tokens(permuted_text, permuted_ids, vocab)
        if sorted(perm) != sorted(toks):
            raise InvalidArgument("the permuted prompt must hold the same tokens as the prompt in another order "
                                  f"({len(toks)} vs {len(perm)} tokens, or different ones)")
        pending = []
        for model in chosen:
            try:
                self.tokens(model, None, toks)  # limits: the server's and this model's positions
            except InvalidArgument as err:
                pending.append((model, None, str(err)))
                continue
            jobs = [model.scheduler.submit(Job(np.asarray(t, np.int64), None, False, deadline, want_state=False))
                    for t in (toks, perm)]
            pending.append((model, jobs, ""))
        out = []
        for model, jobs, error in pending:
            row = Comparison(model.name, model.meta["variant"], error=error)
            if jobs is not None:
                timeout = None if deadline is None else max(deadline - time.monotonic(), 0) + 5.0
                logp, logq = (log_softmax(j.result(timeout=timeout).logits[-1]) for j in jobs)
                row.top, row.permuted_top = top_of(logp, top_k), top_of(logq, top_k)
                row.total_variation, row.kl, row.js = divergences(logp, logq)
                row.top1_changed = row.top[0][0] != row.permuted_top[0][0]
            out.append(row)
        return toks, perm, out

    def _plain_tokens(self, text: str | None, ids: list[int] | None, vocab: int) -> list[int]:
        """Tokens checked against a vocabulary and the server's limits (not a model's positions)."""
        toks = tokenizer.encode(text) if text is not None else list(ids or [])
        bad = [i for i in toks if not 0 <= i < vocab]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if not toks:
            raise InvalidArgument("empty prompt: give text or at least one token id")
        if len(toks) > self.limits.max_prompt_tokens:
            raise InvalidArgument(f"prompt of {len(toks)} tokens exceeds the server's limit of "
                                  f"{self.limits.max_prompt_tokens} tokens")
        return toks

    # --- Encoding ---------------------------------------------------------------------------------------

    def encoding(self, name: str, length: int) -> tuple[list[tuple[str, np.ndarray]], str]:
        """The artifact's encoding graph at positions 0..length-1: [(output name, array)], and a note."""
        with self.acquire(name) as model:
            spec = model.meta.get("encoding")
            if spec is None:
                raise FailedPrecondition(f"model {name!r} was exported before encoding graphs existed; re-export it "
                                         "(make models) to see its encoding")
            cap = min(model.max_positions or self.limits.max_prompt_tokens, self.limits.max_prompt_tokens)
            if not 1 <= length <= cap:
                raise InvalidArgument(f"length must be in [1, {cap}] for model {name!r}, got {length}")
            outputs = spec.get("outputs") or []
            size = 0
            for o in outputs:
                cells = 1
                for d in o["shape"]:
                    cells *= length if isinstance(d, str) else int(d)
                size += 4 * cells
            if size > self.limits.max_message_bytes * 0.9:
                raise ResourceExhausted(f"the encoding at length {length} would take {size} bytes, over the "
                                        f"{self.limits.max_message_bytes}-byte message limit; ask for a shorter length")
            if model.encoding is None:
                return [], spec.get("note", "")
            names = [o["name"] for o in outputs]
            values = model.encoding.run(names, {"positions": np.arange(length, dtype=np.int64)})
            return list(zip(names, values, strict=True)), spec.get("note", "")

    # --- Score ------------------------------------------------------------------------------------------

    def score(self, name: str, text: str | None, ids: list[int] | None,
              deadline: float | None = None) -> tuple[list[int], list[float]]:
        with self.acquire(name) as model:
            toks = self.tokens(model, text, ids)
            if len(toks) < 2:
                raise InvalidArgument("score needs at least two tokens (each is scored given its prefix)")
            result = self.run(model, toks, None, False, deadline, want_state=False)
            logp = log_softmax(result.logits[:-1])
            return toks, [float(logp[t, toks[t + 1]]) for t in range(len(toks) - 1)]

    # --- Generate ---------------------------------------------------------------------------------------

    def generate(self, name: str, text: str | None, ids: list[int] | None, max_new_tokens: int,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0, seed: int | None = None,
                 stop: list[str] | None = None, deadline: float | None = None,
                 is_active: Callable[[], bool] = lambda: True) -> Iterator[tuple[int, float, str, str]]:
        """Yields (token id, log-probability, text so far, finish reason or '') per generated token."""
        with self.stream_slot(), self.acquire(name) as model:
            if not 1 <= max_new_tokens <= self.limits.max_new_tokens:
                raise InvalidArgument(f"max_new_tokens must be in [1, {self.limits.max_new_tokens}], "
                                      f"got {max_new_tokens}")
            if temperature < 0 or not math.isfinite(temperature):
                raise InvalidArgument(f"temperature must be >= 0, got {temperature}")
            if not 0 <= top_k <= model.vocab_size:
                raise InvalidArgument(f"top_k must be in [0, {model.vocab_size}], got {top_k}")
            if not 0 <= top_p <= 1:
                raise InvalidArgument(f"top_p must be in [0, 1], got {top_p}")
            toks = self.tokens(model, text, ids)
            rng = np.random.default_rng(seed)
            generated: list[int] = []
            state, feed = None, toks
            limit = model.max_positions
            for step in range(max_new_tokens):
                if not is_active():
                    raise Cancelled("client cancelled the stream")
                result = self.run(model, feed, state, False, deadline)
                state = result.state
                logp = log_softmax(result.logits[-1])
                token = self._pick(logp, temperature, top_k, top_p, rng)
                generated.append(token)
                text_so_far = tokenizer.decode(generated)
                reason = ""
                if stop and any(s and s in text_so_far for s in stop):
                    reason = "stop"
                elif limit is not None and len(toks) + len(generated) >= limit:
                    reason = "max_positions"  # the next token would need a position past the learned table
                elif step == max_new_tokens - 1:
                    reason = "length"
                yield token, float(logp[token]), text_so_far, reason
                if reason:
                    return
                feed = [token]

    @staticmethod
    def _pick(logp: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
        if temperature == 0:
            return int(np.argmax(logp))
        scaled = logp / temperature
        order = np.argsort(-scaled, kind="stable")
        if top_k:
            order = order[:top_k]
        probs = np.exp(scaled[order] - scaled[order].max())
        probs /= probs.sum()
        if 0 < top_p < 1:
            keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[rng.choice(len(order), p=probs)])
