"""What checking HTTP bodies with their pydantic models costs, beside the parsing the routes did without them.

    python -m bench bodies        (writes bench/results/bodies.json in the results convention)

Per body: the time of the model's validation alone (service.http.errors.validated), and of the whole parse of that
route (KServe REST: JSON text to the neutral request, validation included; posenc JSON: validation plus
json_format into the proto message), best of several repeats of many calls on one CPU thread.  No server: this
is the per-request CPU the models add."""

from __future__ import annotations

import json
import os
import sys
import time
import timeit
from pathlib import Path

from google.protobuf import json_format

from bench.lib.results import write
from model.cli import Parser
from protos.posenc.v1 import posenc_pb2 as pb
from service.http.errors import validated
from service.http.kserve_rest import InferRequest, parse_infer
from service.http.proto_models import model_for

OUT = Path(__file__).resolve().parent / "results" / "bodies.json"


class _Front:  # what parse_infer reads of the HTTP front
    class limits:  # noqa: N801
        max_message_bytes = 64 * 1024 * 1024


def best_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def measure() -> list[list]:
    rows = []
    for tokens in (16, 512):
        doc = {"id": "r", "inputs": [{"name": "input_ids", "shape": [1, tokens], "datatype": "INT64",
                                      "data": list(range(tokens))}], "outputs": [{"name": "logits"}]}
        body = json.dumps(doc).encode()
        model_us = best_us(lambda d=doc: validated(InferRequest, d), 2000)
        parse_us = best_us(lambda b=body: parse_infer(_Front, "rope", "", b, None), 500)
        rows.append([f"KServe REST infer, {tokens} ids as JSON data", round(model_us, 1), round(parse_us, 1),
                     round(100 * model_us / parse_us, 1)])
    doc = {"model": "rope", "prompt": {"text": "the quick brown fox " * 8}, "top_k": 5,
           "attention": "ATTENTION_LAST_ROW", "layers": [0], "heads": [0, 1]}
    model = model_for(pb.PredictRequest.DESCRIPTOR)
    model_us = best_us(lambda: validated(model, doc), 5000)
    proto_us = best_us(lambda: json_format.ParseDict(doc, pb.PredictRequest()), 5000)
    rows.append(["posenc JSON predict", round(model_us, 1), round(model_us + proto_us, 1),
                 round(100 * model_us / (model_us + proto_us), 1)])
    return rows


def main(argv: list[str] | None = None) -> int:
    Parser(prog="python -m bench bodies", description=__doc__.splitlines()[0]).parse_args(argv)
    t0 = time.perf_counter()
    rows = measure()
    result = {"meta": {"command": "python -m bench bodies"},
              "tables": {"overhead": {"columns": ["body", "pydantic validation (us)", "whole parse (us)",
                                                  "share (%)"], "rows": rows}}}
    write(OUT.parent, OUT.stem, result, indent=2)
    for row in rows:
        print(" | ".join(str(c) for c in row))
    print(f"({time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    return 0

