"""/v1/chat/completions, /v1/tokenize and /v1/detokenize on a served imported model with gemma-2-it's chat template
(tests/hf/chat_templates.py: SentencePiece with a BOS post-processor, turns ending at <end_of_turn>), driven by
the openai SDK: greedy content equals transformers' generate() on the ids of transformers' apply_chat_template,
decoded as a completion's text is defined (the tokenizers library's decode of prompt + completion less the
prompt's, special tokens skipped); log-probabilities equal transformers' forward; token ids equal the tokenizers
library's."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import openai
import pytest

from tests.http.openai_reference import forward_logprobs, greedy, written
from tests.serving import start

MESSAGES = [{"role": "user", "content": "dog bites man"}, {"role": "assistant", "content": "man bites dog"},
            {"role": "user", "content": "Wie heißt das auf 中文?"}]
pytestmark = pytest.mark.xdist_group("chat")  # one worker imports the model once (make test)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(transformers' model, its tokenizer, the tokenizers library's, the SDK client, the HTTP base URL).  The
    head's <end_of_turn> row is made to win within a few tokens, so greedy generation ends its turn."""
    import torch
    import transformers as tf

    from export import artifact
    from export.hf import import_artifact
    from tests.hf.chat_templates import save_chat_model

    root = tmp_path_factory.mktemp("chat")
    folder = root / "hf" / "gemma"
    model, tok = save_chat_model("gemma", folder, seed=16)
    hf_tok = tf.AutoTokenizer.from_pretrained(folder)
    ids = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        plain = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0]
        eot = tok.token_to_id("<end_of_turn>")
        model.lm_head.weight[eot] = 4 * model.lm_head.weight[int(plain[len(ids) + 3])]
    model.save_pretrained(folder, safe_serialization=True)
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    import_artifact(folder, root / "artifacts" / "gemma", validation_max_length=16, interventions=False)
    # the same model without a template: model.json's tokenizer entry and the file removed, the manifest rewritten
    plain_dir = root / "artifacts" / "plain"
    shutil.copytree(root / "artifacts" / "gemma", plain_dir)
    meta = json.loads((plain_dir / artifact.MODEL_JSON).read_text())
    del meta["tokenizer"]["chat_template"]
    artifact.write_json(plain_dir / artifact.MODEL_JSON, meta)
    (plain_dir / "chat_template.jinja").unlink()
    artifact.write_manifest(plain_dir, json.loads((plain_dir / artifact.MANIFEST).read_text())["validation"])
    srv = start(root / "artifacts", http_port=0)
    base = f"http://127.0.0.1:{srv.http_port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    yield ref, hf_tok, tok, client, base, root / "artifacts" / "gemma"
    client.close()
    srv.stop(grace=1)


def reference(served, messages, n):
    """(prompt ids, transformers' greedy new ids, their text, finish reason)."""
    import torch

    ref, hf_tok, tok = served[:3]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0].tolist()
    new = out[len(ids):]
    text = tok.decode(ids + new, skip_special_tokens=True)[len(tok.decode(ids, skip_special_tokens=True)):]
    ends = ref.generation_config.eos_token_id
    return ids, new, text, "stop" if new[-1] in ends and len(new) <= n else "length"


def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(base + path, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_greedy_chat_equals_transformers_generate(served):
    ids, new, text, finish = reference(served, MESSAGES, 24)
    assert finish == "stop" and new[-1] == served[2].token_to_id("<end_of_turn>")  # the turn ended
    r = served[3].chat.completions.create(model="gemma", messages=MESSAGES, temperature=0, max_tokens=24)
    assert r.object == "chat.completion" and r.model == "gemma" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(new))
    short = served[3].chat.completions.create(model="gemma", messages=MESSAGES, temperature=0, max_tokens=2)
    assert short.choices[0].finish_reason == "length"
    assert short.choices[0].message.content == reference(served, MESSAGES, 2)[2]


def test_streamed_chat_sends_the_role_then_the_content(served):
    ids, new, text, _ = reference(served, MESSAGES, 24)
    chunks = list(served[3].chat.completions.create(model="gemma", messages=MESSAGES, temperature=0,
                                                    max_tokens=24, stream=True,
                                                    stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(new)


def test_logprobs_equal_transformers(served):
    ref, _, tok, client, _ = served[:5]
    ids, new, _, _ = reference(served, MESSAGES, 6)
    r = client.chat.completions.create(model="gemma", messages=MESSAGES, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(new)
    rows = forward_logprobs(ref, ids + new)[len(ids) - 1:]
    for i, (entry, token) in enumerate(zip(content, new, strict=True)):
        assert entry.logprob == pytest.approx(float(rows[i][token]), abs=1e-4)
        assert entry.token == written(tok, ids + new[:i], token, keep=False)
        if not entry.token.startswith("bytes:"):
            assert entry.bytes == list(entry.token.encode("utf-8"))
        top = rows[i].topk(3).values.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top, abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
    streamed = [t for c in client.chat.completions.create(model="gemma", messages=MESSAGES, temperature=0,
                                                          max_tokens=6, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]


def test_sampling_fields_are_the_completions_ones(served):
    ref, hf_tok, tok, client = served[:4]
    args = dict(model="gemma", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11)
    a, b = (client.chat.completions.create(**args).choices[0].message.content for _ in range(2))
    assert a == b
    # ignore_eos: past the end of the turn, transformers' greedy ids with no end of sequence
    ids = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    new = greedy(ref, ids, 20)
    text = tok.decode(ids + new, skip_special_tokens=True)[len(tok.decode(ids, skip_special_tokens=True)):]
    r = client.chat.completions.create(model="gemma", messages=MESSAGES, temperature=0, max_tokens=20,
                                       extra_body={"ignore_eos": True})
    assert (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, 20,
                                                                                                   "length")
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text)) if "\ufffd" not in text[i:i + 2])
    r = client.chat.completions.create(model="gemma", messages=MESSAGES, temperature=0, max_tokens=20, stop=[stop],
                                       extra_body={"ignore_eos": True})
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text[:text.index(stop)], "stop")


