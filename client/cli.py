"""posenc [--target HOST:PORT] [--json] COMMAND: the one command line for people (also `python -m client`).

  posenc list
  posenc predict --model rope "dog bites man" [--top-k 5] [--attention last|full] [--attention-png F]
  posenc generate --model alibi "The " --max-new-tokens 64 [--temperature 0.8 --seed 1]
  posenc score --model t5 "some text"
  posenc tokenize --model gpt2 "some text"
  posenc compare "dog bites man" [--permuted "man bites dog"] [--model rope --model alibi]
  posenc encoding --model alibi --length 64 --png alibi.png
  posenc extrapolate [--factors 1 2 4 8] [--text-bytes 16384] [--png F] [--out F.json]
  posenc report --out report.html [--extrapolation F.json] [--prompt "dog bites man"]

The last four are the lab's (also `python -m lab`); they and the PNG options import the lab (and matplotlib) only
when used.  Targets, TLS and load balancing: client/channel.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from client.api import ATTENTION, Client, attention_maps
from client.channel import TLS, ChannelError, channel_for, instance_of
from model import cli
from model.cli import ClientTLS, Parser
from protos.posenc.v1 import posenc_pb2 as pb

LAB_COMMANDS = ("compare", "encoding", "extrapolate", "report")


def show_list(resp: pb.ListModelsResponse) -> str:
    rows = [f"{'model':<12} {'variant':<11} {'params':>10} {'context':>7} {'max pos':>9} {'held-out':>9}"]
    for m in resp.models:
        loss = f"{m.heldout_loss:>9.3f}" if m.heldout_loss > 0 else f"{'–':>9}"  # 0: no figure was measured
        rows.append(f"{m.name:<12} {m.variant:<11} {m.parameters:>10} {m.trained_context:>7} "
                    f"{m.max_positions or 'unbounded':>9} {loss}")
    return "\n".join(rows)


def show_predict(resp: pb.PredictResponse) -> str:
    out = [f"model {resp.model}: {len(resp.tokens)} prompt tokens "
           f"({resp.timing.total_ms:.1f} ms, batch {resp.timing.batch_size})",
           f"{'rank':>4} {'token':<14} {'prob':>8} {'logprob':>9}"]
    for rank, c in enumerate(resp.top, 1):
        out.append(f"{rank:>4} {c.token.piece:<14} {c.probability:>8.4f} {c.logprob:>9.3f}")
    for layer, head, grid in attention_maps(resp):
        top = (-grid[-1]).argsort()[:3]
        keys = ", ".join(f"{resp.tokens[k].piece}:{grid[-1, k]:.2f}" for k in top)
        out.append(f"attention layer {layer} head {head} {list(grid.shape)}: last row peaks at {keys}")
    return "\n".join(out)


def show_score(resp: pb.ScoreResponse) -> str:
    return (f"model {resp.model}: {len(resp.logprobs)} scored tokens, total log-prob {resp.total_logprob:.3f}, "
            f"{resp.nats_per_token:.3f} nats/token, {resp.nats_per_byte:.3f} nats/byte, "
            f"perplexity {resp.perplexity:.3f}")


def served_by(call) -> None:
    """Names the replica that answered (the worker's posenc-instance metadata) on stderr."""
    instance = instance_of(call)
    if instance:
        print(f"served by {instance}", file=sys.stderr)


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def parser(prog: str = "posenc", commands: tuple[str, ...] | None = None) -> Parser:
    p = Parser(prog=prog, description="posenc client: the worker's models, predictions, attention and lab studies")
    p.add_argument("--target", default=os.environ.get("POSENC_TARGET", "127.0.0.1:50051"),
                   help="HOST:PORT, a comma-separated list of them, or dns:///NAME:PORT (POSENC_TARGET)")
    p.add_argument("--json", action="store_true", help="print the raw response as JSON")
    p.add_argument("--timeout", type=positive(float), default=60.0, help="seconds per call")
    p.add_argument("--lb", choices=("pick_first", "round_robin"), default=os.environ.get("POSENC_LB"),
                   help="load balancing over the addresses the target resolves to (default: round_robin for a "
                        "list, pick_first otherwise; POSENC_LB)")
    cli.add_options(p, ClientTLS, "POSENC_")  # the TLS flags the healthcheck shares (model.cli.ClientTLS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = set(commands or ("list", "predict", "generate", "score", "tokenize") + LAB_COMMANDS)
    if "list" in wanted:
        sub.add_parser("list", help="the served models")
    for name in ("predict", "generate", "score", "tokenize"):
        if name not in wanted:
            continue
        c = sub.add_parser(name, help={"predict": "top next tokens and attention maps",
                                       "generate": "stream a continuation", "score": "log-probability of a text",
                                       "tokenize": "a text in the model's tokens (runs no model)"}[name])
        c.add_argument("--model", required=True)
        c.add_argument("text")
        if name == "predict":
            c.add_argument("--top-k", type=positive(int), default=5)
            c.add_argument("--attention", choices=sorted(ATTENTION), default="none")
            c.add_argument("--layer", type=int, action="append", default=[])
            c.add_argument("--head", type=int, action="append", default=[])
            c.add_argument("--attention-png", metavar="FILE",
                           help="draw the attention maps (layers x heads, token labels) to a PNG; "
                                "implies --attention full")
        if name == "generate":
            c.add_argument("--max-new-tokens", type=positive(int), default=64)
            c.add_argument("--temperature", type=float, default=0.0)
            c.add_argument("--top-k", type=int, default=0)
            c.add_argument("--top-p", type=float, default=0.0)
            c.add_argument("--seed", type=int)
            c.add_argument("--stop", action="append", default=[])
    if "compare" in wanted:
        c = sub.add_parser("compare", help="lab: one prompt through every model, and the same tokens permuted")
        c.add_argument("text")
        c.add_argument("--permuted", help="the same characters in another order (default: the words reversed)")
        c.add_argument("--model", action="append", default=[], help="repeatable; default every served model")
        c.add_argument("--top-k", type=positive(int), default=5)
    if "encoding" in wanted:
        c = sub.add_parser("encoding", help="lab: what a model's positional encoding is (from its encoding graph)")
        c.add_argument("--model", required=True)
        c.add_argument("--length", type=positive(int), default=64)
        c.add_argument("--png", metavar="FILE", help="write the picture here")
    if "extrapolate" in wanted:
        c = sub.add_parser("extrapolate", help="lab: held-out perplexity at multiples of the trained context")
        c.add_argument("--model", action="append", default=[], help="repeatable; default every served model")
        c.add_argument("--factors", type=positive(int), nargs="+",
                       help="multiples of the trained context (default: the lab's own set, lab.studies.FACTORS)")
        c.add_argument("--text-bytes", type=positive(int), default=16384,
                       help="held-out bytes evaluated at every length")
        c.add_argument("--seed", type=int, default=0, help="where in the held-out text to start (0: its start)")
        c.add_argument("--corpus", help="UTF-8 file whose last 10%% is the held-out text (default: the built-in one)")
        c.add_argument("--concurrency", type=positive(int), default=4)
        c.add_argument("--png", metavar="FILE", help="line plot of perplexity against length")
        c.add_argument("--out", metavar="FILE", help="the full result as JSON")
    if "report" in wanted:
        c = sub.add_parser("report", help="lab: one self-contained HTML page: extrapolation, order, encodings, "
                                          "attention")
        c.add_argument("--out", required=True, metavar="FILE")
        c.add_argument("--prompt", default="dog bites man")
        c.add_argument("--permuted")
        c.add_argument("--extrapolation", metavar="FILE", help="a JSON result of `extrapolate --out` to include")
        c.add_argument("--length", type=positive(int), default=64, help="positions shown in the encoding pictures")
        c.add_argument("--model", action="append", default=[])
    return p


def connect(args) -> Client:
    opts = cli.build(ClientTLS, args)
    tls = TLS.from_env(opts.tls_ca, opts.tls_cert, opts.tls_key)
    return Client(channel=channel_for(args.target, args.lb, tls, server_name=opts.tls_server_name),
                  timeout=args.timeout)


def main(argv: list[str] | None = None, prog: str = "posenc", commands: tuple[str, ...] | None = None) -> int:
    args = parser(prog, commands).parse_args(argv)
    try:
        client = connect(args)
    except (ChannelError, cli.SettingError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    with client:
        try:
            if args.command in LAB_COMMANDS:
                # lazy: the client image (docker/Dockerfile's client target) ships client/ without lab/
                from lab.cli import run

                return run(args, client)
            return run_basic(args, client)
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 2
        except (ValueError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2


def run_basic(args, client: Client) -> int:
    stub, dump = client.stub, (lambda m: print(json.dumps(MessageToDict(m), indent=2)))
    if args.command == "list":
        resp, call = stub.ListModels.with_call(pb.ListModelsRequest(), timeout=args.timeout)
        served_by(call)
        dump(resp) if args.json else print(show_list(resp))
    elif args.command == "predict":
        if args.attention_png and args.attention == "none":
            args.attention = "full"
        resp, call = stub.Predict.with_call(
            pb.PredictRequest(model=args.model, prompt=pb.Prompt(text=args.text), top_k=args.top_k,
                              attention=ATTENTION[args.attention], layers=args.layer, heads=args.head),
            timeout=args.timeout)
        served_by(call)
        dump(resp) if args.json else print(show_predict(resp))
        if args.attention_png:
            # lazy: the client image ships without lab/; the picture also needs matplotlib (the lab extra)
            from lab.heatmap import draw

            path = draw(attention_maps(resp), [t.piece for t in resp.tokens], args.attention_png,
                        title=f"{resp.model}: {args.text!r}")
            print(f"attention heatmaps written to {path}", file=sys.stderr)
    elif args.command == "score":
        resp, call = stub.Score.with_call(pb.ScoreRequest(model=args.model, prompt=pb.Prompt(text=args.text)),
                                          timeout=args.timeout)
        served_by(call)
        dump(resp) if args.json else print(show_score(resp))
    elif args.command == "tokenize":
        resp, call = stub.Tokenize.with_call(pb.TokenizeRequest(model=args.model, text=args.text),
                                             timeout=args.timeout)
        served_by(call)
        dump(resp) if args.json else print(f"model {resp.model}: {len(resp.tokens)} tokens ({resp.tokenizer}, "
                                           f"{resp.text_bytes} bytes): "
                                           + " ".join(f"{t.id}:{t.piece!r}" for t in resp.tokens))
    else:
        last, shown = None, ""
        for msg in client.generate(args.model, args.text, args.max_new_tokens, args.temperature, args.top_k,
                                   args.top_p, args.seed, args.stop):
            if args.json:
                print(json.dumps(MessageToDict(msg)), flush=True)
            elif not msg.text.endswith("\ufffd"):  # print whole characters as they complete
                sys.stdout.write(msg.text[len(shown):])
                sys.stdout.flush()
                shown = msg.text
            last = msg
        if not args.json:
            print(f"\n[{last.finish_reason}] {last.text!r}" if last else "")
    return 0
