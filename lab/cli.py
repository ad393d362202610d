"""posenc [--target HOST:PORT] [--json] COMMAND: the one command line for people (also `python -m lab`): the
client's commands (client/cli.py) and the lab's, on one parser.

  posenc list
  posenc predict --model rope "dog bites man" [--top-k 5] [--attention last|full] [--attention-png F]
  posenc generate --model alibi "The " --max-new-tokens 64 [--temperature 0.8 --seed 1]
  posenc score --model t5 "some text"
  posenc tokenize --model gpt2 "some text"
  posenc profile --model gpt2 "a long text" [--last 256] [--png F]
  posenc compare "dog bites man" [--permuted "man bites dog"] [--model rope --model alibi]
  posenc encoding --model alibi --length 64 --png alibi.png
  posenc extrapolate [--factors 1 2 4 8] [--text-bytes 16384] [--png F] [--out F.json]
  posenc report --out report.html [--extrapolation F.json] [--prompt "dog bites man"]
  posenc passkey --model M [--lengths 64 128] [--depths 0 0.5 1] [--n 5] [--api posenc|openai --url U] [--out DIR]
  posenc intervene --model M --text T [--shift K | --positions P,P,... | --stretch S] [--positional-off L,...]
                   [--ablate L.H,...] [--rope-scaling JSON] [--out F.png]
  posenc intervene --model M --text T --sweep-shift 0,10,100,1000 [--out F.png]

It lives in lab/ because the lab builds on the client: the client's parser takes the lab's commands from here
(`add_commands`), and the client never imports the lab (`python -m client`, the client image, has no lab/).
Pictures need matplotlib (the lab extra); everything else runs on the base install.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from client import cli as client_cli
from client.api import Client, attention_maps
from client.cli import natural, positive
from lab import intervene, passkey, pictures, studies
from lab.heatmap import draw, profile_heatmap
from lab.report import report
from model.files import atomic_write

COMMANDS = ("compare", "encoding", "extrapolate", "report", "passkey", "intervene")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """The lab's commands, and predict's --attention-png, on the client's parser."""
    sub.choices["predict"].add_argument(
        "--attention-png", metavar="FILE",
        help="draw the attention maps (layers x heads, token labels) to a PNG; implies --attention full")
    sub.choices["profile"].add_argument("--png", metavar="FILE",
                                        help="draw the layer x distance heatmap (heads averaged) to a PNG")
    c = sub.add_parser("compare", help="lab: one prompt through every model, and the same tokens permuted")
    c.add_argument("text")
    c.add_argument("--permuted", help="the same characters in another order (default: the words reversed)")
    c.add_argument("--model", action="append", default=[], help="repeatable; default every served model")
    c.add_argument("--top-k", type=positive(int), default=5)
    c = sub.add_parser("encoding", help="lab: what a model's positional encoding is (from its encoding graph)")
    c.add_argument("--model", required=True)
    c.add_argument("--length", type=positive(int), default=64)
    c.add_argument("--png", metavar="FILE", help="write the picture here")
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
    c = sub.add_parser("report", help="lab: one self-contained HTML page: extrapolation, order, encodings, "
                                      "attention")
    c.add_argument("--out", required=True, metavar="FILE")
    c.add_argument("--prompt", default="dog bites man")
    c.add_argument("--permuted")
    c.add_argument("--extrapolation", metavar="FILE", help="a JSON result of `extrapolate --out` to include")
    c.add_argument("--length", type=positive(int), default=64, help="positions shown in the encoding pictures")
    c.add_argument("--model", action="append", default=[])
    c.add_argument("--hybrid", metavar="FILE", help="the hybrid study's results (default: bench/results/hybrid.json "
                   "of this checkout, where it exists)")
    c = sub.add_parser("passkey", help="lab: passkey retrieval over prompt lengths x needle depths, and the "
                                       "attention on the needle")
    c.add_argument("--model", action="append", required=True, help="repeatable")
    c.add_argument("--lengths", type=positive(int), nargs="+", metavar="TOKENS",
                   help="prompt lengths in the model's tokens (default: 0.25, 0.5, 1 and 2 x its trained context)")
    c.add_argument("--depths", type=fraction, nargs="+", default=list(passkey.DEPTHS),
                   help="needle depths from 0 (first) to 1 (last)")
    c.add_argument("--n", type=positive(int), default=5, help="examples per cell")
    c.add_argument("--seed", type=natural, default=0, help="draws the keys")
    c.add_argument("--api", choices=passkey.APIS, default="posenc",
                   help="generate through posenc.v1 Generate or the OpenAI completions of --url")
    c.add_argument("--url", help="the worker's HTTP base for --api openai, e.g. http://127.0.0.1:8000")
    c.add_argument("--concurrency", type=positive(int), default=4)
    c.add_argument("--out", metavar="DIR", help="write passkey.json and passkey.png here")
    c = sub.add_parser("intervene", help="lab: one prompt under an intervention beside the unchanged run: next-token "
                                         "top-k, KL, attention by distance per layer (docs/interventions.md)")
    c.add_argument("--model", required=True)
    c.add_argument("--text", required=True)
    c.add_argument("--top-k", type=positive(int), default=5)
    c.add_argument("--last", type=natural, default=0, help="profile the last N query rows (default 0: all)")
    client_cli.add_intervention(c, baseline=False)  # the baseline is always run
    c.add_argument("--sweep-shift", type=client_cli.naturals, metavar="K,K,...",
                   help="instead: the divergence from the unshifted run at each shift (is the attention relative?)")
    c.add_argument("--out", metavar="FILE", help="draw a PNG: per layer, baseline vs intervened mass by distance "
                                                 "(with --sweep-shift: the divergence against the shift)")


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return value


