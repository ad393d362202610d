"""--spin-threads: onnxruntime's intra-op threads spin between operators when the worker serves one model (auto), or
as the flag says; read back from the sessions the running worker made."""

import shutil

import pytest

from tests.serving import start


def spinning(srv, name):
    session = srv.registry.models[name].session_for(False)
    return session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")


@pytest.mark.parametrize("flag, one, many", [("auto", "1", "0"), ("on", "1", "1"), ("off", "0", "0")])
def test_spin_threads_follow_the_flag_and_the_number_of_models(tiny_artifacts, tmp_path, flag, one, many):
    root, _ = tiny_artifacts
    alone, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(root / "alibi", alone / "alibi")
    for name in ("alibi", "rope"):
        shutil.copytree(root / name, two / name)
    for folder, expected in ((alone, one), (two, many)):
        srv = start(folder, spin_threads=flag)
        try:
            assert {spinning(srv, name) for name in srv.registry.models} == {expected}
        finally:
            srv.stop(grace=1)
