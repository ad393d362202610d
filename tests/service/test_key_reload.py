"""API keys reload on SIGHUP, in a real `python -m service` process: a Generate stream in flight across the reload
runs to its last token, the key removed from the file is refused (UNAUTHENTICATED) from then on, the key added is
accepted, and a file that no longer parses is refused with a logged reason while the keys in force stay.  The
swap keeps a kept key's calls in flight, so its limits still count them; no key ever reaches the log."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.auth import KeyStore, Ticket
from tests.service.test_reliability import NO_RUNAHEAD, copy, worker_process

S = grpc.StatusCode
OLD, NEW, KEPT = "old-key.4be1f0", "new-key.93d7aa", "kept-key.0c55e2"
TOKENS = 600  # over 180 KB of stream messages: the stream cannot finish before its client reads (NO_RUNAHEAD)


def code_of(stub, key: str) -> grpc.StatusCode:
    try:
        stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=(("authorization", f"Bearer {key}"),))
        return S.OK
    except grpc.RpcError as err:
        return err.code()


def until(check, what: str, tries: int = 400) -> None:
    for _ in range(tries):
        if check():
            return
        time.sleep(0.025)
    pytest.fail(f"never happened: {what}")


def test_sighup_swaps_the_api_keys_without_dropping_a_stream(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    models = tmp_path / "models"
    models.mkdir()
    copy(root, "rope", models)
    keys = tmp_path / "keys"
    keys.write_text(f"{OLD}\n")
    with open(tmp_path / "worker.log", "w+") as log:
        proc, port = worker_process(models, log, "--api-keys-file", str(keys), "--max-new-tokens", str(TOKENS))
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=NO_RUNAHEAD) as channel:
                stub = posenc_pb2_grpc.PosencStub(channel)
                assert code_of(stub, OLD) == S.OK and code_of(stub, NEW) == S.UNAUTHENTICATED
                stream = stub.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="ab"),
                                                          max_new_tokens=TOKENS), timeout=300,
                                       metadata=(("authorization", f"Bearer {OLD}"),))
                first = next(stream)  # the stream is running, held back by its unread window

                keys.write_text(f"# rotated\n{NEW}\n")
                proc.send_signal(signal.SIGHUP)
                with grpc.insecure_channel(f"127.0.0.1:{port}") as other:  # its own connection and windows
                    probe = posenc_pb2_grpc.PosencStub(other)
                    until(lambda: code_of(probe, NEW) == S.OK, "the added key accepted")
                    assert code_of(probe, OLD) == S.UNAUTHENTICATED  # removed: refused from now on
                    rest = list(stream)  # the call admitted under the old key runs to its end
                    assert 1 + len(rest) == TOKENS and rest[-1].finish_reason == "length", first

                    keys.write_text(f"{NEW}\nsha256:not-hex\n")  # a broken file: refused, the keys in force stay
                    proc.send_signal(signal.SIGHUP)
                    until(lambda: "reload refused" in log_text(log), "the broken file's refusal logged")
                    assert code_of(probe, NEW) == S.OK
                    assert code_of(probe, OLD) == S.UNAUTHENTICATED
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        text = log_text(log)
    assert "API keys reloaded from" in text and "1 accepted (1 added, 1 removed)" in text
    assert "reload refused, the 1 keys in force stay" in text and "line 2: sha256: needs 64 hexadecimal" in text
    assert OLD not in text and NEW not in text


def log_text(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def test_a_kept_key_keeps_its_calls_in_flight_and_a_removed_keys_calls_end_cleanly(tmp_path):
    """A key in both files keeps its state: its calls in flight still count against max_concurrent after the swap;
    a removed key's call in flight ends without touching the new key set."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEPT} max_concurrent=1\n{OLD}\n")
    store = KeyStore.from_file(keys)
    header = f"Bearer {KEPT}".encode()
    kept, old = store.identify(header), store.identify(f"Bearer {OLD}")
    held, gone = Ticket(store, kept, "grpc"), Ticket(store, old, "grpc")
    assert held.enter() and gone.enter()
    keys.write_text(f"{KEPT} max_concurrent=1\n{NEW} max_concurrent=3\n")
    assert store.reload()
    assert store.identify(header) is kept and store.identify(f"Bearer {OLD}") is None
    assert not Ticket(store, store.identify(header), "grpc").enter()  # its one call in flight still counts
    gone.leave()
    held.leave()
    assert Ticket(store, store.identify(header), "grpc").enter()  # ... until it ends
    new = store.identify(f"Bearer {NEW}")
    tickets = [Ticket(store, new, "grpc") for _ in range(4)]
    assert [t.enter() for t in tickets] == [True, True, True, False]  # the added key's own limit

    calls = [threading.Thread(target=store.reload) for _ in range(4)]  # reloads racing each other: one key set
    for t in calls:
        t.start()
    for t in calls:
        t.join(10)
    assert sorted(k.digest for k in store.keys) == sorted({kept.digest, new.digest})
