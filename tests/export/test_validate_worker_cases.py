"""The validator's worker-shaped cases (pasts of 0, 5 and 11 in one batch with middle padding, each row against
itself alone; decode at a past of 2x the trained context) run for every variant, and fail on a broken graph."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from export.report import Report
from export.validate import Runner, reference_from_graph, worker_cases
from model.config import ModelConfig
from model.variants import REGISTRY

WORKER_CASES = ("middle padding", "2x context")


def graph_and_reference(root, variant):
    import json

    proto = onnx.load(str(root / variant / "model.onnx"))
    cfg = ModelConfig.from_dict(json.loads((root / variant / "model.json").read_text())["config"])
    return proto, reference_from_graph(proto, cfg)


def session(proto):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def ignoring_the_mask(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph, but every node that read attention_mask reads ones: padding is attended to and counted as
    a position, as a graph that took positions from arange instead of the mask would."""
    broken = onnx.ModelProto()
    broken.CopyFrom(proto)
    g = broken.graph

    def rewire(graph):
        for node in graph.node:
            node.input[:] = ["mask_all_ones" if i == "attention_mask" else i for i in node.input]
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    rewire(attr.g)

    rewire(g)
    g.initializer.extend([numpy_helper.from_array(np.array(0, np.int64), "broken_zero"),
                          numpy_helper.from_array(np.array(1, np.int64), "broken_one")])
    first = [helper.make_node("Mul", ["attention_mask", "broken_zero"], ["mask_zeros"]),
             helper.make_node("Add", ["mask_zeros", "broken_one"], ["mask_all_ones"])]
    nodes = first + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    return broken


@pytest.mark.parametrize("variant", sorted(REGISTRY))
def test_worker_cases_ran_and_passed_in_every_variants_export(tiny_artifacts, variant):
    _, reports = tiny_artifacts  # the export's own validation report of each tiny artifact
    rows = [c for c in reports[variant].checks if any(w in c.case for w in WORKER_CASES)]
    failed = [(c.case, c.output, c.max_abs_diff) for c in rows if not c.passed]
    assert rows and not failed, failed
    alone = [c for c in rows if "vs alone" in c.case]
    assert len(alone) == 6  # three rows, logits and attentions each
    skipped = [c for c in rows if c.output == "not run"]
    if variant == "learned":  # 2 * 16 + 2 positions exceed its table of 16 rows: said so, not pretended
        assert [c.case for c in skipped] == ["decode at past=32 (2x context)"] and "16" in skipped[0].detail
    else:  # two decode steps, each logits, attentions and present.*
        assert not skipped and sum("2x context" in c.case for c in rows) == 2 * 3


def test_a_graph_that_ignores_padding_fails_the_worker_cases(tiny_artifacts):
    root, _ = tiny_artifacts
    proto, model = graph_and_reference(root, "rope")
    report = Report("broken")
    run = Runner(session(ignoring_the_mask(proto)), model, report)
    rng = np.random.default_rng(0)

    def ids(b, n):
        return rng.integers(0, 256, (b, n), dtype=np.int64)

    run.compare("B=1 T=7", ids(1, 7), np.ones((1, 7), np.int64), run.empty_past(1), run.empty_past(1))
    assert all(c.passed for c in report.checks)  # the break only shows where there is padding
    worker_cases(run, ids, report)
    batched = [c for c in report.checks if "middle padding" in c.case and "alone" not in c.case]
    assert any(not c.passed for c in batched)
    assert any(not c.passed for c in report.checks if "vs alone" in c.case and "past=5" in c.case)
    assert any(not c.passed for c in report.checks if "2x context" in c.case)
