"""Chat templates as real models' Hugging Face folders carry them, on tokenizers trained here
(tests/hf/tokenizer_kinds.py) with the models' own turn tokens added as special tokens.

- chatml: Qwen2-Instruct's tokenizer_config.json `chat_template` string (a default system turn when none is
  given), a GPT-2-style ByteLevel tokenizer, <|im_start|> / <|im_end|>.
- llama3: Meta-Llama-3-8B-Instruct's template in a chat_template.jinja file (as transformers 5 saves it), a
  ByteLevel tokenizer whose post-processor puts <|begin_of_text|> before every encoding, as Llama 3's does; the
  template writes bos_token itself.
- gemma: gemma-2-2b-it's template (raise_exception on a system turn or roles that do not alternate, `trim`) as a
  list of named templates in tokenizer_config.json ("default" and another), on the SentencePiece tokenizer with
  Llama-2's BOS post-processor; turns end at <end_of_turn>.
- extras: a template using what transformers' environment adds (tojson with non-ASCII, namespace, loopcontrols,
  strftime_now, dict), on the ChatML tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, processors

from tests.hf.tokenizer_kinds import tokenizer_json

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

EXTRAS = (
    "{% set ns = namespace(turns=0) %}{% for message in messages %}{% if message['role'] == 'system' %}{% continue %}"
    "{% endif %}{% set ns.turns = ns.turns + 1 %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }} {{ dict(n=ns.turns, text=message['content']) | tojson }}<|im_end|>\n"
    "{% if ns.turns == 3 %}{% break %}{% endif %}{% endfor %}{{ strftime_now('%%') }}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Hub templates that need what transformers gives a template beyond the message list (tests/hf/test_chat_hub.py):
# Llama-2-chat's (bos_token before each user turn, eos_token after each answer: LlamaTokenizer's defaults when the
# config names none) and Mistral-7B-Instruct-v0.1's, as their repositories have them
LLAMA2_CHAT = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
MISTRAL_INSTRUCT = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
# a chat_template.jinja writing every named token the tokenizer has (GPT-2's <|endoftext|> for bos, eos and unk)
NAMED_TOKENS = (
    "{% for message in messages %}{{ bos_token }}{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{{ unk_token | default('(no unk)') }}{{ pad_token | default('(no pad)') }}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}")
# ChatML with transformers' {% generation %} blocks around the answers (SmolLM3's and others' training templates),
# in both whitespace forms
GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt -%}{%- generation -%}{{ '<|im_start|>assistant\n' }}{%- endgeneration -%}"
    "{%- endif -%}")
# the two names templates read a turn's reasoning under: gpt-oss's `thinking` (its analysis channel) and Qwen3's
# `reasoning_content` (a <think> block)
REASONING = (
    "{% for message in messages %}<|start|>{{ message['role'] }}"
    "{% if message.thinking is defined %}<|channel|>analysis<|message|>{{ message.thinking }}<|end|>"
    "<|start|>assistant{% endif %}<|message|>"
    "{% if message.reasoning_content is string %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ message['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
# Qwen2.5-Instruct's tool-call turns (Hermes style): the arguments written with tojson, a tool answer in <tool_response>
TOOLS = (
    "{%- for message in messages %}{%- if message.role == 'assistant' and message.tool_calls is defined %}"
    "{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\n<tool_call>\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")

# style -> (tokenizer kind, the special tokens it adds, bos, eos, the tokens that end a turn)
STYLES = {
    "chatml": ("bytelevel", ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"]),
    "llama3": ("bytelevel", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", ["<|endoftext|>", "<|eot_id|>"]),
    "gemma": ("sentencepiece-bos", ["<start_of_turn>", "<end_of_turn>"], "<s>", "</s>", ["</s>", "<end_of_turn>"]),
    "extras": ("bytelevel", ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>", ["<|im_end|>"]),
}
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA, "extras": EXTRAS}


def tokenizer(style: str) -> Tokenizer:
    kind, added, bos, _, _ = STYLES[style]
    tok = Tokenizer.from_str(tokenizer_json(kind))
    tok.add_special_tokens(added)
    if style == "llama3":  # Llama 3's post-processor: <|begin_of_text|> before every encoding
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def write_tokenizer(style: str, folder: Path) -> Tokenizer:
    """The style's tokenizer files and chat template, laid out as the model's Hub folder has them."""
    import transformers as tf

    _, _, bos, eos, _ = STYLES[style]
    tok = tokenizer(style)
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"bos_token": bos} if bos else {}
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, **kwargs).save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if style == "llama3":
        (folder / "chat_template.jinja").write_text(LLAMA3)
    elif style == "gemma":
        config["chat_template"] = [{"name": "rag", "template": "{{ raise_exception('not this one') }}"},
                                   {"name": "default", "template": GEMMA}]
    else:
        config["chat_template"] = TEMPLATES[style]
    config_path.write_text(json.dumps(config, indent=2))
    return tok


def save_chat_model(style: str, folder: Path, seed: int = 0):
    """A tiny random LLaMA (transformers) with the style's tokenizer and template; generation_config.json's eos
    list is the style's end-of-turn tokens.  Returns (the model, eager and in eval mode, the tokenizer)."""
    import torch
    import transformers as tf

    from tests.hf.helpers import hf_config, perturb

    tok = write_tokenizer(style, folder)
    _, _, bos, eos, ends = STYLES[style]
    cfg = hf_config("llama")
    cfg.vocab_size = max(cfg.vocab_size, tok.get_vocab_size())
    cfg.eos_token_id = tok.token_to_id(eos)
    cfg.bos_token_id = tok.token_to_id(bos) if bos else cfg.eos_token_id
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    perturb(model, seed)
    model.generation_config.eos_token_id = [tok.token_to_id(t) for t in ends]
    model.generation_config.pad_token_id = cfg.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    return model, tok
