"""Long byte-fallback runs through the worker: a tiny LLaMA (transformers, random weights) with a SentencePiece-style
tokenizer with byte fallback and Llama-2's <s> post-processor, whose greedy continuation cycles through the four
byte pieces of 🙂 (its layers write nothing, so each logit row is set by the last token alone).  Its streams are
runs of 100+ byte pieces, after a prompt that ends before a run, inside one between characters, and inside a
character; the streamed text over posenc.v1 Generate and the OpenAI front is the tokenizers library's whole decode
of transformers' own greedy ids, less the prompt's, in whole characters."""

import grpc
import openai
import pytest
import torch
from tokenizers import Tokenizer

from client.api import joined
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.serving import start

N = 120  # tokens per completion: 30 emoji, a run of 120 byte pieces
SMILE = [0xF0, 0x9F, 0x99, 0x82]
pytestmark = pytest.mark.xdist_group("detokenize-served")  # one worker imports the model once (make test)


def cycle_model(model, tok):
    """Make the model's greedy next token a function of the current token: ▁ -> <0xF0> and around 🙂's bytes
    (F0 9F 99 82 F0 ...).  With every layer's output projections zero, the last hidden state is the current
    token's embedding (normalized), and each successor's head row points along its predecessor's embedding."""
    byte = [tok.token_to_id(f"<0x{b:02X}>") for b in SMILE]
    succ = {byte[k]: byte[(k + 1) % 4] for k in range(4)} | {tok.token_to_id("▁"): byte[0]}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.normal_(0, 0.01)
        for cur, nxt in succ.items():
            head[nxt] += 10 * emb[cur] / emb[cur].norm()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from export.hf import import_artifact
    from tests.hf.tokenizer_kinds import save_model

    root = tmp_path_factory.mktemp("runs")
    folder = root / "hf"
    model = save_model("llama", "sentencepiece-bos", folder, seed=2)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cycle_model(model, tok)
    model.generation_config.eos_token_id = [tok.token_to_id("</s>")]
    model.save_pretrained(folder, safe_serialization=True)
    import_artifact(folder, root / "artifacts" / "llama", validation_max_length=16, interventions=False)
    srv = start(root / "artifacts", http_port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="unused", max_retries=0, timeout=60)
    yield model, tok, posenc_pb2_grpc.PosencStub(channel), sdk
    sdk.close()
    channel.close()
    srv.stop(grace=1)


def greedy(model, ids, n=N):
    """transformers' greedy ids (the reference for which tokens come)."""
    seq = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(seq, attention_mask=torch.ones_like(seq), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def want(tok, prompt, completion):
    whole = tok.decode(prompt + completion, skip_special_tokens=True)
    return whole[len(tok.decode(prompt, skip_special_tokens=True)):]


def prompts(tok, where):
    """(prompt ids, tokens to generate so that the run ends where a character ends): before a run ("a "), inside
    one between characters ("a 🙂🙂", the audit's case), inside a character (ids ending with 🙂's first two bytes)."""
    if where == "inside":
        return tok.encode("a 🙂").ids + [tok.token_to_id(f"<0x{b:02X}>") for b in SMILE[:2]], N - 2
    return tok.encode({"before": "a ", "between": "a 🙂🙂"}[where]).ids, N


def whole_characters(pieces, text):
    sent = ""
    for piece in pieces:
        sent += piece
        assert text.startswith(sent), (sent, text)  # no half character, nothing taken back
    assert sent == text


@pytest.mark.parametrize("where", ["before", "between", "inside"])
def test_generate_streams_a_long_run_as_the_whole_decode(served, where):
    model, tok, stub, _ = served
    ids, n = prompts(tok, where)
    ref = greedy(model, ids, n)
    assert len(ref) == n and set(ref) <= {tok.token_to_id(f"<0x{b:02X}>") for b in SMILE}  # one run of 120 pieces
    text = want(tok, ids, ref)
    assert "🙂" * 25 in text and "\ufffd" not in text
    prompt = pb.Prompt(tokens=pb.TokenIds(ids=ids))
    msgs = list(joined(stub.Generate(pb.GenerateRequest(model="llama", prompt=prompt, max_new_tokens=n), timeout=120)))
    assert [m.token.id for m in msgs] == ref
    assert msgs[-1].text == text
    assert all(text.startswith(m.text) for m in msgs)
    assert msgs[n // 2].text  # text goes out while the run goes on


@pytest.mark.parametrize("where", ["before", "between", "inside"])
def test_openai_stream_of_a_long_run_is_whole_characters(served, where):
    model, tok, _, sdk = served
    ids, n = prompts(tok, where)
    text = want(tok, ids, greedy(model, ids, n))
    chunks = [c.choices[0].text for c in sdk.completions.create(model="llama", prompt=ids, max_tokens=n,
                                                                temperature=0, stream=True)]
    whole_characters(chunks, text)
    c = sdk.completions.create(model="llama", prompt=ids, max_tokens=n, temperature=0, logprobs=1)
    assert c.choices[0].text == text
    tokens = c.choices[0].logprobs.tokens
    assert all(t.startswith("bytes:\\x") for t in tokens)  # each byte of 🙂 is part of a character
    assert [list(top)[0] for top in c.choices[0].logprobs.top_logprobs] == tokens  # greedy: top-1 is the token
