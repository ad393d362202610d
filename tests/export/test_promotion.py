"""export.promotion's type-promotion pass, which reads the values torch.export recorded instead of interpreting the
graph again, held to the exporter's own pass: the same ONNX bytes on a module whose graph needs a cast of every
kind the pass inserts; and it is the pass an export runs, with the pinned torch.  (A model's graph under both passes:
tests/bench/test_export_speed.py.)"""

import collections
import contextlib

import onnx
import torch

from export import dynamo, promotion


class Mixed(torch.nn.Module):
    """Each kind of cast ATen's promotion implies: a float16 tensor added to a float32 one (the float16 input cast),
    an int64 tensor divided by a Python int (both made float32: the int tensor cast, the int a scalar tensor), a
    float32 tensor times a symbolic size (a scalar tensor of the SymInt) and float16 arithmetic computed in float32
    and cast back to float16 (op math)."""

    def forward(self, x: torch.Tensor, h: torch.Tensor, i: torch.Tensor):
        return x + h, i / 3, x * x.shape[1], h * h + 1


def mixed_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g).half(),
            torch.randint(0, 9, (2, 5), generator=g))


def export_mixed(path):
    batch, width = torch.export.Dim("batch"), torch.export.Dim("width")
    program = dynamo.onnx_export(Mixed().eval(), mixed_inputs(), dynamic_shapes=({0: batch, 1: width},) * 3,
                                 external_data=False, optimize=False, verbose=False)
    onnx.save_model(program.model_proto, str(path))
    return path.read_bytes()


def without_it(monkeypatch):
    """The exporter's own type-promotion pass for what runs inside the context."""
    monkeypatch.setattr(promotion, "from_recorded", contextlib.nullcontext)


def test_every_kind_of_cast_is_the_exporters_own(tmp_path, monkeypatch):
    ours = export_mixed(tmp_path / "ours.onnx")
    without_it(monkeypatch)
    theirs = export_mixed(tmp_path / "theirs.onnx")
    assert ours == theirs
    graph = onnx.load(str(tmp_path / "ours.onnx")).graph
    casts = collections.Counter(onnx.helper.tensor_dtype_to_np_dtype(a.i).name for n in graph.node
                                if n.op_type == "Cast" for a in n.attribute if a.name == "to")
    assert casts["float32"] >= 4 and casts["float16"] >= 1, casts  # inputs widened, op math narrowed back


def test_the_pass_is_the_exporters_only_inside_the_context():
    from torch.onnx._internal.exporter import _fx_passes

    assert promotion.available()  # the pinned torch's private names are where the pass expects them
    own = _fx_passes.insert_type_promotion_nodes
    with promotion.from_recorded():
        assert _fx_passes.insert_type_promotion_nodes is promotion.insert_type_promotion_nodes
    assert _fx_passes.insert_type_promotion_nodes is own
