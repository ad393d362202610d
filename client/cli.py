"""python -m client [--target HOST:PORT] [--json] COMMAND: the client's commands, with no lab/ and no matplotlib.

  python -m client list
  python -m client predict --model rope "dog bites man" [--top-k 5] [--attention last|full]
  python -m client generate --model alibi "The " --max-new-tokens 64 [--temperature 0.8 --seed 1]
  python -m client score --model t5 "some text"
  python -m client tokenize --model gpt2 "some text"
  python -m client profile --model gpt2 "a long text" [--last 256]
  python -m client predict --model rope "dog bites man" --shift 1000 --baseline   (docs/interventions.md)

predict, score and profile take an intervention (--positions, --shift, --stretch, --positional-off, --ablate,
--rope-scaling; --baseline runs the unchanged request beside it and prints the effect); generate takes the same
and --next-position, without --baseline.

It is what the client image (docker/Dockerfile's client target) runs.  `posenc` (lab/cli.py, also `python -m lab`)
is the same parser with the lab's commands and pictures added (`extend`, `run`): the lab builds on the client, never
the other way.  Targets, TLS and load balancing: client/channel.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from client import api
from client.api import ATTENTION, Client, attention_maps, profile_values
from client.channel import TLS, ChannelError, channel_for, instance_of
from model import cli
from model.cli import ClientTLS, Parser
from protos.posenc.v1 import posenc_pb2 as pb

COMMANDS = ("list", "predict", "generate", "score", "tokenize", "profile")
# The lab's commands, named here only to tell someone who asks this CLI for one where it is (`posenc`, lab/cli.py);
# tests/lab/test_lab.py keeps the list equal to lab.cli.COMMANDS.
LAB_COMMANDS = ("compare", "encoding", "extrapolate", "report", "passkey", "intervene")
LAB_OPTIONS = ("--attention-png", "--png")  # predict's picture, profile's
Extend = Callable[[argparse._SubParsersAction], None]
Run = Callable[[argparse.Namespace, Client], int]


def show_list(resp: pb.ListModelsResponse) -> str:
    """A table of the models; `proven` says how an imported one was proven equal to transformers at import (its
    importer and the largest logit difference), "-" for a model posenc trained or one imported without the proof."""
    rows = [f"{'model':<12} {'variant':<11} {'params':>10} {'context':>7} {'max pos':>9} {'held-out':>9}  proven"]
    for m in resp.models:
        loss = f"{m.heldout_loss:>9.3f}" if m.heldout_loss > 0 else f"{'–':>9}"  # 0: no figure was measured
        proven = f"{m.proof.importer} ({m.proof.logits:.1e})" if m.HasField("proof") else "–"
        rows.append(f"{m.name:<12} {m.variant:<11} {m.parameters:>10} {m.trained_context:>7} "
                    f"{m.max_positions or 'unbounded':>9} {loss}  {proven}")
    return "\n".join(rows)


def show_predict(resp: pb.PredictResponse) -> str:
    """The top next tokens (beside the unchanged run's, under an intervention with its baseline), the effect, and
    where each attention map's last row peaks."""
    out = [f"model {resp.model}: {len(resp.tokens)} prompt tokens "
           f"({resp.timing.total_ms:.1f} ms, batch {resp.timing.batch_size})"]
    if resp.HasField("effect"):
        out.append(show_effect(resp.effect))
    out.append(show_top(resp.top, resp.effect.baseline_top))
    for layer, head, grid in attention_maps(resp):
        top = (-grid[-1]).argsort()[:3]
        keys = ", ".join(f"{resp.tokens[k].piece}:{grid[-1, k]:.2f}" for k in top)
        out.append(f"attention layer {layer} head {head} {list(grid.shape)}: last row peaks at {keys}")
    return "\n".join(out)


def show_top(top, baseline=()) -> str:
    """A table of next-token candidates; with the unchanged run's (an intervention's baseline) beside them."""
    out = [f"{'rank':>4} {'token':<14} {'prob':>8} {'logprob':>9}"
           + (f"   {'baseline':<14} {'prob':>8} {'logprob':>9}" if baseline else "")]
    for rank, c in enumerate(top, 1):
        row = f"{rank:>4} {c.token.piece:<14} {c.probability:>8.4f} {c.logprob:>9.3f}"
        if rank <= len(baseline):
            b = baseline[rank - 1]
            row += f"   {b.token.piece:<14} {b.probability:>8.4f} {b.logprob:>9.3f}"
        out.append(row)
    return "\n".join(out)


def listed(values, most: int = 12) -> str:
    """Integers as "0, 1, 2", the middle elided past `most` ("5, 6, 7, 8, 9, ..., 103, 104 (100)")."""
    items = [str(v) for v in values]
    if len(items) > most:
        items = [*items[:5], "...", *items[-2:], f"({len(values)})"]
    return ", ".join(items).replace(", (", " (")


def show_effect(effect: pb.Effect, divergences: bool = True) -> str:
    """What an intervention did: its description, the positions the intervened run used, and with the baseline
    (Predict's and Score's, `divergences`) the divergences of the next-token distribution (KL(baseline ||
    intervened), total variation, Jensen-Shannon) and whether the most likely token changed."""
    out = [f"intervention: {effect.description or 'none'}; positions used: {listed(effect.positions)}"]
    if effect.has_baseline and divergences:
        out.append(f"KL {effect.kl_divergence:.6g} nats, total variation {effect.total_variation:.6g}, "
                   f"JS {effect.js_divergence:.6g} nats, top-1 changed: {'yes' if effect.top1_changed else 'no'}")
    return "\n".join(out)


def show_score(resp: pb.ScoreResponse) -> str:
    """The totals; under an intervention with its baseline, each scored token's log-probability in both runs and
    the change (intervened minus baseline)."""
    out = [f"model {resp.model}: {len(resp.logprobs)} scored tokens, total log-prob {resp.total_logprob:.3f}, "
           f"{resp.nats_per_token:.3f} nats/token, {resp.nats_per_byte:.3f} nats/byte, "
           f"perplexity {resp.perplexity:.3f}"]
    if resp.HasField("effect"):
        out.append(show_effect(resp.effect))
    if resp.effect.has_baseline:
        change = resp.effect.logprob_change
        out.append(f"total log-prob change {sum(change):.6g} (intervened - baseline)")
        out.append(f"{'pos':>4} {'token':<14} {'logprob':>10} {'baseline':>10} {'change':>10}")
        for i, (tok, lp, base, d) in enumerate(zip(resp.tokens[1:], resp.logprobs, resp.effect.baseline_logprobs,
                                                   change, strict=True), 1):
            out.append(f"{i:>4} {tok.piece:<14} {lp:>10.4f} {base:>10.4f} {d:>10.3g}")
    return "\n".join(out)


def profile_table(values: np.ndarray, columns, title: str = "layer") -> list[str]:
    """Rows of a (layers, columns) table of profile values, headed by the column names."""
    out = [f"{title:<5} " + " ".join(f"{c:>9}" for c in columns)]
    out += [f"{layer:>5} " + " ".join(f"{v:>9.4f}" for v in row) for layer, row in enumerate(values)]
    return out


def show_profile(resp: pb.ProfileResponse) -> str:
    """The profile as a table: a row per layer, its heads' mean mass in each distance bucket, on the first position,
    and their mean entropy (and a learned sink's mass); under an intervention with its baseline, the unchanged
    run's table and the difference (intervened minus baseline) after it."""
    values = profile_values(resp).mean(axis=1)  # (layers, columns)
    cols = list(resp.columns)
    out = [f"model {resp.model}: {len(resp.tokens)} tokens, query rows {resp.query_start}.."
           f"{resp.query_start + resp.query_count - 1} averaged, heads averaged ({resp.timing.total_ms:.1f} ms)",
           *profile_table(values, cols)]
    if resp.HasField("effect"):
        out.append(show_effect(resp.effect, divergences=False))  # a profile has no next-token distribution
    if resp.effect.has_baseline:
        base = api.effect_profile(resp).mean(axis=1)
        out += ["baseline:", *profile_table(base, cols), "difference (intervened - baseline):",
                *profile_table(values - base, cols)]
    return "\n".join(out)


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


def naturals(text: str) -> list[int]:
    """"5,6,9" -> [5, 6, 9], each >= 0."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be integers >= 0 separated by commas, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"must be integers >= 0 separated by commas, got {text!r}")
    return values


def natural(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def head_pairs(text: str) -> list[tuple[int, int]]:
    """"1.2,3.0" -> [(1, 2), (3, 0)]: layer.head pairs, each from 0."""
    try:
        pairs = [tuple(int(v) for v in item.split(".")) for item in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 0 for p in pairs):
        raise argparse.ArgumentTypeError(f"must be LAYER.HEAD pairs (from 0) separated by commas, got {text!r}")
    return [(p[0], p[1]) for p in pairs]


def json_object(text: str) -> str:
    """A JSON object's text (another RoPE scaling, as transformers' rope_parameters)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"rope_type\": \"yarn\", \"factor\": 4}}', "
                                         f"got {text!r}")
    return text


