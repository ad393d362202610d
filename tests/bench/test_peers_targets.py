"""The peer benchmark's targets are judged within each round, as its ratios are: each measurement of posenc's over
the best peer's in the same round, the median of those (not the ratio of the medians, which pairs figures from
different rounds); `bench peers --rejudge` applies that to a results file without measuring, keeping its
measurements; a missing file is one line and exit 2."""

import json
import subprocess
import sys
from pathlib import Path

from bench.lib.results import meta, write
from bench.peers_targets import targets, worker_memory

ROOT = Path(__file__).resolve().parents[2]

# three rounds, one measurement each; the best peer changes from round to round
POSENC, ORTGENAI, OPENVINO = [10.0, 10.0, 10.0], [8.0, 12.0, 9.0], [11.0, 7.0, 13.0]


def engine(name: str, tps: list[float]) -> dict:
    rounds = {str(s): tps for s in (1, 8, 32)}  # as read back from the JSON: string keys
    return {"engine": name, "tps_1": sorted(tps)[1], "tps_8": sorted(tps)[1], "tps_32": sorted(tps)[1],
            "first_p50_ms_1": 100, "peak_rss_gb": 0.9, "rounds_tps": rounds}


def results() -> dict:
    return {"posenc": engine("posenc worker", POSENC), "ortgenai": engine("onnxruntime-genai", ORTGENAI),
            "openvino": engine("OpenVINO GenAI", OPENVINO)}


def test_a_throughput_target_is_the_median_of_each_rounds_ratio_to_that_rounds_best_peer():
    rows = {r[0]: r for r in targets(results())["rows"]}
    one = rows["1 stream fp32 tok/s >= 1.1x best of onnxruntime-genai / OpenVINO"]
    # by hand: round bests 11, 12, 13 -> 10/11, 10/12, 10/13 -> median 10/12 = 0.83 (the medians' ratio: 10/11 = 0.91)
    assert one[1].startswith("0.83x (posenc worker / the best peer of each round; best median: OpenVINO GenAI)")
    assert one[2] is False
    first = rows["first token fp32 <= 0.9x the best fp32 peer's"]
    assert first[1].startswith("1.00x") and first[2] is False  # first-token times: medians, pooled
    whole = "peak RSS fp32 (32 streams, --batch-tokens 4096: every prompt in one call) <= 1.0 GB"
    assert rows[whole][1:] == [0.9, True]
    default = "peak RSS fp32 (32 streams, the worker's default --batch-tokens) <= 1.0 GB"
    assert rows[default][1:] == ["not measured (python -m bench worker-memory)", None]


def test_the_default_budgets_memory_target_is_read_from_the_worker_memory_results(tmp_path):
    write(tmp_path, "worker_memory", {"meta": meta("python -m bench worker-memory"), "peak_gb": {"256": 1.145,
                                                                                                  "4096": 1.162},
                                      "tables": {}})
    got = worker_memory(tmp_path / "worker_memory.json")
    assert got is not None and got[0] == 1.145
    rows = {r[0]: r for r in targets(results(), memory=got)["rows"]}
    row = rows["peak RSS fp32 (32 streams, the worker's default --batch-tokens) <= 1.0 GB"]
    assert row[1] == f"1.145 (bench.worker_memory, {got[1]})" and row[2] is False
    assert worker_memory(tmp_path / "missing.json") is None
    for peak in (None, 0.0, "x"):  # a file without a measured peak judges nothing
        write(tmp_path, "worker_memory", {"meta": meta("python -m bench worker-memory"), "peak_gb": {"256": peak},
                                          "tables": {}})
        assert worker_memory(tmp_path / "worker_memory.json") is None


def test_without_per_round_figures_the_medians_are_compared():
    out = results()
    for e in out.values():
        del e["rounds_tps"]
    one = targets(out)["rows"][0]
    assert one[1] == "0.91x (posenc worker / OpenVINO GenAI)" and one[2] is False


def test_rejudge_rewrites_the_targets_of_a_results_file_and_nothing_it_measured(tmp_path):
    engines = results()
    stale = {"columns": ["target", "measured", "met"], "rows": [["stale", "0.91x", False]]}
    res = {"meta": {"date": "2026-01-01T00:00:00+00:00", "machine": "x86_64", "load": [1.0, 1.0, 1.0],
                    "load_end": [1.0, 1.0, 1.0], "command": "python -m bench peers --rounds 3"},
           "tables": {"peers": {"columns": ["engine"], "rows": [["posenc worker"]]}, "targets": stale},
           "engines": engines, "unavailable": {}, "accuracy": None}
    (tmp_path / "peers.json").write_text(json.dumps(res))
    done = subprocess.run([sys.executable, "-m", "bench", "peers", "--rejudge", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads((tmp_path / "peers.json").read_text())
    assert got["engines"] == engines and got["tables"]["peers"] == res["tables"]["peers"]
    assert got["tables"]["targets"]["rows"][0][1].startswith("0.83x")
    assert got["meta"]["judged"]["command"].startswith("python -m bench peers --rejudge")
    assert "judged again by `python -m bench peers --rejudge" in (tmp_path / "peers.md").read_text()

    missing = subprocess.run([sys.executable, "-m", "bench", "peers", "--rejudge", "--out", str(tmp_path / "none")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "peers.json" in missing.stderr
