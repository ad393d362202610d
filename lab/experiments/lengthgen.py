"""make lengthgen: every positional variant on every length-generalization task, trained here, served, scored.

For each task of lab.tasks.TASKS and each row (every variant of model.variants.REGISTRY, and `VARIANT+random` for
each variant that takes randomized positions, Ruoss et al. 2023: model/train.py's random_positions), for each seed:

1. a tiny byte-level model (ARCH) is trained on the task's train lengths: the same steps (or seconds), batch and
   learning-rate schedule for every row; the seed sets the initial weights and the data order, which every row
   shares. The loss is on the answer and its terminator only (the prompt is random by construction: nothing in it
   can be learned beyond its fixed words, and the answer is what is scored);
2. it is saved as a posenc checkpoint and exported (export/) to an artifact;
3. a worker (service.server, on a loopback port) serves the task's artifacts, and the examples at 1x, 2x, 4x and
   8x the longest train length (lab.tasks.test_lengths, the same examples for every model) are answered by greedy
   generation through client.api's Generate, stopping at the terminator; lab.tasks.score is exact match.

The positions each model may take: the learned table holds the longest test example (context_of), so an
absolute model is asked every length rather than refused; randomized rows draw from [0, that length).

Writes bench/results/lengthgen.json (bench.lib.results: date, machine, load; the budget and times in it), its
tables filled into docs/lengthgen.md by `make docs`, and docs/img/lengthgen.png (variant x length, one panel per
task), drawn from the JSON alone (`--report-only` recomputes both from the measurements in it).
  python -m lab.experiments.lengthgen [--steps N | --seconds S] [--tasks A,B] [--variants R,S] [--seeds 0,1,2]
                                      [--examples N] [--batch N] [--work DIR] [--report-only]
"""

from __future__ import annotations

import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.results import meta, write
from client.api import Client
from lab.experiments.lengthgen_report import claims, plot, tables
from lab.tasks import END, TASKS, Example, examples, rng_for, score, task_of, test_lengths
from model.cli import Parser

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "lengthgen.json"
PLOT = ROOT / "docs" / "img" / "lengthgen.png"
FACTORS = (1, 2, 4, 8)  # test lengths as multiples of the longest train length
EVAL_SEED = 1_000_003  # the test examples: one fixed set for every model, apart from every training seed
RANDOM = "+random"
# the models: posenc's architecture, small enough that 2 CPUs train one in seconds; each variant's own sizes are
# model.config's defaults (T5's 32 buckets to 128, Shaw's clip 16, FIRE's 32 hidden, CPE's kernel 8)
ARCH = {"d_model": 64, "n_heads": 4, "n_layers": 2, "d_mlp": 256}
BATCH, LR, WARMUP = 32, 3e-3, 0.05


def rows() -> list[str]:
    """Every variant of the registry, then `VARIANT+random` for each that takes randomized positions (asked)."""
    # lazy: torch (213 MB) loads only when models are built; --report-only and the figure tests draw without it
    from model.config import ModelConfig
    from model.errors import ConfigError
    from model.train import check_random_positions
    from model.variants import REGISTRY

    out = list(REGISTRY)
    for name in REGISTRY:
        try:
            check_random_positions(ModelConfig(variant=name, context=64), 64)
        except ConfigError:
            continue
        out.append(name + RANDOM)
    return out


def eval_set(task: str, n: int) -> dict[int, list[Example]]:
    """The examples every model of the task is asked: n per length at 1x..8x."""
    return {f: examples(task, length, n, EVAL_SEED) for f, length in zip(FACTORS, test_lengths(task), strict=False)}


def context_of(tests: dict[int, list[Example]]) -> int:
    """The positions the longest test example needs (prompt, answer, terminator): the learned table's rows."""
    return max(len(e.text) for exs in tests.values() for e in exs)


