"""Bad Hugging Face folders and models posenc does not implement exactly: exit 2, one line naming the file and the
problem, nothing written.  Damaged copies of the session's GPT-2 / LLaMA folders."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from export.__main__ import main
from model.hf import import_folder


def copy_of(hf_families, family, tmp_path):
    folder = tmp_path / f"src-{family}"
    shutil.copytree(hf_families[family]["folder"], folder)
    return folder


def edit_config(folder, **changes):
    data = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (folder / "config.json").write_text(json.dumps(data))


def missing_weights(folder):
    (folder / "model.safetensors").unlink()


def truncated_weights(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 1000])


def shard_absent(folder):
    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    save_file({n: state[n] for n in names[::2]}, folder / "model-00001-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "model.safetensors").unlink()


def wrong_shape(folder):
    state = load_file(folder / "model.safetensors")
    state["transformer.h.1.attn.c_proj.weight"] = torch.zeros(64, 32)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def no_model_type(folder):
    edit_config(folder, model_type=None)


def no_tokenizer(folder):
    (folder / "tokenizer.json").unlink()


def tokenizer_too_big(folder):
    data = json.loads((folder / "tokenizer.json").read_text())
    data["added_tokens"].append({"id": 400, "content": "<extra>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(data))


def slow_files(folder, merges: str | None = None, **config):
    """The folder as the Hub has older ones: vocab.json + merges.txt (and a tokenizer_config.json), no
    tokenizer.json."""
    from tokenizers import Tokenizer

    Tokenizer.from_file(str(folder / "tokenizer.json")).model.save(str(folder))
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if merges is not None:
        (folder / "merges.txt").write_text(merges)


def unused_bias(folder):  # a LLaMA file with q_proj biases while attention_bias is false: a bias posenc would drop
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.bias"] = torch.ones(96)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


CASES = {
    "missing safetensors": ("gpt2", missing_weights, "no model.safetensors or model.safetensors.index.json"),
    "truncated safetensors": ("gpt2", truncated_weights, "model.safetensors: unreadable or truncated"),
    "shard absent": ("gpt2", shard_absent, "model-00002-of-00002.safetensors: listed in"),
    "wrong shape": ("gpt2", wrong_shape, "tensor transformer.h.1.attn.c_proj.weight has shape [64, 32]"),
    "no model_type": ("gpt2", no_model_type,
                      "config.json: no model_type (supported: gpt2, gpt_neox, llama, bloom, qwen2,"),
    "no tokenizer.json": ("gpt2", no_tokenizer, "tokenizer.json: missing"),
    "tokenizer too big": ("gpt2", tokenizer_too_big, "tokenizer.json: vocabulary of 401 ids exceeds the model's 320"),
    "slow tokenizer of another class": ("gpt2", lambda f: slow_files(f, tokenizer_class="Qwen2Tokenizer"),
                                        "tokenizer_class 'Qwen2Tokenizer' is not built from vocab.json + merges.txt"),
    "slow tokenizer's added id": ("gpt2", lambda f: slow_files(f, added_tokens_decoder={"400": "<extra>"}),
                                  "added token '<extra>' has id 400, but the vocabulary gives it 300"),
    "slow tokenizer too big": ("gpt2", lambda f: slow_files(f, additional_special_tokens=[f"<x{i}>" for i in
                                                                                          range(30)]),
                               "vocab.json: vocabulary of 330 ids exceeds the model's 320"),
    "slow merges unreadable": ("gpt2", lambda f: slow_files(f, merges="#version: 0.2\nonlyone\n"),
                               "not a BPE vocabulary and merges list"),
    "other model_type": ("gpt2", lambda f: edit_config(f, model_type="mamba"), "model_type 'mamba' has no module"),
    "inverse layer scaling": ("gpt2", lambda f: edit_config(f, scale_attn_by_inverse_layer_idx=True),
                              "scale_attn_by_inverse_layer_idx = True is not supported"),
    "unsupported rope": ("llama", lambda f: edit_config(f, rope_parameters={"rope_type": "axial",
                                                                            "factor": 4.0, "rope_theta": 500.0}),
                         "rope_type = 'axial' is not supported"),
    "sliding window": ("llama", lambda f: edit_config(f, sliding_window=4096), "sliding_window = 4096"),
    "residual after norm": ("bloom", lambda f: edit_config(f, apply_residual_connection_post_layernorm=True),
                            "apply_residual_connection_post_layernorm = True"),
    "bias not carried": ("llama", unused_bias, "tensor model.layers.0.self_attn.q_proj.bias is not used"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_folder_is_one_line_exit_2_and_writes_nothing(hf_families, tmp_path, capsys, case):
    family, damage, message = CASES[case]
    folder = copy_of(hf_families, family, tmp_path)
    damage(folder)
    out_parent = tmp_path / "artifacts"
    out_parent.mkdir()
    capsys.readouterr()  # what building the folder printed (transformers' save progress) is not the command's
    code = main(["--from-hf", str(folder), "--out", str(out_parent / "m")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert str(folder) in err  # names the file
    assert list(out_parent.iterdir()) == []  # nothing written, no temporary folder left


def test_sharded_weights_import_like_one_file(hf_families, tmp_path):
    folder = copy_of(hf_families, "gpt2", tmp_path)
    one, _ = import_folder(folder)
    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    shards = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    for shard in set(shards.values()):
        save_file({n: state[n] for n in names if shards[n] == shard}, folder / shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    (folder / "model.safetensors").unlink()
    two, _ = import_folder(folder)
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values(), strict=True))


def test_half_precision_weights_are_read_as_float32(hf_families, tmp_path):
    folder = copy_of(hf_families, "llama", tmp_path)
    state = load_file(folder / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    model, _ = import_folder(folder)
    assert model.tok.weight.dtype == torch.float32
    assert torch.equal(model.tok.weight, state["model.embed_tokens.weight"].to(torch.bfloat16).float())


def test_existing_output_needs_force_before_importing(hf_families, tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    code = main(["--from-hf", str(hf_families["gpt2"]["folder"]), "--out", str(out)])
    assert code == 2 and "--force" in capsys.readouterr().err
