"""Speculative decoding by prompt lookup (`--speculate K`, service/lookup.py) on and off, in one run, on the peer
benchmark's model (bench/peers_model.py: a LLaMA of SmolLM-135M's shape, fp32): one greedy stream at a time, each
prompt decoded with speculation off and with each K asked for, alternately, so every ratio is taken within the run;
each K twice, the drafts proposed as the worker proposes them (fewer, and less often, while they fail:
service/batch.py's Guess) and K at every step whatever the drafts did before.

  (a) text that repeats its context: Python source (code), and a summarization-style prompt whose answer quotes its
      input (the peer tokenizer's ids of real text);
  (b) the peer benchmark's own prompts (128 random ids each), where a draft is rarely right and must not cost.

Tokens/s is the stream's decode alone (from its first token to its last, the prompt's call left out); each stream's
tokens are checked equal with and without speculation.  The engine runs in process (service.engine), with the
peer benchmark's threads.

With --trained, the same measurement on the small LLaMA the peer benchmark's accuracy part trains here on real
text (bench/peers_trained.py: hidden 256, 4 layers, a 512-id BPE), whose greedy answers follow the text instead of
repeating one token, with one more prompt set, held-out windows of its corpus's prose (96 ids each), and 128 random
ids of its vocabulary in place of the peer prompts; results in speculative_trained.json.

  python -m bench speculative [--speculate 4,8] [--new 64] [--prompts 4] [--work /tmp/posenc-peers] [--trained]
"""

from __future__ import annotations

import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench import peers_prepare as prep
from bench.lib.results import write
from bench.peers_model import make_folder, prompts
from model.cli import Parser
from service.artifacts import load_artifact
from service.engine import Engine, engine_for
from service.generation import Generation
from service.jobs import Job
from service.sampling import SamplingParams
from service.settings import Batching

THREADS = 2
SUMMARY = ("Article: The committee met on Tuesday to review the budget for the coming year. It agreed to raise the "
           "library's hours, to repair the bridge on the north road before winter, and to hire two teachers for the "
           "school. The mayor said the bridge could not wait another year. The library will open on Sundays from "
           "March.\n\nSummarize the article, quoting it where you can.\nSummary: The committee met on Tuesday to "
           "review the budget for the coming year. It agreed to")


PEER = "peer prompts (128 random ids)"
PROSE = "held-out prose (96 ids)"


def texts(tokenizer, n: int, trained: Path | None = None) -> dict[str, list[list[int]]]:
    """The prompt sets: each a list of token id lists.  trained: the trained model's folder, whose held-out windows
    make one more set and whose vocabulary the random prompts are drawn from."""
    code = [inspect.getsource(f) for f in (json.JSONEncoder.iterencode, statistics.median, Parser.parse_args,
                                           Path.relative_to)]
    sets = {"code (Python source)": [tokenizer.encode(c)[:256] for c in code][:n],
            "summary quoting its input": [tokenizer.encode(SUMMARY)]}
    if trained is None:
        return {**sets, PEER: [row.tolist() for row in prompts()[:n]]}
    from bench.peers_accuracy import windows
    from bench.peers_trained import VOCAB

    rng = np.random.default_rng(0)
    return {**sets, PROSE: [w[:96] for w in windows(trained, count=n)[0]],
            PEER: [rng.integers(3, VOCAB, 128).tolist() for _ in range(n)]}


ADAPT = "as they pay (the worker's)"  # service/batch.py's Guess: fewer, and less often, while drafts fail
EVERY = "K at every step"
PEER_NOTE = ("The peer model's weights are random and its greedy answer to any prompt repeats one token, so drafts "
             "are nearly always right: the rows above are what speculation gives where drafts hold, not what real "
             "text on a trained model gets. The last rows are the other bound: a step whose drafts all fail, "
             "against a plain step.")
TRAINED_NOTE = ("The model is the small LLaMA trained here on real text (bench/peers_trained.py), whose greedy answers "
                "follow the text: the drafts accepted are what prompt lookup finds in its own answers. Its step is "
                "short, so the fixed costs of a speculative step (the lookup, a wider call, handing tokens out one by "
                "one) weigh more than on a real-size model. The last rows: a step whose drafts all fail, against a "
                "plain step.")


def decode(engine: Engine, model, ids: list[int], new: int) -> tuple[list[int], float]:
    """One greedy stream of `new` tokens on the engine: its tokens, and its decode's tokens per second."""
    s = Generation(ids, SamplingParams(max_new_tokens=new, ignore_eos=True), model.tokenizer.detokenizer(ids))
    future = engine.submit(Job(np.asarray(ids, np.int64), None, last_only=True))
    first = s.advance(future.result(timeout=600))
    begun = time.perf_counter()
    engine.add(s)
    out = [first.id]
    while True:
        item = s.out.get(timeout=600)
        if isinstance(item, Exception):
            raise item
        engine.wake()
        out.append(item.id)
        if item.reason:
            break
    return out, (len(out) - 1) / (time.perf_counter() - begun)


