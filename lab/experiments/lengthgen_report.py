"""make lengthgen's results read back: the tables docs/lengthgen.md is filled from, the papers' claims checked against
the measured accuracies, and the heatmap (variant x length, one panel per task).  Everything here reads the results
document alone (lab/experiments/lengthgen.py writes it), so `--report-only` and `make docs` need no model."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from lab.tasks import KAZEMNEJAD, TASKS, examples

PAST = ("2", "4", "8")  # the factors past the trained length
RUOSS_GAIN = 12.0  # Ruoss et al. 2023: randomized positions' mean accuracy gain, in points, over 15 tasks
COPE_TASKS = ("counting", "selective_copy", "flip_flop")  # where Golovneva et al. 2024 report RoPE failing
COPE_MARGIN = 0.1  # CoPE counts as ahead of RoPE past the trained length by this much accuracy or more
SANITY_THRESHOLD = 0.9  # a sanity model's 1x accuracy at which its task counts as learned
# a row answers above chance when its right answers at 1x would be this unlikely from answers each right with the
# chance level's probability, divided among the task's rows (Bonferroni: the best of many rows is read)
SIGNIFICANCE = 0.01
UNLEARNED = "NOT LEARNED: the task is not learned at this budget, so its length results say nothing"


def accuracy(doc: dict, task: str, row: str, factors=PAST) -> float | None:
    """The mean over seeds and `factors` of a row's accuracy on a task; None when it was not measured."""
    cells = doc["tasks"].get(task, {}).get("rows", {}).get(row)
    if cells is None:
        return None
    return sum(cells["factors"][f]["mean"] for f in factors) / len(factors)


def mean_over(doc: dict, tasks: list[str], row: str, factors=PAST) -> float | None:
    values = [accuracy(doc, t, row, factors) for t in tasks]
    return None if not values or None in values else sum(values) / len(values)


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), each term in logs (any n)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0

    def log_term(i: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) \
            + (n - i) * math.log1p(-p)

    return min(1.0, sum(math.exp(log_term(i)) for i in range(k, n + 1)))


def above_chance(doc: dict, task: str, row: str) -> bool:
    """Whether the row's 1x answers (every seed's) beat the task's chance level (the most frequent answer's
    accuracy) beyond luck: so many right would have probability under SIGNIFICANCE / rows from answers each right
    with chance's probability."""
    r = doc["tasks"][task]
    n = r["examples_per_length"] * len(doc["seeds"])
    right = round((accuracy(doc, task, row, ("1",)) or 0.0) * n)
    return binomial_tail(right, n, chance(doc, task)["1"]) < SIGNIFICANCE / len(r["rows"])


def answered(doc: dict, tasks: list[str]) -> tuple[list[str], list[str]]:
    """The `tasks` some row answers above chance in distribution (above_chance) and whose sanity model, where the run
    has one, learned them; and the rest: a task not learned at the trained length says nothing about what happens
    past it."""
    flagged = set(doc.get("sanity", {}).get("unlearned", ()))
    learned = [t for t in tasks if t not in flagged and any(above_chance(doc, t, r) for r in doc["tasks"][t]["rows"])]
    return learned, [t for t in tasks if t not in learned]


def _named(tasks: list[str]) -> str:
    names = [t.replace("_", " ") for t in tasks]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _unlearned(doc: dict, tasks: list[str]) -> str:
    """What a claim says of the tasks `answered` leaves out: which, and why."""
    why = "which no row answers above chance in distribution"
    if doc.get("sanity", {}).get("unlearned"):
        why += " or its sanity model did not learn"
    return f"{_named(tasks)}, {why}"


def _kazemnejad(doc: dict) -> list:
    measured_ = [t for t in doc["tasks"] if TASKS[t].paper == KAZEMNEJAD]
    tasks, left = answered(doc, measured_)
    named = {v: mean_over(doc, tasks, v) for v in ("none", "t5", "alibi", "rope")}
    plain = sorted(((mean_over(doc, tasks, r), r) for r in doc["rows"] if "+" not in r and tasks), reverse=True)
    claim = "NoPE and T5's relative bias generalize best; ALiBi and RoPE less (copy, reverse; 2x-8x)"
    if not measured_ or not {"none", "t5", "alibi", "rope"} <= set(doc["rows"]):
        return ["Kazemnejad et al. 2023", claim, "not measured (needs copy or reverse and none, t5, alibi, rope)",
                "–"]
    if not tasks:
        return ["Kazemnejad et al. 2023", claim,
                f"inconclusive (not learned: {_unlearned(doc, measured_)})", "–"]
    skipped = f" ({', '.join(tasks)}; not {_unlearned(doc, left)})" if left else ""
    rank = {r: i + 1 for i, (_, r) in enumerate(plain)}
    measured = (", ".join(f"{v} {a:.2f} (#{rank[v]})" for v, a in named.items()) + f" of {len(plain)} plain variants"
                + skipped)
    best, worst = min(named["none"], named["t5"]), max(named["alibi"], named["rope"])
    verdict = ("agrees" if best > worst else "partly" if max(named["none"], named["t5"]) > worst else "disagrees")
    return ["Kazemnejad et al. 2023", claim, measured, verdict]


