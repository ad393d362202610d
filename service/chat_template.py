"""A model's chat template, rendered as transformers' `apply_chat_template` renders it.

The template is the Jinja source the exporter took from the Hugging Face folder (tokenizer_config.json's
`chat_template`, its "default" entry when it is a list of named templates, or chat_template.jinja) and recorded in
model.json's tokenizer entry with the special token strings the template may use (artifact file
chat_template.jinja).  It runs in Jinja2's immutable sandbox with trim_blocks, lstrip_blocks, the loopcontrols
extension and transformers' `{% generation %}` block (its body rendered as it is); the globals are raise_exception
(a 400 with the template's message), strftime_now, and restricted `dict` and `namespace` (no underscore names);
`tojson` writes JSON as json.dumps does, non-ASCII kept, never HTML-escaped.  The variables are those transformers
passes: `messages`, `tools` and `documents` (null here), `add_generation_prompt`, and the named special tokens
(bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token) the model's tokenizer has.  The
messages are as transformers and vLLM hand them to a template: keys whose value is null dropped; a turn's reasoning
(`reasoning_content`, `thinking` or `reasoning`) under both `reasoning_content` and `thinking`; an assistant's
`tool_calls[].function.arguments` as the object its JSON string holds ({} for an empty, undecodable or non-object
one), an empty `tool_calls` dropped.  The rendered text is tokenized without adding special tokens (the template
writes the BOS where the model wants one), as transformers' apply_chat_template(tokenize=True) does."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

from service.errors import InvalidArgument
from service.model_json import TokenizerEntry

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# the names a turn's reasoning comes under, the first found taken (transformers' _REASONING_FIELDS)
REASONING = ("reasoning_content", "thinking", "reasoning")


class TemplateRaised(InvalidArgument):
    """The template refused the conversation (its raise_exception), or failed on it: a 400 with its message."""


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _safe_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r} on a namespace")


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace() without underscore attributes (a template cannot reach Python's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 -- Namespace's own signature: self is args[0]
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _safe_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _safe_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _Dict:
    """dict() for templates: builds a dict, exposes no class to walk from."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens for training masks):
    the body is rendered as a call block, as transformers renders it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env


class ChatTemplate:
    """A compiled template and the special token strings it is rendered with."""

    def __init__(self, source: str, tokens: dict[str, str] | None = None):
        try:
            self.template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as err:
            raise ValueError(f"the chat template does not compile: {err} (line {err.lineno})") from None
        self.source = source
        self.tokens = {k: v for k, v in (tokens or {}).items() if k in SPECIAL_TOKENS and isinstance(v, str)}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for these messages (each a dict with at least role and content)."""
        plain = [template_message(m, i) for i, m in enumerate(messages)]
        try:
            return self.template.render(messages=plain, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.tokens)
        except jinja2.exceptions.TemplateError as err:  # raise_exception, an undefined call, the sandbox
            raise TemplateRaised(f"the model's chat template refused the messages: {err}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise TemplateRaised(f"the model's chat template failed on the messages: "
                                 f"{type(err).__name__}: {err}") from None


def template_message(message: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """One message as the template sees it (a new dict; the caller's is left as it is): null keys dropped, as
    transformers drops them; reasoning under both names transformers gives it; tool-call arguments decoded as vLLM
    decodes them."""
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in REASONING if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    calls = out.get("tool_calls")
    if out.get("role") == "assistant" and isinstance(calls, list):
        if calls:
            out["tool_calls"] = [_tool_call(call, f"messages[{index}].tool_calls[{j}]") for j, call in enumerate(calls)]
        else:  # an empty list would take most templates down their tool-call path
            del out["tool_calls"]
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """A tool call with its function's arguments as an object: its JSON string decoded, {} when that is empty, not
    JSON or not an object (vLLM's rule: a bad call in the history does not lock the conversation)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        err = TemplateRaised(f"{where} must be an object of type 'function' with a 'function' object")
        err.param = where
        raise err
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


@functools.lru_cache(maxsize=64)
def _compiled(source: str, tokens: tuple[tuple[str, str], ...]) -> ChatTemplate:
    return ChatTemplate(source, dict(tokens))


def of_model(spec: TokenizerEntry) -> ChatTemplate | None:
    """The chat template model.json's tokenizer entry records (compiled once per source), or None."""
    entry = spec.chat_template
    if entry is None:
        return None
    return _compiled(entry.template, tuple(sorted(entry.tokens.items())))
