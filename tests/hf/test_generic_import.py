"""Families transformers ships and no module in model/hf/families/ names, imported by the generic import
(model/hf/generic.py) and proven at import (export/proof.py), then served equal to transformers; folders altered so
that the mapping would be wrong are refused in one line, exit 2, nothing written, naming the layer and part.

The ten: seed_oss (q/k/v biases, no output bias), granite (muP multipliers on embeddings, scores and logits),
olmo3 (OLMo 2's output norms and all-heads q/k norm, a sliding layer beside a full one, RoPE per layer type), exaone4
(output norms, per-head q/k norm, sliding layers), cwm (llama3 RoPE past 64, sliding layer beside a full one),
hyperclovax (HyperCLOVA X's sandwich norms, a score multiplier), qwen3_moe and mixtral (softmax-routed experts, as
each spells them), flex_olmo (experts with OLMo 2's norms), internlm3 (LLaMA's layout under another name)."""

import json
import shutil

import grpc
import numpy as np
import pytest
import torch

from export.__main__ import main
from export.hf import import_artifact
from export.proof import ProofError, prove
from model.hf import import_folder
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.hf.helpers import VOCAB, perturb, tokenizer_json
from tests.serving import start

pytestmark = pytest.mark.xdist_group("generic-import")  # one worker imports the ten families once (make test)

SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "max_position_embeddings": 256, "vocab_size": VOCAB, "head_dim": 8,
         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "tie_word_embeddings": False}
WINDOW = 7
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500.0}
EXPERTS = {"num_experts_per_tok": 2, "norm_topk_prob": True}
GENERIC = {
    "seed_oss": {"attention_dropout": 0.0, "residual_dropout": 0.0},
    "granite": {"embedding_multiplier": 3.0, "logits_scaling": 2.0, "attention_multiplier": 0.3},
    "olmo3": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "exaone4": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "sliding_attention"]},
    "cwm": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": LLAMA3},
    "hyperclovax": {"embedding_multiplier": 2.0, "attention_multiplier": 0.4},
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 16, **EXPERTS},
    "mixtral": {"num_local_experts": 4, **EXPERTS},
    "flex_olmo": {"num_experts": 4, **EXPERTS},
    "internlm3": {},
}
# what the generic import reads but transformers computes another way: caught by the proof, not by the mapping
APART = {"helium": {}, "hyperclovax_logits": {"logits_scaling": 2.0}}


def save(model_type: str, folder, seed: int = 0, **changes):
    import tokenizers
    import transformers as tf

    config = tf.AutoConfig.for_model(model_type, **{**SIZES, **changes})
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    perturb(model, seed)
    model.save_pretrained(folder)
    tf.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer_json())).save_pretrained(folder)
    if hasattr(model, "set_experts_implementation") and "experts" in str(model):
        model.set_experts_implementation("eager")
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each family's folder, its transformers model and its artifact (imported, proven, exported, validated)."""
    root = tmp_path_factory.mktemp("generic")
    out = {}
    for family, changes in GENERIC.items():
        hf = save(family, root / "hf" / family, **changes)
        report, info = import_artifact(root / "hf" / family, root / "artifacts" / family, validation_max_length=8,
                                       interventions=False)  # (not what these tests ask about)
        out[family] = {"folder": root / "hf" / family, "hf": hf, "artifact": root / "artifacts" / family,
                       "report": report, "info": info}
    return out


@pytest.mark.parametrize("family", GENERIC)
def test_the_family_has_no_module_and_is_proven_at_import(built, family):
    from model.hf.families import FAMILIES

    assert family not in FAMILIES
    entry = built[family]
    assert entry["report"].passed and entry["info"]["generic"]
    proof = json.loads((entry["artifact"] / "model.json").read_text())["source"]["proof"]
    assert proof["importer"] == "generic" and proof["passed"] and proof["reference"].startswith("transformers ")
    assert proof["logits"] <= 1e-4 and proof["attentions"] <= 3e-5
    assert max(proof["lengths"]) > max(WINDOW, 64 if family == "cwm" else 0)  # past the window, the original context


@pytest.fixture(scope="module")
def served(built, tmp_path_factory):
    models = tmp_path_factory.mktemp("served-generic")
    for family, entry in built.items():
        shutil.copytree(entry["artifact"], models / family)
    srv = start(models)
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    yield posenc_pb2_grpc.PosencStub(ch)
    ch.close()
    srv.stop(grace=1)


def test_list_models_says_each_import_was_proven_and_how(served, built):
    """ListModels carries model.json's proof: the generic importer and the largest logit difference found, so
    `posenc list` shows which artifacts were proven at import."""
    listed = {m.name: m for m in served.ListModels(pb.ListModelsRequest(), timeout=30).models}
    for family, entry in built.items():
        proof = json.loads((entry["artifact"] / "model.json").read_text())["source"]["proof"]
        got = listed[family]
        assert got.HasField("proof") and got.proof.importer == "generic"
        assert got.proof.reference == proof["reference"] and got.proof.logits == pytest.approx(proof["logits"])


