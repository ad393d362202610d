"""The lab's commands (compare, encoding, extrapolate, report), reached through `posenc` / `python -m client` or
`python -m lab`; the client's parser defines their options, this runs them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from client.api import Client
from lab import pictures, studies
from lab.report import report


def run(args, client: Client) -> int:
    stub = client.stub
    if args.command == "compare":
        resp = client.compare(args.text, args.permuted, args.model, args.top_k)
        print(json.dumps(MessageToDict(resp), indent=2) if args.json else studies.compare_table(resp).markdown())
    elif args.command == "encoding":
        resp = client.encoding(args.model, args.length)
        if args.json:
            print(json.dumps({"model": resp.model, "variant": resp.variant, "note": resp.note,
                              "tensors": {k: v.tolist() for k, v in pictures.tensors_of(resp).items()}}))
        else:
            shapes = ", ".join(f"{t.name} {list(t.shape)}" for t in resp.tensors) or resp.note
            print(f"model {resp.model} ({resp.variant}): {shapes}")
        if args.png:
            pictures.encoding_plot(resp, args.png)
            print(f"encoding picture written to {args.png}", file=sys.stderr)
    elif args.command == "extrapolate":
        result = studies.extrapolate(stub, args.model or None, args.factors or studies.FACTORS, args.text_bytes,
                                     args.seed, args.corpus, args.concurrency, timeout=max(args.timeout, 600))
        print(json.dumps(result, indent=2) if args.json else studies.extrapolation_table(result).markdown())
        if args.out:
            studies.write_atomic(Path(args.out), (json.dumps(result, indent=2) + "\n").encode())
        if args.png:
            pictures.extrapolation_plot(result, args.png)
            print(f"plot written to {args.png}", file=sys.stderr)
    else:
        extra = studies.load_json(args.extrapolation) if args.extrapolation else None
        path = report(stub, args.out, args.prompt, args.permuted, extra, args.length, args.model or None,
                      timeout=args.timeout)
        print(f"report written to {path}")
    return 0
