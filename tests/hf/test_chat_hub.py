"""Chat templates of Hugging Face folders as the Hub has them (written here by hand: a tokenizer_config.json naming
only the tokenizer class and the template, or no config at all and a chat_template.jinja; no special_tokens_map.json),
imported with posenc's exporter and served by a real worker over HTTP, against transformers' own
apply_chat_template on the same folder: the named special tokens a template sees are those of the tokenizer class
transformers picks (Llama-2's `<s>` before each [INST], Gemma's `<bos>`, the generic backend's pieces, GPT-2's
<|endoftext|>), transformers' {% generation %} blocks render, a turn's reasoning reaches the template under
`reasoning_content` and `thinking` whichever of those or `reasoning` it came under, and an assistant's tool-call
arguments reach it as the object their JSON string holds, as vLLM hands them to the template."""

from __future__ import annotations

import io
import json

import openai
import pytest

from export.hf import chat_template, import_artifact
from tests.hf.chat_templates import GEMMA, GENERATION, LLAMA2_CHAT, MISTRAL_INSTRUCT, NAMED_TOKENS, REASONING, TOOLS
from tests.http.test_chat import post
from tests.serving import start

pytestmark = pytest.mark.xdist_group("chat-hub")  # one worker imports the folders once (make test)

# name -> (family, tokenizer files: a tokenizer.model trained with LLaMA's or Gemma's settings, GPT-2's vocab.json +
# merges.txt, or a tokenizer.json; tokenizer_config.json, None for none; chat_template.jinja, None for none)
FOLDERS = {
    "llama2": ("llama", "llama", {"tokenizer_class": "LlamaTokenizer", "chat_template": LLAMA2_CHAT}, None),
    "mistral": ("mistral", "llama", {"tokenizer_class": "LlamaTokenizer", "chat_template": MISTRAL_INSTRUCT}, None),
    "gemma": ("gemma", "gemma", {"tokenizer_class": "GemmaTokenizer", "chat_template": GEMMA}, None),
    "gpt2": ("gpt2", "gpt2", None, NAMED_TOKENS),
    "generation": ("llama", "json", {"chat_template": GENERATION}, None),
    "reasoning": ("llama", "json", {"chat_template": REASONING}, None),
    "tools": ("llama", "json", None, TOOLS),
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "user", "content": "Wie heißt das? 中文 🙂"}, {"role": "assistant", "content": "Ein Hund."},
     {"role": "user", "content": "And the cat?"}],
]
SYSTEM = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "dog bites man"}]


def train_spm(settings: str) -> bytes:
    """A SentencePiece model with LLaMA's or Gemma's trainer settings, or SentencePiece's defaults
    (tests/hf/test_sentencepiece_import.py's MODELS)."""
    import sentencepiece as spm

    from tests.hf.test_sentencepiece_import import MODELS
    from tests.hf.tokenizer_kinds import _text

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_text()[:60]), model_writer=buf, vocab_size=400,
                                   minloglevel=2, num_threads=1, **MODELS[settings])
    return buf.getvalue()


def write_hub_folder(folder, name: str, models: dict[str, bytes]):
    """The folder FOLDERS[name] describes, with a tiny random model of its family (vocabulary 400)."""
    import torch
    import transformers as tf

    from tests.hf.helpers import hf_config, perturb, tokenizer_json
    from tests.hf.test_hub_folders import write_slow_files

    family, tokenizer, config, template = FOLDERS[name]
    if tokenizer == "gpt2":
        write_slow_files(folder, "gpt2", {})
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer in models:
        (folder / "tokenizer.model").write_bytes(models[tokenizer])
    elif tokenizer == "json":
        (folder / "tokenizer.json").write_text(tokenizer_json())
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    cfg = hf_config(family)
    cfg.vocab_size = 400
    if family != "gpt2":  # room for a ByteLevel tokenizer's long prompts
        cfg.max_position_embeddings = 1024
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    perturb(model, 0)
    model.save_pretrained(folder, safe_serialization=True)
    assert not (folder / "special_tokens_map.json").exists() and "bos_token" not in (config or {})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """name -> transformers' tokenizer of the folder; the SDK client; the HTTP base URL; the artifacts."""
    import transformers as tf

    root = tmp_path_factory.mktemp("chat-hub")
    models = {settings: train_spm(settings) for settings in ("llama", "gemma")}
    refs = {}
    for name in FOLDERS:
        folder = root / "hf" / name
        write_hub_folder(folder, name, models)
        refs[name] = tf.AutoTokenizer.from_pretrained(folder)
        import_artifact(folder, root / "artifacts" / name, validation_max_length=8, interventions=False)
    srv = start(root / "artifacts", http_port=0)
    base = f"http://127.0.0.1:{srv.http_port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    yield refs, client, base, root / "artifacts"
    client.close()
    srv.stop(grace=1)


def served_ids(served, name: str, messages: list[dict]) -> list[int]:
    """The prompt ids the worker makes of the messages: /v1/tokenize's, which the openai SDK's chat completion
    counts as its usage.prompt_tokens."""
    _, client, base, _ = served
    status, body = post(base, "/v1/tokenize", {"model": name, "messages": messages})
    assert status == 200, body
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(body["tokens"])
    return body["tokens"]


def transformers_ids(served, name: str, messages: list[dict]) -> list[int]:
    return served[0][name].apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)