def add_intervention(c: argparse.ArgumentParser, next_position: bool = False, baseline: bool = True) -> None:
    """The intervention's flags (docs/interventions.md) on a command: Generate's add --next-position and lack
    --baseline (the worker refuses it there)."""
    g = c.add_argument_group("intervention (docs/interventions.md)")
    g.add_argument("--positions", type=naturals, default=[], metavar="P,P,...",
                   help="one position per prompt token, in place of 0, 1, 2, ...")
    g.add_argument("--shift", type=int, default=0, metavar="K", help="add K to every counted position")
    g.add_argument("--stretch", type=positive(float), default=1.0, metavar="S",
                   help="token i at shift + round(i x S)")
    if next_position:
        g.add_argument("--next-position", type=natural, metavar="P", help="the first generated token's position")
    g.add_argument("--positional-off", type=naturals, default=[], metavar="L,L,...",
                   help="layers whose positional computation is removed (a NoPE ablation)")
    g.add_argument("--ablate", type=head_pairs, default=[], metavar="L.H,...",
                   help="heads (layer.head) whose output is zeroed before the output projection")
    g.add_argument("--rope-scaling", type=json_object, metavar="JSON",
                   help="another RoPE scaling for this call, as transformers' rope_parameters")
    if baseline:
        g.add_argument("--baseline", action="store_true",
                       help="also run the unchanged request and print the effect (KL, both top-k, changes)")


