"""The `profile` output through the standard KServe client, run as its own process (tritonclient registers
Triton's protobuf messages, which posenc's stubs also define; tritonclient.http brings gevent).

  python tests/http/tritonclient_profile.py grpc|http HOST:PORT MODEL OUT.npz

Asks for the profile of two prompts (the second left-padded) averaged over every row and over the last 3, and
for an unknown parameter value; prints a JSON summary (the columns the config and the output name, the statuses of
refusals) and writes the arrays to OUT.npz.
"""

import json
import sys

import numpy as np

IDS = np.array([[0, 0, 0, 100, 101, 102, 103, 104, 105], [10, 11, 12, 13, 14, 15, 16, 17, 18]], np.int64)
MASK = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]], np.int64)


def grpc(target: str, model: str) -> tuple[dict, dict]:
    import tritonclient.grpc as tc

    client = tc.InferenceServerClient(target)
    cfg = client.get_model_config(model, as_json=True)["config"]
    summary = {"metadata": client.get_model_metadata(model, as_json=True)["outputs"],
               "config_columns": cfg["parameters"]["profile_columns"]["string_value"],
               "config_outputs": {o["name"]: o["dims"] for o in cfg["output"]}}
    inputs = [tc.InferInput("input_ids", list(IDS.shape), "INT64"), tc.InferInput("attention_mask", list(MASK.shape),
                                                                                   "INT64")]
    inputs[0].set_data_from_numpy(IDS)
    inputs[1].set_data_from_numpy(MASK)
    arrays = {}
    for last in (0, 3):
        result = client.infer(model, inputs, outputs=[tc.InferRequestedOutput("profile")],
                              parameters={"profile_last": last} if last else None)
        arrays[f"last{last}"] = result.as_numpy("profile")
        summary["columns"] = result.get_output("profile").parameters["columns"].string_param
        summary["logits_is_none"] = result.as_numpy("logits") is None
    both = client.infer(model, inputs, outputs=[tc.InferRequestedOutput("logits"), tc.InferRequestedOutput("profile")])
    arrays["both_logits"], arrays["both_profile"] = both.as_numpy("logits"), both.as_numpy("profile")
    summary["default_outputs"] = sorted(o.name for o in client.infer(model, inputs).get_response().outputs)
    for name, params in (("too_many", {"profile_last": 7}), ("negative", {"profile_last": -1})):
        try:
            client.infer(model, inputs, outputs=[tc.InferRequestedOutput("profile")], parameters=params)
            summary[name] = ["OK", ""]
        except tc.InferenceServerException as err:
            summary[name] = [err.status(), err.message()]
    return summary, arrays


def http(target: str, model: str) -> tuple[dict, dict]:
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    client = th.InferenceServerClient(target)
    cfg = client.get_model_config(model)
    summary = {"metadata": client.get_model_metadata(model)["outputs"],
               "config_columns": cfg["parameters"]["profile_columns"]["string_value"]}
    inputs = [th.InferInput("input_ids", list(IDS.shape), "INT64"), th.InferInput("attention_mask", list(MASK.shape),
                                                                                   "INT64")]
    inputs[0].set_data_from_numpy(IDS)
    inputs[1].set_data_from_numpy(MASK)
    arrays = {}
    for last, binary in ((0, True), (3, False)):  # bytes after the JSON part, and JSON data
        result = client.infer(model, inputs, outputs=[th.InferRequestedOutput("profile", binary_data=binary)],
                              parameters={"profile_last": last} if last else None)
        arrays[f"last{last}"] = result.as_numpy("profile")
        summary["columns"] = result.get_output("profile")["parameters"]["columns"]
    summary["default_outputs"] = sorted(o["name"] for o in client.infer(model, inputs).get_response()["outputs"])
    for name, params in (("too_many", {"profile_last": 7}), ("negative", {"profile_last": -1})):
        try:
            client.infer(model, inputs, outputs=[th.InferRequestedOutput("profile")], parameters=params)
            summary[name] = ["OK", ""]
        except InferenceServerException as err:
            summary[name] = [err.status(), err.message()]
    client.close()
    return summary, arrays


if __name__ == "__main__":
    kind, target, model, out = sys.argv[1:5]
    summary, arrays = (grpc if kind == "grpc" else http)(target, model)
    np.savez(out, **arrays)
    print(json.dumps(summary, default=str))
