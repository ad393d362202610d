"""make lengthgen's harness, end to end on a tiny configuration through a real worker (its sanity models and their
verdicts included), and a sanity model that must learn a task in distribution (so a broken task, scorer or serving
path cannot hide behind "nothing generalizes")."""

import dataclasses
import json
import re
import shutil

import numpy as np
import pytest
import torch
from matplotlib import image

from export.__main__ import export_main
from lab import tasks
from lab.experiments.lengthgen import FACTORS, PLOT, RESULTS, SANITY, SANITY_ROW, main
from lab.experiments.lengthgen_models import (
    EVAL_SEED,
    INIT_STD,
    LR,
    config_for,
    context_of,
    eval_set,
    examples_sha256,
    greedy,
    model_name,
    rows,
    served_answers,
    train_batch,
    train_one,
)
from lab.experiments.lengthgen_report import (
    SANITY_THRESHOLD,
    UNLEARNED,
    above_chance,
    binomial_tail,
    claims,
    majority,
    tables,
)
from lab.tasks import answer_of, examples, score
from model import checkpoint
from model.variants import REGISTRY
from service.server import Server
from service.settings import Settings

ROWS, TASKS = ["rope", "t5+random"], ["copy", "selective_copy"]


def serving(folder):
    return Server(Settings(model_dir=folder, host="127.0.0.1", port=0, threads=1, metrics_port=-1,
                           http_port=-1)).start()


