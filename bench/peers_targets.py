"""bench/peers.py's ratio and targets tables: posenc against the peers of its own precision, each judged on one run.

fp32 rows are compared with every fp32 peer; an int8 row with every 8-bit peer (onnxruntime-genai int8, OpenVINO int8
weights, llama.cpp q8_0); the int4 row with the 4-bit ones (onnxruntime-genai int4, llama.cpp Q4_K_M).  Where
bench/peers_accuracy.py scored the forms on the trained model, the int8 target states posenc's accuracy beside it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from export.quantize import DEFAULT_BUDGET

ROOT = Path(__file__).resolve().parent.parent
STREAMS = (1, 8, 32)
INT8 = ("posenc-int8", "posenc-int8-dynamic")  # both int8 methods within the budget; the int8 target takes the faster
METHOD = {"posenc-int8": "int8", "posenc-int8-dynamic": "dynamic", "posenc-int4": "int4"}
FP32_PEERS = ("ortgenai", "openvino", "vllm", "llamacpp")
PEERS_8BIT = ("ortgenai-int8", "openvino-int8", "llamacpp-q8")
PEERS_4BIT = ("ortgenai-int4", "llamacpp-q4km")


def peers_of(mine: str) -> tuple[str, ...]:
    if mine == "ortgenai-posenc-graph":  # the graphs under one loop: posenc's fast graph over onnxruntime-genai's
        return ("ortgenai",)
    if mine == "posenc":  # and the loops over one graph: the worker over onnxruntime-genai's Generator
        return (*FP32_PEERS, "ortgenai-posenc-graph")
    if mine == "posenc-openvino":  # beside the worker's own cpu provider too
        return ("posenc", *FP32_PEERS)
    if mine == "posenc-int8-openvino":
        return ("posenc-int8", *PEERS_8BIT)
    if mine in INT8:
        return PEERS_8BIT
    return PEERS_4BIT if mine == "posenc-int4" else FP32_PEERS


def ratio_rows(engines: dict, stats: dict) -> list[list]:
    """posenc's tokens/s over each peer of its precision: the median of per-round ratios, per stream count."""
    rows = []
    for mine in ("posenc", "posenc-inproc", "ortgenai-posenc-graph", "posenc-openvino", *INT8, "posenc-int8-openvino",
                 "posenc-int4"):
        if mine not in stats:
            continue
        for key in peers_of(mine):
            if key not in stats:
                continue
            pairs = {s: zip(stats[mine][s]["tps"], stats[key][s]["tps"], strict=True) for s in STREAMS}
            rows.append([engines[mine].name, engines[key].name]
                        + [f"{statistics.median(a / b for a, b in pairs[s]):.2f}x" for s in STREAMS])
    return rows


def quant_budget(path: Path = ROOT / "bench" / "results" / "peers_quant.json") -> dict | None:
    """The int8 accuracy budget as bench/peers_quant.py last measured it on a model trained here: {method: (rows
    within budget, rows, date)}; None when it has not been run."""
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    t = res["tables"]["budget"]
    col = {c: i for i, c in enumerate(t["columns"])}
    out: dict = {}
    for row in t["rows"]:
        ok, n, _ = out.get(row[col["method"]], (0, 0, None))
        out[row[col["method"]]] = (ok + bool(row[col["within"]]), n + 1, res["meta"]["date"])
    return out


def worker_memory(path: Path = ROOT / "bench" / "results" / "worker_memory.json") -> tuple[float, str] | None:
    """The worker's peak RSS in GB at 32 streams and its default token budget, as bench/worker_memory.py last
    measured it, and when; None when it has not been run."""
    try:
        res = json.loads(path.read_text())
        gb = float(res["peak_gb"]["256"])
        return (gb, str(res["meta"]["date"])) if gb > 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def rounds_of(out: dict, key: str, streams: int) -> list[float] | None:
    """key's tokens/s at `streams`, one figure per measurement in run order (keys are ints in process, strings
    once read back from the JSON); None when the results hold no per-round figures."""
    per = out.get(key, {}).get("rounds_tps") or {}
    got = per.get(streams, per.get(str(streams)))
    return got or None