def main(argv: list[str] | None = None, prog: str = "posenc") -> int:
    return client_cli.main(argv, prog, extend=add_commands, run=run,
                           description="posenc: the worker's models, predictions, attention and lab studies")


def run(args, client: Client) -> int:
    try:
        if args.command in COMMANDS:
            return run_lab(args, client)
        if args.command == "predict" and args.attention_png:
            return predict_png(args, client)
        if args.command == "profile" and args.png:
            resp = client_cli.profile(args, client)
            print(f"profile heatmap written to {profile_heatmap(resp, args.png)}", file=sys.stderr)
            return 0
        return client_cli.run_basic(args, client)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != "matplotlib":
            raise
        print("error: pictures need matplotlib: pip install 'posenc[lab]'", file=sys.stderr)
        return 2


def predict_png(args, client: Client) -> int:
    if args.attention == "none":
        args.attention = "full"
    resp = client_cli.predict(args, client)
    path = draw(attention_maps(resp), [t.piece for t in resp.tokens], args.attention_png,
                title=f"{resp.model}: {args.text!r}")
    print(f"attention heatmaps written to {path}", file=sys.stderr)
    return 0


def run_lab(args, client: Client) -> int:
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
            atomic_write(Path(args.out), json.dumps(result, indent=2) + "\n")
        if args.png:
            pictures.extrapolation_plot(result, args.png)
            print(f"plot written to {args.png}", file=sys.stderr)
    elif args.command == "passkey":
        run_passkey(args, client)
    elif args.command == "intervene":
        run_intervene(args, client)
    else:
        extra = studies.load_json(args.extrapolation) if args.extrapolation else None
        path = report(stub, args.out, args.prompt, args.permuted, extra, args.length, args.model or None,
                      timeout=args.timeout, **({"hybrid": args.hybrid} if args.hybrid else {}))
        print(f"report written to {path}")
    return 0


def run_passkey(args, client: Client) -> None:
    passkey.check_grid(args.lengths or [1], args.depths, args.n, args.seed, args.api, args.url)
    client.timeout = max(args.timeout, 600)  # a long prompt's Predict with every map
    result = passkey.study(client, args.model, args.lengths, args.depths, args.n, args.seed, args.api, args.url,
                           args.concurrency)
    print(json.dumps(result, indent=2) if args.json else "\n\n".join(t.markdown() for t in passkey.tables(result)))
    if args.out:
        out = Path(args.out)
        atomic_write(out / "passkey.json", json.dumps(result, indent=2) + "\n")
        pictures.passkey_plot(result, out / "passkey.png")
        print(f"passkey.json and passkey.png written to {out}", file=sys.stderr)


def run_intervene(args, client: Client) -> None:
    edit = client_cli.intervention_of(args, baseline=True)
    if args.sweep_shift:
        if args.shift or args.positions:
            raise ValueError("--sweep-shift sets the shift itself: give no --shift or --positions with it")
        effects = intervene.sweep(client, args.model, args.text, args.sweep_shift, edit, args.top_k)
        print(json.dumps([MessageToDict(e) for e in effects], indent=2) if args.json else
              intervene.sweep_table(args.model, args.sweep_shift, effects).markdown())
        if args.out:
            path = intervene.draw_sweep(args.model, args.sweep_shift, effects, args.out)
            print(f"sweep picture written to {path}", file=sys.stderr)
        return
    result = intervene.study(client, args.model, args.text, edit, args.top_k, args.last)
    print(json.dumps({"predict": MessageToDict(result.predict), "profile": MessageToDict(result.profile)}, indent=2)
          if args.json else intervene.show(result))
    if args.out:
        path = intervene.draw(result, args.out, title=f"{args.model}: {args.text!r}")
        print(f"intervention picture written to {path}", file=sys.stderr)