def test_the_harness_end_to_end_serves_what_pytorch_answers(tmp_path, monkeypatch):
    out = tmp_path / "lengthgen.json"
    work = tmp_path / "work"
    argv = ["--tasks", ",".join(TASKS), "--variants", ",".join(ROWS), "--seeds", "0", "--steps", "6",
            "--batch", "4", "--examples", "3", "--work", str(work), "--out", str(out),
            "--plot", str(tmp_path / "lengthgen.png"), "--sanity-steps", "3", "--sanity-batch", "2",
            "--sanity-examples", "3"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert {"date", "machine", "load", "seconds", "budget", "command"} <= set(doc["meta"])
    assert doc["meta"]["budget"] == {"steps": 6, "batch": 4, "per": "model"}
    assert doc["rows"] == ROWS and list(doc["tasks"]) == TASKS and doc["seeds"] == [0]
    assert [c[0] for c in doc["claims"]] == ["Kazemnejad et al. 2023", "Ruoss et al. 2023", "Golovneva et al. 2024",
                                            "Golovneva et al. 2024"]
    assert {f"accuracy_{t}" for t in TASKS} | {"claims", "run", "sanity"} == set(doc["tables"])
    assert (tmp_path / "lengthgen.png").stat().st_size > 0
    for task in TASKS:
        r = doc["tasks"][task]
        assert r["lengths"] == {str(f): n for f, n in zip(FACTORS, tasks.test_lengths(task), strict=False)}
        assert r["training"]["t5-random-s0"]["random_positions"] == r["context"] > 8 * r["train_lengths"][1]
        for name in ("rope-s0", "t5-random-s0"):  # trained at the train lengths' context, not the test's positions
            summary = r["training"][name]
            assert summary["context"] == r["trained_context"] < r["context"]
            assert summary["longest_trained"] <= r["trained_context"]  # copy and selective copy: one size per length
            served = json.loads((work / "artifacts" / task / name / "model.json").read_text())
            assert served["trained_context"] == r["trained_context"]
        tests = eval_set(task, 3)
        for row in ROWS:
            cells = r["rows"][row]
            assert set(cells["factors"]) == {"1", "2", "4", "8"} and set(cells["seeds"]) == {"0"}
            model, _ = checkpoint.load(tmp_path / "work" / "checkpoints" / task / model_name(row, 0))
            for f, exs in tests.items():  # the worker's accuracy is PyTorch's greedy accuracy on the same examples
                inproc = sum(score(e, greedy(model, e.prompt, e.max_new_tokens)) for e in exs) / len(exs)
                assert cells["seeds"]["0"][str(f)] == inproc, (task, row, f)
    # scoring stops a continuation at its first wrong character (the call cancelled): the served text is PyTorch's
    # greedy text cut just past where it departs from the answer, so its exact match is the same
    model, _ = checkpoint.load(work / "checkpoints" / "copy" / model_name("rope", 0))
    server = serving(work / "artifacts" / "copy")
    try:
        cut = served_answers(f"127.0.0.1:{server.port}", model_name("rope", 0), eval_set("copy", 3), until_wrong=True)
    finally:
        server.stop(grace=1)
    departed = 0
    for f, exs in eval_set("copy", 3).items():
        for e, text in zip(exs, cut[f], strict=True):
            full, right = greedy(model, e.prompt, e.max_new_tokens), e.answer + "\n"
            at = next((i for i, (a, b) in enumerate(zip(full, right, strict=False)) if a != b), None)
            if at is None:
                assert answer_of(text) == answer_of(full), (f, e.prompt)
            else:
                assert text == full[:at + 1] and score(e, text) == score(e, full) == 0, (f, text, full)
                departed += len(full) > at + 1
    assert departed > 0  # six steps of training leave answers wrong early on, and generation stopped there

    sanity = doc["sanity"]
    assert list(sanity["tasks"]) == TASKS and sanity["row"] == SANITY_ROW and sanity["threshold"] == SANITY_THRESHOLD
    for task, entry in sanity["tasks"].items():
        assert entry["budget"] == {**SANITY[task], "steps": 3, "batch": 2} and entry["steps"] == 3
        model, _ = checkpoint.load(work / "sanity" / "checkpoints" / task / model_name(SANITY_ROW, 0))
        # a task's own init std (copy's 0.02) or the study's: the Linear weights, three tiny steps on, are drawn at it
        std = SANITY[task].get("init_std", INIT_STD)
        first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).weight
        assert entry["init_std"] == std and abs(first.std().item() / std - 1) < 0.1
        exs = eval_set(task, 3, (1,))[1]  # the served 1x accuracy is PyTorch's on the same examples
        assert entry["accuracy"] == sum(score(e, greedy(model, e.prompt, e.max_new_tokens)) for e in exs) / 3
        # three steps of two examples learn nothing: flagged in the JSON, and on the page beside the task's table
        assert not entry["learned"] and entry["verdict"] == UNLEARNED and entry["accuracy"] < SANITY_THRESHOLD
        assert UNLEARNED in doc["tables"][f"accuracy_{task}"]["note"]
    assert sanity["unlearned"] == TASKS and [r[-1] for r in doc["tables"]["sanity"]["rows"]] == [UNLEARNED] * 2
    at = json.loads(json.dumps(doc))  # the verdict turns at the threshold, read from the figures
    at["sanity"]["tasks"]["copy"]["accuracy"] = SANITY_THRESHOLD
    assert [r[-1] for r in tables(at)["sanity"]["rows"]] == ["learned", UNLEARNED]
    assert "learned." in tables(at)["accuracy_copy"]["note"] and UNLEARNED not in tables(at)["accuracy_copy"]["note"]

    # --resume reads every cell back that was made under the same key: only a cell whose file is gone trains again
    stamps = {(t, r): (work / "checkpoints" / t / model_name(r, 0) / "model.safetensors").stat().st_mtime_ns
              for t in TASKS for r in ROWS}
    (work / "cells" / "copy" / "rope-s0.json").unlink()
    unscored = work / "cells" / "selective_copy" / "t5-random-s0.json"  # exported, not yet scored: scored alone
    unscored.write_text(json.dumps({k: v for k, v in json.loads(unscored.read_text()).items() if k != "scores"}))
    assert main([*argv, "--resume", "--no-sanity"]) == 0
    again = json.loads(out.read_text())
    assert [again["tasks"][t]["kept"] for t in TASKS] == [1, 2]  # copy's rope cell retrained; the rest read back
    assert "3 of the cells were read back from the cells folder" in again["tables"]["run"]["note"]
    for (task, row), stamp in stamps.items():
        retrained = (task, row) == ("copy", "rope")
        assert ((work / "checkpoints" / task / model_name(row, 0) / "model.safetensors").stat().st_mtime_ns
                != stamp) == retrained, (task, row)
        if not retrained:
            assert again["tasks"][task]["rows"][row] == doc["tasks"][task]["rows"][row]
            name = model_name(row, 0)
            assert again["tasks"][task]["training"][name] == doc["tasks"][task]["training"][name]
    # scored cells need no model: another machine's run (another --work, the cells given by --cells) reads them back
    # and says when and where they were trained; an unscored cell is kept only with the artifact it was exported to
    for path in (work / "cells").rglob("*.json"):
        path.write_text(json.dumps({**json.loads(path.read_text()),
                                    "made": {"date": "2000-01-01T00:00:00+00:00", "machine": "elsewhere"}}))
    unscored = work / "cells" / "copy" / "rope-s0.json"
    unscored.write_text(json.dumps({k: v for k, v in json.loads(unscored.read_text()).items() if k != "scores"}))
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "artifacts" / "copy").mkdir(parents=True)  # another model under the unscored cell's name
    shutil.copytree(work / "artifacts" / "copy" / "t5-random-s0", elsewhere / "artifacts" / "copy" / "rope-s0")
    assert main([*argv[:argv.index("--work")], "--work", str(elsewhere), *argv[argv.index("--work") + 2:],
                 "--cells", str(work / "cells"), "--resume", "--no-sanity"]) == 0
    moved = json.loads(out.read_text())
    assert [moved["tasks"][t]["kept"] for t in TASKS] == [1, 2]
    assert [p.name for p in (elsewhere / "checkpoints").glob("*/*")] == ["rope-s0"]  # retrained, and alone
    assert moved["tasks"]["selective_copy"] == {**again["tasks"]["selective_copy"], "made": ["2000-01-01, elsewhere"]}
    assert moved["tasks"]["copy"]["made"] == ["2000-01-01, elsewhere"]  # the read-back cells' alone
    assert "(cells trained 2000-01-01, elsewhere)" in moved["tables"]["run"]["note"]
    cell = json.loads(unscored.read_text())
    assert cell["made"]["date"][:10] == moved["meta"]["date"][:10] and "scores" in cell
    # another budget is another key: every cell trains again under it
    assert main([*argv[:argv.index("--steps")], "--steps", "7", *argv[argv.index("--steps") + 2:], "--resume",
                 "--no-sanity"]) == 0
    doc = json.loads(out.read_text())
    assert {s["steps"] for r in doc["tasks"].values() for s in r["training"].values()} == {7}
    # and a task whose generator changed is another key: its cells train again, another task's are read back
    monkeypatch.setitem(tasks.TASKS, "copy", dataclasses.replace(tasks.TASKS["copy"], generate=tasks.reverse))
    seven = [*argv[:argv.index("--steps")], "--steps", "7", *argv[argv.index("--steps") + 2:]]
    assert main([*seven[:seven.index("--variants")], "--variants", "rope", *seven[seven.index("--variants") + 2:],
                 "--resume", "--no-sanity"]) == 0
    doc = json.loads(out.read_text())
    assert [doc["tasks"][t]["kept"] for t in TASKS] == [0, 1]
    monkeypatch.undo()

    # --sanity-only puts a new sanity section into the file and leaves the study's results and metadata as they were;
    # another number of steps drops a task's curriculum (MQAR's), which is for its own budget
    assert main(["--sanity-only", "--tasks", "copy,mqar", "--sanity-steps", "2", "--sanity-batch", "2",
                 "--sanity-examples", "2", "--work", str(work), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert {k: v for k, v in merged.items() if k not in ("sanity", "tables")} == \
        {k: v for k, v in doc.items() if k not in ("sanity", "tables")}
    assert list(merged["sanity"]["tasks"]) == ["copy", "mqar"]
    assert [merged["sanity"]["tasks"][t]["steps"] for t in ("copy", "mqar")] == [2, 2]
    assert "curriculum" in SANITY["mqar"] and merged["sanity"]["tasks"]["mqar"]["budget"] == {"steps": 2, "batch": 2}
    assert "--sanity-only" in merged["sanity"]["meta"]["command"] and merged["tables"] == tables(merged)
    assert "No sanity model" in merged["tables"]["accuracy_selective_copy"]["note"]
    # and read back with --resume: the same model's figures, the note saying where they come from
    assert main(["--sanity-only", "--tasks", "copy,mqar", "--sanity-steps", "2", "--sanity-batch", "2",
                 "--sanity-examples", "2", "--work", str(work), "--out", str(out), "--resume"]) == 0
    kept = json.loads(out.read_text())["sanity"]
    assert kept["tasks"] == merged["sanity"]["tasks"] and kept["kept"] == 2
    assert "2 of the models were read back from their cells (--resume), trained " in tables(
        json.loads(out.read_text()))["sanity"]["note"]


def test_a_cells_examples_digest_sees_a_generator_change_at_one_short_train_length(monkeypatch):
    """A change that keeps every text and touches one train length alone (copy at two words, the answer's first
    letter moved into the prompt: what is trained and scored, not the bytes) is another digest, so another key."""
    before, short = examples_sha256("copy", eval_set("copy", 3)), examples("copy", 2, 4, 5)

    def moved(rng, length):
        ex = tasks.copy(rng, length)
        return {**ex, "prompt": ex["prompt"] + ex["answer"][0], "answer": ex["answer"][1:]} if length == 2 else ex

    monkeypatch.setitem(tasks.TASKS, "copy", dataclasses.replace(tasks.TASKS["copy"], generate=moved))
    now = examples("copy", 2, 4, 5)
    assert [e.text for e in now] == [e.text for e in short] and now[0].answer != short[0].answer
    assert examples_sha256("copy", eval_set("copy", 3)) != before
    monkeypatch.undo()
    assert examples_sha256("copy", eval_set("copy", 3)) == before


def test_a_bounded_variant_takes_the_test_positions_and_the_others_the_trained_context():
    assert config_for("rope", 900, 100).context == config_for("t5+random", 900, 100).context == 100
    assert config_for("learned", 900, 100).context == config_for("learned+random", 900, 100).context == 900


def test_the_loss_weighs_the_answer_its_terminator_and_the_marks_alone():
    """MQAR's weighted targets are every query's value (the answered ones in the prompt, then the answer) and the
    newline, read here from the batch's text; the pad after the text weighs nothing."""
    x, y, w = train_batch("mqar", 0, 3, (2, 9), batch=6)
    for b in range(6):
        text = bytes(torch.cat([x[b, :1], y[b]]).tolist()).rstrip(b"\0").decode()
        values = re.findall(r"[a-z]{2}([0-9])", text.split(" | ")[1])
        assert bytes(y[b][w[b] > 0].tolist()).decode() == "".join(values) + "\n"
        pairs, keys = text.split(" | ")[0].split(" "), re.findall(r"[a-z]{2}", text.split(" | ")[1])
        assert text.endswith("\n") and len(values) == len(set(keys)) == (len(pairs) + 1) // 2  # half the keys


def test_every_linear_weight_starts_at_the_recipes_std_and_the_summary_says_which():
    """One step at the warm-up's zero learning rate leaves the initial weights: every Linear weight (attention,
    MLP, head and the residual projections alike) is drawn at init_std, not the model's own 0.02."""
    torch.set_num_threads(1)
    for std in (INIT_STD, 0.05):
        model, summary = train_one("flip_flop", "rope", 0, 64, steps=1, train=(2, 4), init_std=std)
        weights = [m.weight.detach().flatten() for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert len(weights) >= 8 and summary["init_std"] == std and summary["lr"] == LR
        assert all(abs(float(w.std()) - std) < 0.15 * std for w in weights), [float(w.std()) for w in weights]


def test_a_curriculum_trains_its_phases_on_the_shorter_lengths_first(monkeypatch):
    """Each phase's steps draw their batches from the train lengths up to its longest (the lengths each step asks for,
    and the examples' own sizes read off the batch's text: MQAR's pairs), the steps after the last phase from every
    train length; the summary names the phases. A phase outside the train lengths, one that leaves no step for every
    length, or one under a budget in seconds is refused."""
    from lab.experiments import lengthgen_models
    torch.set_num_threads(1)
    asked: list[tuple[int, int]] = []
    seen: list[list[int]] = []
    real = lengthgen_models.train_batch

    def counting(task, seed, step, train, batch=16):
        x, y, w = real(task, seed, step, train, batch)
        asked.append(tuple(train))
        seen.append([len(bytes(torch.cat([x[b, :1], y[b]]).tolist()).rstrip(b"\0").decode().split(" | ")[0].split())
                     for b in range(x.shape[0])])
        return x, y, w

    monkeypatch.setattr(lengthgen_models, "train_batch", counting)
    _, summary = train_one("mqar", "rope", 0, 128, steps=12, batch=8, train=(1, 12), curriculum=[[2, 4], [5, 3]])
    assert summary["curriculum"] == [[2, 4], [5, 3]]
    assert asked == [(1, 2)] * 4 + [(1, 5)] * 3 + [(1, 12)] * 5
    assert all(max(pairs) <= longest for pairs, (_, longest) in zip(seen, asked, strict=True))
    assert max(p for pairs in seen[7:] for p in pairs) > 5  # the last steps reach past the phases' lengths
    for bad, kw in (([[13, 4]], {"steps": 12}), ([[2, 12]], {"steps": 12}), ([[2, 4]], {"seconds": 1.0})):
        with pytest.raises(ValueError, match="curriculum"):
            train_one("mqar", "rope", 0, 128, batch=2, train=(1, 12), curriculum=bad, **kw)


def test_a_tail_trains_on_at_its_constant_rate_once_the_schedule_has_decayed(monkeypatch):
    """The rate each optimizer step ran at: the budget's steps under the warmup and cosine (down to a tenth of LR, as
    the docstring defines it), then the tail's steps at its constant rate, on every train length; the summary counts
    and names them. A tail without steps, above LR, or under a budget in seconds is refused."""
    from lab.experiments import lengthgen_models
    torch.set_num_threads(1)
    rates: list[float] = []
    asked: list[tuple[int, int]] = []
    real_batch, real_adamw = lengthgen_models.train_batch, torch.optim.AdamW

    class Recorded(real_adamw):
        def step(self, closure=None):
            rates.append(self.param_groups[0]["lr"])
            return super().step(closure)

    def recorded_batch(task, seed, step, train, batch=16):
        asked.append(tuple(train))
        return real_batch(task, seed, step, train, batch)

    monkeypatch.setattr(torch.optim, "AdamW", Recorded)
    monkeypatch.setattr(lengthgen_models, "train_batch", recorded_batch)
    _, summary = train_one("mqar", "rope", 0, 128, steps=20, batch=4, train=(1, 12), curriculum=[[2, 5]],
                           tail=(6, 1e-3))
    assert summary["steps"] == 26 and summary["tail"] == [6, 1e-3] and len(rates) == 26
    # the schedule: from the peak after the warmup's step down to just over a tenth of LR, never rising
    assert rates[0] < rates[1] == pytest.approx(LR, rel=0.01) and LR / 10 < rates[19] < 0.12 * LR
    assert all(a >= b for a, b in zip(rates[1:20], rates[2:20], strict=False))
    assert rates[20:] == [1e-3] * 6
    assert asked == [(1, 2)] * 5 + [(1, 12)] * 21
    for bad, kw in (((0, 1e-3), {"steps": 4}), ((3, 2 * LR), {"steps": 4}), ((3, 1e-3), {"seconds": 1.0}),
                    ((3, 1e-3), {})):
        with pytest.raises(ValueError, match="tail"):
            train_one("mqar", "rope", 0, 128, batch=2, train=(1, 12), tail=bad, **kw)


def test_every_task_has_a_sanity_budget():
    assert set(SANITY) == set(tasks.TASKS) and all(b["steps"] > 0 and b["batch"] > 0 for b in SANITY.values())


def test_a_sanity_model_learns_flip_flop_in_distribution_and_the_worker_answers_as_pytorch(tmp_path):
    torch.set_num_threads(1)
    exs = {n: examples("flip_flop", n, 8, seed=5) for n in range(2, 9)}
    model, summary = train_one("flip_flop", "rope", 0, context_of(exs), steps=400, train=(2, 8))
    folder = tmp_path / "checkpoints" / "rope-s0"
    checkpoint.save(model, folder, summary)
    assert export_main(["--checkpoint", str(folder), "--out", str(tmp_path / "artifacts" / "rope-s0"),
                        "--interventions", "off"]) == 0
    server = serving(tmp_path / "artifacts")
    try:
        served = served_answers(f"127.0.0.1:{server.port}", "rope-s0", exs)
    finally:
        server.stop(grace=1)
    inproc = {n: [greedy(model, e.prompt, e.max_new_tokens) for e in es] for n, es in exs.items()}
    assert {n: [answer_of(t) for t in ts] for n, ts in served.items()} == \
        {n: [answer_of(t) for t in ts] for n, ts in inproc.items()}
    scores = [score(e, t) for n, es in exs.items() for e, t in zip(es, served[n], strict=True)]
    assert sum(scores) / len(scores) >= 0.9, f"in-distribution accuracy {sum(scores) / len(scores):.2f}"


def test_the_rows_are_the_registry_and_its_randomizable_variants():
    every = rows()
    assert every[:len(REGISTRY)] == list(REGISTRY)
    assert every[len(REGISTRY):] == [f"{v}+random" for v in REGISTRY if v not in ("cpe", "cope", "fox", "path", "none")]


def test_the_committed_tables_and_picture_are_drawn_from_the_committed_measurements(tmp_path):
    src, png = tmp_path / "lengthgen.json", tmp_path / "lengthgen.png"
    committed = json.loads(RESULTS.read_text())
    src.write_text(json.dumps({**committed, "tables": {}, "claims": []}))
    assert main(["--report-only", "--out", str(src), "--plot", str(png)]) == 0
    redone = json.loads(src.read_text())
    assert redone["tables"] == committed["tables"] and redone["claims"] == committed["claims"]
    drawn, kept = image.imread(png), image.imread(PLOT)
    assert drawn.shape == kept.shape and np.array_equal(drawn, kept)


def test_the_committed_results_are_the_committed_cells():
    """bench/results/lengthgen-cells holds the committed run's cells: each task's every (row, seed) is there, made
    under the run's budget and examples, and the JSON's per-seed accuracies are those cells' scores, its means their
    mean (so a later run that resumes from the cells starts from what the page shows)."""
    committed = json.loads(RESULTS.read_text())
    cells_root = RESULTS.parent / "lengthgen-cells"
    budget = {k: v for k, v in committed["meta"]["budget"].items() if k != "per"}
    for task, result in committed["tasks"].items():
        digest = examples_sha256(task, eval_set(task, result["examples_per_length"]))
        for row, entry in result["rows"].items():
            for seed in committed["seeds"]:
                cell = json.loads((cells_root / task / f"{model_name(row, seed)}.json").read_text())
                assert cell["key"]["budget"] == budget and cell["key"]["examples"] == result["examples_per_length"]
                assert (cell["key"]["task"], cell["key"]["row"], cell["key"]["seed"]) == (task, row, seed)
                assert cell["key"]["examples_sha256"] == digest  # made from the task as lab/tasks.py writes it now
                assert cell["key"]["init_std"] == cell["training"]["init_std"] == INIT_STD
                assert entry["seeds"][str(seed)] == cell["scores"], (task, row, seed)
            for f, summary in entry["factors"].items():
                mean = np.mean([entry["seeds"][str(s)][f] for s in committed["seeds"]])
                assert abs(summary["mean"] - mean) < 1e-4, (task, row, f)
    sanity = committed["sanity"]
    for task, entry in sanity["tasks"].items():  # and the sanity models' figures are their cells'
        cell = json.loads((cells_root / "sanity" / task / f"{model_name(SANITY_ROW, sanity['seed'])}.json").read_text())
        assert cell["key"]["examples_sha256"] == examples_sha256(task, eval_set(task, sanity["examples"], (1,)))
        assert cell["key"]["budget"] == entry["budget"] and abs(cell["scores"]["1"] - entry["accuracy"]) < 1e-4, task
        assert cell["key"]["init_std"] == cell["training"]["init_std"] == SANITY[task].get("init_std", INIT_STD)


def measured(rows: dict[str, dict[str, list[float]]]) -> dict:
    """A results document with the given accuracies: {task: {row: [1x, 2x, 4x, 8x]}}, on the study's test lengths
    and examples (24 per length) and three seeds, whose most frequent answers are each task's chance."""
    return {"rows": sorted({r for t in rows.values() for r in t}), "eval_seed": EVAL_SEED, "seeds": [0, 1, 2],
            "tasks": {t: {"lengths": dict(zip(("1", "2", "4", "8"), tasks.test_lengths(t), strict=False)),
                          "examples_per_length": 24,
                          "rows": {r: {"factors": {f: {"mean": a} for f, a in
                                                   zip(("1", "2", "4", "8"), accs, strict=True)}}
                                   for r, accs in by_row.items()}} for t, by_row in rows.items()}}


def test_the_golovneva_verdicts_follow_the_papers_two_claims():
    """RoPE fails past the trained length on counting, selective copy and flip-flop, and CoPE does not: each verdict
    read off accuracies made up for the purpose, as the paper's tables would read."""
    def verdicts(rows):
        return [c[3] for c in claims(measured(rows)) if c[0] == "Golovneva et al. 2024"]

    # the paper's picture: RoPE right in distribution and wrong past it, CoPE right at every length
    paper = {"counting": {"rope": [1.0, 0.2, 0.1, 0.0], "cope": [1.0, 0.9, 0.8, 0.7]},
             "flip_flop": {"rope": [1.0, 0.3, 0.2, 0.1], "cope": [1.0, 1.0, 0.9, 0.9]}}
    assert verdicts(paper) == ["agrees", "agrees"]
    # RoPE holds on one task; CoPE no better than RoPE on the other
    mixed = {"counting": {"rope": [1.0, 0.2, 0.1, 0.0], "cope": [1.0, 0.9, 0.8, 0.7]},
             "flip_flop": {"rope": [1.0, 0.9, 0.9, 0.8], "cope": [1.0, 0.9, 0.9, 0.8]}}
    assert verdicts(mixed) == ["partly", "partly"]
    # both hold everywhere: RoPE did not fail, so CoPE is not ahead
    assert verdicts({"counting": {"rope": [0.9, 0.8, 0.8, 0.8], "cope": [0.9, 0.8, 0.8, 0.8]}}) == \
        ["disagrees", "disagrees"]
    # nothing learned in distribution says nothing; a missing row or task is not measured
    assert verdicts({"counting": {"rope": [0.2, 0.1, 0.1, 0.1], "cope": [0.3, 0.1, 0.1, 0.1]}}) == \
        ["inconclusive (rope did not learn the tasks in distribution)",
         "inconclusive (cope did not learn the tasks in distribution)"]
    assert verdicts({"counting": {"rope": [1.0, 0.2, 0.1, 0.0]}}) == ["agrees", "–"]
    # a one-bit answer: RoPE falling to the most frequent answer past 1x fails, though that keeps over half its 1x
    base = [majority("flip_flop", n, 24, EVAL_SEED) for n in tasks.test_lengths("flip_flop")[:4]]
    assert min(base) > 0.45  # flip-flop's chance is about one half
    assert verdicts({"flip_flop": {"rope": [0.9, *base[1:]]}}) == ["agrees", "–"]
    assert verdicts({"flip_flop": {"rope": [0.9, *(b + 0.2 for b in base[1:])]}}) == ["disagrees", "–"]
    assert verdicts({"copy": {"rope": [1.0, 0.2, 0.1, 0.0], "cope": [1.0, 0.9, 0.8, 0.7]}}) == ["–", "–"]


def test_kazemnejad_and_ruoss_read_only_the_tasks_some_row_learned():
    """A task no row answers above chance at 1x (every answer wrong) says nothing about length: Kazemnejad's ordering
    and Ruoss's gain are read from the learned tasks alone, and neither has a verdict when none is learned."""
    def claim(rows, paper):
        return next(c for c in claims(measured(rows)) if c[0] == paper)

    zero = [0.0] * 4
    paper = {"copy": {"none": [1.0, 0.8, 0.6, 0.5], "t5": [1.0, 0.7, 0.6, 0.4], "alibi": [1.0, 0.3, 0.2, 0.1],
                      "rope": [1.0, 0.2, 0.1, 0.0]}}
    assert claim(paper, "Kazemnejad et al. 2023")[3] == "agrees"
    unlearned = {"none": zero, "t5": zero, "alibi": zero, "rope": zero}
    kazemnejad = "Kazemnejad et al. 2023"
    alone, both = claim(paper, kazemnejad), claim({**paper, "reverse": unlearned}, kazemnejad)
    assert both[3] == alone[3] and both[2] == alone[2] + \
        " (copy; not reverse, which no row answers above chance in distribution)"
    nothing = claim({"copy": unlearned, "reverse": unlearned}, "Kazemnejad et al. 2023")
    assert nothing[3] == "–" and nothing[2].startswith("inconclusive (not learned: copy or reverse, which no row")
    assert claim({"copy": {"rope": zero}}, "Kazemnejad et al. 2023")[2].startswith("not measured")  # rows missing

    gain = {"counting": {"rope": [1.0, 0.2, 0.2, 0.2], "rope+random": [1.0, 0.5, 0.5, 0.5]}}
    ruoss = claim({**gain, "selective_copy": {"rope": zero, "rope+random": zero}}, "Ruoss et al. 2023")
    assert ruoss[3] == "agrees" and ruoss[2].startswith("+30.0 points on average over 1 variants and 1 task")
    assert "not selective copy" in ruoss[2]
    assert claim(gain, "Ruoss et al. 2023")[3] == "agrees"
    # a task whose sanity model did not learn it is left out, however its rows fall about chance
    noisy = measured({**gain, "mqar": {"rope": [0.1, 0.1, 0.1, 0.1], "rope+random": [0.5, 0.1, 0.1, 0.1]}})
    assert claims(noisy)[1][2].startswith("+15.0 points on average over 1 variants and 2 tasks")  # read as learned
    flagged = {**noisy, "sanity": {"unlearned": ["mqar"]}}
    assert claims(flagged)[1][2].startswith("+30.0 points on average over 1 variants and 1 task")
    assert "not mqar, which no row answers above chance in distribution or its sanity model did not learn" in \
        claims(flagged)[1][2]
    assert claim({"selective_copy": {"rope": zero, "rope+random": zero}}, "Ruoss et al. 2023")[3] == "–"


def test_above_chance_is_beyond_luck_among_the_rows_read():
    """The binomial tail against values known in closed form and against draws; a row a few answers above the most
    frequent answer's line is luck among 39 rows, one far above it is not, and a claim reads the task then alone."""
    assert binomial_tail(10, 10, 0.5) == pytest.approx(1 / 1024)
    assert binomial_tail(9, 10, 0.5) == pytest.approx(11 / 1024)
    assert binomial_tail(1, 72, 0.17) == pytest.approx(1 - 0.83 ** 72)
    assert binomial_tail(0, 72, 0.17) == pytest.approx(1.0)
    draws = np.random.default_rng(0).binomial(72, 0.17, size=400_000)
    assert binomial_tail(20, 72, 0.17) == pytest.approx(float((draws >= 20).mean()), abs=2e-3)
    many = np.random.default_rng(1).binomial(5000, 0.2, size=400_000)  # large runs: no overflow, the same tail
    assert binomial_tail(1030, 5000, 0.2) == pytest.approx(float((many >= 1030).mean()), abs=2e-3)
    line = majority("mqar", tasks.test_lengths("mqar")[0], 24, EVAL_SEED)
    rows = {f"r{i}": [line, line, line, line] for i in range(37)}
    lucky = measured({"mqar": {**rows, "rope": [line + 3 / 72] * 4, "rope+random": [line] * 4}})
    assert not above_chance(lucky, "mqar", "rope")  # three answers more than the constant answer's, of 72
    right = measured({"mqar": {**rows, "rope": [line + 0.3] * 4, "rope+random": [line] * 4}})
    assert above_chance(right, "mqar", "rope") and not above_chance(right, "mqar", "r0")
    # ten answers over the line: beyond luck for the better of two rows, not for the best of 39
    ten = [line + 10 / 72] * 4
    assert not above_chance(measured({"mqar": {**rows, "rope": ten, "rope+random": [line] * 4}}), "mqar", "rope")
    assert above_chance(measured({"mqar": {"rope": ten, "rope+random": [line] * 4}}), "mqar", "rope")
    gain = {"counting": {"rope": [1.0, 0.2, 0.2, 0.2], "rope+random": [1.0, 0.5, 0.5, 0.5]}}
    noisy = measured({**gain, "mqar": {"rope": [line + 2 / 72] * 4, "rope+random": [line] * 4}})
    ruoss = next(c for c in claims(noisy) if c[0] == "Ruoss et al. 2023")
    assert ruoss[2].startswith("+30.0 points on average over 1 variants and 1 task") and "not mqar" in ruoss[2]


def test_a_run_stopped_after_a_cell_leaves_it_scored(tmp_path, monkeypatch):
    """Each cell is scored as soon as its model is exported, so a run stopped at its second model leaves the first
    cell complete: scored, and read back by a run elsewhere without any model."""
    from lab.experiments import lengthgen

    trained = []

    def stop_at_the_second(*args, **kwargs):
        if trained:
            raise KeyboardInterrupt  # the run is stopped here
        trained.append(args[:3])
        return train_one(*args, **kwargs)

    monkeypatch.setattr(lengthgen, "train_one", stop_at_the_second)
    argv = ["--tasks", "copy", "--variants", ",".join(ROWS), "--seeds", "0", "--steps", "2", "--batch", "2",
            "--examples", "2", "--cells", str(tmp_path / "cells"), "--out", str(tmp_path / "lengthgen.json"),
            "--plot", str(tmp_path / "lengthgen.png"), "--no-sanity", "--resume"]
    try:
        main([*argv, "--work", str(tmp_path / "here")])
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the run was not stopped")
    first = json.loads((tmp_path / "cells" / "copy" / "rope-s0.json").read_text())
    assert trained == [("copy", "rope", 0)] and set(first["scores"]) == {"1", "2", "4", "8"}
    assert not (tmp_path / "cells" / "copy" / "t5-random-s0.json").exists()
    monkeypatch.setattr(lengthgen, "train_one", train_one)
    assert main([*argv, "--work", str(tmp_path / "there")]) == 0  # another machine: the first cell read back
    doc = json.loads((tmp_path / "lengthgen.json").read_text())
    assert doc["tasks"]["copy"]["kept"] == 1 and doc["tasks"]["copy"]["rows"]["rope"]["seeds"]["0"] == first["scores"]
