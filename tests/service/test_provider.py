"""--provider: cpu, cuda (onnxruntime-gpu) or auto.  This machine's onnxruntime has no CUDA provider, so cuda must
be a clear one-line error and auto must serve on the CPU; where CUDA is present the same tests check it is used."""

import subprocess
import sys
from pathlib import Path

import onnxruntime as ort

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.serving import start

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def test_cuda_is_used_where_present_and_one_line_exit_2_where_not(tiny_artifacts):
    root, _ = tiny_artifacts
    if HAS_CUDA:  # an onnxruntime-gpu build: the sessions run on the CUDA provider
        srv = start(root, provider="cuda")
        try:
            assert srv.registry.models["rope"].session.get_providers()[0] == "CUDAExecutionProvider"
        finally:
            srv.stop(grace=1)
        return
    out = subprocess.run([sys.executable, "-m", "service", "--model-dir", str(root), "--port", "0",
                          "--metrics-port", "-1", "--http-port", "-1", "--provider", "cuda"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "onnxruntime-gpu" in out.stderr and "CUDA" in out.stderr


def test_auto_serves_on_what_is_available(tiny_artifacts):
    import grpc

    root, _ = tiny_artifacts
    srv = start(root, provider="auto")
    try:
        want = "CUDAExecutionProvider" if HAS_CUDA else "CPUExecutionProvider"
        assert srv.loading.providers[0] == want
        assert srv.registry.models["rope"].session.get_providers()[0] == want
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            resp = posenc_pb2_grpc.PosencStub(ch).Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="a")),
                                                          timeout=30)
        assert resp.top
    finally:
        srv.stop(grace=1)


def test_a_provider_that_cannot_start_refuses_the_model_instead_of_serving_on_the_cpu(tiny_artifacts):
    """onnxruntime falls back to its CPU provider, with a warning, when a requested provider cannot start (the CUDA
    libraries missing beside onnxruntime-gpu, or a provider this build lacks): the worker refuses the model with
    that reason instead of serving it on the CPU under --provider cuda."""
    import pytest

    from service import ortenv
    from service.artifacts import ArtifactRejected, _session

    root, _ = tiny_artifacts
    opts = ortenv.session_options(1, True, False, False)
    with pytest.raises(ArtifactRejected, match=r"could not start ROCMExecutionProvider for model\.onnx \(it fell back "
                                               r"to CPUExecutionProvider\)"):
        _session(root / "rope", "model.onnx", opts, ["ROCMExecutionProvider", "CPUExecutionProvider"], None)
    assert _session(root / "rope", "model.onnx", opts, ["CPUExecutionProvider"], None).get_providers() == [
        "CPUExecutionProvider"]