def train_batch(task: str, seed: int, step: int, train: tuple[int, int], batch: int = BATCH):
    """Step `step`'s batch of seed `seed`, the same for every row: (ids (B, T), targets (B, T), weights (B, T)).
    Rows are right-padded with 0 (causal attention: a pad after the text changes nothing before it); the weights
    are 1 on the answer and its terminator."""
    # lazy: torch (213 MB) loads only when models train
    import torch

    t = task_of(task)
    lengths = np.random.default_rng([seed, step]).integers(train[0], train[1] + 1, batch)
    texts = [Example(task=task, length=int(n), **t.generate(rng_for(seed, task, int(n), step * batch + b), int(n)))
             for b, n in enumerate(lengths)]
    width = max(len(e.text) for e in texts)
    ids = torch.zeros(batch, width, dtype=torch.int64)
    weights = torch.zeros(batch, width - 1)
    for b, e in enumerate(texts):
        ids[b, :len(e.text)] = torch.tensor(list(e.text.encode("ascii")))
        weights[b, len(e.prompt) - 1:len(e.text) - 1] = 1.0  # predicting target byte j from the byte before it
    return ids[:, :-1], ids[:, 1:], weights


def train_one(task: str, row: str, seed: int, context: int, steps: int = 0, seconds: float = 0.0,
              train: tuple[int, int] | None = None, batch: int = BATCH):
    """A model of ARCH for `row` trained on `task` for `steps` steps or `seconds` seconds (the learning rate
    warms up over the first 5% of the budget, then decays by a cosine to a tenth); (model, summary)."""
    # lazy: torch (213 MB) loads only when models train
    import torch
    import torch.nn.functional as F

    from model.config import ModelConfig
    from model.train import check_random_positions, draw_positions
    from model.transformer import Transformer

    variant, randomized = row.removesuffix(RANDOM), row.endswith(RANDOM)
    cfg = ModelConfig(variant=variant, context=context, **ARCH)
    check_random_positions(cfg, context if randomized else 0)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.95))
    pos_gen = torch.Generator().manual_seed(seed + 1)
    train = train or task_of(task).train
    start, step, recent = time.perf_counter(), 0, []
    model.train()
    while True:
        done = max(step / steps if steps else 0.0, (time.perf_counter() - start) / seconds if seconds else 0.0)
        if done >= 1.0:
            break
        lr = LR * (done / WARMUP if done < WARMUP else 0.1 + 0.45 * (1 + math.cos(math.pi * done)))
        for group in opt.param_groups:
            group["lr"] = lr
        x, y, w = train_batch(task, seed, step, train, batch)
        ids = draw_positions(*x.shape, context, pos_gen) if randomized else None
        logits = model(x, output_attentions=False, position_ids=ids).logits
        loss = (F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none") * w.flatten()).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = (recent + [loss.item()])[-20:]
        step += 1
    summary = {"steps": step, "seconds": round(time.perf_counter() - start, 2), "batch": batch,
               "train_loss": round(sum(recent) / max(1, len(recent)), 4), "loss_unit": "nats per answer byte",
               "task": task, "train_lengths": list(train), "random_positions": context if randomized else 0,
               "seed": seed}
    return model.eval(), summary


def greedy(model, prompt: str, max_new_tokens: int) -> str:
    """The model's greedy continuation in PyTorch (KV cache, the variant's state), stopping after the terminator:
    what the worker is checked against."""
    # lazy: torch (213 MB) loads only when models run in process
    import torch

    out_ids: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([list(prompt.encode("utf-8"))]), output_attentions=False)
        for _ in range(max_new_tokens):
            nxt = int(out.logits[0, -1].argmax())
            out_ids.append(nxt)
            if bytes([nxt]) == END.encode():
                break
            out = model(torch.tensor([[nxt]]), past_key_values=out.presents, state=out.state or None,
                        output_attentions=False)
    return bytes(out_ids).decode("utf-8", errors="replace")


