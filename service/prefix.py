"""The prefix cache: a prompt whose leading tokens match a recently served prompt of the same model starts from their
keys and values instead of computing them again (the prompt runner runs the rest as a later piece on that cache,
as it runs any prompt longer than the token budget: service/prompts.py).

Prompts are cut into blocks of BLOCK tokens; block j is named by a hash chained over the model's own key and every
token up to the block's end (vLLM's scheme), so a prompt matches whole blocks, as many as lead it, and a block is
only ever found behind the same tokens.  A block holds the keys and values of its positions (one (H, BLOCK, Dh) slice
per state tensor), and, where a prompt that wanted its own per-token outputs ran it, those outputs: for each of its
positions p, the item the job's reduce gave for row p - 1 (log p(token p), the row's top candidates; Score and
OpenAI's echo), under the reduce's `key` (service.generation.NextTokens: ("next", k)).  Such a job reuses blocks
that hold its key's items and starts one token short of their end, so the row before its first new token (whose
item needs the next token) is computed; any job starts at least one token short of its prompt's end (its last
logits are computed).  Jobs that want every position's logits (KServe), attention maps or a profile never use it.

Which models: those whose carried state is keys and values alone and whose positions do not depend on the whole
prompt (`reusable`): a fixed-size state (a mixer layer's, cpe's) or a RoPE scaling that follows the prompt's length
(LoadedModel.whole_prompts) would make a reused block differ from a cold run's.

Memory is bounded by `max_bytes` (--prefix-cache-mb; 0 = off), least recently used blocks evicted first: a lookup or
insert touches a chain from its last block back to its first, so a prefix's leading blocks outlive its tails and
eviction never strands a reachable block's descendants for long.  One cache serves every model of a registry; each
model (each load: a reload is a new key) has its own chain root, and a retired model's blocks are dropped.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from service.jobs import Job, MapRequest

if TYPE_CHECKING:
    from service.artifacts import LoadedModel

BLOCK = 16  # tokens per block
ITEM_BYTES = 64  # what one reduced item (a float and a list) holds in Python, besides its candidates
CANDIDATE_BYTES = 72  # one top candidate (a tuple of an int and a float)
_serial = itertools.count()


def reusable(model: LoadedModel) -> bool:
    """Whether a cached prefix's keys and values equal a cold run's: a state of KV caches alone (no variant's
    fixed-size state) and positions that do not follow the whole prompt's length."""
    return not model.whole_prompts and all(spec.sequence_axis is not None for spec in model.meta.state)


def root_of(model: LoadedModel) -> bytes:
    """A chain root of its own for each load of a model: a reloaded model never reads another's blocks."""
    return f"{model.name}\0{model.sha256}\0{next(_serial)}".encode()


