"""export.encoding keeps each encoding graph by a digest of what it is exported from (export.dynamo's graph cache):
a graph written from the cache (this process's, or the folder another process wrote) is byte for byte the one a
fresh export writes, also for a model whose config differs only where the graph does not read it, and anything
that changes the graph changes the digest."""

import pytest
import torch

from export import dynamo, encoding
from model.variants.rope import Rope
from tests.model.helpers import tiny_model


@pytest.fixture
def exports(tmp_path, monkeypatch):
    """A cache of its own (nothing kept in this process, a new folder), and the list of the exports that ran."""
    monkeypatch.setattr(dynamo, "_CACHE", {})
    monkeypatch.setattr(dynamo, "CACHE_DIR", tmp_path / "cache")
    ran = []
    original = torch.onnx.export
    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: ran.append(type(a[0]).__name__) or original(*a, **k))
    return ran


def test_a_kept_graph_is_byte_for_byte_a_fresh_export(tmp_path, monkeypatch, exports):
    """RoPE's graph, the one most families share; `other` differs in its biases and MLP (as the tiny Mistral, Gemma,
    Ministral and Gemma 2 families do), which the graph does not read: one digest, and rightly so."""
    cfg = tiny_model("rope").cfg
    other = cfg.replace(qkv_bias=not cfg.qkv_bias, mlp="gated", activation="silu", d_mlp=24, tie_head=False)
    assert encoding.cache_key(Rope(cfg), 23) == encoding.cache_key(Rope(other), 23)
    assert dynamo.graph_key(Rope(cfg), 23) != dynamo.graph_key(Rope(other), 23)  # every field: two digests
    files = {}
    for way, config in (("fresh", other), ("miss", cfg), ("memory", other), ("folder", other)):
        (tmp_path / way).mkdir()
        with monkeypatch.context() as patch:
            if way == "fresh":  # no cache at all: exported and written, nothing kept
                patch.setattr(dynamo, "graph_key", lambda *a, **k: None)
            if way == "folder":  # what another process kept
                patch.setattr(dynamo, "_CACHE", {})
            entry = encoding.export_encoding(Rope(config), tmp_path / way, 23)
        files[way] = (tmp_path / way / encoding.FILE).read_bytes()
        assert entry["file"] == encoding.FILE
        if way == "miss":
            assert len(list((tmp_path / "cache").glob("*.onnx"))) == 1
            assert not list((tmp_path / "cache").glob("*.part"))
    assert exports == ["EncodingGraph"] * 2  # the fresh one and the miss
    assert files["fresh"] and all(data == files["fresh"] for data in files.values())


def test_what_changes_the_graph_changes_the_digest():
    model = tiny_model("learned")
    key = encoding.cache_key(model.pos, 23)
    assert key == encoding.cache_key(tiny_model("learned").pos, 23)
    assert key != encoding.cache_key(model.pos, 18)  # the opset
    assert key != encoding.cache_key(tiny_model("learned", seed=5).pos, 23)  # the weights
    with torch.no_grad():
        next(model.pos.parameters()).view(-1)[0] += 1e-3
    assert encoding.cache_key(model.pos, 23) != key  # one weight
    rope = tiny_model("rope").pos
    base = encoding.cache_key(rope, 23)
    for change in ({"rope_base": 500.0}, {"rope_pairing": "interleaved"}, {"n_heads": 2}, {"n_layers": 3},
                   {"rope_scaling": "linear", "rope_factor": 2.0, "rope_original_context": 16}):
        assert encoding.cache_key(Rope(rope.cfg.replace(**change)), 23) != base, change  # a field the graph reads
    rope.onnx_ops = True  # a flag the hooks read
    assert encoding.cache_key(rope, 23) != base
    local = Rope(rope.cfg.replace(local_rope_base=rope.cfg.rope_base, sliding_window=4))
    same = Rope(rope.cfg.replace(local_rope_base=rope.cfg.rope_base, sliding_window=4))
    same.layer_cfgs = [same.cfg if c is not None else None for c in same.layer_cfgs]  # equal fields, one object
    assert encoding.cache_key(local, 23) != encoding.cache_key(same, 23)  # which configs are the same object


def test_what_the_digest_cannot_read_is_not_kept(tmp_path, exports):
    pos = tiny_model("rope").pos
    pos.helper = object()  # an attribute of a kind the digest does not know
    hooked = tiny_model("alibi").pos
    hooked.register_forward_hook(lambda module, args, out: out)  # a hook changes what forward computes
    assert encoding.cache_key(pos, 23) is None and encoding.cache_key(hooked, 23) is None
    assert encoding.cache_key(tiny_model("alibi").pos, 23) is not None
    encoding.export_encoding(pos, tmp_path, 23)
    assert exports == ["EncodingGraph"] and (tmp_path / encoding.FILE).is_file()
    assert not dynamo._CACHE and not (tmp_path / "cache").exists()
