"""export.dynamo exports in one trace: torch.export straight to the graph the ONNX exporter decomposes to, instead of
torch.export's training IR traced a second time by the exporter's run_decompositions.  Held to the exporter as torch
ships it (both traces): the same operators, and the same answers in onnxruntime at a batch, a length and a cache
other than the traced example's; and the one trace is what ran (run_decompositions never called), so a torch whose
private names moved fails here instead of exporting at twice the cost unnoticed."""

import collections
import contextlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export import dynamo, promotion
from export.build import export_onnx
from export.signature import input_names, spec_of
from export.wrapper import example_inputs
from tests.model.helpers import tiny_model


@pytest.fixture
def decompositions(monkeypatch):
    """The calls of ExportedProgram.run_decompositions (the exporter's second trace), counted."""
    calls = []
    original = torch.export.ExportedProgram.run_decompositions
    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    return calls


def answers(path, model):
    """The graph's outputs on 3 rows of 5 new tokens after 4 cached slots (the export traced 2, 7 and 6)."""
    ids, mask, past = example_inputs(model, batch=3, new=5, past=4, seed=3)
    mask[2, :3] = 0  # a second left-padded row
    feeds = dict(zip(input_names(spec_of(model)), [ids.numpy(), mask.numpy(), *(p.numpy() for p in past)],
                     strict=True))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("variant", ["rope", "cope"])  # cope: a float64 cumsum, gathers and a flip in the graph
def test_one_trace_exports_the_graph_the_exporters_two_traces_do(tmp_path, monkeypatch, decompositions, variant):
    monkeypatch.setattr(dynamo, "CACHE_DIR", None)  # both traced here, neither written from the run's graph cache
    model = tiny_model(variant)
    export_onnx(model, tmp_path / "one.onnx", 23)
    assert decompositions == []  # the exporter's decomposition pass took the program as it came
    with monkeypatch.context() as patch:
        patch.setattr(dynamo, "one_trace", contextlib.nullcontext)  # the exporter as torch ships it
        patch.setattr(promotion, "from_recorded", contextlib.nullcontext)
        export_onnx(model, tmp_path / "two.onnx", 23)
    assert decompositions == [1]

    def ops(name):
        return collections.Counter(n.op_type for n in onnx.load(str(tmp_path / name)).graph.node)

    assert ops("one.onnx") == ops("two.onnx")
    for a, b in zip(answers(tmp_path / "one.onnx", model), answers(tmp_path / "two.onnx", model), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_the_program_traced_once_is_the_exporters_only_inside_one_trace():
    """Outside an export torch.export and the exporter's decomposition pass are torch's own again."""
    from torch.onnx._internal.exporter import _fx_passes

    before = torch.export.export, _fx_passes.decompose_with_registry
    with dynamo.one_trace():
        assert torch.export.export is not before[0] and _fx_passes.decompose_with_registry is not before[1]
    assert (torch.export.export, _fx_passes.decompose_with_registry) == before
