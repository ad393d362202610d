"""bench/serving_threads.py's clocks read each thread's own CPU time and waits: a thread's CPU time as it reads it
itself (time.thread_time) and its timed-out waits, under the group its name puts it in."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.serving_threads import GROUPS, clocks, group_of, per_token

ROOT = Path(__file__).resolve().parents[2]


def test_a_threads_cpu_time_and_waits_are_its_own_under_its_group():
    started, go, measured, never = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    own: dict[str, float] = {}

    def engine():
        started.set()
        go.wait()
        start = time.thread_time()
        end = time.perf_counter() + 0.4
        while time.perf_counter() < end:  # busy: CPU time
            pass
        for _ in range(20):  # 20 waits that time out: each one sleeps, a voluntary switch
            never.wait(0.005)
        own["cpu"] = time.thread_time() - start
        measured.set()
        never.wait(5)  # alive while the second clock is read

    t = threading.Thread(target=engine, name="engine-probe", daemon=True)
    t.start()
    started.wait(5)
    before = clocks()
    go.set()
    assert measured.wait(10), "the probe thread did not finish"
    after = clocks()
    never.set()
    tid = t.native_id
    assert before[tid][0] == after[tid][0] == GROUPS[0]
    cpu = after[tid][1] - before[tid][1]
    assert abs(cpu - own["cpu"]) <= 0.03, (cpu, own["cpu"])  # the kernel's ticks, 10 ms, at either end
    assert after[tid][2] - before[tid][2] >= 20
    engine_row = per_token(before, after, tokens=10, wall_s=1.0)[GROUPS[0]]
    assert engine_row[0] >= 1 and engine_row[1] >= 1000 * cpu / 10 - 1e-9 and engine_row[3] >= 2.0


def test_the_threads_a_grpc_server_starts_are_counted_as_grpcs():
    """In a fresh process, every native thread that starting a gRPC server and connecting to it adds (named by the
    installed grpc, not by this test) falls in the gRPC core group, not in onnxruntime's pool."""
    script = """
import json
import time
from concurrent import futures
from bench.serving_threads import clocks
before = clocks()
import grpc
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
    grpc.channel_ready_future(channel).result(timeout=30)
    # a new thread carries its parent's name until it names itself: read again, for up to 10 s, until none is
    # left outside gRPC's group (wrong grouping never gets there)
    for _ in range(50):
        time.sleep(0.2)
        new = [v[0] for t, v in clocks().items() if t not in before and not v[0].endswith("(Python)")
               and v[0] != "other Python threads"]
        if set(new) == {"gRPC core (C threads)"}:
            break
server.stop(0)
print(json.dumps(new))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    new = json.loads(done.stdout)
    assert len(new) >= 2 and set(new) == {GROUPS[3]}, new


def test_threads_fall_in_their_groups_by_name():
    assert group_of("engine-smollm", "python") == GROUPS[0]
    assert group_of("ThreadPoolExecutor-0_3", "python") == GROUPS[1]
    assert group_of("MainThread", "python") == GROUPS[2]
    assert group_of(None, "python") == GROUPS[4]
