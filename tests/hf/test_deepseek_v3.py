"""DeepSeek-V3 beyond the Zoo's common checks (test_families.py, test_families_served.py): its other forms (queries
through q_proj, half-split RoPE, biases, one expert group, unnormalised weights, two shared experts) against
transformers' eager forward; the experts layer alone against transformers' DeepseekV3MoE on many tokens; latent
attention in the compact fast graph, served; and each refused field."""

from __future__ import annotations

import os
import shutil

import grpc
import pytest
import torch

from export.__main__ import main
from model.hf import import_folder
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.hf import float64
from tests.hf.helpers import VOCAB
from tests.hf.test_families import hf_forward
from tests.hf.test_families_refusals import edit_config
from tests.hf.test_hf_parity import batch
from tests.serving import start


@pytest.mark.numerics
@pytest.mark.parametrize("length", [7, 200])
def test_other_forms_equal_transformers(hf_zoo, length):
    folder, hf = hf_zoo.saved_folder("deepseek_v3_forms")
    model, _ = import_folder(folder)
    c = model.cfg
    assert (c.mla_q_rank, c.rope_pairing, c.qkv_bias, c.out_bias, c.rope_scaling, c.attn_scale_dim) == \
        (0, "half", True, True, "none", 0.0)
    assert (c.expert_groups, c.router_norm, c.router_scale, c.shared_experts) == (1, False, 1.5, 2)
    ids, mask = batch(length, seed=7)
    refs = float64.rows_alone(lambda m, i, k: hf_forward("deepseek_v3", m, i, k), float64.double(hf), ids, mask)
    with torch.no_grad():
        out = float64.double(model)(ids, mask)
    float64.compare("deepseek_v3", refs, out.logits, out.attentions, mask)  # in float64, as test_families.py


@pytest.mark.parametrize("form", ["deepseek_v3", "deepseek_v3_forms"])
def test_experts_layer_equals_transformers_moe_on_many_tokens(hf_zoo, form):
    """The MoE layer alone on 4,096 hidden states spread wide enough that every expert and group is chosen and left
    out: posenc's dense weights (0 off the chosen experts) equal transformers' router and eager experts loop."""
    folder, hf = hf_zoo.saved_folder(form)
    model, _ = import_folder(folder)
    ours, theirs = model.blocks[1].mlp, hf.model.layers[1].mlp
    x = torch.randn(4096, model.cfg.d_model, generator=torch.Generator().manual_seed(8)) * 2
    with torch.no_grad():
        want, got = theirs(x[None])[0], ours(x)
        _, _, chosen = theirs.gate(x)
    assert chosen.unique().numel() == model.cfg.n_experts  # every expert chosen somewhere
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_latent_attention_is_served_from_the_compact_fast_graph(hf_zoo, tmp_path):
    """Keys and values of every head in the cache (values zero-padded to the key's width): GroupQueryAttention
    replaces both Attention nodes, the fast graph equals the exact one, and the worker's compact layout generates
    transformers' greedy tokens for two prompts at once."""
    from export.fuse import add_to_artifact

    entry = hf_zoo["deepseek_v3"]
    folder = tmp_path / "models" / "deepseek_v3"
    folder.mkdir(parents=True)
    for p in entry["artifact"].iterdir():
        os.link(p, folder / p.name)
    fast = add_to_artifact(folder)
    assert fast["layout"] == "compact" and fast["fused"]["GroupQueryAttention"] == 2
    assert fast["parity"]["max_abs_diff"] <= 1e-4
    srv = start(tmp_path / "models")
    try:
        stub = posenc_pb2_grpc.PosencStub(grpc.insecure_channel(f"127.0.0.1:{srv.port}"))
        g = torch.Generator().manual_seed(9)
        prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 40)]
        calls = [stub.Generate(pb.GenerateRequest(model="deepseek_v3", prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)),
                                                  max_new_tokens=12), timeout=120) for ids in prompts]  # both at once
        got = [[m.token.id for m in call] for call in calls]
    finally:
        srv.stop(grace=1)
    for ids, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = entry["hf"].generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                                        max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        assert tokens == want


CASES = {
    "quantized": ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config = 'fp8' is not supported"),
    "grouped kv heads": ({"num_key_value_heads": 2}, "num_key_value_heads = 2 is not supported"),
    "values wider than keys": ({"v_head_dim": 24}, "v_head_dim = 24 is not supported"),
    "partial rotary": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
                       "partial_rotary_factor = 0.5 is not supported"),
    "groups not splitting the experts": ({"n_group": 3}, "n_group = 3 is not supported"),
    "more groups kept than exist": ({"topk_group": 5}, "topk_group = 5 is not supported"),
    "no latent": ({"kv_lora_rank": None}, "no kv_lora_rank"),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_field_is_one_line_exit_2_and_writes_nothing(hf_zoo, tmp_path, capsys, case):
    changes, message = CASES[case]
    folder = tmp_path / "deepseek_v3"
    shutil.copytree(hf_zoo.saved_folder("deepseek_v3")[0], folder)
    edit_config(folder, **changes)
    out_parent = tmp_path / "artifacts"
    out_parent.mkdir()
    capsys.readouterr()
    code = main(["--from-hf", str(folder), "--out", str(out_parent / "m")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert str(folder / "config.json") in err
    assert list(out_parent.iterdir()) == []
