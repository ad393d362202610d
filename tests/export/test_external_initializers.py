"""export.graphcheck.initializer_array: a graph loaded without its external data gives its weights memory-mapped
from the file beside it (what the validator compares and fingerprints at real size), and refuses a location that
is not a plain file name in the graph's folder."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from export.graphcheck import initializer_array, is_external


def _graph_with_external_weight(folder, values: np.ndarray):
    weight = numpy_helper.from_array(values, "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, values.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, values.shape[1]])], [weight])
    model = helper.make_model(graph)
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0)
    return onnx.load(str(folder / "model.onnx"), load_external_data=False)


def test_external_weights_are_memory_mapped_from_the_file(tmp_path):
    values = np.arange(24, dtype=np.float32).reshape(4, 6) / 7
    proto = _graph_with_external_weight(tmp_path, values)
    init = proto.graph.initializer[0]
    assert is_external(init) and not init.raw_data  # nothing of the weight is in the loaded proto
    got = initializer_array(init, tmp_path)
    assert isinstance(got, np.memmap) and got.shape == (4, 6)
    np.testing.assert_array_equal(got, values)
    got[0, 0] = 99  # copy-on-write: the file is never changed through the map
    np.testing.assert_array_equal(initializer_array(init, tmp_path), values)


@pytest.mark.parametrize("location", ["../model.onnx.data", "/etc/passwd", "sub/model.onnx.data"])
def test_a_location_outside_the_folder_is_refused(tmp_path, location):
    proto = _graph_with_external_weight(tmp_path, np.ones((2, 3), np.float32))
    init = proto.graph.initializer[0]
    for entry in init.external_data:
        if entry.key == "location":
            entry.value = location
    with pytest.raises(ValueError, match="not a file beside the graph"):
        initializer_array(init, tmp_path)


def test_without_a_folder_an_external_weight_is_refused(tmp_path):
    proto = _graph_with_external_weight(tmp_path, np.ones((2, 3), np.float32))
    with pytest.raises(ValueError):
        initializer_array(proto.graph.initializer[0], None)
