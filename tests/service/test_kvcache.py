"""The KV-cache contract (service/kvcache.py) that every layout registered in service/layouts.py keeps, run against
each one on a tiny artifact whose fast graph has it, with torch's forward over each row's whole sequence as the
reference: prompts in pieces batched with other rows' pieces, a batch that streams join and leave (with their
state, and back), grows past its room and shrinks when a long stream has gone; every row's logits at every step
are those of its sequence run alone."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from service.artifacts import LAYOUTS as ACCEPTED
from service.artifacts import load_artifact
from service.executor import Executor
from service.jobs import Job, Step
from service.layouts import LAYOUTS, layout_of
from tests.model.helpers import tiny_model

ARTIFACT_OF = {"padded": "alibi", "compact": "rope"}  # a tiny variant whose fast graph has the layout
ATOL = 1e-4


@pytest.fixture(scope="module")
def fast_artifacts(tiny_artifacts, tmp_path_factory):
    """The tiny artifacts of ARTIFACT_OF's variants with their fast graphs added (python -m export.fuse)."""
    from export.fuse import add_to_artifact

    root = tmp_path_factory.mktemp("fast")
    for variant in sorted(set(ARTIFACT_OF.values())):
        (root / variant).mkdir()
        for f in (tiny_artifacts[0] / variant).iterdir():
            os.link(f, root / variant / f.name)
        add_to_artifact(root / variant)
    return root


def test_every_registered_layout_is_accepted_and_tested_here():
    """A new layout is one class in service/layouts.py: the artifact check accepts its name and inputs from there,
    and this module must name a tiny variant whose fast graph has it."""
    assert set(ARTIFACT_OF) == set(LAYOUTS)
    assert ACCEPTED == {name: cls.inputs for name, cls in LAYOUTS.items()}


class Row(SimpleNamespace):
    """A stream as the cache sees it (cached, room), with its tokens so far for the reference."""

    @property
    def cached(self):
        return len(self.tokens)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_batch_in_every_layout_gives_each_row_the_logits_of_its_sequence_alone(fast_artifacts, layout):
    variant = ARTIFACT_OF[layout]
    model = load_artifact(fast_artifacts / variant, threads=1)
    assert layout_of(model) is LAYOUTS[layout]
    reference = tiny_model(variant)  # the weights the tiny artifact was exported from (tests/conftest.py)
    rng = np.random.default_rng(21)
    executor = Executor(model)

    def alone(tokens):
        with torch.no_grad():
            return reference(torch.tensor([tokens])).logits[0].numpy()

    # prompts: every row's first piece in one call, then the rest of each on its past, batched (a layout may split)
    rows = [Row(tokens=rng.integers(0, 256, n).tolist(), room=0) for n in (7, 12, 3)]
    first = executor.run([Job(np.asarray(r.tokens[:2]), None) for r in rows])
    rest = executor.run([Job(np.asarray(r.tokens[2:]), res.state) for r, res in zip(rows, first, strict=True)])
    for r, res in zip(rows, rest, strict=True):
        assert np.allclose(res.logits, alone(r.tokens)[2:], atol=ATOL)
        r.state, r.room = res.state, r.cached + 3  # rooms the steps below outgrow: the cache must grow

    cache, outside = executor.cache(), []

    def steps(batch, n):
        for _ in range(n):
            cache.grow(batch + outside)
            ids = rng.integers(0, 256, (len(batch), 1))
            logits = executor.step(Step(ids, cache))
            for b, r in enumerate(batch):
                r.tokens.append(int(ids[b, 0]))
                assert np.allclose(logits[b], alone(r.tokens)[-1], atol=ATOL), (layout, b, r.cached)
            assert cache.lengths.tolist() == [r.cached for r in batch]

    def regroup(batch, keep, enter):
        order = cache.regroup(keep, [r.state for r in enter], [batch[b] for b in keep] + enter + outside)
        assert sorted(order) == sorted(keep)
        return [batch[b] for b in order] + enter

    batch = regroup([], [], rows[:2])  # two join an empty batch
    steps(batch, 4)
    batch = regroup(batch, [0, 1], rows[2:])  # a third joins the running two
    steps(batch, 5)
    gone = batch[0]
    gone.state = cache.take(0)  # it leaves with its state (ahead of its reader) ...
    outside.append(gone)
    batch = regroup(batch, [1, 2], [])
    steps(batch, 3)
    outside.remove(gone)
    batch = regroup(batch, list(range(len(batch))), [gone])  # ... and comes back
    steps(batch, 3)
    long = Row(tokens=rng.integers(0, 256, 60).tolist(), room=200)
    long.state = executor.run([Job(np.asarray(long.tokens), None)])[0].state
    batch = regroup(batch, list(range(len(batch))), [long])
    steps(batch, 2)
    batch = regroup(batch, [b for b, r in enumerate(batch) if r is not long], [])  # the long stream finished
    if cache.oversized(batch):  # memory held for it is let go at a regroup
        batch = regroup(batch, list(range(len(batch))), [])
    assert not cache.oversized(batch)
    steps(batch, 3)
    cache.clear()
    assert cache.rows == 0