def intervention_of(args: argparse.Namespace, baseline: bool | None = None) -> pb.Intervention | None:
    """The request's intervention from the flags add_intervention() declares; None when none is given."""
    base = getattr(args, "baseline", False) if baseline is None else baseline
    nxt = getattr(args, "next_position", None)
    if not (args.positions or args.shift or args.stretch != 1.0 or nxt is not None or args.positional_off
            or args.ablate or args.rope_scaling or base):
        return None
    return api.intervention(args.positions, args.shift, args.stretch, nxt, args.positional_off, args.ablate,
                            args.rope_scaling, base)


def parser(prog: str = "python -m client", extend: Extend | None = None,
           description: str = "posenc client: the worker's models, predictions, attention and tokens") -> Parser:
    """The global options and the client's commands; `extend(subparsers)` adds more (the lab's, in lab/cli.py).
    Without it, the lab's command names answer with where to find them."""
    p = Parser(prog=prog, description=description)
    p.add_argument("--target", default=os.environ.get("POSENC_TARGET", "127.0.0.1:50051"),
                   help="HOST:PORT, a comma-separated list of them, or dns:///NAME:PORT (POSENC_TARGET)")
    p.add_argument("--json", action="store_true", help="print the raw response as JSON")
    p.add_argument("--timeout", type=positive(float), default=60.0, help="seconds per call")
    p.add_argument("--lb", choices=("pick_first", "round_robin"), default=os.environ.get("POSENC_LB"),
                   help="load balancing over the addresses the target resolves to (default: round_robin for a "
                        "list, pick_first otherwise; POSENC_LB)")
    cli.add_options(p, ClientTLS, "POSENC_")  # the TLS flags the healthcheck shares (model.cli.ClientTLS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("list", help="the served models")
    for name in COMMANDS[1:]:
        c = sub.add_parser(name, help={"predict": "top next tokens and attention maps",
                                       "generate": "stream a continuation", "score": "log-probability of a text",
                                       "tokenize": "a text in the model's tokens (runs no model)",
                                       "profile": "how far each layer looks: attention mass by distance"}[name])
        c.add_argument("--model", required=True)
        c.add_argument("text")
        if name == "predict":
            c.add_argument("--top-k", type=positive(int), default=5)
            c.add_argument("--attention", choices=sorted(ATTENTION), default="none")
            c.add_argument("--layer", type=int, action="append", default=[])
            c.add_argument("--head", type=int, action="append", default=[])
        if name == "profile":
            c.add_argument("--last", type=int, default=0, help="average the last N query rows (default 0: all)")
        if name == "generate":
            c.add_argument("--max-new-tokens", type=positive(int), default=64)
            c.add_argument("--temperature", type=float, default=0.0)
            c.add_argument("--top-k", type=int, default=0)
            c.add_argument("--top-p", type=float, default=0.0)
            c.add_argument("--seed", type=int)
            c.add_argument("--stop", action="append", default=[])
        if name != "tokenize":
            add_intervention(c, next_position=name == "generate", baseline=name != "generate")
    if extend:
        extend(sub)
    else:
        for name in LAB_COMMANDS:
            sub.add_parser(name, add_help=False, help="a lab command: `posenc` offers it where lab/ is installed")
    return p