def rejected_cost(engine: Engine, model, ids: list[int], ks: list[int], calls: int = 24) -> dict[int, float]:
    """The worst case: a step of 1 + k tokens whose drafts are all rejected (their positions given back), against a
    plain step of one token, on a lone row's cache after the prompt: per k, plain step time / speculative step time
    (median of alternating calls; 1.0 = drafts cost nothing)."""
    result = engine.executor.run([Job(np.asarray(ids, np.int64), None, last_only=True)])[0]
    s = Generation(ids, SamplingParams(max_new_tokens=calls * 2 + 2), model.tokenizer.detokenizer(ids))
    s.advance(result)
    cache = model.layout.cache(model.kv, engine.tuning)
    cache.regroup([], [s.state], [s])
    times: dict[int, list[float]] = {k: [] for k in [0, *ks]}
    for _ in range(calls):
        for k in times:
            cache.grow([s], 1 + k)
            begun = time.perf_counter()
            engine.executor.step(np.array([[s.last] + [s.last] * k], np.int64), cache)
            times[k].append(time.perf_counter() - begun)
            if k:
                cache.drop(k)
            s.cached = int(cache.lengths[0])
    return {k: statistics.median(times[0]) / statistics.median(times[k]) for k in ks}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--speculate", default="4,8", help="draft tokens to measure, comma-separated")
    p.add_argument("--new", type=int, default=64, help="new tokens per stream")
    p.add_argument("--prompts", type=int, default=4, help="prompts per set (code, peer prompts)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("/tmp/posenc-peers"))
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--trained", action="store_true",
                   help="the small LLaMA trained here on real text (bench/peers_trained.py) instead of the peer model")
    a = p.parse_args(argv)
    ks = [int(k) for k in a.speculate.split(",")]
    if a.trained:
        from bench.peers_trained import make_trained

        work = a.work / "trained"
        folder = work / "hf"
        make_trained(folder)  # reused when trained before with the same recipe
        art = prep.posenc_artifact(folder, work, "trained")
    else:
        folder = a.work / "hf"
        make_folder(folder)
        art = prep.posenc_artifact(folder, a.work)
    model = load_artifact(art, threads=THREADS)
    engine = engine_for(model, Batching(max_wait_ms=0))
    sets = texts(model.tokenizer, a.prompts, folder if a.trained else None)
    rates: dict[tuple[str, int], list[float]] = {}
    drafts: dict[tuple[str, int], list[int]] = {}
    try:
        decode(engine, model, sets[PEER][0], 4)  # warm up
        for _ in range(a.rounds):
            for name, rows in sets.items():
                for ids in rows:
                    plain = None
                    for k, adapt in [(0, True), *((k, adapt) for k in ks for adapt in (True, False))]:
                        engine.batch.speculate, engine.batch.adapt = k, adapt
                        before = engine.stats.accepted, engine.stats.rejected
                        toks, rate = decode(engine, model, ids, a.new)
                        if plain is not None and toks != plain:
                            raise RuntimeError(f"{name}: speculate {k} gave other tokens than plain decoding")
                        plain = plain or toks
                        rates.setdefault((name, k, adapt), []).append(rate)
                        got = drafts.setdefault((name, k, adapt), [0, 0])
                        got[0] += engine.stats.accepted - before[0]
                        got[1] += engine.stats.rejected - before[1]
        worst = rejected_cost(engine, model, sets[PEER][0], ks)
    finally:
        engine.close()
    rows, figures = [], {}
    for name in sets:
        plain = rates[(name, 0, True)]
        off = statistics.median(plain)
        for k in ks:
            for adapt in (True, False):
                on = rates[(name, k, adapt)]
                ratio = statistics.median([x / y for x, y in zip(on, plain, strict=True)])
                accepted, rejected = drafts[(name, k, adapt)]
                share = accepted / max(accepted + rejected, 1)
                how = ADAPT if adapt else EVERY
                figures[f"{name}, {k}, {how}"] = {"off_tok_s": off, "on_tok_s": statistics.median(on),
                                                  "ratio": ratio, "accepted": accepted, "rejected": rejected}
                rows.append([name, k, how, round(off, 1), round(statistics.median(on), 1), f"{ratio:.2f}x",
                             f"{share:.0%} of {accepted + rejected}"])
    for k in ks:
        figures[f"every draft rejected, {k}"] = {"ratio": worst[k]}
        rows.append(["every draft rejected (a step of 1 + K tokens on a peer prompt, K given back)", k, EVERY, None,
                     None, f"{worst[k]:.2f}x", "0%"])
    args = sys.argv[1:] if argv is None else argv
    doc = {"meta": {"command": " ".join(["python -m bench speculative", *args])}, "figures": figures,
           "tables": {"speculative": {
               "columns": ["prompts", "--speculate", "drafts proposed", "off (tok/s)", "on (tok/s)",
                           "on / off (median of streams)", "drafts accepted"],
               "rows": rows,
               "note": f"One greedy stream at a time, {a.new} new tokens, {a.rounds} rounds, each stream off and on "
                       f"in turn; {THREADS} onnxruntime threads. " + (TRAINED_NOTE if a.trained else PEER_NOTE)}}}
    print(write(a.out, "speculative_trained" if a.trained else "speculative", doc))
    return 0
