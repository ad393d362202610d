"""HTTP streams pull their tokens in threads of their own: with every thread for unary calls (--workers) held by
slow Predicts and more Predicts waiting for one, a streamed Generate still runs to its last token."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from tests.http.conftest import Http
from tests.service.test_unary_limit import hold_predicts
from tests.serving import start

PREDICT = {"model": "rope", "prompt": {"text": "ab"}}
GENERATE = {"model": "alibi", "prompt": {"text": "a"}, "max_new_tokens": 5}


def test_a_stream_runs_while_every_unary_thread_is_held(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, http_port=0, workers=4)  # 4 threads for the HTTP front's blocking calls
    inside, release = hold_predicts(srv)
    web = Http(srv.http_port)
    try:
        with ThreadPoolExecutor(7) as pool:
            calls = [pool.submit(web.call, "POST", "/v1/posenc/predict", PREDICT, None, 120) for _ in range(6)]
            for _ in range(6000):  # every unary thread taken (bounded: 60 s); 2 more Predicts wait for one
                if inside[0] == 4:
                    break
                time.sleep(0.01)
            time.sleep(0.3)  # room for a fifth to enter, were the limit not there
            assert inside == [4, 4]
            stream = pool.submit(web.call, "POST", "/v1/posenc/generate", GENERATE, None, 120)
            status, _, body = stream.result(timeout=90)  # on the unary calls' threads it would wait for them
            lines = [json.loads(x) for x in body.splitlines()]
            assert status == 200 and len(lines) == 5 and lines[-1]["finish_reason"] == "length", body[:300]
            assert inside == [4, 4] and not any(c.done() for c in calls)  # the Predicts are still held
            release.set()
            assert all(c.result(timeout=60)[0] == 200 for c in calls)
    finally:
        release.set()
        srv.stop(grace=1)
