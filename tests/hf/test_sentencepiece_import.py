"""Hub folders whose only tokenizer is a SentencePiece `tokenizer.model` (LLaMA, Mistral, Phi-3 and Gemma repositories
as older snapshots give them): the tokenizer.json the import builds is the tokenizer transformers' AutoTokenizer
loads from the same folder (its parts, and encode and decode of non-ASCII text, whitespace, special tokens and
characters only byte fallback covers), on models trained here with sentencepiece; sentencepiece's own encoder agrees
where transformers follows the model file; a LLaMA folder imports through the CLI and the worker's tokenizer reads
what it wrote; what is not reproduced is refused in one line."""

import io
import json
import os
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from export.__main__ import main
from model.errors import ImportRefusedError
from model.hf.sentencepiece import BYTE, CONTROL, UNKNOWN, UNUSED, USER_DEFINED, read_model, sentencepiece

pytestmark = pytest.mark.xdist_group("sentencepiece")  # one worker trains and imports the models once (make test)

TEXTS = ["Héllo  wörld, naïve café — déjà vu", "Καλημέρα κόσμε", "中文 漢字 日本語の文章です", "emoji 🙂👩‍👩‍👧 🇫🇷!",
         "  two spaces\n\n\ttab   runs   ", " leading space", "   ", "\n", "", "ẞ 𝔘 ☃ \U0001f9ff ꙮ", "▁▁x ▁",
         "a<s>b</s> <unk>c", "<bos>x<eos> <pad><mask>", "<start_of_turn>user\nhi<end_of_turn>\n"]


def added(content, special=True, normalized=False):
    return {"__type": "AddedToken", "content": content, "lstrip": False, "rstrip": False, "single_word": False,
            "normalized": normalized, "special": special}


# tokenizer_config.json as the repositories have them (meta-llama/Llama-2-7b-hf, mistralai/Mistral-7B-v0.1,
# google/gemma-2b), less what does not bear on the tokenizer
LLAMA2 = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "legacy": False,
          "bos_token": added("<s>"), "eos_token": added("</s>"), "unk_token": added("<unk>"), "pad_token": None}
MISTRAL = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "legacy": True,
           "added_tokens_decoder": {"0": added("<unk>"), "1": added("<s>"), "2": added("</s>")},
           "additional_special_tokens": [], "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
GEMMA = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
         "added_tokens_decoder": {"0": added("<pad>"), "1": added("<eos>"), "2": added("<bos>"), "3": added("<unk>"),
                                  "4": added("<mask>"), "5": added("<start_of_turn>", special=False),
                                  "6": added("<end_of_turn>", special=False)},
         "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"], "bos_token": "<bos>", "eos_token": "<eos>",
         "pad_token": "<pad>", "unk_token": "<unk>"}
