"""tritonclient, gRPC and HTTP, sends the KServe requests of a JSON file to a worker, run as its own process (one
process cannot hold tritonclient's `inference.*` protobuf names and posenc's: tests/tritonclient_checks.py).

  python tests/service/tritonclient_intervene.py GRPC_HOST:PORT HTTP_HOST:PORT REQUESTS.json OUT.npz

A request is {"model", "inputs": {name: [values, datatype]}, "outputs": [names], "parameters": {...}}.  Prints a JSON
summary: per transport and request key, {"error": [status, message]} or {"ok": true}, and per transport each
model's metadata inputs; the outputs go to OUT.npz as "transport/key/output"."""

import json
import sys

import numpy as np

DTYPES = {"INT64": np.int64, "FP32": np.float32}


def send(tc, client, request: dict) -> dict[str, np.ndarray]:
    inputs = []
    for name, (values, datatype) in request["inputs"].items():
        array = np.asarray(values, DTYPES[datatype])
        tensor = tc.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    names = request.get("outputs") or ["logits", "attentions"]
    result = client.infer(request["model"], inputs, outputs=[tc.InferRequestedOutput(n) for n in names],
                          parameters=request.get("parameters") or None)
    return {n: result.as_numpy(n) for n in names}


def main(grpc_target: str, http_target: str, requests_file: str, out: str) -> dict:
    import tritonclient.grpc as tg
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    requests = json.loads(open(requests_file).read())
    summary: dict = {}
    arrays = {}
    for transport, tc, target in (("grpc", tg, grpc_target), ("http", th, http_target)):
        client = tc.InferenceServerClient(target)
        meta = {}
        for model in sorted({r["model"] for r in requests.values()}):
            doc = client.get_model_metadata(model, as_json=True) if tc is tg else client.get_model_metadata(model)
            meta[model] = [i["name"] for i in doc["inputs"]]
        summary[f"{transport}/metadata"] = meta
        for key, request in requests.items():
            try:
                for name, value in send(tc, client, request).items():
                    arrays[f"{transport}/{key}/{name}"] = value
                summary[f"{transport}/{key}"] = {"ok": True}
            except InferenceServerException as err:
                summary[f"{transport}/{key}"] = {"error": [str(err.status()), err.message()]}
        client.close()
    np.savez(out, **arrays)
    return summary


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
