"""make lengthgen: every positional variant on every length-generalization task, trained here, served, scored.

For each task of lab.tasks.TASKS and each row (every variant of model.variants.REGISTRY, and `VARIANT+random` for
each variant that takes randomized positions, Ruoss et al. 2023: model/train.py's random_positions), for each seed:

1. a tiny byte-level model (ARCH) is trained on the task's train lengths: the same steps (or seconds), batch and
   learning-rate schedule for every row; the seed sets the initial weights and the data order, which every row
   shares. The loss is on the answer, its terminator and the prompt's marks (lab.tasks: bytes that follow from the
   text before them, as flip-flop's earlier reads and MQAR's answered queries, which the papers train on too); the
   rest of the prompt is random by construction, so nothing in it can be learned beyond its fixed words;
2. it is saved as a posenc checkpoint and exported (export/) to an artifact;
3. a worker (service.server, on a loopback port) serves the artifact as soon as it is written, and the examples at
   1x, 2x, 4x and 8x the longest train length (lab.tasks.test_lengths, the same examples for every model) are answered
   by greedy generation through client.api's Generate, stopping at the terminator; lab.tasks.score is exact match.

The models, their contexts and their training are lab/experiments/lengthgen_models.py's: a model's config (and its
model.json's trained_context) holds the context it is trained at, except the learned table, which holds the longest
test example so that it is asked every length rather than refused; randomized rows draw from [0, that length).

Then a sanity model per task (sanity(): SANITY_ROW, the task's SANITY budget, scored at 1x through the worker like
the rest): a task whose sanity model stays under SANITY_THRESHOLD is flagged, in the JSON and on the page, as not
learned at this budget, so its length results say nothing.

Each (task, row, seed) cell is written to WORK/cells/TASK/NAME.json (or --cells DIR) once trained and again once
scored, with the key it was made under (cell_key) and when and where it was trained; `--resume` reads back every
cell of the same key instead of making it again.  The committed run's cells are bench/results/lengthgen-cells, so a
study longer than one machine's time goes on from them elsewhere (a scored cell needs no model).

Writes bench/results/lengthgen.json (bench.lib.results: date, machine, load; the budget and times in it; the sanity
section with its own), its tables filled into docs/lengthgen.md by `make docs`, and docs/img/lengthgen.png (variant
x length, one panel per task), drawn from the JSON alone (`--report-only` recomputes both from the measurements in
it; `--sanity-only` runs the sanity models alone and puts their section into the existing JSON).
  python -m lab.experiments.lengthgen [--steps N | --seconds S] [--tasks A,B] [--variants R,S] [--seeds 0,1,2]
                                      [--examples N] [--batch N] [--work DIR] [--cells DIR] [--resume]
                                      [--report-only]
                                      [--sanity-only | --no-sanity] [--sanity-steps N] [--sanity-batch N]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.results import meta, write
from lab.experiments.lengthgen_models import (
    ADAMW,
    ANSWER_S,
    ARCH,
    BATCH,
    EVAL_SEED,
    FACTORS,
    INIT_STD,
    LR,
    WARMUP,
    context_of,
    eval_set,
    examples_sha256,
    model_name,
    rows,
    served_scores,
    train_one,
    trained_context,
)
from lab.experiments.lengthgen_report import SANITY_THRESHOLD, UNLEARNED, claims, plot, tables
from lab.tasks import TASKS, task_of, test_lengths
from model.cli import Parser

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "lengthgen.json"
PLOT = ROOT / "docs" / "img" / "lengthgen.png"
# The sanity models (sanity()): RoPE at the study's sizes and recipe (train_one: the loss on the answer, its newline
# and the prompt's marks), a budget per task in steps (repeatable) and, where a task needs it, its own init_std for
# the Linear weights (INIT_STD otherwise), about SANITY_MINUTES minutes for the seven on 2 CPUs under nice with their
# exports and serving. Probes (in process, 1x, 32 or 64 examples, one thread): at std 0.125, MQAR (half its keys
# queried) 0.33 of 64 after 6,000 steps of 32 (0.25 served after 2,400; its loss 1.8-2.2 nats on every query, chance
# 2.3: no recall), selective copy 0.66 after 1,500 and 0.94 after 2,500 (0 at 0.02), flip-flop 1.00 after 1,500 of 16
# (0.80), counting 0.84 after 500 and after 1,000 (its loss still falling), passkey 0 after 800 of 8 and 1.00 after
# 1,600; copy and reverse stay at chance per letter (0 exact) after 3,000 steps of 8 (at 3e-3 or 1e-2) or 1,500 of 32.
# At std 0.02 (64 examples, steps of 8): copy 1.00 after 19,000 steps (384 s), reverse 0.00 after 19,000 and 1.00
# after 40,000 (750 s), MQAR 0.23 after 19,000: a copy with repeated letters needs a positional circuit that forms
# late at this size. MQAR at 2,400 steps of 32 from 0.125 stays near a quarter however the model changes (d_model 128:
# 0.13; lr 1e-3: 0.28; three layers: 0.28; eight heads: 0.27), each at a loss near ln 4, as if it learned elimination
# among the unused values and not the lookup. Nor does the task's form help (probes of 3,000-30,000 steps of 32 at
# std 0.02 or 0.125, lr 1e-3 to 1e-2): one-character keys (83, so the lookup is a plain induction head), values before
# keys, no spaces, every key queried: 0.25-0.34 at 1x (one-character keys, 1-10 pairs: 0.25 after 50,000 steps of 32
# at std 0.125). Two pairs and one query stay at chance (0.5-0.67 after 2,000 to 6,000 steps) for rope, none, learned,
# t5 and alibi alike, and so does transformers' GPT2LMHeadModel of the same size on the same batches (0.5-0.63 after
# 4,000); rope learns them after a plateau (chance until about 24,000 steps of 32, 0.96-1.00 from 28,000). The task
# as it is, 22,000 steps of 32 from 0.125: 0.35-0.42 (loss 1.31). The lookup circuit forms late at this size, but
# once formed on two pairs it carries over (train_one's curriculum, one schedule at 3e-3): 30,000 steps on up to two
# pairs (loss 0.06 from about 13,000), 4,000 on four, 4,000 on eight and 8,000 on sixteen answer 0.52 of 48 16-pair
# examples in process, and 6,000 more on sixteen at a constant 1e-3 answer 0.92. MQAR's budget below shortens the
# first phase: 20,000, 4,000, 4,000 and 16,000 answered 0.89 of the 64 served (loss 0.074), and with 24,000 in the
# last phase 0.89 again (loss 0.097), one example under SANITY_THRESHOLD each time; 16,000 in the last phase and then
# a tail of 8,000 at a constant 1e-3 (below) answer 0.95 (loss 0.047, 46 minutes here beside two other jobs).
SANITY_ROW, SANITY_SEED, SANITY_EXAMPLES, SANITY_MINUTES = "rope", 0, 64, 90
SANITY_ARCH = ARCH
SANITY = {"copy": {"steps": 19000, "batch": 8, "init_std": 0.02},
          "reverse": {"steps": 40000, "batch": 8, "init_std": 0.02},
          "counting": {"steps": 2000, "batch": 32}, "selective_copy": {"steps": 3000, "batch": 32},
          "flip_flop": {"steps": 1500, "batch": 16},
          "mqar": {"steps": 44000, "batch": 32, "curriculum": [[2, 20000], [4, 4000], [8, 4000]],
                   "tail": [8000, 1e-3]},
          "passkey": {"steps": 1600, "batch": 8}}


def cell_key(task: str, row: str, seed: int, n: int, budget: dict, factors: tuple[int, ...], arch: dict | None,
             validate: bool, digest: str) -> dict[str, Any]:
    """What a (task, row, seed) cell's result follows from beside the code (the task, the budget, the recipe's
    constants, the test examples and the generator's examples' digest, `examples_sha256`, and whether the export
    was validated): a kept cell is reused only when its key is this.  (A budget in seconds trains as many steps as
    the machine manages, so such a cell is the machine's.)"""
    budget = json.loads(json.dumps(budget))  # as a cell reads it back: a curriculum's tuples are lists there
    return {"task": task, "examples_sha256": digest, "row": row, "seed": seed, "examples": n, "budget": budget,
            "factors": list(factors),
            "architecture": arch or ARCH, "init_std": budget.get("init_std", INIT_STD), "lr": LR, "warmup": WARMUP,
            "adamw": ADAMW,
            "eval_seed": EVAL_SEED, "validated": validate}


def kept_cell(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The cell written at `path` when it was made under `key` (else None: absent, unreadable or another key)."""
    try:
        cell = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cell if isinstance(cell, dict) and cell.get("key") == key else None


def run_task(task: str, rows_: list[str], seeds: list[int], n: int, budget: dict, work: Path,
             validate: bool, say, factors: tuple[int, ...] = FACTORS, arch: dict | None = None,
             resume: bool = False, cells: Path | None = None) -> dict[str, Any]:
    """Train (`arch`, ARCH), export and serve every (row, seed) of one task; the accuracy per row, seed and factor
    (`factors`).  Each cell is written to CELLS/TASK/NAME.json (`cells`, default work/cells) as soon as it is trained,
    with when and where (`made`), and again once scored, right after; with `resume`, a cell written under the same
    key (cell_key) is read back instead of being trained or scored again, so a long study stopped anywhere goes on
    from its last cell.  A scored cell needs neither its checkpoint nor its artifact: a folder of scored cells (a
    committed one) resumes on another machine."""
    # lazy: torch, the exporter and the worker load only when a study trains and serves
    from export.__main__ import export_main
    from model import checkpoint
    from model.files import atomic_write, sha256_file
    from service.server import Server
    from service.settings import Limits, Settings

    tests = eval_set(task, n, factors)
    digest = examples_sha256(task, tests)
    context = context_of(eval_set(task, n))  # the positions 8x needs, whatever `factors` (the same for every row)
    cells_dir = (cells or work / "cells") / task
    cell_of: dict[str, dict[str, Any]] = {}
    kept, read_back = 0, set()

    def artifact(name: str) -> Path:
        return work / "artifacts" / task / name

    def exported(name: str) -> str | None:
        """The digest of the artifact's manifest (which holds every file's): an unscored cell is kept only with the
        artifact it was exported to, not another run's of the same name."""
        manifest = artifact(name) / "manifest.json"
        return sha256_file(manifest) if manifest.exists() else None

    def write_cell(name: str) -> None:
        atomic_write(cells_dir / f"{name}.json", json.dumps(cell_of[name], indent=1))

    def score(names: list[str]) -> None:
        """A worker over `names`' artifacts (links in work/serving/TASK), each cell written once scored."""
        serve = work / "serving" / task
        serve.mkdir(parents=True, exist_ok=True)
        for link in serve.iterdir():
            link.unlink()
        for name in names:
            (serve / name).symlink_to(artifact(name).resolve(), target_is_directory=True)
        server = Server(Settings(model_dir=serve, host="127.0.0.1", port=0, threads=1, metrics_port=-1,
                                 http_port=-1, limits=Limits(max_request_s=ANSWER_S))).start()
        try:
            for name in names:
                t0 = time.perf_counter()
                scores = served_scores(f"127.0.0.1:{server.port}", name, tests)
                cell_of[name]["scores"] = {str(f): sum(s) / len(s) for f, s in scores.items()}
                cell_of[name]["seconds"]["evaluate"] = time.perf_counter() - t0
                write_cell(name)
        finally:
            server.stop(grace=1)

    for row in rows_:
        for seed in seeds:
            name = model_name(row, seed)
            key = cell_key(task, row, seed, n, budget, factors, arch, validate, digest)
            path = cells_dir / f"{name}.json"
            cell = kept_cell(path, key) if resume else None
            if cell is not None and ("scores" in cell or exported(name) == cell.get("artifact_sha256")):
                say(f"{task} {row} seed {seed}: kept ({path})")
                cell_of[name], kept = cell, kept + 1
                read_back |= {f"{cell['made']['date'][:10]}, {cell['made']['machine']}"} if "made" in cell else set()
                continue
            path.unlink(missing_ok=True)  # a cell stays unwritten until its new model is exported
            when = meta("")
            model, summary = train_one(task, row, seed, context, arch=arch, **budget)
            folder = work / "checkpoints" / task / name
            checkpoint.save(model, folder, summary)
            t0 = time.perf_counter()
            argv = ["--checkpoint", str(folder), "--out", str(artifact(name)), "--force",
                    "--interventions", "off"]  # the study asks Generate alone: no intervention graph to trace
            if export_main(argv + ([] if validate else ["--no-validate"])):
                raise SystemExit(f"exporting {task}/{name} failed")
            cell_of[name] = {"key": key, "training": summary,
                             "made": {"date": when["date"], "machine": when["machine"]},
                             "seconds": {"train": summary["seconds"], "export": time.perf_counter() - t0},
                             "artifact_sha256": exported(name)}
            write_cell(name)
            say(f"{task} {row} seed {seed}: {summary['steps']} steps in {summary['seconds']} s, "
                f"train loss {summary['train_loss']}")
            score([name])  # scored at once: a stopped run leaves only scored cells, which need no model to resume
    unscored = [name for name, cell in cell_of.items() if "scores" not in cell]
    if unscored:  # kept cells an earlier run exported and did not score
        score(unscored)
    out: dict[str, dict] = {}
    for row in rows_:
        out[row] = summarize({str(seed): cell_of[model_name(row, seed)]["scores"] for seed in seeds})
        say(f"{task} {row}: " + "  ".join(f"{f}x {c['mean']:.2f}±{c['std']:.2f}"
                                          for f, c in out[row]["factors"].items()))
    times = {k: round(sum(c["seconds"].get(k, 0.0) for c in cell_of.values()), 1)
             for k in ("train", "export", "evaluate")}
    lengths = {str(f): n for f, n in zip(FACTORS, test_lengths(task), strict=False) if f in factors}
    return {"train_lengths": list(task_of(task).train), "lengths": lengths, "context": context,
            "trained_context": trained_context(task),
            "examples_per_length": n, "rows": out, "training": {name: c["training"] for name, c in cell_of.items()},
            "seconds": times, "kept": kept,
            "made": sorted(read_back)}


def sanity(tasks: list[str], n: int, override: dict, work: Path, validate: bool, say,
           resume: bool = False, cells: Path | None = None) -> dict[str, Any]:
    """A sanity model per task: SANITY_ROW of SANITY_ARCH trained on the task's train lengths for the task's
    SANITY budget and init_std (`override` replaces its steps or batch), exported, served and scored like the
    study's models at 1x alone. A task whose sanity model stays under SANITY_THRESHOLD is not learned at this
    budget, so its length results say nothing: `learned` false, and the task listed under `unlearned`."""
    out: dict[str, Any] = {}
    kept, made = 0, set()
    for task in tasks:
        budget = {**SANITY[task], **override}
        if "steps" in override:  # another number of steps is another run: the task's phases are for its own
            budget.pop("curriculum", None)
            budget.pop("tail", None)
        r = run_task(task, [SANITY_ROW], [SANITY_SEED], n, budget, work / "sanity", validate, say, factors=(1,),
                     arch=SANITY_ARCH, resume=resume, cells=cells / "sanity" if cells else None)
        acc, summary = r["rows"][SANITY_ROW]["factors"]["1"]["mean"], r["training"][model_name(SANITY_ROW, SANITY_SEED)]
        learned = acc >= SANITY_THRESHOLD
        kept, made = kept + r["kept"], made | set(r["made"])
        out[task] = {"accuracy": acc, "learned": learned, "verdict": "learned" if learned else UNLEARNED,
                     "length": r["lengths"]["1"],
                     "train_lengths": r["train_lengths"], "trained_context": r["trained_context"],
                     "budget": budget, "init_std": summary["init_std"], "steps": summary["steps"],
                     "train_loss": summary["train_loss"],
                     "seconds": r["seconds"]}
        say(f"sanity {task}: 1x accuracy {acc:.2f}, {out[task]['verdict']}")
    return {"row": SANITY_ROW, "seed": SANITY_SEED, "architecture": SANITY_ARCH, "init_std": INIT_STD, "lr": LR,
            "examples": n,
            "threshold": SANITY_THRESHOLD, "tasks": out, "unlearned": [t for t, e in out.items() if not e["learned"]],
            "kept": kept, "kept_made": sorted(made),
            "seconds": round(sum(sum(e["seconds"].values()) for e in out.values()), 1)}


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
    p.add_argument("--work", default="/tmp/posenc-lengthgen", help="where checkpoints, artifacts and cells go")
    p.add_argument("--cells", default="", help="where the cells go instead of WORK/cells, the sanity models' in "
                                               "CELLS/sanity (a scored cell there is read back by --resume on any "
                                               "machine, without its model; without --resume a cell made again "
                                               "replaces its file)")
    p.add_argument("--resume", action="store_true",
                   help="read back every (task, row, seed) cell the cells folder (--cells, default WORK/cells) holds "
                        "from an earlier run with the same budget, examples and recipe instead of training and "
                        "scoring it again")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--plot", default=str(PLOT))
    p.add_argument("--report-only", action="store_true",
                   help="recompute the claims and tables in --out and draw --plot from its measurements alone")
    p.add_argument("--sanity-only", action="store_true",
                   help="run the --tasks' sanity models alone and put their section into --out, keeping the study's "
                        "results and their metadata there")
    p.add_argument("--no-sanity", action="store_true", help="the study without the sanity models")
    p.add_argument("--sanity-steps", type=int, default=0,
                   help="every sanity model's steps, without a task's curriculum or tail (default: SANITY's)")
    p.add_argument("--sanity-batch", type=int, default=0, help="every sanity model's batch (default: SANITY's)")
    p.add_argument("--sanity-examples", type=int, default=SANITY_EXAMPLES, help="sanity test examples (1x)")
    return p, p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    p, args = parse(argv)
    out = Path(args.out)
    if args.report_only:
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
    if bad or not tasks or not seeds or min(args.examples, args.batch, args.sanity_examples) < 1 or \
            min(args.steps, args.seconds, args.sanity_steps, args.sanity_batch) < 0:
        p.error(f"unknown task or row {', '.join(bad)} (rows: {', '.join(every)})" if bad else
                "give tasks, seeds, --examples >= 1 and a budget >= 0")
    if args.sanity_only and not out.exists():
        p.error(f"--sanity-only puts its section into the study's results: {out} does not exist")
    budget = {"seconds": args.seconds} if args.seconds else {"steps": args.steps or 300}
    budget["batch"] = args.batch
    override = {k: v for k, v in (("steps", args.sanity_steps), ("batch", args.sanity_batch)) if v}
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    command = " ".join(["python -m lab.experiments.lengthgen", *(argv if argv is not None else sys.argv[1:])])

    def say(line: str) -> None:
        print(f"[{time.monotonic() - start:7.1f} s] {line}", file=sys.stderr, flush=True)

    def checks() -> dict[str, Any]:
        t0 = time.monotonic()
        say(f"sanity models for {len(tasks)} tasks (all seven at SANITY's budgets: about {SANITY_MINUTES} minutes)")
        section = sanity(tasks, args.sanity_examples, override, Path(args.work), args.validate, say, args.resume,
                         cells)
        return {"meta": meta(command, seconds=round(time.monotonic() - t0, 1), torch_threads=args.threads),
                **section}

    cells = Path(args.cells) if args.cells else None
    if args.sanity_only:
        doc = json.loads(out.read_text())
        doc["sanity"] = checks()
        doc["tables"] = tables(doc)
        write(out.parent, out.stem, doc, indent=1)
        print(f"put the sanity models of {', '.join(tasks)} into {out} in {doc['sanity']['meta']['seconds']} s")
        return 0
    say(f"{len(tasks)} tasks x {len(chosen)} rows x {len(seeds)} seeds, budget {budget} per model")
    results = {t: run_task(t, chosen, seeds, args.examples, budget, Path(args.work), args.validate, say,
                           resume=args.resume, cells=cells) for t in tasks}
    doc = {"meta": meta(command, seconds=round(time.monotonic() - start, 1),
                        budget={**budget, "per": "model"}, torch_threads=args.threads),
           "architecture": ARCH, "init_std": INIT_STD, "lr": LR, "factors": list(FACTORS), "seeds": seeds,
           "rows": chosen, "tasks": results,
           "eval_seed": EVAL_SEED, "validated": args.validate,
           "papers": {t: TASKS[t].paper for t in tasks}}
    if not args.no_sanity:
        doc["sanity"] = checks()
    seconds = round(time.monotonic() - start, 1)
    doc["claims"] = claims(doc)
    doc["tables"] = tables(doc)
    write(out.parent, out.stem, doc, indent=1)
    plot(doc, Path(args.plot))
    print(f"wrote {out} and {args.plot} in {seconds} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