def chain(root: bytes, ids: np.ndarray) -> list[bytes]:
    """The hash of every whole block of `ids`, each over the one before it."""
    out, h = [], root
    data = np.ascontiguousarray(ids, np.int64)
    for j in range(len(data) // BLOCK):
        h = hashlib.blake2b(h + data[j * BLOCK:(j + 1) * BLOCK].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def wants(job: Job) -> tuple[bool, Hashable | None]:
    """Whether a job may start on the cache, and the key of the items it needs (None: none, it reads its last
    logits alone).  Not a job that wants maps or a profile, every position's logits, or the items of a reduce
    without a key."""
    if job.attention is not MapRequest.NONE or job.state is not None or job.done:
        return False, None
    if job.last_only:
        return True, None
    key = None if job.reduce is None else getattr(job.reduce, "key", None)
    return key is not None, key


@dataclass
class Block:
    root: bytes
    tokens: np.ndarray  # (BLOCK,): checked on every match
    kv: list[np.ndarray]  # per state tensor (H, BLOCK, Dh)
    items: dict[Hashable, list[Any]] = field(default_factory=dict)  # reduce key -> its items for the positions
    nbytes: int = 0


@dataclass
class Stats:
    hits: int = 0  # jobs that started on a cached prefix
    misses: int = 0  # jobs that could have and found none
    saved: int = 0  # prompt tokens not computed
    evictions: int = 0  # blocks evicted for room


@dataclass
class Hit:
    """A job's start on the cache: its first `tokens` positions' state, and (a reduce job's) their items."""

    tokens: int
    state: list[np.ndarray]
    items: list[Any]


class PrefixCache:
    """Blocks of every model's recent prompts, least recently used first (the module docstring)."""

    def __init__(self, max_bytes: int, metrics: Any = None):
        self.max_bytes = max(int(max_bytes), 0)
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.nbytes = 0
        self.stats: dict[str, Stats] = {}  # per model name
        self._lock = threading.Lock()
        self._metrics = PrefixMetrics(metrics.registry, self) if metrics is not None else None

    @classmethod
    def of_mb(cls, mb: float, metrics: Any = None) -> PrefixCache:
        return cls(int(mb * 1024 * 1024), metrics)

    @property
    def on(self) -> bool:
        return self.max_bytes > 0

    def stats_of(self, model: str) -> Stats:
        return self.stats.setdefault(model, Stats())

    # --- a job's start and end ------------------------------------------------------------------------------------

    def lookup(self, model: str, root: bytes, ids: np.ndarray, hashes: Sequence[bytes],
               key: Hashable | None) -> Hit | None:
        """The longest cached start of a prompt (key: the reduce's whose items it needs, None for none), counted as a
        hit or a miss: whole blocks, less one token where items are needed, and never the prompt's last token."""
        with self._lock:
            found: list[Block] = []
            for j, h in enumerate(hashes):
                block = self.blocks.get(h)
                if block is None or block.root != root or (key is not None and key not in block.items) or \
                        not np.array_equal(block.tokens, ids[j * BLOCK:(j + 1) * BLOCK]):
                    break
                found.append(block)
            for h in reversed(hashes[:len(found)]):
                self.blocks.move_to_end(h)
            tokens = min(len(found) * BLOCK - (key is not None), len(ids) - 1)
            stats = self.stats_of(model)
            if tokens <= 0:
                stats.misses += 1
                return None
            stats.hits += 1
            stats.saved += tokens
            kv = [[b.kv[s] for b in found] for s in range(len(found[0].kv))]
            items = [it for b in found for it in b.items[key]][:tokens] if key is not None else []
        return Hit(tokens, [np.concatenate(parts, axis=1)[:, :tokens] for parts in kv], items)

    def missing(self, hashes: Sequence[bytes], key: Hashable | None) -> bool:
        """Whether a prompt's end would add anything: a block not held, or one without its key's items."""
        with self._lock:
            return any(h not in self.blocks or (key is not None and key not in self.blocks[h].items) for h in hashes)

    def insert(self, root: bytes, ids: np.ndarray, hashes: Sequence[bytes], state: list[np.ndarray],
               key: Hashable | None, items: list[Any] | None) -> None:
        """The whole blocks of a finished prompt (its state covers every position; `items`: its reduce's items for
        rows 0 .. n - 2, i.e. positions 1 .. n - 1), then evictions down to the bound."""
        added = []
        with self._lock:
            for j, h in enumerate(hashes):
                block = self.blocks.get(h)
                if block is None:
                    # copies of their own: a slice that is contiguous already (one KV head) would otherwise be a
                    # view keeping the call's whole output alive, past what the bound counts
                    kv = [np.array(t[:, j * BLOCK:(j + 1) * BLOCK], order="C", copy=True) for t in state]
                    block = Block(root, ids[j * BLOCK:(j + 1) * BLOCK].copy(), kv)
                    block.nbytes = sum(t.nbytes for t in kv) + block.tokens.nbytes
                    self.blocks[h] = block
                    self.nbytes += block.nbytes
                    added.append(h)
                if key is not None and items is not None and key not in block.items:
                    # positions j*BLOCK .. j*BLOCK+BLOCK-1 come from rows one before them; position 0 has none
                    first = max(j * BLOCK, 1)
                    block.items[key] = own = items[first - 1:(j + 1) * BLOCK - 1]
                    extra = len(own) * ITEM_BYTES + sum(len(c) for _, c in own) * CANDIDATE_BYTES
                    block.nbytes += extra
                    self.nbytes += extra
            for h in reversed(hashes):
                self.blocks.move_to_end(h)
            self._evict()

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes and self.blocks:
            _, block = self.blocks.popitem(last=False)
            self.nbytes -= block.nbytes
            self.stats_of_root(block.root).evictions += 1

    def stats_of_root(self, root: bytes) -> Stats:
        return self.stats_of(root.split(b"\0", 1)[0].decode())

    def purge(self, root: bytes) -> None:
        """Drop a retired model's blocks."""
        with self._lock:
            for h in [h for h, b in self.blocks.items() if b.root == root]:
                self.nbytes -= self.blocks.pop(h).nbytes

    def held(self, root: bytes | None = None) -> int:
        """Bytes held (by one model's blocks, given its root)."""
        with self._lock:
            return self.nbytes if root is None else sum(b.nbytes for b in self.blocks.values() if b.root == root)


class PrefixMetrics:
    """The cache's counters in the server's Prometheus registry, read from its stats when scraped."""

    def __init__(self, registry: Any, cache: PrefixCache):
        class Collector:
            def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
                counters = {"hits": "prompts that started on a cached prefix",
                            "misses": "prompts that could have used the prefix cache and found nothing",
                            "tokens_saved": "prompt tokens taken from the prefix cache instead of computed",
                            "evictions": "prefix cache blocks evicted for room (least recently used)"}
                for name, text in counters.items():
                    family = CounterMetricFamily(f"posenc_prefix_cache_{name}", text, labels=["model"])
                    for model, stats in list(cache.stats.items()):
                        family.add_metric([model], getattr(stats, "saved" if name == "tokens_saved" else name))
                    yield family
                gauge = GaugeMetricFamily("posenc_prefix_cache_bytes", "bytes the prefix cache holds (every model)")
                gauge.add_metric([], cache.nbytes)
                yield gauge

        registry.register(Collector())