def connect(args) -> Client:
    opts = cli.build(ClientTLS, args)
    tls = TLS.from_env(opts.tls_ca, opts.tls_cert, opts.tls_key)
    return Client(channel=channel_for(args.target, args.lb, tls, server_name=opts.tls_server_name),
                  timeout=args.timeout)


def main(argv: list[str] | None = None, prog: str = "python -m client", extend: Extend | None = None,
         run: Run | None = None, description: str | None = None) -> int:
    """Parses, connects and runs one command (`run`, default run_basic); bad input and failed calls are one line on
    stderr and exit status 2."""
    p = parser(prog, extend, **({"description": description} if description else {}))
    args, rest = p.parse_known_args(argv)
    if not extend and args.command in LAB_COMMANDS:
        p.error(f"{args.command} is a lab command, and this client has no lab: run `posenc {args.command}` where the "
                "lab is installed (pip install 'posenc[lab]'); the client image has the client's commands only")
    lab_options = [r for r in rest if r.split("=")[0] in LAB_OPTIONS]
    if not extend and lab_options:
        p.error(f"{lab_options[0].split('=')[0]} draws a picture, which is the lab's: run `posenc {args.command} "
                f"... {lab_options[0]}` where the lab is installed (pip install 'posenc[lab]')")
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        client = connect(args)
    except (ChannelError, cli.SettingError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    with client:
        try:
            return (run or run_basic)(args, client)
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 2
        except (ValueError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2


def predict(args, client: Client) -> pb.PredictResponse:
    """Runs and prints `predict`; returns the response (the lab draws its attention maps)."""
    req = pb.PredictRequest(model=args.model, prompt=pb.Prompt(text=args.text), top_k=args.top_k,
                            attention=ATTENTION[args.attention], layers=args.layer, heads=args.head,
                            intervention=intervention_of(args))
    resp, call = client.stub.Predict.with_call(req, timeout=args.timeout)
    served_by(call)
    print(json.dumps(MessageToDict(resp), indent=2) if args.json else show_predict(resp))
    return resp


def profile(args, client: Client) -> pb.ProfileResponse:
    """Runs and prints `profile`; returns the response (the lab draws its heatmap)."""
    resp, call = client.stub.Profile.with_call(
        pb.ProfileRequest(model=args.model, prompt=pb.Prompt(text=args.text), last=args.last,
                          intervention=intervention_of(args)), timeout=args.timeout)
    served_by(call)
    print(json.dumps(MessageToDict(resp), indent=2) if args.json else show_profile(resp))
    return resp


def run_basic(args, client: Client) -> int:
    stub, dump = client.stub, (lambda m: print(json.dumps(MessageToDict(m), indent=2)))
    if args.command == "list":
        resp, call = stub.ListModels.with_call(pb.ListModelsRequest(), timeout=args.timeout)
        served_by(call)
        dump(resp) if args.json else print(show_list(resp))
    elif args.command == "predict":
        predict(args, client)
    elif args.command == "score":
        resp, call = stub.Score.with_call(pb.ScoreRequest(model=args.model, prompt=pb.Prompt(text=args.text),
                                                          intervention=intervention_of(args)), timeout=args.timeout)
        served_by(call)
        dump(resp) if args.json else print(show_score(resp))
    elif args.command == "profile":
        profile(args, client)
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
                                   args.top_p, args.seed, args.stop, intervention=intervention_of(args)):
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
