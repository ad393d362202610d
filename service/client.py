"""python -m service.client [--target HOST:PORT] [--json] list | predict | generate | score

  python -m service.client list
  python -m service.client predict --model rope "dog bites man" [--top-k 5] [--attention last|full]
  python -m service.client generate --model alibi "The " --max-new-tokens 64 [--temperature 0.8 --seed 1]
  python -m service.client score --model t5 "some text"
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc

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


def served_by(call) -> None:
    """Names the replica that answered (the worker's posenc-instance metadata) on stderr."""
    instance = dict(call.initial_metadata() or ()).get("posenc-instance")
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
    args = p.parse_args(argv)
    options = [("grpc.service_config", json.dumps({"loadBalancingConfig": [{args.lb: {}}]}))]
    with grpc.insecure_channel(args.target, options=options) as channel:
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


if __name__ == "__main__":
    sys.exit(main())
