"""export.encoding keeps each encoding graph by a digest of what it is exported from (export.dynamo's graph cache):
a graph written from the cache (this process's, or the folder another process wrote) is byte for byte the one a
fresh export writes, also for a model whose config differs only where the graph does not read it, and anything
that changes the graph changes the digest.  The model's graph and the intervention graph are kept in the folder by
a digest that sets their weights apart: written for a model with other weights, byte for byte a fresh export."""

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from export import build, dynamo, encoding, intervene
from export.build import export_onnx
from export.signature import spec_of
from export.wrapper import GraphModule
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


# --- the model's graph and the intervention graph, kept with their weights apart ---------------------------------

def test_a_model_graph_kept_for_other_weights_is_byte_for_byte_a_fresh_export(tmp_path, monkeypatch, exports):
    """A model of the same variant and sizes as one exported before (other seeds: other weights; a trained copy) is
    written from the kept graph with its own weights, and that file is the one a fresh export writes: the model's
    graph and the intervention graph."""
    def both(model, folder):
        folder.mkdir()
        export_onnx(model, folder / "model.onnx", 23)
        intervene.export_intervene(model, folder / "intervene.onnx", 23, "onnx")
        return [(folder / name).read_bytes() for name in ("model.onnx", "intervene.onnx")]

    both(tiny_model("alibi", seed=1), tmp_path / "first")
    assert exports == ["GraphModule", "InterveneModule"]
    kept = both(tiny_model("alibi", seed=2), tmp_path / "kept")
    assert exports == ["GraphModule", "InterveneModule"]  # nothing traced again
    monkeypatch.setattr(dynamo, "CACHE_DIR", None)
    fresh = both(tiny_model("alibi", seed=2), tmp_path / "fresh")
    assert len(exports) == 4
    assert kept == fresh and kept[0] != (tmp_path / "first" / "model.onnx").read_bytes()


def test_a_model_graph_is_kept_only_in_the_folder(tmp_path, monkeypatch, exports):
    """No folder (the export CLI, make models): nothing kept, every graph traced; with one, nothing kept in this
    process (a model's graph holds its weights)."""
    monkeypatch.setattr(dynamo, "CACHE_DIR", None)
    for seed in (1, 2):
        export_onnx(tiny_model("alibi", seed=seed), tmp_path / f"{seed}.onnx", 23)
    assert exports == ["GraphModule"] * 2 and not dynamo._CACHE


def test_what_changes_a_model_graph_changes_its_weights_key():
    def key(model, *args):
        return dynamo.weights_key(GraphModule(model), *args)

    base = key(tiny_model("rope"), 23)
    assert key(tiny_model("rope", seed=9), 23) == base  # weights alone
    assert key(tiny_model("rope"), 18) != base  # what the caller adds: the opset
    assert key(tiny_model("rope", n_heads=2), 23) != base and key(tiny_model("alibi"), 23) != base
    tied = tiny_model("rope")
    tied.blocks[1].mlp[0].weight = tied.blocks[0].mlp[0].weight  # one tensor in two places
    assert key(tied, 23) != base
    constant = tiny_model("rope")
    constant.blocks[0].attn.table = torch.zeros(3)  # a plain tensor attribute: a constant of the graph
    other = tiny_model("rope")
    other.blocks[0].attn.table = torch.ones(3)
    assert len({key(constant, 23), key(other, 23), base}) == 3
    flagged = tiny_model("rope")
    flagged.use_onnx_ops(False)  # set to the class's own value: as unset
    assert key(flagged, 23) == base
    flagged.use_onnx_ops(True)
    assert key(flagged, 23) != base


def test_a_kept_graph_whose_weights_do_not_fit_is_exported_again(tmp_path, exports):
    """A kept graph whose initializer has another shape than the module's tensor of that name is not used: the
    module is traced (and kept anew)."""
    model = tiny_model("alibi")
    key = dynamo.weights_key(GraphModule(model), "model", 23, "onnx", build.__file__,
                             json.dumps(spec_of(model), sort_keys=True))
    export_onnx(model, tmp_path / "a.onnx", 23)
    proto = onnx.load(str(tmp_path / "a.onnx"))
    init = next(i for i in proto.graph.initializer if i.name == "model.tok.weight")
    init.CopyFrom(numpy_helper.from_array(np.zeros((3, 3), np.float32), init.name))
    (dynamo.CACHE_DIR / f"{key}.onnx").write_bytes(proto.SerializeToString())
    assert dynamo.kept_graph(key, GraphModule(model)) is None
    export_onnx(model, tmp_path / "b.onnx", 23)
    assert exports == ["GraphModule"] * 2
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()


def test_a_kept_graph_that_holds_a_weight_under_another_name_is_not_used(tmp_path, exports):
    """Every tensor of the module must be written into the kept graph under one of its names: one the graph holds
    under another name would keep the first model's values, so such a graph is not used."""
    model = tiny_model("alibi")
    key = dynamo.weights_key(GraphModule(model), "model", 23, "onnx", build.__file__,
                             json.dumps(spec_of(model), sort_keys=True))
    export_onnx(model, tmp_path / "a.onnx", 23)
    assert dynamo.kept_graph(key, GraphModule(tiny_model("alibi", seed=3))) is not None
    proto = onnx.load(str(tmp_path / "a.onnx"))
    for init in proto.graph.initializer:
        if init.name == "model.ln_f.weight":
            init.name = "renamed"
    for node in proto.graph.node:
        node.input[:] = ["renamed" if i == "model.ln_f.weight" else i for i in node.input]
    (dynamo.CACHE_DIR / f"{key}.onnx").write_bytes(proto.SerializeToString())
    assert dynamo.kept_graph(key, GraphModule(tiny_model("alibi", seed=3))) is None
    assert exports == ["GraphModule"]
