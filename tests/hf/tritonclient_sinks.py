"""KServe's `sink_mass` output through the standard client, run as its own process (tritonclient registers Triton's
protobuf messages, which posenc's stubs also define; tritonclient.http brings gevent).

  python tests/hf/tritonclient_sinks.py grpc|http|long HOST:PORT IN.npz OUT.npz

IN.npz holds `ids` and `mask` INT64 [batch, seq].  grpc, http: asks the model `gpt_oss` (attention sinks) for
attentions and sink_mass together and for sink_mass alone, and the model `ministral` (none) for sink_mass; prints a
JSON summary (both models' metadata and config outputs, the refusal's status and message) and writes the arrays to
OUT.npz.  long: over REST, `gpt_oss` alone, attentions alone and then sink_mass alone (each one's status).
"""

import json
import sys

import numpy as np

SINKS, PLAIN = "gpt_oss", "ministral"


def grpc(target: str, ids: np.ndarray, mask: np.ndarray) -> tuple[dict, dict]:
    import tritonclient.grpc as tc

    client = tc.InferenceServerClient(target)
    summary: dict = {"metadata": {}, "config": {}}
    for model in (SINKS, PLAIN):
        summary["metadata"][model] = {o["name"]: [int(d) for d in o["shape"]]
                                      for o in client.get_model_metadata(model, as_json=True)["outputs"]}
        summary["config"][model] = {o["name"]: [int(d) for d in o["dims"]]
                                    for o in client.get_model_config(model, as_json=True)["config"]["output"]}
    inputs = [tc.InferInput("input_ids", list(ids.shape), "INT64"), tc.InferInput("attention_mask", list(mask.shape),
                                                                                   "INT64")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(mask)
    both = client.infer(SINKS, inputs, outputs=[tc.InferRequestedOutput("attentions"),
                                                tc.InferRequestedOutput("sink_mass")])
    alone = client.infer(SINKS, inputs, outputs=[tc.InferRequestedOutput("sink_mass")])
    arrays = {"attentions": both.as_numpy("attentions"), "sink_mass": both.as_numpy("sink_mass"),
              "alone": alone.as_numpy("sink_mass")}
    summary["alone_outputs"] = [o.name for o in alone.get_response().outputs]
    summary["default_outputs"] = sorted(o.name for o in client.infer(SINKS, inputs).get_response().outputs)
    try:
        client.infer(PLAIN, inputs, outputs=[tc.InferRequestedOutput("sink_mass")])
        summary["refused"] = ["OK", ""]
    except tc.InferenceServerException as err:
        summary["refused"] = [err.status(), err.message()]
    return summary, arrays


def http(target: str, ids: np.ndarray, mask: np.ndarray) -> tuple[dict, dict]:
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    client = th.InferenceServerClient(target)
    summary: dict = {"metadata": {}, "config": {}}
    for model in (SINKS, PLAIN):
        summary["metadata"][model] = {o["name"]: [int(d) for d in o["shape"]]
                                      for o in client.get_model_metadata(model)["outputs"]}
        summary["config"][model] = {o["name"]: [int(d) for d in o["dims"]]
                                    for o in client.get_model_config(model)["output"]}
    inputs = [th.InferInput("input_ids", list(ids.shape), "INT64"), th.InferInput("attention_mask", list(mask.shape),
                                                                                   "INT64")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(mask)
    # attentions as bytes after the JSON part, sink_mass as JSON data; then sink_mass alone as bytes
    both = client.infer(SINKS, inputs, outputs=[th.InferRequestedOutput("attentions", binary_data=True),
                                                th.InferRequestedOutput("sink_mass", binary_data=False)])
    alone = client.infer(SINKS, inputs, outputs=[th.InferRequestedOutput("sink_mass", binary_data=True)])
    arrays = {"attentions": both.as_numpy("attentions"), "sink_mass": both.as_numpy("sink_mass"),
              "alone": alone.as_numpy("sink_mass")}
    summary["alone_outputs"] = [o["name"] for o in alone.get_response()["outputs"]]
    summary["default_outputs"] = sorted(o["name"] for o in client.infer(SINKS, inputs).get_response()["outputs"])
    try:
        client.infer(PLAIN, inputs, outputs=[th.InferRequestedOutput("sink_mass")])
        summary["refused"] = ["OK", ""]
    except InferenceServerException as err:
        summary["refused"] = [err.status(), err.message()]
    client.close()
    return summary, arrays


def long(target: str, ids: np.ndarray, mask: np.ndarray) -> tuple[dict, dict]:
    """Over REST: `attentions` alone, then `sink_mass` alone; each one's status and message, and its array where it
    was answered."""
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    client = th.InferenceServerClient(target, network_timeout=600.0, connection_timeout=600.0)
    inputs = [th.InferInput("input_ids", list(ids.shape), "INT64"), th.InferInput("attention_mask", list(mask.shape),
                                                                                   "INT64")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(mask)
    summary, arrays = {}, {}
    for name in ("attentions", "sink_mass"):
        try:
            answer = client.infer(SINKS, inputs, outputs=[th.InferRequestedOutput(name, binary_data=True)])
            summary[name], arrays[name] = ["OK", ""], answer.as_numpy(name)
        except InferenceServerException as err:
            summary[name] = [err.status(), err.message()]
    client.close()
    return summary, arrays


if __name__ == "__main__":
    kind, target, given, out = sys.argv[1:5]
    tensors = np.load(given)
    summary, arrays = {"grpc": grpc, "http": http, "long": long}[kind](target, tensors["ids"], tensors["mask"])
    np.savez(out, **arrays)
    print(json.dumps(summary, default=str))