# name -> (model file, model_type, tokenizer_config.json or None, the class transformers picks)
FOLDERS = {
    "llama2": ("llama", "llama", LLAMA2, "LlamaTokenizer"),
    "llama-legacy-eos": ("llama", "llama", {"tokenizer_class": "LlamaTokenizerFast", "legacy": True,
                                            "add_eos_token": True, "additional_special_tokens": ["<tool>"]},
                         "LlamaTokenizer"),
    "llama-no-prefix": ("llama", "llama", {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": False},
                        "LlamaTokenizer"),
    "llama-bare": ("llama", "llama", None, "TokenizersBackend"),
    "mistral": ("llama", "mistral", MISTRAL, "TokenizersBackend"),
    "phi3": ("llama", "phi3", {"tokenizer_class": "LlamaTokenizer", "legacy": False}, "TokenizersBackend"),
    "gemma": ("gemma", "gemma", GEMMA, "GemmaTokenizer"),
    "gemma-bare": ("gemma", "gemma", None, "GemmaTokenizer"),
    "gemma-unk": ("gemma", "gemma", {"tokenizer_class": "GemmaTokenizer", "unk_token": "<UNK>", "add_eos_token": True},
                  "GemmaTokenizer"),  # an unknown token new to the vocabulary: the BPE model's unk
    # SentencePiece's defaults: extra spaces collapsed, no byte fallback (unknown characters are <unk>)
    "mistral-defaults": ("defaults", "mistral", {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True},
                         "TokenizersBackend"),
}
IDENTITY = {"model_type": "bpe", "character_coverage": 0.99, "normalization_rule_name": "identity"}
MODELS = {  # trainer settings: LLaMA's (BPE, byte fallback, digits split, spaces kept), Gemma's (no dummy prefix,
    # <pad> <eos> <bos> <unk> first, a control and two user-defined pieces), SentencePiece's defaults, and two refused
    "llama": {**IDENTITY, "byte_fallback": True, "split_digits": True, "allow_whitespace_only_pieces": True,
              "remove_extra_whitespaces": False},
    "gemma": {**IDENTITY, "byte_fallback": True, "split_digits": True, "allow_whitespace_only_pieces": True,
              "remove_extra_whitespaces": False, "add_dummy_prefix": False, "pad_id": 0, "eos_id": 1, "bos_id": 2,
              "unk_id": 3, "pad_piece": "<pad>", "eos_piece": "<eos>", "bos_piece": "<bos>",
              "control_symbols": ["<mask>"], "user_defined_symbols": ["<start_of_turn>", "<end_of_turn>"]},
    "defaults": IDENTITY,
    "unigram": {**IDENTITY, "model_type": "unigram"},
    "nfkc": {"model_type": "bpe", "character_coverage": 0.99},  # SentencePiece's default nmt_nfkc rule
    "suffix": {**IDENTITY, "treat_whitespace_as_suffix": True},
}


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
    """Each MODELS setting trained with sentencepiece (vocabulary 400) on CPython's documentation text and
    non-ASCII lines; name -> tokenizer.model path."""
    import sentencepiece as spm

    from tests.hf.tokenizer_kinds import _text

    corpus = _text()[:60] + ["Καλημέρα κόσμε, γειά σου", "中文 漢字 日本語の文章です", "café naïve déjà vu 🙂"] * 3
    root = tmp_path_factory.mktemp("spm")
    out = {}
    for name, options in MODELS.items():
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=buf, vocab_size=400,
                                       minloglevel=2, num_threads=1, **options)
        out[name] = root / f"{name}.model"
        out[name].write_bytes(buf.getvalue())
    return out


def write_folder(folder, model, model_type, config, files=None):
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(model, folder / "tokenizer.model")
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, data in (files or {}).items():
        (folder / name).write_text(json.dumps(data))
    return folder


def reference(folder):
    import transformers as tf

    return tf.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("name", FOLDERS)
def test_tokenizer_model_builds_the_tokenizer_transformers_loads(tmp_path, spm_models, name):
    """Every part of the built tokenizer.json is the one transformers builds (model with its vocabulary and merges,
    normalizer, pre-tokenizer, decoder, post-processor, added tokens), and it encodes (with and without special
    tokens) and decodes (skipping them or not, and every id in runs that cut characters' bytes) as transformers."""
    model, model_type, config, cls = FOLDERS[name]
    folder = write_folder(tmp_path, spm_models[model], model_type, config)
    ref = reference(folder)
    assert type(ref).__name__ == cls and not (folder / "tokenizer.json").exists()
    text = sentencepiece(folder, model_type)
    want, got = json.loads(ref.backend_tokenizer.to_str()), json.loads(text)
    for part in ("model", "normalizer", "pre_tokenizer", "decoder", "post_processor", "added_tokens"):
        assert got[part] == want[part], part
    built = Tokenizer.from_str(text)
    for sample in TEXTS:
        for special in (True, False):
            ids = built.encode(sample, add_special_tokens=special).ids
            assert ids == ref(sample, add_special_tokens=special).input_ids, (sample, special)
        for skip in (False, True):
            assert built.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    every = list(range(len(ref)))
    for start in range(0, len(every), 7):
        run = every[start:start + 11]
        assert built.decode(run, skip_special_tokens=False) == ref.decode(run)


