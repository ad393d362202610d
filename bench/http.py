"""make bench, section 6: what the HTTP front costs next to gRPC on the same worker, the same model and prompt.

Predict (posenc.v1 over gRPC vs its JSON form over HTTP) and KServe v2 inference (gRPC ModelInfer vs REST with
binary tensors, logits only), each timed in interleaved blocks over one kept-alive connection; ratio = the
median of paired block ratios against the gRPC call."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import grpc
import numpy as np

from bench.timing import interleaved, paired_ratio
from protos.inference import grpc_service_pb2 as kv
from protos.inference import grpc_service_pb2_grpc
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc


def bench_http(art_dir: Path, model: str, n: int, repeat: int) -> list[dict]:
    from service.registry import Limits
    from service.server import Server, Settings
    from service.settings import Batching

    srv = Server(Settings(model_dir=art_dir, port=0, http_port=0, metrics_port=-1, threads=2,
                          batching=Batching(max_wait_ms=0.0), limits=Limits())).start()
    web = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=60)
    try:
        ids = np.random.default_rng(0).integers(0, 256, (1, n)).astype(np.int64)
        predict = pb.PredictRequest(model=model, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids[0].tolist())))
        predict_json = json.dumps({"model": model, "prompt": {"tokens": {"ids": ids[0].tolist()}}}).encode()
        infer = kv.ModelInferRequest(model_name=model, inputs=[kv.ModelInferRequest.InferInputTensor(
            name="input_ids", datatype="INT64", shape=list(ids.shape))], raw_input_contents=[ids.tobytes()],
            outputs=[kv.ModelInferRequest.InferRequestedOutputTensor(name="logits")])
        head = json.dumps({"inputs": [{"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64",
                                       "parameters": {"binary_data_size": ids.nbytes}}],
                           "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
        infer_body = head + ids.tobytes()

        def post(path: str, body: bytes, headers: dict) -> bytes:
            web.request("POST", path, body=body, headers=headers)
            r = web.getresponse()
            data = r.read()
            if r.status != 200:
                raise RuntimeError(f"{path}: HTTP {r.status}: {data[:200]!r}")
            return data

        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = posenc_pb2_grpc.PosencStub(ch)
            kserve = grpc_service_pb2_grpc.GRPCInferenceServiceStub(ch)
            times = interleaved({
                "gRPC Predict": lambda: stub.Predict(predict),
                "HTTP JSON Predict": lambda: post("/v1/posenc/predict", predict_json,
                                                  {"content-type": "application/json"}),
                "gRPC ModelInfer (logits)": lambda: kserve.ModelInfer(infer),
                "HTTP KServe infer, binary (logits)": lambda: post(
                    f"/v2/models/{model}/infer", infer_body,
                    {"inference-header-content-length": str(len(head)), "content-type": "application/octet-stream"}),
            }, repeat)
    finally:
        web.close()
        srv.stop(grace=1)
    rows = []
    for name, t in times.items():
        base = "gRPC Predict" if "Predict" in name else "gRPC ModelInfer (logits)"
        rows.append({"model": model, "seq": n, "path": name, **{k: v for k, v in t.items() if k != "round_ms"},
                     "ratio_vs_grpc": paired_ratio(times, name, base)})
    return rows


def table(rows: list[dict]) -> dict:
    """Section 6 in the results convention (docs/tools/fill.py renders it)."""
    return {"title": "6. HTTP front vs gRPC (same worker, model and prompt; one kept-alive connection each; ratio = "
                     "median of paired block ratios against the gRPC call)",
            "columns": ["path", "seq", "median ms", "p10-p90", "vs gRPC"],
            "rows": [[x["path"], x["seq"], f"{x['median_ms']:.2f}", f"{x['p10_ms']:.2f}-{x['p90_ms']:.2f}",
                      f"{x['ratio_vs_grpc']:.2f}x"] for x in rows]}
