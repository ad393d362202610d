"""Hub folders as they are: a folder with only the slow tokenizer files (vocab.json + merges.txt and the
tokenizer_config.json OPT's repositories have) imports, and its artifact's tokenizer equals transformers' tokenizer
loaded from the same files (encode, decode, served ids and text); the length a model with RoPE scaling is served
by default is the one the scaling is for, as vLLM derives it."""

import json
import shutil

import grpc
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from export.__main__ import main
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.hf.tokenizer_kinds import _text
from tests.serving import start

TEXTS = ["Héllo  wörld, naïve café — déjà vu", "中文 漢字 日本語の文章です", "emoji 🙂👩‍👩‍👧 🇫🇷!",
         "  two spaces\n\n\ttab   runs   ", "</s>a</s> <pad>b<s>c<unk> <|endoftext|>", "<|im_start|>x <tool> y", ""]
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<|endoftext|>"]
pytestmark = pytest.mark.xdist_group("hub-folders")  # one worker imports the OPT folder once (make test)


def added(content, normalized=True, special=True, **flags):
    return {"__type": "AddedToken", "content": content, "lstrip": False, "rstrip": False, "single_word": False,
            "normalized": normalized, "special": special, **flags}


# facebook/opt-*'s tokenizer_config.json (as transformers 4 wrote them): </s> as bos, eos and unk, put before
# every encoding (add_bos_token)
OPT_CONFIG = {"add_bos_token": True, "add_prefix_space": False, "errors": "replace", "tokenizer_class": "GPT2Tokenizer",
              "bos_token": added("</s>"), "eos_token": added("</s>"), "unk_token": added("</s>"),
              "pad_token": added("<pad>")}
# name -> (model_type, files beside vocab.json + merges.txt)
FOLDERS = {
    "opt": ("opt", {"tokenizer_config.json": OPT_CONFIG}),
    "gpt2-bare": ("gpt2", {}),  # GPT-2's repository: no tokenizer config, <|endoftext|> everywhere
    "special-map": ("gptj", {  # special_tokens_map.json over the config, an extra token new to the vocabulary
        "tokenizer_config.json": {"add_prefix_space": True, "add_eos_token": True, "bos_token": "<s>"},
        "special_tokens_map.json": {"eos_token": "</s>", "pad_token": "<pad>",
                                    "additional_special_tokens": ["<|im_start|>"]}}),
    "added-decoder": ("opt", {  # added_tokens_decoder: a plain added token after the vocabulary, stripping spaces
        "tokenizer_config.json": {**OPT_CONFIG, "added_tokens_decoder": {
            "1": added("<pad>", normalized=False), "2": added("</s>", normalized=False),
            "305": added("<tool>", special=False, lstrip=True, rstrip=True)}}}),
}


def write_slow_files(folder, model_type, files):
    """A byte-level BPE trained here, saved as the slow files only (vocab.json + merges.txt), with `files`."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_text(), trainers.BpeTrainer(
        vocab_size=305, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.model.save(str(folder))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    for name, data in files.items():
        (folder / name).write_text(json.dumps(data))
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json", "vocab.json", "merges.txt", *files])


@pytest.mark.parametrize("name", FOLDERS)
def test_slow_files_build_the_tokenizer_transformers_loads(tmp_path, name):
    """The tokenizer.json built from the slow files encodes and decodes as transformers' GPT2Tokenizer loaded from
    the same folder: special tokens in the text, bos / eos added per the config, non-ASCII text and whitespace."""
    import transformers as tf

    from model.hf.load import tokenizer_text

    model_type, files = FOLDERS[name]
    write_slow_files(tmp_path, model_type, files)
    ref = tf.AutoTokenizer.from_pretrained(tmp_path)
    assert type(ref).__name__ == "GPT2Tokenizer" and not (tmp_path / "tokenizer.json").exists()
    built = Tokenizer.from_str(tokenizer_text(tmp_path, model_type))
    assert built.get_vocab() == ref.get_vocab()
    for text in TEXTS:
        ids = built.encode(text).ids
        assert ids == ref(text).input_ids, text
        for skip in (False, True):
            assert built.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    every = list(range(len(ref)))  # every id, in runs that cut characters' bytes anywhere
    for start_at in range(0, len(every), 7):
        run = every[start_at:start_at + 11]
        assert built.decode(run, skip_special_tokens=False) == ref.decode(run)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An OPT with random weights saved with only the slow tokenizer files, imported with the CLI, behind a worker."""
    import transformers as tf

    from tests.hf.helpers import hf_config, perturb

    root = tmp_path_factory.mktemp("hub")
    opt = root / "hf" / "opt"
    write_slow_files(opt, "opt", FOLDERS["opt"][1])
    cfg = hf_config("opt")
    cfg.bos_token_id = cfg.eos_token_id = 2
    cfg.pad_token_id = 1
    torch.manual_seed(0)
    model = tf.OPTForCausalLM(cfg).eval()
    perturb(model, 0)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 1
    model.save_pretrained(opt, safe_serialization=True)
    assert main(["--from-hf", str(opt), "--out", str(root / "artifacts" / "opt"), "--validate-max-length", "8"]) == 0
    ref = tf.AutoModelForCausalLM.from_pretrained(opt, attn_implementation="eager").eval()


    srv = start(root / "artifacts")
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    yield {"opt": opt, "ref": ref, "slow": tf.AutoTokenizer.from_pretrained(opt), "root": root,
           "stub": posenc_pb2_grpc.PosencStub(channel)}
    channel.close()
    srv.stop(grace=1)


