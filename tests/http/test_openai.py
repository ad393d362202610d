"""OpenAI-compatible completions, driven by the official openai SDK against a real worker: greedy text is
posenc.v1 Generate's (cut before a stop string), log-probabilities, top candidates and text offsets are transformers'
and the tokenizers library's (a tiny LLaMA with Llama-2's tokenizer layout, <s> first), streams end with [DONE],
errors are the SDK's exceptions."""

import json

import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from protos.posenc.v1 import posenc_pb2 as pb
from tests.http.openai_reference import check_offsets, clean, forward_logprobs, greedy, top_written, written
from tests.serving import start

on_llama = pytest.mark.xdist_group("openai-llama")  # one worker builds the imported model (make test)
TEXT = "Hello world, 中文 3 is (a, b) = 7; x.y"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny LLaMA built with transformers (random weights) with Llama-2's tokenizer layout: <s> before every
    encoding, Metaspace spaces, byte fallback (tests/hf/tokenizer_kinds.py's sentencepiece-bos), imported and served.
    The head's row of each one-character piece's byte piece (`<0x33>` for `3`) is that piece's row plus a little
    noise, so two top candidates often write the same text.  Yields (the transformers model, the tokenizer, an openai
    SDK client of the worker)."""
    import torch
    import transformers as tf

    from export.hf import import_artifact
    from tests.hf.tokenizer_kinds import save_model

    root = tmp_path_factory.mktemp("openai-llama")
    folder = root / "hf" / "llama"
    model = save_model("llama", "sentencepiece-bos", folder, seed=3)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        head = model.lm_head.weight
        for piece, i in vocab.items():
            byte = vocab.get(f"<0x{ord(piece):02X}>") if len(piece) == 1 and piece.isascii() else None
            if byte is not None:
                head[byte] = head[i] + 0.02 * torch.randn(head.shape[1], generator=g)
    model.save_pretrained(folder, safe_serialization=True)
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    import_artifact(folder, root / "artifacts" / "llama", validation_max_length=16, interventions=False)
    srv = start(root / "artifacts", http_port=0)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    yield ref, tok, client
    client.close()
    srv.stop(grace=1)


def generate(stub, model, text, n, **kw):
    return list(stub.Generate(pb.GenerateRequest(model=model, prompt=pb.Prompt(text=text), max_new_tokens=n, **kw),
                              timeout=60))


def test_models_list(sdk, server):
    assert sorted(m.id for m in sdk.models.list().data) == sorted(server.registry.models)
    assert sdk.models.retrieve("rope").owned_by == "posenc"


def test_greedy_completion_equals_generate(sdk, stub):
    c = sdk.completions.create(model="rope", prompt="The cat sat", max_tokens=12, temperature=0)
    want = generate(stub, "rope", "The cat sat", 12)
    assert c.object == "text_completion" and c.model == "rope"
    assert c.choices[0].text == want[-1].text and c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (11, 12, 23)


def test_a_list_of_prompts_gets_one_choice_each(sdk, stub):
    prompts = ["dog bites man", "man bites dog"]
    c = sdk.completions.create(model="alibi", prompt=prompts, max_tokens=6, temperature=0)
    assert [x.index for x in c.choices] == [0, 1]
    assert [x.text for x in c.choices] == [generate(stub, "alibi", p, 6)[-1].text for p in prompts]


def test_stream_ends_with_done_and_adds_up_to_the_text(sdk, web):
    args = dict(model="rope", prompt="Once upon", max_tokens=10, temperature=0)
    whole = sdk.completions.create(**args).choices[0].text
    chunks = list(sdk.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    status, headers, body = web.call("POST", "/v1/completions", {**args, "stream": True,
                                                                 "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[-3][len("data: "):])["usage"]["completion_tokens"] == 10


@on_llama
@pytest.mark.parametrize("as_ids", [True, False], ids=["token-ids", "string"])
def test_echo_logprobs_and_top_candidates_are_transformers(llama, as_ids):
    """Scoring as lm-evaluation-harness does it (echo, max_tokens 0): each prompt token's log-probability is
    transformers', and top_logprobs has the keys the tokenizers library's decode writes for transformers' top 5,
    one per text with the highest log-probability among the tokens that write it."""
    ref, tok, sdk = llama
    ids = tok.encode(TEXT).ids
    assert ids[0] == tok.token_to_id("<s>")
    c = sdk.completions.create(model="llama", prompt=ids if as_ids else TEXT, max_tokens=0, echo=True, logprobs=5)
    lp = c.choices[0].logprobs
    assert c.usage.prompt_tokens == len(ids) == len(lp.tokens) and c.choices[0].finish_reason == "length"
    want = forward_logprobs(ref, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], [float(want[i - 1, ids[i]]) for i in range(1, len(ids))],
                               atol=1e-4)
    shared = 0  # positions where two of the top 5 write the same text
    for i in range(1, len(ids)):
        top = lp.top_logprobs[i]
        assert max(top.values()) == pytest.approx(float(want[i - 1].max()), abs=1e-4)
        if not clean(tok, ids[:i], keep=as_ids):
            continue  # after part of a character: a candidate's text is not its own alone
        expected, dup = top_written(tok, ids[:i], want[i - 1], 5, keep=as_ids)
        assert sorted(top) == sorted(expected), i
        assert [top[k] for k in sorted(top)] == pytest.approx([expected[k] for k in sorted(top)], abs=1e-4), i
        shared += dup
    assert shared >= 3  # the case that dict() got wrong is here


@on_llama
def test_generated_logprobs_are_transformers_streamed_or_not(llama):
    """A greedy completion's tokens, log-probabilities, top candidates (keys and values) and offsets are
    transformers' and the tokenizers library's, the same streamed; lm-evaluation-harness's is_greedy check (the
    most likely key of top_logprobs is the token) holds for every token."""
    ref, tok, sdk = llama
    ids = tok.encode("The value of x = 3, 中 and").ids
    n = 16
    cont = greedy(ref, ids, n)
    want = forward_logprobs(ref, ids + cont)
    args = dict(model="llama", prompt=ids, max_tokens=n, temperature=0, logprobs=5, extra_body={"ignore_eos": True})
    c = sdk.completions.create(**args)
    lp = c.choices[0].logprobs
    assert c.usage.completion_tokens == n
    at = [len(ids) - 1 + j for j in range(n)]
    np.testing.assert_allclose(lp.token_logprobs, [float(want[t, cont[j]]) for j, t in enumerate(at)], atol=1e-4)
    assert lp.tokens == [written(tok, ids + cont[:j], cont[j], keep=False) for j in range(n)]
    for j, t in enumerate(at):
        top = lp.top_logprobs[j]
        assert max(top, key=top.get) == lp.tokens[j], j  # is_greedy
        if clean(tok, ids + cont[:j], keep=False):
            expected, _ = top_written(tok, ids + cont[:j], want[t], 5, keep=False)
            assert sorted(top) == sorted(expected), j
            assert [top[k] for k in sorted(top)] == pytest.approx([expected[k] for k in sorted(top)], abs=1e-4)
    check_offsets(tok, ids + cont, c.choices[0].text, lp.tokens, lp.text_offset, keep=False, skip=len(ids))
    chunks = [x.choices[0].logprobs for x in sdk.completions.create(**args, stream=True) if x.choices[0].logprobs]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for x in chunks for v in getattr(x, key)] == getattr(lp, key), key


@on_llama
def test_logprobs_0_gives_each_greedy_tokens_own_and_none_gives_the_same_text(llama):
    """logprobs: 0 asks for each token's own log-probability and no candidates (the decode loop's argmax rows, which
    compute it only when asked): transformers' value at every token; without logprobs the same tokens, none
    written."""
    ref, tok, sdk = llama
    ids = tok.encode("Seven times six is").ids
    n = 12
    cont = greedy(ref, ids, n)
    want = forward_logprobs(ref, ids + cont)
    args = dict(model="llama", prompt=ids, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    with_lp = sdk.completions.create(**args, logprobs=0)
    lp = with_lp.choices[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs, [float(want[len(ids) - 1 + j, cont[j]]) for j in range(n)],
                               atol=1e-4)
    assert lp.top_logprobs == [{}] * n
    plain = sdk.completions.create(**args)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].text == with_lp.choices[0].text
    streamed = list(sdk.completions.create(**args, stream=True))
    assert all(x.choices[0].logprobs is None for x in streamed if x.choices)
    assert "".join(x.choices[0].text for x in streamed if x.choices) == with_lp.choices[0].text


@on_llama
@pytest.mark.parametrize("as_ids", [True, False], ids=["token-ids", "string"])
def test_echo_text_and_every_offset_agree_with_a_bos(llama, as_ids):
    """The echo of token ids is their decode with special tokens kept (<s> is text, as vLLM and OpenAI echo it); a
    string is echoed as sent, its <s> listed by name where the text starts.  Every token, a `bytes:` one included,
    starts where the tokenizers library's decodes of the prefixes put it, in the echo and in the completion after
    it."""
    ref, tok, sdk = llama
    ids = tok.encode(TEXT).ids
    c = sdk.completions.create(model="llama", prompt=ids if as_ids else TEXT, max_tokens=8, temperature=0,
                               echo=True, logprobs=1, extra_body={"ignore_eos": True})
    text, lp = c.choices[0].text, c.choices[0].logprobs
    echo = tok.decode(ids, skip_special_tokens=False) if as_ids else TEXT
    assert text.startswith(echo) and echo.startswith("<s> Hello" if as_ids else "Hello")
    assert lp.tokens[0] == "<s>" and lp.text_offset[0] == 0
    p = len(ids)
    assert check_offsets(tok, ids, text[:len(echo)], lp.tokens[:p], lp.text_offset[:p], keep=as_ids) == 6  # 中文
    cont = greedy(ref, ids, 8)
    check_offsets(tok, ids + cont, text, lp.tokens[p:], lp.text_offset[p:], keep=False, skip=p, shift=len(echo))


def test_stop_cuts_the_text_before_the_stop_string(sdk, stub):
    """docs/openai.md: greedy text is Generate's cut before the first stop string, where Generate's own text keeps
    the stop string (and the rest of the token that completed it)."""
    full = generate(stub, "rope", "stop here", 20)[-1].text
    stop = full[5:7]
    c = sdk.completions.create(model="rope", prompt="stop here", max_tokens=20, temperature=0, stop=[stop])
    assert c.choices[0].text == full[:full.find(stop)] and c.choices[0].finish_reason == "stop"
    kept = generate(stub, "rope", "stop here", 20, stop=[stop])
    assert kept[-1].finish_reason == "stop" and kept[-1].text.startswith(c.choices[0].text + stop)
    streamed = "".join(x.choices[0].text for x in sdk.completions.create(
        model="rope", prompt="stop here", max_tokens=20, temperature=0, stop=stop, stream=True))
    assert streamed == c.choices[0].text


def test_seeded_sampling_equals_generate_with_the_seed(sdk, stub):
    args = dict(model="rope", prompt="random", max_tokens=8, temperature=1.0, seed=7)
    a, b = (sdk.completions.create(**args).choices[0].text for _ in range(2))
    assert a == b == generate(stub, "rope", "random", 8, temperature=1.0, seed=7)[-1].text


def test_errors_are_the_sdk_exceptions(sdk):
    with pytest.raises(openai.BadRequestError, match="has no chat template"):  # a byte model: no template
        sdk.chat.completions.create(model="rope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        sdk.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens") as err:
        sdk.completions.create(model="rope", prompt="x", max_tokens=10**6)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="logprobs") as err:
        sdk.completions.create(model="rope", prompt="x", logprobs=9)
    assert err.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError, match="prompt"):
        sdk.completions.create(model="rope", prompt=[])


def test_a_streamed_chunk_carries_its_tokens_logprobs_and_they_add_up_to_the_answer(sdk, web):
    """A byte model writes a character of several bytes in several tokens: a streamed chunk goes out with text (or
    the choice's end, or HELD tokens), so a token that lets out no text rides with the next that does, and the
    chunks' logprobs arrays, joined, are the unary answer's (tokens, log-probabilities, candidates, offsets)."""
    from service.http.completion import HELD

    args = dict(model="rope", prompt="Once upon a time", max_tokens=48, temperature=1.0, seed=5, logprobs=3,
                echo=True)
    whole = sdk.completions.create(**args).choices[0]
    assert any(t.startswith("bytes:") for t in whole.logprobs.tokens)  # tokens that are part of a character
    chunks = [x.choices[0] for x in sdk.completions.create(**args, stream=True)]
    assert "".join(c.text for c in chunks) == whole.text
    carried = [c for c in chunks if c.logprobs is not None]
    joined = {key: [v for c in carried for v in getattr(c.logprobs, key)] for key in
              ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined["tokens"] == whole.logprobs.tokens and joined["text_offset"] == whole.logprobs.text_offset
    # the same values, within float32's rounding: the second request's prompt may come from the prefix cache
    assert joined["token_logprobs"] == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)
    assert [sorted(top or {}) for top in joined["top_logprobs"]] == [sorted(top or {}) for top in
                                                                    whole.logprobs.top_logprobs]
    assert [top and sorted(top.values()) for top in joined["top_logprobs"]] == [
        top and pytest.approx(sorted(top.values()), abs=1e-5) for top in whole.logprobs.top_logprobs]
    tokens = carried[1:]  # the first is the echo
    assert sum(len(c.logprobs.tokens) for c in tokens) == 48
    assert all(c.text or len(c.logprobs.tokens) == HELD for c in tokens[:-1])
    assert all(1 <= len(c.logprobs.tokens) <= HELD for c in tokens)
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    status, _, body = web.call("POST", "/v1/completions", {**args, "stream": True})  # the wire: OpenAI's shape
    events = [json.loads(e[len("data: "):]) for e in body.decode().split("\n\n") if e and e != "data: [DONE]"]
    assert status == 200 and all(set(e["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
                                 for e in events)
