"""API keys reload on SIGHUP, in a real `python -m service` process: a Generate stream in flight across the reload
runs to its last token, the key removed from the file is refused (UNAUTHENTICATED) from then on, the key added is
accepted, and a file that no longer parses is refused with a logged reason while the keys in force stay.  The
swap keeps a kept key's calls in flight, so its limits still count them; no key ever reaches the log."""

from __future__ import annotations

import errno
import os
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


def rope_models(tiny_artifacts, tmp_path):
    """A models folder holding a copy of the tiny rope artifact alone."""
    models = tmp_path / "models"
    models.mkdir()
    copy(tiny_artifacts[0], "rope", models)
    return models


def test_sighup_swaps_the_api_keys_without_dropping_a_stream(tiny_artifacts, tmp_path):
    models = rope_models(tiny_artifacts, tmp_path)
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


def reloads(log) -> int:
    return log_text(log).count("API keys reloaded from")


def test_a_key_removed_and_added_again_keeps_its_calls_in_flight(tiny_artifacts, tmp_path):
    """A key with max_concurrent=1 and a stream in flight, removed by one SIGHUP and added again by the next: its
    stream still counts, so a second call is refused until the stream ends."""
    models = rope_models(tiny_artifacts, tmp_path)
    keys = tmp_path / "keys"
    keys.write_text(f"{KEPT} max_concurrent=1\n{NEW}\n")
    with open(tmp_path / "worker.log", "w+") as log:
        proc, port = worker_process(models, log, "--api-keys-file", str(keys), "--max-new-tokens", str(TOKENS))
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=NO_RUNAHEAD) as channel, \
                    grpc.insecure_channel(f"127.0.0.1:{port}") as other:
                stream = posenc_pb2_grpc.PosencStub(channel).Generate(
                    pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="ab"), max_new_tokens=TOKENS),
                    timeout=300, metadata=(("authorization", f"Bearer {KEPT}"),))
                next(stream)  # admitted, running, held back by its unread window
                probe = posenc_pb2_grpc.PosencStub(other)
                assert code_of(probe, KEPT) == S.RESOURCE_EXHAUSTED  # its one call in flight
                keys.write_text(f"{NEW}\n")
                proc.send_signal(signal.SIGHUP)
                until(lambda: code_of(probe, KEPT) == S.UNAUTHENTICATED, "the removed key refused")
                keys.write_text(f"{KEPT} max_concurrent=1\n{NEW}\n")
                proc.send_signal(signal.SIGHUP)
                until(lambda: reloads(log) == 2, "the second reload")
                assert code_of(probe, KEPT) == S.RESOURCE_EXHAUSTED  # the stream admitted before still counts
                assert len(list(stream)) == TOKENS - 1
                until(lambda: code_of(probe, KEPT) == S.OK, "the stream's unit given back")
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0


def test_two_quick_sighups_install_the_newest_file(tiny_artifacts, tmp_path):
    """The first SIGHUP's reload reads a key file that arrives slowly (a FIFO whose writer holds it open: an older
    file, OLD still in it); meanwhile the file is replaced by one revoking OLD and a second SIGHUP comes.  Whatever
    order the two reloads end in, the newer file is the one in force: OLD refused, NEW accepted."""
    models = rope_models(tiny_artifacts, tmp_path)
    keys = tmp_path / "keys"
    keys.write_text(f"{OLD}\n")
    with open(tmp_path / "worker.log", "w+") as log:
        proc, port = worker_process(models, log, "--api-keys-file", str(keys))
        writer = None
        try:
            os.mkfifo(tmp_path / "slow")
            os.replace(tmp_path / "slow", keys)
            proc.send_signal(signal.SIGHUP)  # the first reload opens the FIFO and reads until its writer closes it

            def reader_waiting() -> bool:  # a FIFO opens for writing, without blocking, once a reader has it open
                nonlocal writer
                try:
                    writer = os.open(keys, os.O_WRONLY | os.O_NONBLOCK)
                except OSError as err:
                    assert err.errno == errno.ENXIO
                return writer is not None

            until(reader_waiting, "the first reload reading the key file")
            os.write(writer, f"{OLD}\n{NEW}\n".encode())  # the older file: read, its end not yet
            (tmp_path / "newer").write_text(f"{NEW}\n")
            os.replace(tmp_path / "newer", keys)  # the newer file, revoking OLD
            proc.send_signal(signal.SIGHUP)
            until(lambda: reloads(log) == 1 or "reads the file again" in log_text(log), "the second reload's turn")
            os.close(writer)
            writer = None  # the first reload reads its file's end
            until(lambda: reloads(log) == 2, "both files read")
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = posenc_pb2_grpc.PosencStub(channel)
                assert code_of(stub, NEW) == S.OK
                assert code_of(stub, OLD) == S.UNAUTHENTICATED
        finally:
            if writer is not None:
                os.close(writer)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
