"""make lengthgen's harness, end to end on a tiny configuration through a real worker, and a sanity model that must
learn a task in distribution (so a broken task, scorer or serving path cannot hide behind "nothing generalizes")."""

import json

import numpy as np
import torch
from matplotlib import image

from export.__main__ import export_main
from lab import tasks
from lab.experiments.lengthgen import (
    FACTORS,
    PLOT,
    RESULTS,
    context_of,
    eval_set,
    greedy,
    main,
    model_name,
    rows,
    served_answers,
    train_one,
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


def test_the_harness_end_to_end_serves_what_pytorch_answers(tmp_path):
    out = tmp_path / "lengthgen.json"
    argv = ["--tasks", ",".join(TASKS), "--variants", ",".join(ROWS), "--seeds", "0", "--steps", "6",
            "--batch", "4", "--examples", "3", "--work", str(tmp_path / "work"), "--out", str(out),
            "--plot", str(tmp_path / "lengthgen.png")]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert {"date", "machine", "load", "seconds", "budget", "command"} <= set(doc["meta"])
    assert doc["meta"]["budget"] == {"steps": 6, "batch": 4, "per": "model"}
    assert doc["rows"] == ROWS and list(doc["tasks"]) == TASKS and doc["seeds"] == [0]
    assert [c[0] for c in doc["claims"]] == ["Kazemnejad et al. 2023", "Ruoss et al. 2023", "Golovneva et al. 2024"]
    assert {f"accuracy_{t}" for t in TASKS} | {"claims", "run"} == set(doc["tables"])
    assert (tmp_path / "lengthgen.png").stat().st_size > 0
    for task in TASKS:
        r = doc["tasks"][task]
        assert r["lengths"] == {str(f): n for f, n in zip(FACTORS, tasks.test_lengths(task), strict=False)}
        assert r["training"]["t5-random-s0"]["random_positions"] == r["context"] > 8 * r["train_lengths"][1]
        tests = eval_set(task, 3)
        for row in ROWS:
            cells = r["rows"][row]
            assert set(cells["factors"]) == {"1", "2", "4", "8"} and set(cells["seeds"]) == {"0"}
            model, _ = checkpoint.load(tmp_path / "work" / "checkpoints" / task / model_name(row, 0))
            for f, exs in tests.items():  # the worker's accuracy is PyTorch's greedy accuracy on the same examples
                inproc = sum(score(e, greedy(model, e.prompt, e.max_new_tokens)) for e in exs) / len(exs)
                assert cells["seeds"]["0"][str(f)] == inproc, (task, row, f)


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
    assert every[len(REGISTRY):] == [f"{v}+random" for v in REGISTRY if v not in ("cpe", "cope", "none")]


def test_the_committed_tables_and_picture_are_drawn_from_the_committed_measurements(tmp_path):
    src, png = tmp_path / "lengthgen.json", tmp_path / "lengthgen.png"
    committed = json.loads(RESULTS.read_text())
    src.write_text(json.dumps({**committed, "tables": {}, "claims": []}))
    assert main(["--report-only", "--out", str(src), "--plot", str(png)]) == 0
    redone = json.loads(src.read_text())
    assert redone["tables"] == committed["tables"] and redone["claims"] == committed["claims"]
    drawn, kept = image.imread(png), image.imread(PLOT)
    assert drawn.shape == kept.shape and np.array_equal(drawn, kept)
