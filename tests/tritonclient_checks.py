"""Checks that use tritonclient, run as a separate process by the tests.

tritonclient registers Triton's own `inference.*` protobuf messages; posenc's stubs register the same names, and
one Python process cannot hold both descriptor sets.  So the pytest process serves, and this script is the
standard client.

  python tests/tritonclient_checks.py parse-configs REPO      # every config.pbtxt with model_config_pb2
  python tests/tritonclient_checks.py kserve HOST:PORT MODEL  # infer, async_infer, metadata, readiness
"""

import json
import sys
import threading
from pathlib import Path

import numpy as np


def parse_configs(repo: str) -> dict:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    out = {}
    for cfg_path in sorted(Path(repo).glob("*/config.pbtxt")):
        cfg = text_format.Parse(cfg_path.read_text(), model_config_pb2.ModelConfig())
        out[cfg_path.parent.name] = {
            "name": cfg.name, "backend": cfg.backend, "max_batch_size": cfg.max_batch_size,
            "inputs": {i.name: [list(i.dims), model_config_pb2.DataType.Name(i.data_type)] for i in cfg.input},
            "outputs": {o.name: [list(o.dims), model_config_pb2.DataType.Name(o.data_type)] for o in cfg.output},
        }
    return out


def kserve(target: str, model: str) -> dict:
    import tritonclient.grpc as tc

    client = tc.InferenceServerClient(target)
    out = {"live": client.is_server_live(), "ready": client.is_server_ready(),
           "model_ready": client.is_model_ready(model), "unknown_ready": client.is_model_ready("no-such-model"),
           "server": client.get_server_metadata(as_json=True),
           "metadata": client.get_model_metadata(model, as_json=True),
           "config": client.get_model_config(model, as_json=True)}
    ids = np.array([[0, 0, 100, 101, 102], [10, 11, 12, 13, 14]], np.int64)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int64)
    inputs = [tc.InferInput("input_ids", list(ids.shape), "INT64"),
              tc.InferInput("attention_mask", list(mask.shape), "INT64")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(mask)
    result = client.infer(model, inputs)
    out["logits"] = result.as_numpy("logits").tolist()
    out["attentions_shape"] = list(result.as_numpy("attentions").shape)
    only = client.infer(model, inputs[:1], outputs=[tc.InferRequestedOutput("logits")])
    out["subset_attentions_is_none"] = only.as_numpy("attentions") is None
    out["subset_logits"] = only.as_numpy("logits").tolist()
    done, box = threading.Event(), {}
    client.async_infer(model, inputs, lambda result, error: (box.update(result=result, error=error), done.set()))
    done.wait(30)
    out["async_equal"] = box["error"] is None and bool(np.array_equal(box["result"].as_numpy("logits"),
                                                                      result.as_numpy("logits")))
    try:
        client.infer("no-such-model", inputs)
        out["unknown_status"] = "OK"
    except tc.InferenceServerException as err:
        out["unknown_status"] = err.status()
    bad = tc.InferInput("input_ids", [1, 2], "INT64")
    bad.set_data_from_numpy(np.array([[1, 999]], np.int64))
    try:
        client.infer(model, [bad])
        out["bad_status"] = "OK"
    except tc.InferenceServerException as err:
        out["bad_status"] = err.status()
    return out


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    result = parse_configs(*args) if command == "parse-configs" else kserve(*args)
    print(json.dumps(result))
