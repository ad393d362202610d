"""tritonclient.http against the worker's KServe v2 REST port, run as its own process (tritonclient brings gevent;
the pytest process keeps its own threads and gRPC).  Prints a JSON summary; arrays go to an .npz file.

  python tests/http/tritonclient_http.py HOST:PORT MODEL OUT.npz
"""

import json
import sys

import numpy as np


def main(target: str, model: str, out: str) -> dict:
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    client = th.InferenceServerClient(target)
    summary = {"live": client.is_server_live(), "ready": client.is_server_ready(),
               "model_ready": client.is_model_ready(model), "unknown_ready": client.is_model_ready("no-such-model"),
               "server": client.get_server_metadata(), "metadata": client.get_model_metadata(model),
               "config": client.get_model_config(model)}
    ids = np.array([[72, 101, 108, 108, 111], [0, 0, 100, 111, 103]], np.int64)
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], np.int64)
    inputs = [th.InferInput("input_ids", list(ids.shape), "INT64"), th.InferInput("attention_mask", list(mask.shape),
                                                                                   "INT64")]
    inputs[0].set_data_from_numpy(ids)  # binary_data=True: the default, the binary tensor extension
    inputs[1].set_data_from_numpy(mask)
    result = client.infer(model, inputs)  # no outputs named: all of them
    arrays = {"ids": ids, "mask": mask, "logits": result.as_numpy("logits"),
              "attentions": result.as_numpy("attentions")}
    json_in = th.InferInput("input_ids", list(ids.shape), "INT64")
    json_in.set_data_from_numpy(ids, binary_data=False)
    result = client.infer(model, [json_in], outputs=[th.InferRequestedOutput("logits", binary_data=False)])
    arrays["json_logits"] = result.as_numpy("logits")
    summary["json_attentions_is_none"] = result.as_numpy("attentions") is None
    try:
        client.infer("no-such-model", [json_in])
    except InferenceServerException as err:
        summary["unknown_error"] = [err.status(), err.message()]
    bad = th.InferInput("input_ids", [1, 2], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 2), np.float32))
    try:
        client.infer(model, [bad])
    except InferenceServerException as err:
        summary["bad_error"] = [err.status(), err.message()]
    np.savez(out, **arrays)
    client.close()
    return summary


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4]), default=str))