def test_an_opt_folder_with_slow_files_serves_what_transformers_computes(served):
    """Predict on non-ASCII text: the worker's ids are transformers' tokenizer's (</s> first, as OPT's config asks)
    and its top-5 log-probabilities are transformers' logits'; greedy Generate's tokens and text are transformers'
    generate() and decode."""
    stub, slow, ref = served["stub"], served["slow"], served["ref"]
    meta = json.loads((served["root"] / "artifacts" / "opt" / "model.json").read_text())
    assert meta["tokenizer"]["type"] == "huggingface-tokenizers" and meta["tokenizer"]["vocab_size"] == len(slow)
    text = "Héllo wörld 中文 🙂  spaces</s>"
    ids = slow(text).input_ids
    assert ids[0] == 2 and ids[-1] == 2
    resp = stub.Predict(pb.PredictRequest(model="opt", prompt=pb.Prompt(text=text), top_k=5), timeout=30)
    assert [t.id for t in resp.tokens] == ids
    with torch.no_grad():
        logp = torch.log_softmax(ref(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1).numpy()
    want = np.argsort(-logp, kind="stable")[:5]
    assert [c.token.id for c in resp.top] == list(want)
    assert np.allclose([c.logprob for c in resp.top], logp[want], atol=1e-4)

    prompt = "Naïve café: 日本語"
    ids = slow(prompt).input_ids
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=10, do_sample=False)
    gen = out[0, len(ids):].tolist()
    msgs = list(stub.Generate(pb.GenerateRequest(model="opt", prompt=pb.Prompt(text=prompt), max_new_tokens=10),
                              timeout=60))
    assert [m.token.id for m in msgs] == gen
    whole = slow.decode(ids + gen, skip_special_tokens=True)
    assert msgs[-1].text == whole[len(slow.decode(ids, skip_special_tokens=True)):]


def test_a_folder_with_no_tokenizer_at_all_is_refused(served, tmp_path, capsys):
    folder = tmp_path / "bare"
    shutil.copytree(served["opt"], folder)
    (folder / "merges.txt").unlink()
    assert main(["--from-hf", str(folder), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json: missing, and no slow tokenizer files" in err and not (tmp_path / "m").exists()


@pytest.mark.parametrize("rope, max_positions, want", [
    # vLLM's _get_and_verify_max_len on real configs: Qwen2.5-7B-Instruct's YaRN note, DeepSeek-V3, a dynamic
    # NTK LLaMA-2, a linear x4 LLaMA; Llama-3.1 and Phi-3-mini-128k already state their extended length
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 32768, 131072),
    ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}, 163840, 163840),
    ({"rope_type": "dynamic", "factor": 2.0}, 4096, 8192),
    ({"rope_type": "linear", "factor": 4.0}, 4096, 16384),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, 131072, 131072),
    ({"rope_type": "default"}, 4096, 4096),
])
def test_the_served_length_follows_vllms_rule(tmp_path, rope, max_positions, want):
    from model.hf.load import read_config
    from model.rope_scaling import served_length

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 48, "max_position_embeddings": max_positions,
        "rope_parameters": {"rope_theta": 10000.0, **rope}}))
    cfg, _, _ = read_config(tmp_path)
    assert served_length(cfg) == want and cfg.context == max_positions  # the model's own length is kept