@pytest.mark.parametrize("name", ["llama2", "mistral", "gemma", "gpt2"])
def test_a_template_sees_the_tokenizer_class_special_tokens(served, name):
    """The folder names no special token: the template sees the class's (transformers' special_tokens_map), as
    model.json records them, and the prompt ids are transformers'."""
    ref = served[0][name]
    for messages in CONVERSATIONS + ([SYSTEM] if name in ("llama2", "gpt2") else []):
        text = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ref.bos_token and text.count(ref.bos_token) >= 1  # the template writes it
        assert served_ids(served, name, messages) == transformers_ids(served, name, messages), messages
    meta = json.loads((served[3] / name / "model.json").read_text())
    assert meta["tokenizer"]["chat_template"]["tokens"] == ref.special_tokens_map


def test_generation_blocks_render_as_transformers_renders_them(served):
    for messages in CONVERSATIONS:
        assert served_ids(served, "generation", messages) == transformers_ids(served, "generation", messages)


REASONED = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add them"},
            {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6", "reasoning": "add again"},
            {"role": "user", "content": "4+4?"}, {"role": "assistant", "content": "8", "thinking": "once more"},
            {"role": "user", "content": "5+5?"}, {"role": "assistant", "content": "10", "thinking": "gpt-oss's",
                                                   "reasoning_content": "Qwen3's"},
            {"role": "user", "content": "thanks", "reasoning_content": None}]


def test_reasoning_reaches_the_template_under_both_names(served):
    """gpt-oss's template reads `thinking`, Qwen3's `reasoning_content`: a turn's reasoning sent under either, or
    under vLLM's `reasoning`, is rendered by both parts of the template, as transformers renders it."""
    text = served[0]["reasoning"].apply_chat_template(REASONED, add_generation_prompt=True, tokenize=False)
    assert all(text.count(r) == 2 for r in ("add them", "add again", "once more"))
    assert served_ids(served, "reasoning", REASONED) == transformers_ids(served, "reasoning", REASONED)


def calls(*arguments) -> list[dict]:
    return [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": a}}
            for i, a in enumerate(arguments)]


def tool_turns(*arguments) -> list[dict]:
    return [{"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": None, "tool_calls": calls(*arguments)},
            {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21°C"},
            {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]


def test_tool_call_arguments_reach_the_template_as_objects(served):
    """The OpenAI SDK sends each call's arguments as a JSON string; vLLM decodes it to the object Hub tool templates
    expect (`tool_call.arguments | tojson` writes it once), and empty or undecodable arguments become {}: the
    prompt is transformers' rendering of the calls with those objects."""
    sent = tool_turns(json.dumps({"city": "Zürich", "days": 2}), "", "{not json", '{"unit": "C"}')
    parsed = tool_turns({"city": "Zürich", "days": 2}, {}, {}, {"unit": "C"})
    text = served[0]["tools"].apply_chat_template(parsed, add_generation_prompt=True, tokenize=False)
    assert '"arguments": {"city": "Zürich", "days": 2}}' in text
    assert served_ids(served, "tools", sent) == transformers_ids(served, "tools", parsed)


def test_a_tool_call_that_is_not_an_object_is_a_400(served):
    _, client, base, _ = served
    messages = tool_turns("{}")
    messages[1]["tool_calls"][0] = "get_weather()"
    with pytest.raises(openai.BadRequestError, match="tool_calls"):
        client.chat.completions.create(model="tools", messages=messages, max_tokens=1)
    assert post(base, "/v1/tokenize", {"model": "tools", "messages": messages})[0] == 400


def test_the_exporter_records_the_tokens_transformers_passes(tmp_path):
    """Without a model: slow-file folders of every kind the import builds (tests/hf/test_sentencepiece_import.py's
    and test_hub_folders.py's configs) and tokenizer.json folders whose special_tokens_map.json and config disagree:
    the tokens recorded for the template are transformers' special_tokens_map."""
    import transformers as tf

    from tests.hf.helpers import tokenizer_json
    from tests.hf.test_hub_folders import FOLDERS as SLOW
    from tests.hf.test_hub_folders import write_slow_files
    from tests.hf.test_sentencepiece_import import FOLDERS as SPM
    from tests.hf.test_sentencepiece_import import write_folder

    folders = []
    for settings in ("llama", "gemma", "defaults"):
        (tmp_path / f"{settings}.model").write_bytes(train_spm(settings))
    for name, (model, model_type, config, _) in SPM.items():
        folders.append(write_folder(tmp_path / name, tmp_path / f"{model}.model", model_type, config))
    for name, (model_type, files) in SLOW.items():
        write_slow_files(tmp_path / name, model_type, files)
        folders.append(tmp_path / name)
    for name, config in {"map-over-config": {"bos_token": "<a>", "eos_token": "<e>"},
                         "decoder-ignores-map": {"bos_token": "<a>", "added_tokens_decoder": {
                             "0": {"content": "<|endoftext|>", "special": True}}}}.items():
        folders.append(tmp_path / name)
        folders[-1].mkdir()
        (folders[-1] / "tokenizer.json").write_text(tokenizer_json())
        (folders[-1] / "tokenizer_config.json").write_text(json.dumps(config))
        (folders[-1] / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<b>", "pad_token": "<p>"}))
        (folders[-1] / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for folder in folders:
        (folder / "chat_template.jinja").write_text("{{ bos_token }}")
        want = tf.AutoTokenizer.from_pretrained(folder).special_tokens_map
        assert chat_template(folder)["tokens"] == want, folder.name

