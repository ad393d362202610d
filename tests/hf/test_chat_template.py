"""Chat templates as the exporter records them and the worker renders them (export.hf.chat_template ->
model.json's tokenizer entry -> service.chat_template), against transformers' own
AutoTokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) on the same saved folder,
for the template styles of tests/hf/chat_templates.py."""

from __future__ import annotations

import json

import jinja2
import pytest
from tokenizers import Tokenizer

from export.build import tokenizer_entry
from export.errors import ExportError
from export.hf import chat_template
from service import chat_template as worker_template
from service.chat_template import TemplateRaised
from service.model_json import TokenizerEntry, typed
from tests.hf.chat_templates import STYLES, write_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "  dog bites man  "}],
    [{"role": "user", "content": "Wie heißt das? 中文 🙂"}, {"role": "assistant", "content": "Ein Hund."},
     {"role": "user", "content": "And the cat?\nSay it twice."}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}, {"role": "user", "content": "e", "name": None}],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """style -> (folder, transformers' tokenizer of it, the worker's template from the exporter's entry)."""
    import transformers as tf

    out = {}
    for style in STYLES:
        folder = tmp_path_factory.mktemp(f"chat-{style}")
        write_tokenizer(style, folder)
        entry = json.loads(json.dumps(tokenizer_entry(100, {}, chat_template(folder))))  # as model.json holds it
        spec = typed(TokenizerEntry, entry)  # as the worker reads it (service/model_json.py)
        out[style] = (folder, tf.AutoTokenizer.from_pretrained(folder), worker_template.of_model(spec))
    return out


def ours(folder, template, messages, add_generation_prompt=True) -> list[int]:
    text = template.render(messages, add_generation_prompt)
    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("style", list(STYLES))
def test_prompt_ids_equal_transformers_apply_chat_template(folders, style):
    folder, hf, template = folders[style]
    rendered = 0
    for messages in CONVERSATIONS:
        try:
            want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except jinja2.TemplateError as err:  # Gemma refuses a system turn: so does the worker, with its message
            with pytest.raises(TemplateRaised, match=str(err)):
                ours(folder, template, messages)
            continue
        assert ours(folder, template, messages) == want, (style, messages)
        rendered += 1
    assert rendered >= 3
    last = CONVERSATIONS[2]
    assert ours(folder, template, last, False) == hf.apply_chat_template(last, add_generation_prompt=False,
                                                                         tokenize=True, return_dict=False)


def test_the_bos_is_written_once(folders):
    """Llama 3's tokenizer adds <|begin_of_text|> to every encoding and the template writes it too: the prompt has
    it once (the rendered text is tokenized without special tokens, as transformers does)."""
    folder, hf, template = folders["llama3"]
    ids = ours(folder, template, CONVERSATIONS[0])
    bos = hf.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids[0] == bos and ids.count(bos) == 1
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).encode("x").ids[0] == bos


def test_the_exporter_takes_the_default_template_and_the_special_tokens(folders):
    gemma = chat_template(folders["gemma"][0])
    assert gemma["template"] == folders["gemma"][1].chat_template["default"]
    assert gemma["tokens"]["bos_token"] == "<s>" and gemma["tokens"]["eos_token"] == "</s>"
    llama3 = chat_template(folders["llama3"][0])  # from chat_template.jinja
    assert llama3["template"] == folders["llama3"][1].chat_template
    assert llama3["tokens"]["bos_token"] == "<|begin_of_text|>"


def test_folders_without_a_usable_template(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert chat_template(folder) is None
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "rag", "template": "x"}]}))
    with pytest.raises(ExportError, match="none named 'default'"):
        chat_template(folder)


def test_the_sandbox_refuses_what_transformers_refuses():
    template = worker_template.ChatTemplate("{{ messages.__class__ }}{% set ns = namespace() %}"
                                            "{% set ns._x = 1 %}")
    with pytest.raises(TemplateRaised):
        template.render([{"role": "user", "content": "x"}])
    template = worker_template.ChatTemplate("{{ ''.__class__.__mro__ }}")
    with pytest.raises(TemplateRaised, match="unsafe|access"):
        template.render([])
