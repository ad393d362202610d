"""A bounded, steady stream of Predict and Generate calls for make swarm-test; runs inside the client image.

    python load.py --target dns:///posenc_worker:50051 [--concurrency 4] [--max-seconds 300]

It runs in a container of the client image on the stack's attachable overlay network (the service uses DNS
round-robin, so there is no routing mesh to reach it from the host), through the project's own client channel
(client.channel.channel_for with round_robin over every address the name resolves to, re-resolved when a worker
ages a connection out; its retry policy off, so this script sees and counts every refusal).  First it answers
each request of a fixed set once: those answers are the reference.  Then `concurrency` callers send the set over
and over, each call compared with its reference, until a line `stop` (or end of input) arrives on stdin or
--max-seconds pass.  A call refused by a replica that is going away, before any answer came back, is sent once
more (--retries; see RESEND); a Generate stream that had begun is never replayed.  Every resend is reported with
the refusal's status, so the host sees how often that happened.

stdout carries one JSON object per line: {"event": "ready"}, one {"event": "call"} per finished call (wall-clock
start and end, rpc, code, the replica that answered from the posenc-instance metadata, whether the answer equals
the reference, the refusals that were resent), and a last {"event": "done"}.  The host reads them as they come.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import grpc

from client.channel import channel_for
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc

PROMPTS = ("dog bites man", "The function ", "posenc", "a = b + c", "Return the number of items")
TOL = 1e-5  # replicas batch differently (left padding); probabilities agree to float32 rounding


def requests() -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for model in ("rope", "alibi"):
        for text in PROMPTS:
            out.append(("Predict", pb.PredictRequest(model=model, prompt=pb.Prompt(text=text), top_k=5)))
        for text in PROMPTS[:2]:
            out.append(("Generate", pb.GenerateRequest(model=model, prompt=pb.Prompt(text=text), max_new_tokens=8)))
    return out


def call(stub, rpc: str, req, timeout: float, received: list):
    """(answer summary, replica) of one call: Predict's top tokens with probabilities, Generate's token ids.
    Generate's tokens go into `received` as they arrive (a failed stream shows how far it got)."""
    if rpc == "Predict":
        resp, c = stub.Predict.with_call(req, timeout=timeout)
        return [(t.token.id, t.probability) for t in resp.top], dict(c.trailing_metadata()).get("posenc-instance")
    stream = stub.Generate(req, timeout=timeout)
    received.extend((m.token.id, m.finish_reason) for m in stream)
    return list(received), dict(stream.initial_metadata()).get("posenc-instance")


# A replica going away refuses work with UNAVAILABLE ("server is shutting down", or its connection closed), and
# gRPC's server core resets with CANCEL the calls that had reached it but no handler yet when it stopped.  This
# client never cancels a call itself, so a CANCELLED is the server's.
RESEND = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def answer(stub, rpc: str, req, timeout: float, retries: int) -> tuple[object, str | None, list[str]]:
    """One request as a careful client makes it: a call refused (RESEND) before any answer arrived is sent again,
    up to `retries` times; a stream that had begun is never replayed.  Returns the answer, the replica, and the
    status of every refusal that was resent."""
    refused: list[str] = []
    while True:
        received: list = []
        try:
            got, instance = call(stub, rpc, req, timeout, received)
            return got, instance, refused
        except grpc.RpcError as err:
            if err.code() not in RESEND or received or len(refused) >= retries:
                err.refused = refused
                raise
            refused.append(f"{err.code().name}: {err.details()}")


def same(rpc: str, got, want) -> bool:
    if rpc == "Generate":
        return got == want
    if len(got) != len(want):
        return False
    for i, ((gid, gp), (wid, wp)) in enumerate(zip(got, want, strict=True)):
        if abs(gp - wp) > TOL:
            return False
        # Two tokens whose probabilities tie within rounding may swap places; any other difference is a failure.
        if gid != wid and not any(abs(want[j][1] - wp) <= TOL and want[j][0] == gid for j in range(len(want))
                                  if j != i):
            return False
    return True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-seconds", type=float, default=300.0)
    p.add_argument("--pause-ms", type=float, default=10.0, help="each caller's pause between calls")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of one call")
    p.add_argument("--retries", type=int, default=1, help="resends of a call refused before any answer")
    a = p.parse_args()
    lock = threading.Lock()

    def emit(**record) -> None:
        with lock:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()

    channel = channel_for(a.target, lb="round_robin", retries=False)
    grpc.channel_ready_future(channel).result(timeout=60)
    stub = posenc_pb2_grpc.PosencStub(channel)
    work = requests()
    reference = [answer(stub, rpc, req, a.timeout, 0)[0] for rpc, req in work]
    stop = threading.Event()

    def caller(k: int) -> None:
        i = k
        while not stop.is_set():
            rpc, req = work[i % len(work)]
            t0 = time.time()
            try:
                got, instance, refused = answer(stub, rpc, req, a.timeout, a.retries)
                emit(event="call", rpc=rpc, i=i % len(work), t0=t0, t1=time.time(), code="OK", instance=instance,
                     equal=same(rpc, got, reference[i % len(work)]), retried=refused)
            except grpc.RpcError as err:
                emit(event="call", rpc=rpc, i=i % len(work), t0=t0, t1=time.time(), code=err.code().name,
                     instance=None, equal=False, details=err.details(), retried=err.refused)
            i += a.concurrency
            stop.wait(a.pause_ms / 1000)

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    callers = [threading.Thread(target=caller, args=(k,)) for k in range(a.concurrency)]
    emit(event="ready", t=time.time(), requests=len(work))
    for t in callers:
        t.start()
    stop.wait(a.max_seconds)
    stop.set()
    for t in callers:
        t.join()
    channel.close()
    emit(event="done", t=time.time())
    return 0


if __name__ == "__main__":
    sys.exit(main())