def _ruoss(doc: dict) -> list:
    tasks = list(doc["tasks"])
    pairs = [(r.removesuffix("+random"), r) for r in doc["rows"] if r.endswith("+random")
             and r.removesuffix("+random") in doc["rows"]]
    claim = f"randomized positions: +{RUOSS_GAIN} points of mean accuracy past the trained length"
    if not pairs:
        return ["Ruoss et al. 2023", claim, "not measured (no VARIANT+random row beside its variant)", "–"]
    learned, left = answered(doc, tasks)
    skipped = f"; not {_unlearned(doc, left)}" if left else ""
    if not learned:
        return ["Ruoss et al. 2023", claim, f"inconclusive (not learned: {_unlearned(doc, tasks)})", "–"]
    gains = {plain: 100 * (mean_over(doc, learned, rnd) - mean_over(doc, learned, plain)) for plain, rnd in pairs}
    mean = sum(gains.values()) / len(gains)
    helped = sum(g > 0 for g in gains.values())
    measured = (f"{mean:+.1f} points on average over {len(pairs)} variants and {len(learned)} "
                f"task{'s' if len(learned) > 1 else ''} (2x-8x{skipped}); "
                f"better for {helped} of {len(pairs)}")
    verdict = "agrees" if mean >= RUOSS_GAIN / 2 else "partly" if mean > 0 else "disagrees"
    return ["Ruoss et al. 2023", claim, measured, verdict]


def _verdict(hits: int, learned: int, row: str) -> str:
    """A claim's verdict over the tasks `row` learned in distribution (1x >= 0.5): agrees when it holds on every one,
    partly on some, disagrees on none; inconclusive when the row learned none."""
    if not learned:
        return f"inconclusive ({row} did not learn the tasks in distribution)"
    return "agrees" if hits == learned else "partly" if hits else "disagrees"


def _cope(doc: dict) -> list:
    tasks = [t for t in COPE_TASKS if t in doc["tasks"]]
    claim = "RoPE fails past the trained length on counting, selective copy and flip-flop"
    if not tasks or "rope" not in doc["rows"]:
        return ["Golovneva et al. 2024", claim, "not measured (needs rope and one of the three tasks)", "–"]
    parts, fails, learned = [], 0, 0
    for t in tasks:
        at1, past = accuracy(doc, t, "rope", ("1",)), accuracy(doc, t, "rope")
        base = chance(doc, t)
        base1, base_past = base["1"], sum(base[f] for f in PAST) / len(PAST)
        parts.append(f"{t} 1x {at1:.2f}, 2x-8x {past:.2f} (chance {base1:.2f}, {base_past:.2f})")
        learned += at1 >= 0.5
        fails += at1 >= 0.5 and past - base_past < (at1 - base1) / 2
    return ["Golovneva et al. 2024", claim, "; ".join(parts), _verdict(fails, learned, "rope")]


def _cope_remedy(doc: dict) -> list:
    """Golovneva et al.'s remedy: CoPE's contextual positions answer past the trained length where RoPE does not."""
    tasks = [t for t in COPE_TASKS if t in doc["tasks"]]
    claim = "CoPE generalizes where RoPE fails: higher accuracy past the trained length on the same three tasks"
    if not tasks or not {"cope", "rope"} <= set(doc["rows"]):
        return ["Golovneva et al. 2024", claim, "not measured (needs cope, rope and one of the three tasks)", "–"]
    parts, ahead, learned = [], 0, 0
    for t in tasks:
        at1, cope, rope = accuracy(doc, t, "cope", ("1",)), accuracy(doc, t, "cope"), accuracy(doc, t, "rope")
        parts.append(f"{t} 2x-8x cope {cope:.2f}, rope {rope:.2f} (cope 1x {at1:.2f})")
        learned += at1 >= 0.5
        ahead += at1 >= 0.5 and cope >= rope + COPE_MARGIN
    return ["Golovneva et al. 2024", claim, "; ".join(parts), _verdict(ahead, learned, "cope")]


def claims(doc: dict) -> list[list]:
    """Each paper's claim beside what this run measured, with a verdict computed from the numbers: [paper, claim,
    measured, verdict]."""
    return [_kazemnejad(doc), _ruoss(doc), _cope(doc), _cope_remedy(doc)]