@pytest.mark.parametrize("name", ["mistral", "gemma"])
def test_sentencepiece_itself_agrees_where_transformers_follows_the_model_file(tmp_path, spm_models, name):
    """Mistral's folders (the generic backend, legacy) and Gemma's segment text as SentencePiece's own encoder does:
    byte fallback for characters outside the vocabulary, whitespace kept, Gemma's user-defined pieces whole."""
    import sentencepiece as spm

    model, model_type, config, _ = FOLDERS[name]
    folder = write_folder(tmp_path, spm_models[model], model_type, config)
    built = Tokenizer.from_str(sentencepiece(folder, model_type))
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    for sample in TEXTS[:11] + (["<start_of_turn>user\nhi<end_of_turn>"] if name == "gemma" else []):
        assert built.encode(sample, add_special_tokens=False).ids == sp.encode(sample), sample
        assert built.decode(sp.encode(sample)) == sp.decode(sp.encode(sample))


def test_the_reader_sees_what_sentencepiece_sees(spm_models):
    """read_model's pieces, scores, types and special ids are the ones sentencepiece's processor reports."""
    import sentencepiece as spm

    for name in ("llama", "gemma", "unigram"):
        sp = spm.SentencePieceProcessor(model_file=str(spm_models[name]))
        got = read_model(spm_models[name])
        assert [p for p, _, _ in got.pieces] == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        assert [s for _, s, _ in got.pieces] == [sp.get_score(i) for i in range(sp.get_piece_size())]
        for i, (_, _, kind) in enumerate(got.pieces):  # the processor has no user-defined query: the trainer's list
            assert (kind == CONTROL, kind == UNKNOWN, kind == BYTE, kind == UNUSED) == (
                sp.is_control(i), sp.is_unknown(i), sp.is_byte(i), sp.is_unused(i))
        assert [p for p, _, k in got.pieces if k == USER_DEFINED] == MODELS[name].get("user_defined_symbols", [])
        assert got.ids == {"unk": sp.unk_id(), "bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id()}
    assert read_model(spm_models["gemma"]).dummy_prefix is False and read_model(spm_models["llama"]).byte_fallback


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=24)
       | st.lists(st.sampled_from(["a", "b", " ", "  ", "\n", "▁", "é", "中", "🙂", "<s>", "</s>", "<bos>",
                                   "<start_of_turn>", "<mask>"]), max_size=12).map("".join))
def test_random_text_encodes_and_decodes_as_transformers(spm_models, tmp_path_factory, text):
    for name in ("llama2", "mistral", "gemma"):
        built, ref = _pair(spm_models, tmp_path_factory, name)
        ids = ref(text).input_ids
        assert built.encode(text).ids == ids
        assert built.decode(ids, skip_special_tokens=False) == ref.decode(ids)


_PAIRS: dict = {}


def _pair(spm_models, tmp_path_factory, name):
    if name not in _PAIRS:
        model, model_type, config, _ = FOLDERS[name]
        folder = write_folder(tmp_path_factory.mktemp(name), spm_models[model], model_type, config)
        _PAIRS[name] = Tokenizer.from_str(sentencepiece(folder, model_type)), reference(folder)
    return _PAIRS[name]


@pytest.fixture(scope="module")
def llama_folder(spm_models, tmp_path_factory):
    """A tiny random LLaMA saved with only tokenizer.model and Llama-2's tokenizer_config.json."""
    import torch
    import transformers as tf

    from tests.hf.helpers import hf_config, perturb

    folder = write_folder(tmp_path_factory.mktemp("hub") / "llama", spm_models["llama"], "llama", LLAMA2)
    cfg = hf_config("llama")
    cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id = 400, 1, 2
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    perturb(model, 0)
    model.save_pretrained(folder, safe_serialization=True)
    assert not (folder / "tokenizer.json").exists()
    return folder


