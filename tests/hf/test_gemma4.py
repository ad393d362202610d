"""Gemma 4's text model beyond the Zoo's common checks (test_families.py: PyTorch in float64 and the graph against
transformers' eager forward at lengths 1, 7 and 200 past the window, the cache past the window, 32 greedy tokens
against generate()): its other forms (Gemma4TextConfig's own layer types and RoPE, attention biases) against
transformers in float64, the fast graph, the worker's answers, and each part posenc does not reproduce refused."""

from __future__ import annotations

import json
import os
import shutil

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from export.__main__ import main
from model.hf import import_folder
from protos.posenc.v1 import posenc_pb2_grpc
from tests.hf import float64, test_families_served
from tests.hf.test_families import hf_forward
from tests.hf.test_families_refusals import edit_config
from tests.hf.test_hf_parity import batch
from tests.serving import start

FAMILY = "gemma4_text"


@pytest.mark.numerics
@pytest.mark.parametrize("length", [7, 200])
def test_other_forms_equal_transformers(hf_zoo, length):
    """3 layers without layer_types (every 6th full, the last made full: sliding, sliding, full), rope_parameters
    absent (proportional over a quarter of the pairs at 1e6 on the full layer, default at 1e4 on the sliding ones),
    biases on q, k, v and o, every layer with its own v_proj."""
    folder, hf = hf_zoo.saved_folder("gemma4_text_forms")
    model, _ = import_folder(folder)
    c = model.cfg
    assert [(s.attention, s.encoding) for s in c.layers] == [("sliding", "local")] * 2 + [("full", "model")]
    assert (c.rope_scaling, c.rope_fraction, c.rope_base, c.local_rope_base, c.qkv_bias, c.out_bias) == \
        ("proportional", 0.25, 1e6, 1e4, True, True)
    ids, mask = batch(length, seed=7)
    refs = float64.rows_alone(lambda m, i, k: hf_forward(FAMILY, m, i, k), float64.double(hf), ids, mask)
    with torch.no_grad():
        out = float64.double(model)(ids, mask)
    float64.compare(FAMILY, refs, out.logits, out.attentions, mask)


def test_the_full_layer_takes_its_values_from_the_key_projection(hf_zoo):
    """attention_k_eq_v: the tiny folder has no v_proj in its full layer, and posenc's value rows there are the key
    rows (normed apart: the keys by k_norm's weight, the values by v_norm without one)."""
    folder, _ = hf_zoo.saved_folder(FAMILY)
    names = set(load_file(str(folder / "model.safetensors")))
    assert "model.layers.0.self_attn.v_proj.weight" in names and "model.layers.1.self_attn.v_proj.weight" not in names
    model, _ = import_folder(folder)
    kv = model.cfg.kv_heads * model.cfg.head_dim
    k, v = model.blocks[1].attn.qkv.weight[-2 * kv:].split(kv)
    assert torch.equal(k, v) and model.cfg.v_norm


def test_fast_graph_equals_the_exact_graph(hf_zoo, tmp_path):
    """The fast graph (padded: the sliding window keeps the Attention nodes; the norms fused, the values' norm
    among them) equals the exact graph."""
    from export.fuse import add_to_artifact

    folder = tmp_path / FAMILY
    folder.mkdir()
    for p in hf_zoo[FAMILY]["artifact"].iterdir():
        os.link(p, folder / p.name)
    entry = add_to_artifact(folder)
    assert entry["layout"] == "padded" and entry["parity"]["max_abs_diff"] <= 1e-4, entry


@pytest.fixture(scope="module")
def served(hf_zoo, tmp_path_factory):
    models = tmp_path_factory.mktemp("served-gemma4")
    shutil.copytree(hf_zoo[FAMILY]["artifact"], models / FAMILY)
    srv = start(models)
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    yield posenc_pb2_grpc.PosencStub(ch)
    ch.close()
    srv.stop(grace=1)


def test_predict_and_generate_equal_transformers(served, hf_zoo):
    test_families_served.test_predict_and_generate_equal_transformers(served, hf_zoo, FAMILY)


def test_encoding_names_each_layers_positions_as_transformers_builds_them(served, hf_zoo):
    test_families_served.test_encoding_names_each_layers_positions_as_transformers_builds_them(served, hf_zoo, FAMILY)


PROPORTIONAL = {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000.0}
CASES = {  # config.json changes (None: the key removed), what the one line says
    "per-layer inputs": ({"hidden_size_per_layer_input": 256}, "hidden_size_per_layer_input = 256 is not supported"),
    "per-layer inputs by default": ({"hidden_size_per_layer_input": None},
                                    "hidden_size_per_layer_input = 256 is not supported"),
    "shared kv layers": ({"num_kv_shared_layers": 1}, "num_kv_shared_layers = 1 is not supported"),
    "moe block": ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8},
                  "enable_moe_block = True is not supported"),
    "full layers' head size, by default": ({"per_layer_config": None}, "global_head_dim = 512 is not supported"),
    "full layers' head size": ({"per_layer_config": None, "global_head_dim": 32}, "global_head_dim = 32 is not"),
    "full layers' kv heads": ({"per_layer_config": None, "global_head_dim": 16, "num_global_key_value_heads": 4},
                              "num_global_key_value_heads = 4 is not supported"),
    "a layer's own head size": ({"per_layer_config": {"1": {"head_dim": 32}}},
                                "per_layer_config.1.head_dim = 32 is not supported"),
    "bidirectional": ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention = 'all' is not supported"),
    "scaled local rope": ({"rope_parameters": {"full_attention": PROPORTIONAL, "sliding_attention": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 100.0}}}, "rope_parameters.sliding_attention = "),
    "one rope for all layers": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
                                "rope_parameters = {'rope_type': 'default'"),
    "partial linear rope": ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                    "partial_rotary_factor": 0.5,
                                                                    "rope_theta": 1e3}}},
                            "rope_parameters.full_attention.partial_rotary_factor = 0.5 is not supported"),
}


def refused(folder, tmp_path, capsys) -> str:
    """The export's one-line error, after checking exit 2 and nothing written."""
    out_parent = tmp_path / "artifacts"
    out_parent.mkdir()
    capsys.readouterr()
    code = main(["--from-hf", str(folder), "--out", str(out_parent / "m")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert list(out_parent.iterdir()) == []
    return err


@pytest.mark.parametrize("case", CASES)
def test_refused_field_is_one_line_exit_2_and_writes_nothing(hf_zoo, tmp_path, capsys, case):
    changes, message = CASES[case]
    folder = tmp_path / FAMILY
    shutil.copytree(hf_zoo.saved_folder(FAMILY)[0], folder)
    edit_config(folder, **{k: v for k, v in changes.items() if v is not None})
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in data.items() if changes.get(k, 0) is not None}))
    err = refused(folder, tmp_path, capsys)
    assert message in err and str(folder / "config.json") in err, err


def test_layer_scalar_other_than_1_is_refused(hf_zoo, tmp_path, capsys):
    """transformers multiplies each block's output (the residual stream) by its layer_scalar buffer, saved with the
    weights: posenc's blocks do not scale it, so a value other than 1 is refused, naming the tensor and its file."""
    folder = tmp_path / FAMILY
    shutil.copytree(hf_zoo.saved_folder(FAMILY)[0], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.layer_scalar"] = torch.tensor([0.5])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    err = refused(folder, tmp_path, capsys)
    assert "model.layers.1.layer_scalar = 0.5 is not supported" in err and str(folder / "model.safetensors") in err