def chance(doc: dict, task: str) -> dict[str, float]:
    """Each factor's chance level on a task: `majority` on the run's own test examples."""
    r = doc["tasks"][task]
    return {f: majority(task, n, r["examples_per_length"], doc["eval_seed"]) for f, n in r["lengths"].items()}


def majority(task: str, length: int, n: int, seed: int) -> float:
    """The accuracy of always answering the most frequent answer among the test examples: the task's chance level."""
    counts = Counter(e.answer for e in examples(task, length, n, seed))
    return counts.most_common(1)[0][1] / n


def _budget(b: dict) -> str:
    phases = "".join(f", {'then ' if i else 'the first '}{n} on lengths up to {longest}"
                     for i, (longest, n) in enumerate(b.get("curriculum", ())))
    tail = f", then {b['tail'][0]} more at a constant rate of {b['tail'][1]:g}" if b.get("tail") else ""
    return (f"{b['steps']} steps" if "steps" in b else f"{b['seconds']} s") + f" of {b['batch']}{phases}{tail}"


def sanity_line(doc: dict, task: str) -> str:
    """What the task's sanity model says, for the note under its table: learned, not learned, or not run."""
    s = doc.get("sanity", {})
    e = s.get("tasks", {}).get(task)
    if e is None:
        return " No sanity model was run for this task."
    said = "learned" if e["accuracy"] >= s["threshold"] else UNLEARNED
    own = e.get("init_std")
    init = f", init std {own}" if own is not None and own != doc.get("init_std") else ""
    return (f" Sanity model ({s['row']}, {_budget(e['budget'])}{init}): {e['accuracy']:.2f} at 1x "
            f"(threshold {s['threshold']}): {said}.")


def read_back(s: dict) -> str:
    """What the sanity note says of models an earlier run trained (--resume): their s are theirs, not this run's."""
    if not s.get("kept"):
        return ""
    where = f", trained {'; '.join(s['kept_made'])}" if s.get("kept_made") else ""
    return f"; {s['kept']} of the models were read back from their cells (--resume){where} (s is each model's own)"


def sanity_table(doc: dict) -> dict[str, Any]:
    s = doc["sanity"]
    rows = [[task, "{}-{}".format(*e["train_lengths"]), e["length"], _budget(e["budget"]),
             e.get("init_std", s.get("init_std", "not recorded")), e["train_loss"],
             round(sum(e["seconds"].values()), 1), f"{e['accuracy']:.2f}",
             "learned" if e["accuracy"] >= s["threshold"] else UNLEARNED] for task, e in s["tasks"].items()]
    m, arch = s["meta"], s["architecture"]
    recorded = "init_std" in s or all("init_std" in e for e in s["tasks"].values())
    init = "every Linear weight drawn at the init std" if recorded else "initialisation not recorded"
    load = " / ".join(f"{x:.2f}" for x in m["load"]) if m.get("load") else "not recorded"
    return {"columns": ["task", "train lengths", "1x length", "budget", "init std", "train loss", "s", "1x accuracy",
                        "verdict"],
            "rows": rows,
            "note": f"A {s['row']} model per task (d_model {arch['d_model']}, {arch['n_heads']} heads, "
                    f"{arch['n_layers']} layers, MLP {arch['d_mlp']}; seed {s['seed']}; {init}) trained on the "
                    f"task's train lengths, exported, served and scored like the study's models on {s['examples']} "
                    f"examples at 1x; under {s['threshold']} the task is flagged. train loss: nats per byte trained "
                    f"on (the answer, its newline and the prompt's marks), the last 20 steps. s: train, "
                    f"export, serve and score; {m['seconds']} s in all ({m['seconds'] / 60:.1f} minutes)"
                    f"{read_back(s)}. These models' own run (the source line below is the study's): "
                    f"`{m['command']}`, "
                    f"{m['date']}, {m['machine']}, load {load}."}


