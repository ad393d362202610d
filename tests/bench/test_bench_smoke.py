
"""`python -m bench run --quick`: every section of make bench runs (a couple of iterations on tiny artifacts), so
none can rot.  No timing is asserted."""

import json

from bench.run import main
from model.variants import REGISTRY


def test_bench_quick_smoke(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    assert main(["--artifacts", str(root), "--model", "alibi", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "latest.json").read_text())
    assert {"forward", "serving", "batching", "generation", "footprint", "machine"} <= set(data)
    engines = {r["engine"] for r in data["forward"]}
    assert "pytorch eager (2 threads)" in engines and "ort ALL + IOBinding" in engines
    assert {r["concurrency"] for r in data["batching"]["predict"]} == {1, 4}
    assert {r["streams"] for r in data["batching"]["generate"]} == {1, 4}
    assert all(r["tokens_per_s"] > 0 for r in data["batching"]["generate"])
    assert [r["batch"] for r in data["batching"]["onnxruntime_per_row"]] == [1, 4]
    assert len(data["footprint"]["models"]) == len(REGISTRY) and data["footprint"]["rss_mb"] > 0
    assert data["footprint"]["rss_when"] == "idle, right after SERVING"
    assert [r["path"] for r in data["serving"]] == ["in-process ort (logits)", "gRPC Predict (no maps)",
                                                    "in-process ort (logits + attentions)", "gRPC Predict (full maps)"]
    predict = data["batching"]["predict"]  # the same prompts at every level, in both modes
    assert len({r["requests"] for r in predict}) == 1 and all(r["rounds"] == 1 for r in predict)
    assert data["generation"]["new_tokens"] == 24
    memory = data["profile_memory"]  # measured on the tiny model itself, not an import of GPT-2 small
    assert memory["model"].startswith("alibi (") and memory["length"] == 16
    plain, profiled = memory["plain"]["peak_mb"], memory["profile"]["peak_mb"]
    assert profiled > 0 and memory["ratio"] == profiled / plain
    md = (tmp_path / "latest.md").read_text()
    assert "Dynamic batching" in md and "Footprint" in md and "idle, right after SERVING" in md
    # the results convention the docs are generated from: meta, and tables of rows as wide as their columns
    assert {"date", "machine", "load", "command"} <= set(data["meta"]) and len(data["meta"]["load"]) == 3
    assert {"targets", "forward", "serving", "batching", "streams", "generation", "footprint"} <= set(data["tables"])
    assert all(len(row) == len(t["columns"]) for t in data["tables"].values() for row in t["rows"])