def served_answers(target: str, model: str, tests: dict[int, list[Example]]) -> dict[int, list[str]]:
    """Each test example's continuation from the worker's greedy Generate (client.api), stopping at the terminator,
    per factor; eight requests in flight, which the worker's engine batches."""
    with Client(target, timeout=600) as client, ThreadPoolExecutor(max_workers=8) as pool:
        def ask(e: Example) -> str:
            text = ""
            for msg in client.generate(model, e.prompt, max_new_tokens=e.max_new_tokens, stop=[END]):
                text = msg.text
            return text

        return {f: list(pool.map(ask, exs)) for f, exs in tests.items()}


def served_scores(target: str, model: str, tests: dict[int, list[Example]]) -> dict[int, list[int]]:
    """Each test example's exact-match score (lab.tasks.score) on the worker's answer, per factor."""
    answers = served_answers(target, model, tests)
    return {f: [score(e, text) for e, text in zip(exs, answers[f], strict=True)] for f, exs in tests.items()}


def model_name(row: str, seed: int) -> str:
    return f"{row.replace(RANDOM, '-random')}-s{seed}"


def run_task(task: str, rows_: list[str], seeds: list[int], n: int, budget: dict, work: Path,
             validate: bool, say) -> dict[str, Any]:
    """Train, export and serve every (row, seed) of one task; the accuracy per row, seed and factor."""
    # lazy: torch, the exporter and the worker load only when a study trains and serves
    from export.__main__ import export_main
    from model import checkpoint
    from service.server import Server
    from service.settings import Settings

    tests = eval_set(task, n)
    context = context_of(tests)
    times = {"train": 0.0, "export": 0.0, "evaluate": 0.0}
    training: dict[str, dict] = {}
    for row in rows_:
        for seed in seeds:
            name = model_name(row, seed)
            model, summary = train_one(task, row, seed, context, **budget)
            times["train"] += summary["seconds"]
            folder = work / "checkpoints" / task / name
            checkpoint.save(model, folder, summary)
            t0 = time.perf_counter()
            argv = ["--checkpoint", str(folder), "--out", str(work / "artifacts" / task / name), "--force",
                    "--interventions", "off"]  # the study asks Generate alone: no intervention graph to trace
            if export_main(argv + ([] if validate else ["--no-validate"])):
                raise SystemExit(f"exporting {task}/{name} failed")
            times["export"] += time.perf_counter() - t0
            training[name] = summary
            say(f"{task} {row} seed {seed}: {summary['steps']} steps in {summary['seconds']} s, "
                f"answer loss {summary['train_loss']}")
    t0 = time.perf_counter()
    server = Server(Settings(model_dir=work / "artifacts" / task, host="127.0.0.1", port=0, threads=1,
                             metrics_port=-1, http_port=-1)).start()
    cells: dict[str, dict] = {}
    try:
        for row in rows_:
            per_seed = {}
            for seed in seeds:
                scores = served_scores(f"127.0.0.1:{server.port}", model_name(row, seed), tests)
                per_seed[str(seed)] = {str(f): sum(s) / len(s) for f, s in scores.items()}
            cells[row] = summarize(per_seed)
            say(f"{task} {row}: " + "  ".join(f"{f}x {c['mean']:.2f}±{c['std']:.2f}"
                                              for f, c in cells[row]["factors"].items()))
    finally:
        server.stop(grace=1)
    times["evaluate"] = time.perf_counter() - t0
    lengths = dict(zip((str(f) for f in FACTORS), test_lengths(task), strict=False))
    return {"train_lengths": list(task_of(task).train), "lengths": lengths, "context": context,
            "examples_per_length": n, "rows": cells, "training": training,
            "seconds": {k: round(v, 1) for k, v in times.items()}}