def tables(doc: dict) -> dict[str, Any]:
    """The page's tables: one per task (mean ± standard deviation over seeds at each length, its sanity model's
    verdict under it), the sanity models, the claims, the run."""
    out: dict[str, Any] = {}
    if "sanity" in doc:
        out["sanity"] = sanity_table(doc)
    seeds = len(doc["seeds"])
    for task, r in doc["tasks"].items():
        cols = ["row", *(f"{f}x ({r['lengths'][f]})" for f in r["lengths"]), "2x-8x mean"]
        rows = []
        for row in doc["rows"]:
            cells = r["rows"][row]["factors"]
            past = accuracy(doc, task, row)
            rows.append([row, *(f"{c['mean']:.2f} ± {c['std']:.2f}" for c in cells.values()),
                         None if past is None else f"{past:.2f}"])
        rows.append(["(the most frequent answer)", *(f"{c:.2f}" for c in chance(doc, task).values()), None])
        out[f"accuracy_{task}"] = {
            "columns": cols, "rows": rows,
            "note": f"Exact-match accuracy of the worker's greedy answers, mean ± standard deviation over {seeds} "
                    f"seeds, {r['examples_per_length']} examples per length; trained on lengths "
                    f"{r['train_lengths'][0]}-{r['train_lengths'][1]} ({TASKS[task].paper})."
                    + sanity_line(doc, task)}
    out["claims"] = {"columns": ["paper", "claim", "measured here", "verdict"], "rows": doc["claims"],
                     "note": "Verdicts are computed from the tables above (lab/experiments/lengthgen_report.py): "
                             "Kazemnejad agrees when both NoPE and T5 beat both ALiBi and RoPE; Ruoss agrees at half "
                             "the paper's gain or more; both read only the tasks some row answers above chance at "
                             "1x (its right answers, over every seed, would have probability under "
                             f"{SIGNIFICANCE:g} divided by the number of rows from answers each right with the most "
                             "frequent answer's accuracy) and, where the run has them, whose sanity model learned "
                             "them; Golovneva's failure agrees when RoPE keeps less than half its 1x margin over "
                             "chance (the most frequent answer) at 2x-8x on every task it learned (1x >= 0.5), and "
                             "their remedy when CoPE's 2x-8x accuracy is at least 0.1 above RoPE's on every task "
                             "CoPE learned."}
    budget = doc["meta"]["budget"]
    per = f"{budget['steps']} steps" if "steps" in budget else f"{budget['seconds']} s"
    out["run"] = {"columns": ["task", "train lengths", "models", "per model", "train s", "export s", "serve+score s"],
                  "rows": [[t, "{}-{}".format(*r["train_lengths"]), len(r["training"]), per,
                            r["seconds"]["train"], r["seconds"]["export"], r["seconds"]["evaluate"]]
                           for t, r in doc["tasks"].items()],
                  "note": f"{len(doc['rows'])} rows x {seeds} seeds per task, batch {budget['batch']}; "
                          f"{doc['meta']['seconds']} s in all ({doc['meta']['seconds'] / 60:.1f} minutes)"
                          + kept_line(doc) + "."}
    return out


def kept_line(doc: dict) -> str:
    """What the run note says of cells an earlier run made (--resume): their seconds are theirs, not this run's."""
    kept = sum(r.get("kept", 0) for r in doc["tasks"].values())
    made = sorted(set().union(*(r.get("made", []) for r in doc["tasks"].values())))
    where = f" (cells trained {'; '.join(made)})" if made else ""
    return (f"; {kept} of the cells were read back from the cells folder (--resume){where}, and each task's "
            "seconds are its cells' own, across the runs that made them") if kept else ""


def plot(doc: dict, path: Path) -> None:
    """The heatmap: one panel per task, a row per model row, a column per test length, the mean accuracy over seeds
    in each cell.  Drawn from the JSON alone; the same JSON gives the same pixels."""
    # lazy: matplotlib (55 MB) only to draw; the study's other paths never load it
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    tasks, rows = list(doc["tasks"]), doc["rows"]
    ncols = min(4, len(tasks))
    nrows = math.ceil(len(tasks) / ncols)
    with plt.style.context("default"):
        fig, axes = plt.subplots(nrows, ncols, figsize=(2.8 * ncols + 2.0, 0.24 * len(rows) * nrows + 1.4 * nrows),
                                 dpi=100, squeeze=False)
        image = None
        for i, ax in enumerate(axes.flat):
            if i >= len(tasks):
                ax.axis("off")
                continue
            r = doc["tasks"][tasks[i]]
            factors = list(r["lengths"])
            grid = [[r["rows"][row]["factors"][f]["mean"] for f in factors] for row in rows]
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            for y, line in enumerate(grid):
                for x, v in enumerate(line):
                    ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=6,
                            color="black" if v > 0.6 else "white")
            ax.set_xticks(range(len(factors)), [f"{f}x\n{r['lengths'][f]}" for f in factors], fontsize=7)
            ax.set_yticks(range(len(rows)), rows if i % ncols == 0 else [""] * len(rows), fontsize=7)
            ax.set_title(f"{tasks[i]} (trained {r['train_lengths'][0]}-{r['train_lengths'][1]})", fontsize=8)
        fig.colorbar(image, ax=axes, shrink=0.8, label="exact match, mean over seeds")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, metadata={"Software": None}, bbox_inches="tight")
        plt.close(fig)
    tmp.replace(path)