def test_a_llama_folder_imports_and_the_worker_reads_its_tokenizer(llama_folder, tmp_path):
    """posenc-export --from-hf imports the folder; the worker's tokenizer, loaded from the artifact as
    service/tokenizer.py loads it, gives transformers' ids (<s> first) and text."""
    from service import model_json
    from service.tokenizer import for_artifact

    out = tmp_path / "llama"
    assert main(["--from-hf", str(llama_folder), "--out", str(out), "--validate-max-length", "8"]) == 0
    meta = json.loads((out / "model.json").read_text())
    ref = reference(llama_folder)
    assert meta["tokenizer"]["vocab_size"] == len(ref)
    spec = model_json.read(out / "model.json")
    tok = for_artifact(out, spec.tokenizer, spec.sizes.vocab_size)
    for sample in TEXTS:
        ids = ref(sample).input_ids
        assert tok.encode(sample) == ids and ids[0] == 1
        assert tok.decode(ids) == ref.decode(ids)


# name -> (model file, model_type, tokenizer_config.json, other files, what the one line says)
REFUSED = {
    "unigram": ("unigram", "llama", LLAMA2, {}, "trainer_spec.model_type UNIGRAM is not built here"),
    "charsmap": ("nfkc", "mistral", MISTRAL, {}, "normalizer_spec 'nmt_nfkc' has a normalization rule"),
    "suffix": ("suffix", "mistral", MISTRAL, {}, "trainer_spec.treat_whitespace_as_suffix is not reproduced"),
    "no-byte-fallback": ("defaults", "llama", LLAMA2, {}, "trainer_spec.byte_fallback is false"),
    "class": ("llama", "llama", {"tokenizer_class": "T5Tokenizer"}, {}, "tokenizer_class 'T5Tokenizer' with "
              "model_type 'llama' is not built from tokenizer.model"),
    "family": ("llama", "qwen2", None, {}, "tokenizer_class None with model_type 'qwen2'"),
    "renamed": ("llama", "llama", {**LLAMA2, "added_tokens_decoder": {"2": added("<|end|>")}}, {},
                "added_tokens_decoder names id 2 '<|end|>', but tokenizer.model has '</s>' there"),
    "map-extras": ("gemma", "gemma", None, {"special_tokens_map.json": {"additional_special_tokens": ["<x>"]}},
                   "special_tokens_map.json: additional_special_tokens beside tokenizer.model"),
    "user-named": ("gemma", "mistral", {"additional_special_tokens": ["<end_of_turn>"]}, {},
                   "additional_special_tokens names a user-defined piece of tokenizer.model ('<end_of_turn>')"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_is_not_reproduced_is_refused(tmp_path, spm_models, name):
    model, model_type, config, files, says = REFUSED[name]
    folder = write_folder(tmp_path, spm_models[model], model_type, config, files)
    with pytest.raises(ImportRefusedError) as err:
        sentencepiece(folder, model_type)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_truncated_model_file_is_refused(tmp_path, spm_models):
    folder = write_folder(tmp_path, spm_models["llama"], "llama", LLAMA2)
    data = (folder / "tokenizer.model").read_bytes()
    (folder / "tokenizer.model").write_bytes(data[:len(data) // 2])
    with pytest.raises(ImportRefusedError, match="not a SentencePiece model"):
        sentencepiece(folder, "llama")


def test_the_cli_refuses_a_unigram_folder_in_one_line(llama_folder, spm_models, tmp_path, capsys):
    folder = tmp_path / "unigram"
    shutil.copytree(llama_folder, folder)
    shutil.copy(spm_models["unigram"], folder / "tokenizer.model")
    assert main(["--from-hf", str(folder), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tokenizer.model: trainer_spec.model_type UNIGRAM" in err
    assert not (tmp_path / "m").exists() and os.listdir(folder) == os.listdir(llama_folder)
