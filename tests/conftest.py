import gc
import os
import shutil
import sys
from pathlib import Path

import grpc
import pytest

from protos.posenc.v1 import posenc_pb2_grpc
from service.registry import Limits
from tests.serving import start


def torch_threads() -> int:
    """The two cores this project is sized for, shared among pytest-xdist's workers: make test runs two, each with
    one torch thread (two each would put four busy threads on two cores, and the tiny models gain nothing from a
    second thread: their exports and validations took about 15% more CPU time with two)."""
    return max(1, 2 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """pytest-xdist's --dist loadgroup sends the tests of one xdist_group to one worker by a suffix on their node ids
    (`nodeid@group`, which its scheduler splits).  xdist 3.8 writes that suffix to Node._nodeid, which pytest 9 no
    longer reads (node ids live in Node._id), so every group's tests spread over both workers and each worker built
    the group's fixtures again.  The suffix is set here, last, after every conftest has marked its items (tests/hf's
    mark by the fixtures they use)."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers under --dist loadgroup
        return
    from _pytest.nodeid import NodeId  # lazy: only under xdist's loadgroup

    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # xdist's controller runs no test: importing torch there (a second) only delayed starting the workers
    # Import lazily so torch-free tests stay torch-free.
    try:
        import torch
    except ImportError:  # the worker-only environment
        return
    torch.set_num_threads(torch_threads())


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Every object is frozen once pytest's own unconfigure has collected the garbage (its last check for unraisable
    exceptions): the collections after it, pytest's cleanup and the interpreter's at exit, each walked the million and
    more objects that torch, transformers and the session's models leave (seconds at the end of each xdist worker,
    which the controller waits for)."""
    gc.freeze()


@pytest.fixture(autouse=True)
def _torch_threads():
    """Training (model.train sets its own two threads) and other fixtures may change torch's thread count: every test
    starts from the same one."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != torch_threads():
        torch.set_num_threads(torch_threads())


@pytest.fixture(scope="session", autouse=True)
def _graph_cache(tmp_path_factory, worker_id):
    """The graphs export.dynamo keeps by digest go to one folder of the run, shared by pytest-xdist's workers: the
    same graph (the encoding graph of tiny LLaMA-shaped families with the same rotary settings, a model imported
    again under another name, a model's and its intervention graph for another model of the same variant and sizes,
    whatever its weights) is traced once per run.  POSENC_GRAPH_CACHE names a folder instead, which make test gives
    both its passes: the numerics tests' second pass, under AVX2 kernels, reads the graphs the first pass traced (a
    trace runs no kernel: the same module gives the same graph on any CPU; an encoding graph whose tensors came out
    otherwise under AVX2 has another digest and is exported again, a model's graph is written with those tensors),
    and validates and compares them anew."""
    try:
        from export import dynamo  # lazy: the worker-only environment has no torch
    except ImportError:
        return
    given = os.environ.get("POSENC_GRAPH_CACHE")
    shared = tmp_path_factory.getbasetemp().parent if worker_id != "master" else tmp_path_factory.getbasetemp()
    dynamo.CACHE_DIR = Path(given) if given else shared / "graph-cache"


@pytest.fixture
def rng_seed():
    return 1234


def _build_tiny(root, variants=None):
    from export.build import build_artifact
    from model.variants import REGISTRY
    from tests.model.helpers import tiny_model

    return {variant: build_artifact(tiny_model(variant), root / variant, name=variant, opset=23,
                                    source={"kind": "random", "preset": "tiny"}, training={}, force=False)
            for variant in (variants or REGISTRY)}


def _report_of(folder):
    """The export's validation report of an artifact, read back from its manifest."""
    import json

    from export.report import Check, Report

    validation = json.loads((folder / "manifest.json").read_text())["validation"]
    return Report(validation["name"], [Check(**c) for c in validation["checks"]])


def _tiny_folder(tmp_path_factory, worker_id):
    """Where the run's tiny artifacts and their locks live: the workers' common temp folder under pytest-xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if worker_id != "master" else base


def _tiny(shared, variant: str, blocking: bool = True) -> None:
    """`variant`'s tiny artifact in shared/tiny-artifacts, built under its lock unless a worker has built it (a lock
    another worker holds is passed over when blocking is False)."""
    from filelock import FileLock

    done = shared / f"tiny-{variant}.done"
    if done.exists():
        return
    lock = FileLock(str(shared / f"tiny-{variant}.lock"))
    try:
        lock.acquire(blocking=blocking)
    except TimeoutError:  # filelock's Timeout: another worker is building it
        return
    try:
        if not done.exists():
            _build_tiny(shared / "tiny-artifacts", [variant])
            done.write_text("")
    finally:
        lock.release()


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory, worker_id):
    """One validated artifact per registered variant, from scaled-up random tiny weights, exported once per run:
    under pytest-xdist (make test runs two workers) the workers share the building in the run's common temp folder
    (a file lock per variant) and read the same artifacts and their reports."""
    import torch

    from model.variants import REGISTRY

    shared = _tiny_folder(tmp_path_factory, worker_id)
    # Every worker builds the variants no other has taken (a lock per variant), then waits for the rest.
    for blocking in (False, True):
        for variant in REGISTRY:
            _tiny(shared, variant, blocking)
    torch.set_num_threads(torch_threads())
    root = shared / "tiny-artifacts"
    return root, {variant: _report_of(root / variant) for variant in REGISTRY}


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, worker_id):
    """One variant's artifact of tiny_artifacts, built when first asked for (the same folder and locks, so a run that
    builds them all builds none twice, and a run of a few modules builds only theirs): get(variant) -> (its folder,
    its validation report)."""
    import torch

    shared = _tiny_folder(tmp_path_factory, worker_id)

    def get(variant: str):
        _tiny(shared, variant)
        torch.set_num_threads(torch_threads())
        folder = shared / "tiny-artifacts" / variant
        return folder, _report_of(folder)
    return get


@pytest.fixture(scope="session")
def long_llama(tmp_path_factory):
    """A tiny LLaMA built with transformers whose max_position_embeddings (2,048) allows long prompts, imported once
    for the modules of the "long-llama" xdist group (tests/hf/test_profile.py, tests/http/test_viewer_maps.py), which
    each serve a copy under their own name: (its artifact folder, the transformers model, the tokenizer)."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer

    from export.hf import import_artifact
    from tests.hf.helpers import perturb, tokenizer_json

    root = tmp_path_factory.mktemp("long-llama")
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=2048,
                            rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    hf = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()  # it returns weights
    perturb(hf, 0, scale=0.5)  # sharper attention than random init's near-uniform rows
    hf.save_pretrained(root / "hf", safe_serialization=True)
    tok = Tokenizer.from_str(tokenizer_json())
    tf.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(root / "hf")
    import_artifact(root / "hf", root / "llama", validation_max_length=8, interventions=False)
    torch.set_num_threads(torch_threads())
    return root / "llama", hf, tok


@pytest.fixture(scope="module")
def rope_alone(tiny_artifacts, tmp_path_factory):
    """A real worker (gRPC, and HTTP on a free port) serving a copy of the tiny rope artifact alone: (server, posenc
    stub, its model folder)."""
    root = tmp_path_factory.mktemp("rope-alone")
    shutil.copytree(tiny_artifacts[0] / "rope", root / "rope")
    srv = start(root, http_port=0)
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        yield srv, posenc_pb2_grpc.PosencStub(channel), root
    srv.stop(grace=1)


# A real worker per test module, on a loopback port, over the tiny artifacts.
@pytest.fixture(scope="module")
def server(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, max_batch=8, max_wait_ms=5.0, limits=Limits(max_prompt_tokens=200, max_new_tokens=64))
    yield srv
    srv.stop(grace=1)


@pytest.fixture(scope="module")
def channel(server):
    ch = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    grpc.channel_ready_future(ch).result(timeout=10)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel):
    return posenc_pb2_grpc.PosencStub(channel)