def _ratio_row(out: dict, what: str, mine: str | None, peers: tuple[str, ...], field: str, want: float,
               lower: bool = False) -> list:
    """A target row: mine's figure over the best peer's (lower is better for `lower` fields).  Tokens/s are judged
    within each round, as the ratios table is: each measurement of mine over the best peer's in the same round, the
    median of those; the peer named is the one with the best median.  First-token times, pooled over the rounds, are
    compared as medians."""
    got = [(out[k][field], k) for k in peers if out.get(k, {}).get(field)]
    if not mine or not out.get(mine, {}).get(field) or not got:
        return [what, None, None]
    best, key = (min if lower else max)(got)
    r = out[mine][field] / best
    how = f"{out[mine]['engine']} / {out[key]['engine']}"
    if field.startswith("tps_"):
        streams = int(field.removeprefix("tps_"))
        series = [s for s in (rounds_of(out, k, streams) for _, k in got) if s]
        own = rounds_of(out, mine, streams)
        if own and len(series) == len(got) and all(len(s) == len(own) for s in series):
            r = statistics.median(a / max(b) for a, *b in zip(own, *series, strict=True))
            how = f"{out[mine]['engine']} / the best peer of each round; best median: {out[key]['engine']}"
    return [what, f"{r:.2f}x ({how})", r <= want if lower else r >= want]


def targets(out: dict, budget: dict | None = None, accuracy: dict | None = None,
            memory: tuple[float, str] | None = None) -> dict:
    def get(key, field):
        return out.get(key, {}).get(field)

    rows = [_ratio_row(out, "1 stream fp32 tok/s >= 1.1x best of onnxruntime-genai / OpenVINO", "posenc",
                       ("ortgenai", "openvino"), "tps_1", 1.1),
            _ratio_row(out, "32 streams fp32 tok/s >= 1.1x best of OpenVINO / vLLM", "posenc", ("openvino", "vllm"),
                       "tps_32", 1.1),
            _ratio_row(out, "first token fp32 <= 0.9x the best fp32 peer's", "posenc", FP32_PEERS, "first_p50_ms_1",
                       0.9, lower=True)]
    rows.append(["peak RSS fp32 (32 streams, the worker's default --batch-tokens) <= 1.0 GB",
                 *(["not measured (python -m bench worker-memory)", None] if memory is None else
                   [f"{memory[0]} (bench.worker_memory, {memory[1]})", memory[0] <= 1.0])])
    rss = get("posenc", "peak_rss_gb")
    rows.append(["peak RSS fp32 (32 streams, --batch-tokens 4096: every prompt in one call) <= 1.0 GB", rss,
                 None if rss is None else rss <= 1.0])
    fast = max((k for k in INT8 if get(k, "tps_1")), key=lambda k: get(k, "tps_1"), default=None)
    rows.append(_ratio_row(out, "int8 1 stream tok/s >= 1.2x the best 8-bit peer", fast, PEERS_8BIT, "tps_1", 1.2))
    rows.append(_ratio_row(out, "int8 32 streams tok/s >= 1.2x the best 8-bit peer", fast, PEERS_8BIT, "tps_32", 1.2))
    method = METHOD.get(fast or "", "int8")
    low, high = DEFAULT_BUDGET[method]
    acc = (accuracy or {}).get(fast or "posenc-int8") or {}
    if "top1_agreement" in acc:
        rows.append([f"int8 ({method}) within its budget on the trained model (top-1 >= {low}, nats/byte <= x{high})",
                     f"top-1 {acc['top1_agreement']:.3f}, x{acc['nats_ratio']:.3f} (bench.peers_accuracy)",
                     acc["top1_agreement"] >= low and acc["nats_ratio"] <= high])
    elif budget and method in budget:
        ok, n, date = budget[method]
        rows.append([f"int8 ({method}) within the accuracy budget on a model trained here (top-1 >= {low}, "
                     f"nats/byte <= x{high})", f"{ok}/{n} lengths within (bench.peers_quant, {date})", ok == n])
    else:
        rows.append(["int8 within the accuracy budget on a model trained here", "not measured (python -m "
                     "bench.peers_accuracy)", None])
    if fast and get(fast, "peak_rss_gb") and get("llamacpp-q8", "peak_rss_gb"):
        rows.append(["peak RSS int8 (32 streams), llama.cpp q8_0's beside it (no target)",
                     f"{get(fast, 'peak_rss_gb')} GB (q8_0: {get('llamacpp-q8', 'peak_rss_gb')} GB)", None])
    return {"columns": ["target", "measured", "met"], "rows": rows}