def test_bad_requests_answer_400_naming_the_cause(served):
    client, base = served[3], served[4]
    with pytest.raises(openai.BadRequestError, match="System role not supported"):  # the template's own error
        client.chat.completions.create(model="gemma", messages=[{"role": "system", "content": "x"}] + MESSAGES)
    with pytest.raises(openai.BadRequestError, match="'plain' has no chat template") as err:
        client.chat.completions.create(model="plain", messages=MESSAGES)
    assert err.value.body["param"] == "model"
    cases = [({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
             ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
             ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"), ({"top_logprobs": 9, "logprobs": True},
                                                                        "top_logprobs"),
             ({"n": 2}, "n"), ({"tools": [{"type": "function"}]}, "tools"),
             ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
             ({"max_completion_tokens": 4, "min_tokens": 5}, "min_tokens")]
    for change, param in cases:
        status, body = post(base, "/v1/chat/completions", {"model": "gemma", "messages": MESSAGES} | change)
        assert (status, body["error"]["param"]) == (400, param), (change, body)
    status, body = post(base, "/v1/chat/completions", {"model": "nope", "messages": MESSAGES})
    assert status == 404 and "gemma" in body["error"]["message"]


def test_tokenize_and_detokenize_equal_the_tokenizers_library(served):
    _, hf_tok, tok, _, base = served[:5]
    text = "Hello world, 中文 🙂"
    status, body = post(base, "/v1/tokenize", {"model": "gemma", "prompt": text})
    assert status == 200 and body["tokens"] == tok.encode(text).ids and body["count"] == len(body["tokens"])
    assert body["tokens"][0] == tok.token_to_id("<s>") and body["max_model_len"] > 0
    _, body = post(base, "/v1/tokenize", {"model": "gemma", "prompt": text, "add_special_tokens": False,
                                          "return_token_strs": True})
    plain = tok.encode(text, add_special_tokens=False)
    assert (body["tokens"], body["token_strs"]) == (plain.ids, plain.tokens)
    _, body = post(base, "/v1/tokenize", {"model": "gemma", "messages": MESSAGES})
    assert body["tokens"] == hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)
    ids = body["tokens"]
    status, body = post(base, "/v1/detokenize", {"model": "gemma", "tokens": ids})
    assert status == 200 and body["prompt"] == tok.decode(ids, skip_special_tokens=False)
    status, body = post(base, "/v1/detokenize", {"model": "gemma", "tokens": [1, 10**6]})
    assert (status, body["error"]["param"]) == (400, "tokens")
    status, body = post(base, "/v1/tokenize", {"model": "gemma"})
    assert (status, body["error"]["param"]) == (400, "prompt")
    status, body = post(base, "/v1/tokenize", {"model": "plain", "messages": MESSAGES})
    assert (status, body["error"]["param"]) == (400, "model")


def test_the_routes_are_in_openapi(served):
    doc = json.loads(urllib.request.urlopen(served[4] + "/openapi.json", timeout=30).read())
    for path, model in (("/v1/chat/completions", "ChatRequest"), ("/v1/tokenize", "TokenizeRequest"),
                        ("/v1/detokenize", "DetokenizeRequest")):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(model)
    assert "ChatCompletionChunk" in doc["components"]["schemas"]


def test_the_artifact_carries_the_template(served):
    """chat_template.jinja is covered by the manifest and recorded in model.json's tokenizer entry, with the
    special token strings transformers renders the template with."""
    import hashlib

    from export import artifact

    folder, hf_tok = served[5], served[1]
    manifest = artifact.verify(folder)
    data = (folder / "chat_template.jinja").read_bytes()
    assert manifest["files"]["chat_template.jinja"]["sha256"] == hashlib.sha256(data).hexdigest()
    entry = json.loads((folder / "model.json").read_text())["tokenizer"]["chat_template"]
    assert data.decode() == entry["template"] == hf_tok.chat_template["default"]
    assert entry["file"] == "chat_template.jinja" and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert {k: entry["tokens"][k] for k in ("bos_token", "eos_token")} == {"bos_token": hf_tok.bos_token,
                                                                            "eos_token": hf_tok.eos_token}
