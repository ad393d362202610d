"""A big HTTP body is parsed and validated off the event loop: while one is being parsed, the worker still answers a
health check.  The parse is held (a hook in the JSON decoder or the route's validation) until the health check has
come back, so if the parse ran on the event loop the health check could not be answered and the hook would give up;
the 400 naming the field still comes back after."""

from __future__ import annotations

import json
import threading
import types

import pytest

import service.http.chat as chat
import service.http.front as front_module
import service.http.kserve_rest as kserve_rest
import service.http.openai as openai_routes
import service.http.posenc_json as posenc_json
from tests.http.conftest import Http

BIG = 2_000_000  # characters (or token ids): far past the size parsed inline
HOLD = 1_000_000  # bytes of JSON from which the hook holds the parse

BODIES = {
    "/v1/posenc/score": {"model": "rope", "prompt": {"text": "x" * BIG}},
    "/v2/models/rope/infer": {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, BIG // 2],
                                          "data": [5] * (BIG // 2)}]},
    "/v1/completions": {"model": "rope", "prompt": "x" * BIG, "max_tokens": 1},
    "/v1/chat/completions": {"model": "rope", "messages": [{"role": "user", "content": "x" * BIG}]},
}
# where the parse is held: the JSON decoder (every route), the route's validation of the decoded body
HOOKS = [("decode", path) for path in BODIES] + [("validate", path) for path in BODIES]
# the module whose validation a route calls, and the name it calls it by
VALIDATORS = {"/v1/posenc/score": (posenc_json, "validated"), "/v2/models/rope/infer": (kserve_rest, "validated"),
              "/v1/completions": (openai_routes, "parse"), "/v1/chat/completions": (chat, "validated")}


def held(fn, started: threading.Event, answered: threading.Event, seen: list):
    """fn, which (for a big input) first waits until the health check has been answered (bounded) and records
    whether it was."""

    def hook(value, *args, **kwargs):
        if len(value if isinstance(value, (bytes, memoryview)) else json.dumps(value)) > HOLD:
            started.set()
            seen.append(answered.wait(15))
        return fn(value, *args, **kwargs)

    return hook


@pytest.mark.parametrize("where, path", HOOKS)
def test_a_health_check_is_answered_while_a_big_body_is_parsed(server, web, monkeypatch, where, path):
    started, answered, seen = threading.Event(), threading.Event(), []
    if where == "decode":
        monkeypatch.setattr(front_module, "json", types.SimpleNamespace(
            loads=held(json.loads, started, answered, seen), dumps=json.dumps))
    else:
        module, name = VALIDATORS[path]
        inner = getattr(module, name)
        if name == "parse":  # parse(doc, most)
            monkeypatch.setattr(module, name, held(inner, started, answered, seen))
        else:  # validated(model, doc)
            monkeypatch.setattr(module, name,
                                lambda model, doc: held(lambda d: inner(model, d), started, answered, seen)(doc))
    result = []
    sender = threading.Thread(target=lambda: result.append(web.call("POST", path, BODIES[path], timeout=120)))
    sender.start()
    try:
        assert started.wait(60), "the body never reached the parser"
        health = Http(web.port).call("GET", "/v2/health/live", timeout=60)
        answered.set()
    finally:
        answered.set()
        sender.join(120)
    assert health[0] == 200
    assert seen == [True], "the health check was answered only after the parse: the parse held the event loop"
    status, _, body = result[0]
    assert status == 400, body[:300]  # the request itself is still answered, naming what is wrong
    error = json.dumps(json.loads(body)["error"])
    if path == "/v1/chat/completions":  # rope is a byte model: its body parses, then it has no chat template
        assert "chat template" in error, error
    else:
        assert "prompt" in error or "limit" in error, error
