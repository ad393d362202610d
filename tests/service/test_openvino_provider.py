"""--provider openvino: the real worker run from .venv-openvino (make openvino: onnxruntime-openvino in place of
onnxruntime) serves a tiny model with the same greedy tokens and log-probabilities as the cpu provider; the main
virtualenv's onnxruntime, which has no OpenVINO provider, refuses it in one line; and the graphs OpenVINO gets
wrong or cannot read run on the CPU provider under it (the tiny rope model's fast graph, whose tokens it would
otherwise get wrong)."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from export.fuse import add_to_artifact
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.artifacts import PROVIDERS, openvino_checked
from service.model_json import Fast
from tests.serving import start

ROOT = Path(__file__).resolve().parents[2]
OPENVINO_PYTHON = ROOT / ".venv-openvino" / "bin" / "python"
# measured: 4e-6 at most between the providers over the 23 tiny variants (their exact and fast graphs)
TOLERANCE = 1e-4


def worker(python: Path, root: Path, *args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([str(python), "-m", "service", "--model-dir", str(root), "--host", "127.0.0.1",
                             "--port", "0", "--metrics-port", "-1", "--http-port", "-1", "--threads", "1", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    line = proc.stdout.readline()
    if "posenc serving" not in line:
        proc.kill()
        raise AssertionError(f"the worker did not start: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, int(line.rsplit(":", 1)[1])


def generate(port: int, model: str, prompts: list[list[int]], n: int = 12) -> list[tuple[list[int], list[float]]]:
    """Greedy completions of the prompts sent at once (the worker batches them as rows of one step)."""
    out: list = [None] * len(prompts)

    def one(k: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stream = posenc_pb2_grpc.PosencStub(ch).Generate(pb.GenerateRequest(
                model=model, prompt=pb.Prompt(tokens=pb.TokenIds(ids=prompts[k])), max_new_tokens=n,
                ignore_eos=True), timeout=120)
            got = [m for m in stream if m.HasField("token")]
        out[k] = ([m.token.id for m in got], [m.logprob for m in got])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def predict(port: int, prompt: list[int]) -> list[tuple[int, float]]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = posenc_pb2_grpc.PosencStub(ch).Predict(pb.PredictRequest(
            model="rope", prompt=pb.Prompt(tokens=pb.TokenIds(ids=prompt)), top_k=5), timeout=120)
    return [(c.token.id, c.logprob) for c in resp.top]


@pytest.fixture(scope="module")
def models(tiny_artifact, tmp_path_factory):
    """The tiny rope model twice: as built (its exact graph, which runs on OpenVINO) and with its fast graph
    (export.fuse: positions clamped in the graph, which OpenVINO 2025.4 reads as zeros: it runs on the CPU)."""
    folder, _ = tiny_artifact("rope")
    root = tmp_path_factory.mktemp("openvino")
    for name in ("rope", "rope_fast"):
        (root / name).mkdir()
        for p in folder.iterdir():
            os.link(p, root / name / p.name)
    assert add_to_artifact(root / "rope_fast")["fused"] == {"GroupQueryAttention": 2}
    return root


def test_the_openvino_worker_gives_the_cpu_providers_tokens_and_logprobs(models):
    assert OPENVINO_PYTHON.is_file(), f"{OPENVINO_PYTHON} is missing: make openvino makes it (make test does)"
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 250, n).tolist() for n in (5, 9, 3)]
    proc, port = worker(OPENVINO_PYTHON, models, "--provider", "openvino")
    cpu = start(models)
    try:
        for name in ("rope", "rope_fast"):
            for batch in ([prompts[0]], prompts):  # one row, then three of different lengths in one batch
                want, got = generate(cpu.port, name, batch), generate(port, name, batch)
                for (want_ids, want_lp), (got_ids, got_lp) in zip(want, got, strict=True):
                    assert got_ids == want_ids and len(got_ids) == 12, name
                    assert np.abs(np.subtract(got_lp, want_lp)).max() <= TOLERANCE, name
        want_top, got_top = predict(cpu.port, prompts[1]), predict(port, prompts[1])
        assert [i for i, _ in got_top] == [i for i, _ in want_top]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got_top, want_top, strict=True)) <= TOLERANCE
    finally:
        cpu.stop(grace=1)
        proc.terminate()
        proc.wait(timeout=30)


def test_an_onnxruntime_without_openvino_refuses_the_provider_in_one_line(models):
    out = subprocess.run([sys.executable, "-m", "service", "--model-dir", str(models), "--port", "0",
                          "--metrics-port", "-1", "--http-port", "-1", "--provider", "openvino"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "no OpenVINO execution provider" in out.stderr and "onnxruntime-openvino" in out.stderr


def test_fast_graphs_that_rotate_outside_attention_run_on_the_cpu_under_openvino():
    """OpenVINO 2025.4 (onnxruntime-openvino 1.24.1) computes the clamp of a fast graph's in-graph positions
    (Clip on int64 with a lower bound alone) as zeros, and cannot read the padded fast graphs: those run on the CPU
    provider, as do the profile and intervention graphs; a fast graph rotating inside GroupQueryAttention runs on
    OpenVINO."""
    ov = PROVIDERS["openvino"]
    inside = Fast(file="fast.onnx", source_sha256="", layout="compact",
                  fused={"GroupQueryAttention": 2, "GroupQueryAttention do_rotary": 2})
    outside = Fast(file="fast.onnx", source_sha256="", layout="compact", fused={"GroupQueryAttention": 2})
    assert openvino_checked(ov, inside) == ov
    assert openvino_checked(ov, outside) == openvino_checked(ov) == PROVIDERS["cpu"]
    assert openvino_checked(PROVIDERS["cpu"], outside) == PROVIDERS["cpu"]
    partly = Fast(file="fast.onnx", source_sha256="", layout="compact",  # one layer still reads the clamp
                  fused={"GroupQueryAttention": 2, "GroupQueryAttention do_rotary": 1})
    assert openvino_checked(ov, partly) == PROVIDERS["cpu"]
