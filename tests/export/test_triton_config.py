"""The Triton repository's config.pbtxt against the graph it describes (read with Triton's own schema, from
tritonclient, in a process of its own), and against the ModelConfig the worker answers for the same artifact."""

import json
import subprocess
import sys

import onnx
from google.protobuf import json_format

from export.triton import write_repository
from protos.inference import grpc_service_pb2 as kv
from protos.inference import grpc_service_pb2_grpc
from protos.inference.config import from_pbtxt

# tritonclient registers Triton's own inference.* protobuf names; they clash with posenc's stubs in one process
READ_WITH_TRITON_SCHEMA = """
import json, sys
from pathlib import Path
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2
out = {p.parent.name: json_format.MessageToDict(text_format.Parse(p.read_text(), model_config_pb2.ModelConfig()),
                                                 preserving_proto_field_name=True)
       for p in sorted(Path(sys.argv[1]).glob("*/config.pbtxt"))}
print(json.dumps(out))
"""
ONNX_TYPES = {onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.FLOAT: "TYPE_FP32"}


def graph_io(path):
    graph = onnx.load(str(path), load_external_data=False).graph

    def spec(v):
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim]
        return ONNX_TYPES[v.type.tensor_type.elem_type], dims

    return {v.name: spec(v) for v in graph.input}, {v.name: spec(v) for v in graph.output}


def test_config_declares_the_graph_with_only_input_ids_required(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    names = write_repository(root, tmp_path / "repo")
    res = subprocess.run([sys.executable, "-c", READ_WITH_TRITON_SCHEMA, str(tmp_path / "repo")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    parsed = json.loads(res.stdout)
    assert sorted(parsed) == sorted(names)
    for name, cfg in parsed.items():
        inputs, outputs = graph_io(tmp_path / "repo" / name / "1" / "model.onnx")
        assert cfg["name"] == name and cfg["backend"] == "onnxruntime" and "max_batch_size" not in cfg  # 0
        declared = {i["name"]: (i["data_type"], [int(d) for d in i["dims"]]) for i in cfg["input"]}
        assert declared == inputs, name  # every graph input, with the graph's types and shapes
        required = [i["name"] for i in cfg["input"] if not i.get("optional")]
        assert required == ["input_ids"], (name, required)  # the mask and every past_* state may be left out
        assert {o["name"]: (o["data_type"], [int(d) for d in o["dims"]]) for o in cfg["output"]} == outputs
        assert cfg["parameters"]["posenc_variant"]["string_value"] == name
    assert "past_conv_state" in {i["name"] for i in parsed["cpe"]["input"] if i.get("optional")}


def test_the_workers_model_config_comes_from_the_same_builder(tiny_artifacts, channel, tmp_path):
    root, _ = tiny_artifacts
    write_repository(root, tmp_path / "repo")
    stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
    for name in ("rope", "cpe", "learned"):
        served = stub.ModelConfig(kv.ModelConfigRequest(name=name), timeout=10).config
        written = from_pbtxt((tmp_path / "repo" / name / "config.pbtxt").read_text())
        for field in ("name", "platform", "backend", "max_batch_size", "instance_group"):
            assert getattr(served, field) == getattr(written, field), (name, field)
        # the worker's own profile output (profile.onnx, which a Triton repository does not carry) names its columns
        # in one parameter more; every other parameter is the written one
        served_params = dict(served.parameters)
        assert "profile_columns" in served_params and "profile_columns" not in written.parameters
        del served_params["profile_columns"]
        assert served_params == dict(written.parameters), name
        by_name = {t.name: t for t in [*written.input, *written.output]}
        assert [t.name for t in served.output if t.name not in by_name] == ["profile"]  # the worker's alone
        # and its optional position_ids (the intervention graph's, which a Triton repository does not carry either),
        # where the model's encoding takes positions
        assert [t.name for t in served.input if t.name not in by_name] == (["position_ids"] if name != "cpe" else [])
        for tensor in [*served.input, *served.output]:  # ModelInfer's subset: input_ids, attention_mask, logits, ...
            if tensor.name in ("profile", "position_ids"):
                continue
            assert json_format.MessageToDict(tensor) == json_format.MessageToDict(by_name[tensor.name]), tensor.name
        assert [t.name for t in served.input if not t.optional] == ["input_ids"]