def summarize(per_seed: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Mean, standard deviation (over seeds, ddof 0) and range of each factor's accuracy, with every seed's."""
    factors = next(iter(per_seed.values())).keys()
    out = {}
    for f in factors:
        values = np.array([acc[f] for acc in per_seed.values()])
        out[f] = {"mean": round(float(values.mean()), 4), "std": round(float(values.std()), 4),
                  "min": round(float(values.min()), 4), "max": round(float(values.max()), 4)}
    return {"factors": out, "seeds": per_seed}


def parse(argv: list[str] | None):
    p = Parser(prog="python -m lab.experiments.lengthgen", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=0, help="training steps per model; default 300 unless --seconds")
    p.add_argument("--batch", type=int, default=BATCH, help="training examples per step")
    p.add_argument("--seconds", type=float, default=0.0, help="training seconds per model instead of steps")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks (lab.tasks.TASKS)")
    p.add_argument("--variants", default="", help="comma-separated rows (a variant, or VARIANT+random); "
                                                  "default: every variant and every randomized one")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (at least three for a spread)")
    p.add_argument("--examples", type=int, default=32, help="test examples per length")
    p.add_argument("--threads", type=int, default=1, help="torch threads while training")
    p.add_argument("--validate", action="store_true", help="run the exporter's parity validation on every model "
                                                           "(about 8x the export's time)")
    p.add_argument("--work", default="/tmp/posenc-lengthgen", help="where checkpoints and artifacts go")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--plot", default=str(PLOT))
    p.add_argument("--report-only", action="store_true",
                   help="recompute the claims and tables in --out and draw --plot from its measurements alone")
    return p, p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    p, args = parse(argv)
    if args.report_only:
        out = Path(args.out)
        doc = json.loads(out.read_text())
        doc["claims"] = claims(doc)
        doc["tables"] = tables(doc)
        write(out.parent, out.stem, doc, indent=1)
        plot(doc, Path(args.plot))
        print(f"rewrote {out}'s tables and drew {args.plot} from it")
        return 0
    # lazy: torch (213 MB) loads only when a study trains
    import torch

    tasks = [t for t in args.tasks.split(",") if t]
    every = rows()
    chosen = [r for r in args.variants.split(",") if r] or every
    seeds = [int(s) for s in args.seeds.split(",") if s]
    bad = [t for t in tasks if t not in TASKS] + [r for r in chosen if r not in every]
    if bad or not tasks or not seeds or min(args.examples, args.batch) < 1 or min(args.steps, args.seconds) < 0:
        p.error(f"unknown task or row {', '.join(bad)} (rows: {', '.join(every)})" if bad else
                "give tasks, seeds, --examples >= 1 and a budget >= 0")
    budget = {"seconds": args.seconds} if args.seconds else {"steps": args.steps or 300}
    budget["batch"] = args.batch
    torch.set_num_threads(args.threads)
    start = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - start:7.1f} s] {line}", file=sys.stderr, flush=True)

    say(f"{len(tasks)} tasks x {len(chosen)} rows x {len(seeds)} seeds, budget {budget} per model")
    results = {t: run_task(t, chosen, seeds, args.examples, budget, Path(args.work), args.validate, say)
               for t in tasks}
    seconds = round(time.monotonic() - start, 1)
    command = " ".join(["python -m lab.experiments.lengthgen", *(argv if argv is not None else sys.argv[1:])])
    doc = {"meta": meta(command, seconds=seconds,
                        budget={**budget, "per": "model"}, torch_threads=args.threads),
           "architecture": ARCH, "factors": list(FACTORS), "seeds": seeds, "rows": chosen, "tasks": results,
           "eval_seed": EVAL_SEED, "validated": args.validate,
           "papers": {t: TASKS[t].paper for t in tasks}}
    doc["claims"] = claims(doc)
    doc["tables"] = tables(doc)
    out = Path(args.out)
    write(out.parent, out.stem, doc, indent=1)
    plot(doc, Path(args.plot))
    print(f"wrote {out} and {args.plot} in {seconds} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