@pytest.mark.parametrize("family", GENERIC)
def test_served_equal_to_transformers(served, built, family):
    """Predict's top candidates and last attention rows, and up to 32 greedy tokens of Generate (both stop at the
    end-of-sequence id), against transformers."""
    hf = built[family]["hf"]
    ids = [int(i) for i in torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(5))]
    resp = served.Predict(pb.PredictRequest(model=family, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)), top_k=5,
                                            attention=pb.ATTENTION_LAST_ROW), timeout=60)
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), output_attentions=True)
    last = out.logits[0, -1].double().numpy()
    logp = last - last.max() - np.log(np.exp(last - last.max()).sum())
    want = np.argsort(-logp, kind="stable")[:5]
    assert [c.token.id for c in resp.top] == list(want)
    assert np.allclose([c.logprob for c in resp.top], logp[want], atol=1e-4)
    assert len(resp.attention) == 2 * 4
    for m in resp.attention:
        row = np.frombuffer(m.data, "<f4").reshape(m.shape)[-1]
        assert np.allclose(row, out.attentions[m.layer][0, m.head, -1].numpy(), atol=3e-5)
    msgs = list(served.Generate(pb.GenerateRequest(model=family, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)),
                                                   max_new_tokens=32), timeout=120))
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                           max_new_tokens=32, do_sample=False, pad_token_id=0)[0, len(ids):]
    assert [m.token.id for m in msgs] == want.tolist()


def refused(folder, tmp_path, capsys, *flags) -> str:
    out_parent = tmp_path / "artifacts"
    out_parent.mkdir(exist_ok=True)
    capsys.readouterr()
    code = main(["--from-hf", str(folder), "--out", str(out_parent / "m"), *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert list(out_parent.iterdir()) == []  # nothing written, no temporary folder left
    return err


def copy(built, family, tmp_path):
    folder = tmp_path / family
    shutil.copytree(built[family]["folder"], folder)
    return folder


def edit(folder, **changes):
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, **changes}))


def test_a_renamed_tensor_is_refused_naming_it(built, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = copy(built, "seed_oss", tmp_path)
    state = load_file(folder / "model.safetensors")
    state["model.layers.1.mlp.gate.weight"] = state.pop("model.layers.1.mlp.gate_proj.weight")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    err = refused(folder, tmp_path, capsys)
    assert "no tensor model.layers.1.mlp.gate_proj.weight" in err and "generic import" in err, err


def test_a_tensor_no_part_reads_is_refused(built, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = copy(built, "internlm3", tmp_path)
    state = load_file(folder / "model.safetensors")
    state["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    err = refused(folder, tmp_path, capsys)
    assert "tensor model.layers.1.mlp.extra_proj.weight is not used by the generic import" in err, err


@pytest.mark.parametrize(("family", "change", "message"), [
    ("granite", {"residual_multiplier": 0.5}, "residual_multiplier = 0.5 is not supported"),
    ("internlm3", {"qk_dropout_scale": 2.0}, "qk_dropout_scale = 2.0 is not supported (the generic import does not"),
    ("seed_oss", {"auto_map": {"AutoModelForCausalLM": "x.Y"}}, "auto_map = ['AutoModelForCausalLM']"),
])
def test_a_config_field_that_changes_the_computation_is_refused(built, tmp_path, capsys, family, change, message):
    folder = copy(built, family, tmp_path)
    edit(folder, **change)
    err = refused(folder, tmp_path, capsys)
    assert message in err and str(folder) in err, err


@pytest.mark.parametrize(("family", "message"), [
    ("helium", "differs from transformers' helium at layer 0 attention"),  # interleaved rotary, in code only
    ("hyperclovax_logits", "at the final norm and head"),  # multiplies by logits_scaling where Granite divides
])
def test_what_the_config_cannot_say_is_caught_by_the_proof(tmp_path, capsys, family, message):
    folder = tmp_path / family
    save(family.split("_logits")[0], folder, **APART[family])
    err = refused(folder, tmp_path, capsys)
    assert message in err and "differ by" in err and "nothing was written" in err, err
    assert "model_type 'helium' has no module" in refused(folder, tmp_path, capsys, "--no-verify") or \
        family != "helium"


def test_a_perturbed_weight_is_caught_at_its_layer_and_part(built):
    folder = built["olmo3"]["folder"]
    model, _ = import_folder(folder)
    with torch.no_grad():
        model.blocks[1].mlp.down.weight[0].add_(0.3)
    with pytest.raises(ProofError, match=r"at layer 1 MLP and norms \(largest difference"):
        prove(model, folder, json.loads((folder / "config.json").read_text()), 64, generic=True)
