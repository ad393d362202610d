"""python -m service.client [--target HOST:PORT] [--json] list | predict | generate | score | compare | encoding |
extrapolate | report

  python -m service.client list
  python -m service.client predict --model rope "dog bites man" [--top-k 5] [--attention last|full]
  python -m service.client generate --model alibi "The " --max-new-tokens 64 [--temperature 0.8 --seed 1]
  python -m service.client score --model t5 "some text"
  python -m service.client compare "dog bites man" [--permuted "man bites dog"] [--model rope --model alibi]
  python -m service.client encoding --model alibi --length 64 --png alibi.png
  python -m service.client extrapolate [--factors 1 2 4 8] [--text-bytes 16384] [--png F] [--out F.json]
  python -m service.client report --out report.html [--extrapolation F.json] [--prompt "dog bites man"]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.lab import FACTORS

MODES = {"none": pb.ATTENTION_NONE, "last": pb.ATTENTION_LAST_ROW, "full": pb.ATTENTION_FULL}


def show_list(resp: pb.ListModelsResponse) -> str:
    rows = [f"{'model':<12} {'variant':<11} {'params':>8} {'context':>7} {'max pos':>9} {'held-out':>9}"]
    for m in resp.models:
        rows.append(f"{m.name:<12} {m.variant:<11} {m.parameters:>8} {m.trained_context:>7} "
                    f"{m.max_positions or 'unbounded':>9} {m.heldout_loss:>9.3f}")
    return "\n".join(rows)


def show_predict(resp: pb.PredictResponse) -> str:
    out = [f"model {resp.model}: {len(resp.tokens)} prompt tokens "
           f"({resp.timing.total_ms:.1f} ms, batch {resp.timing.batch_size})",
           f"{'rank':>4} {'token':<14} {'prob':>8} {'logprob':>9}"]
    for rank, c in enumerate(resp.top, 1):
        out.append(f"{rank:>4} {c.token.piece:<14} {c.probability:>8.4f} {c.logprob:>9.3f}")
    for m in resp.attention:
        grid = np.frombuffer(m.data, "<f4").reshape(m.shape)
        top = np.argsort(-grid[-1])[:3]
        keys = ", ".join(f"{resp.tokens[k].piece}:{grid[-1, k]:.2f}" for k in top)
        out.append(f"attention layer {m.layer} head {m.head} {list(m.shape)}: last row peaks at {keys}")
    return "\n".join(out)


def show_score(resp: pb.ScoreResponse) -> str:
    return (f"model {resp.model}: {len(resp.logprobs)} scored tokens, total log-prob {resp.total_logprob:.3f}, "
            f"{resp.nats_per_token:.3f} nats/token, perplexity {resp.perplexity:.3f}")


def channel_for(target: str, lb: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=[("grpc.service_config",
                                                   json.dumps({"loadBalancingConfig": [{lb: {}}]}))])


INSTANCE_HEADER = "posenc-instance"  # service.servicer sends it


def instance_of(call) -> str | None:
    """The replica that answered a call (or an RpcError): trailing metadata on unary calls, initial on streams."""
    for part in (call.trailing_metadata, call.initial_metadata):
        found = dict(part() or ()).get(INSTANCE_HEADER)
        if found:
            return found
    return None


def served_by(call) -> None:
    """Names the replica that answered (the worker's posenc-instance metadata) on stderr."""
    instance = instance_of(call)
    if instance:
        print(f"served by {instance}", file=sys.stderr)


def prompt_of(args) -> pb.Prompt:
    return pb.Prompt(text=args.text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.client", description="posenc gRPC client")
    p.add_argument("--target", default=os.environ.get("POSENC_TARGET", "127.0.0.1:50051"))
    p.add_argument("--json", action="store_true", help="print the raw response as JSON")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--lb", choices=("pick_first", "round_robin"), default=os.environ.get("POSENC_LB", "pick_first"),
                   help="load balancing over the addresses the target resolves to (round_robin: every replica "
                        "behind dns:///SERVICE:PORT)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list")
    for name in ("predict", "generate", "score"):
        c = sub.add_parser(name)
        c.add_argument("--model", required=True)
        c.add_argument("text")
        if name == "predict":
            c.add_argument("--top-k", type=int, default=5)
            c.add_argument("--attention", choices=sorted(MODES), default="none")
            c.add_argument("--layer", type=int, action="append", default=[])
            c.add_argument("--head", type=int, action="append", default=[])
            c.add_argument("--attention-png", metavar="FILE",
                           help="draw the attention maps (layers x heads, token labels) to a PNG; "
                                "implies --attention full")
        if name == "generate":
            c.add_argument("--max-new-tokens", type=int, default=64)
            c.add_argument("--temperature", type=float, default=0.0)
            c.add_argument("--top-k", type=int, default=0)
            c.add_argument("--top-p", type=float, default=0.0)
            c.add_argument("--seed", type=int)
            c.add_argument("--stop", action="append", default=[])
    c = sub.add_parser("compare", help="one prompt through every model, and the same tokens permuted")
    c.add_argument("text")
    c.add_argument("--permuted", help="the same characters in another order (default: the words reversed)")
    c.add_argument("--model", action="append", default=[], help="repeatable; default every served model")
    c.add_argument("--top-k", type=int, default=5)
    c = sub.add_parser("encoding", help="draw what a model's positional encoding is (from its encoding graph)")
    c.add_argument("--model", required=True)
    c.add_argument("--length", type=int, default=64)
    c.add_argument("--png", metavar="FILE", help="write the picture here")
    c = sub.add_parser("extrapolate", help="held-out perplexity at multiples of the trained context")
    c.add_argument("--model", action="append", default=[], help="repeatable; default every served model")
    c.add_argument("--factors", type=int, nargs="+", default=list(FACTORS))
    c.add_argument("--text-bytes", type=int, default=16384, help="held-out bytes evaluated at every length")
    c.add_argument("--seed", type=int, default=0, help="picks where in the held-out text to start (0: its start)")
    c.add_argument("--corpus", help="UTF-8 file whose last 10%% is the held-out text (default: the built-in one)")
    c.add_argument("--concurrency", type=int, default=4)
    c.add_argument("--png", metavar="FILE", help="line plot of perplexity against length")
    c.add_argument("--out", metavar="FILE", help="the full result as JSON")
    c = sub.add_parser("report", help="one self-contained HTML page: extrapolation, order, encodings, attention")
    c.add_argument("--out", required=True, metavar="FILE")
    c.add_argument("--prompt", default="dog bites man")
    c.add_argument("--permuted")
    c.add_argument("--extrapolation", metavar="FILE", help="a JSON result of `extrapolate --out` to include")
    c.add_argument("--length", type=int, default=64, help="positions shown in the encoding pictures")
    c.add_argument("--model", action="append", default=[])
    args = p.parse_args(argv)
    if args.command in ("compare", "encoding", "extrapolate", "report"):
        return lab_main(args)
    with channel_for(args.target, args.lb) as channel:
        stub = posenc_pb2_grpc.PosencStub(channel)
        try:
            if args.command == "list":
                resp, call = stub.ListModels.with_call(pb.ListModelsRequest(), timeout=args.timeout)
                served_by(call)
                print(json.dumps(MessageToDict(resp), indent=2) if args.json else show_list(resp))
            elif args.command == "predict":
                if args.attention_png and args.attention == "none":
                    args.attention = "full"
                resp, call = stub.Predict.with_call(
                    pb.PredictRequest(model=args.model, prompt=prompt_of(args), top_k=args.top_k,
                                      attention=MODES[args.attention], layers=args.layer, heads=args.head),
                    timeout=args.timeout)
                served_by(call)
                print(json.dumps(MessageToDict(resp), indent=2) if args.json else show_predict(resp))
                if args.attention_png:
                    from service.heatmap import draw

                    maps = [(m.layer, m.head, np.frombuffer(m.data, "<f4").reshape(m.shape)) for m in resp.attention]
                    path = draw(maps, [t.piece for t in resp.tokens], args.attention_png,
                                title=f"{resp.model}: {args.text!r}")
                    print(f"attention heatmaps written to {path}", file=sys.stderr)
            elif args.command == "score":
                resp, call = stub.Score.with_call(pb.ScoreRequest(model=args.model, prompt=prompt_of(args)),
                                                  timeout=args.timeout)
                served_by(call)
                print(json.dumps(MessageToDict(resp), indent=2) if args.json else show_score(resp))
            else:
                req = pb.GenerateRequest(model=args.model, prompt=prompt_of(args), max_new_tokens=args.max_new_tokens,
                                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                         stop=args.stop, **({"seed": args.seed} if args.seed is not None else {}))
                last, shown = None, ""
                for msg in stub.Generate(req, timeout=args.timeout):
                    if args.json:
                        print(json.dumps(MessageToDict(msg)), flush=True)
                    elif not msg.text.endswith("\ufffd"):  # print whole characters as they complete
                        sys.stdout.write(msg.text[len(shown):])
                        sys.stdout.flush()
                        shown = msg.text
                    last = msg
                if not args.json:
                    print(f"\n[{last.finish_reason}] {last.text!r}" if last else "")
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 2
    return 0


def lab_main(args) -> int:
    from service import lab

    with channel_for(args.target, args.lb) as channel:
        stub = posenc_pb2_grpc.PosencStub(channel)
        try:
            if args.command == "compare":
                req = pb.CompareRequest(prompt=pb.Prompt(text=args.text), models=args.model, top_k=args.top_k)
                if args.permuted is not None:
                    req.permuted.CopyFrom(pb.Prompt(text=args.permuted))
                resp = stub.Compare(req, timeout=args.timeout)
                print(json.dumps(MessageToDict(resp), indent=2) if args.json else lab.compare_table(resp))
            elif args.command == "encoding":
                resp = stub.Encoding(pb.EncodingRequest(model=args.model, length=args.length), timeout=args.timeout)
                if args.json:
                    print(json.dumps({"model": resp.model, "variant": resp.variant, "note": resp.note,
                                      "tensors": {k: v.tolist() for k, v in lab.tensors_of(resp).items()}}))
                else:
                    shapes = ", ".join(f"{t.name} {list(t.shape)}" for t in resp.tensors) or resp.note
                    print(f"model {resp.model} ({resp.variant}): {shapes}")
                if args.png:
                    lab.encoding_plot(resp, args.png)
                    print(f"encoding picture written to {args.png}", file=sys.stderr)
            elif args.command == "extrapolate":
                result = lab.extrapolate(stub, args.model or None, args.factors, args.text_bytes, args.seed,
                                         args.corpus, args.concurrency, timeout=max(args.timeout, 600))
                print(json.dumps(result, indent=2) if args.json else lab.extrapolation_table(result))
                if args.out:
                    lab.write_atomic(Path(args.out), (json.dumps(result, indent=2) + "\n").encode())
                if args.png:
                    lab.extrapolation_plot(result, args.png)
                    print(f"plot written to {args.png}", file=sys.stderr)
            else:
                extra = lab.load_json(args.extrapolation) if args.extrapolation else None
                path = lab.report(stub, args.out, args.prompt, args.permuted, extra, args.length,
                                  args.model or None, timeout=args.timeout)
                print(f"report written to {path}")
        except grpc.RpcError as err:
            print(lab.rpc_error(err), file=sys.stderr)
            return 2
        except (ValueError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
