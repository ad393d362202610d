"""Imported models answer as transformers does, through posenc.v1 and the openai SDK: generation stops at the
end-of-sequence ids of generation_config.json (a list), not before min_new_tokens tokens where one is asked for
(transformers' min_new_tokens is the reference), and the text is the
tokenizers library's decode of prompt + completion less the prompt's, for a GPT-2 with a ByteLevel BPE and a
LLaMA with a SentencePiece-style tokenizer (Metaspace spaces, byte fallback), with non-ASCII prompts."""

import grpc
import openai
import pytest
import torch
from tokenizers import Tokenizer

from client.api import joined
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.http.openai_reference import check_offsets
from tests.serving import start

MODELS = {"gpt2": "bytelevel", "llama": "sentencepiece"}
PROMPT = "The value of 中文 is"
N = 24
pytestmark = pytest.mark.xdist_group("hf-answers")  # one worker imports the two models once (make test)


def greedy(model, ids, n):
    """The model's greedy continuation with no end of sequence (one full forward per token)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """Per family: a folder whose generation_config.json lists an end-of-sequence id that greedy decoding of PROMPT
    reaches after a few tokens (beside the tokenizer's own), the transformers model loaded from it, the tokenizer,
    and a worker (gRPC and HTTP) serving the imported artifacts."""
    import transformers as tf

    from export.hf import import_artifact
    from tests.hf.tokenizer_kinds import save_model

    root = tmp_path_factory.mktemp("answers")
    out = {}
    for family, kind in MODELS.items():
        folder = root / "hf" / family
        model = save_model(family, kind, folder, seed=4)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        ids = tok.encode(PROMPT).ids
        cont = greedy(model, ids, 12)
        stop_id = next(t for k, t in enumerate(cont) if k >= 3 and t not in cont[:k])
        model.generation_config.eos_token_id = [model.config.eos_token_id, stop_id]
        model.save_pretrained(folder, safe_serialization=True)
        ref = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        import_artifact(folder, root / "artifacts" / family, validation_max_length=16, interventions=False)
        out[family] = {"ref": ref, "tok": tok, "ids": ids, "root": root / "artifacts"}
    srv = start(root / "artifacts", http_port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="unused", max_retries=0, timeout=60)
    yield out, posenc_pb2_grpc.PosencStub(channel), sdk
    sdk.close()
    channel.close()
    srv.stop(grace=1)


def reference(f, n=N, least=0, ids=None):
    ids = torch.tensor([ids or f["ids"]])
    with torch.no_grad():
        seq = f["ref"].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=least,
                                do_sample=False)
    return seq[0, ids.shape[1]:].tolist()


def own_logprobs(f, ids, cont):
    """The model's own log-probability of each token of cont after ids (one forward pass, nothing masked)."""
    with torch.no_grad():
        logp = torch.log_softmax(f["ref"](input_ids=torch.tensor([ids + cont])).logits[0].double(), -1)
    return [float(logp[len(ids) - 1 + j, t]) for j, t in enumerate(cont)]


def text_of(f, completion):
    tok, ids = f["tok"], f["ids"]
    return tok.decode(ids + completion, skip_special_tokens=True)[len(tok.decode(ids, skip_special_tokens=True)):]


@pytest.mark.parametrize("family", MODELS)
def test_generate_stops_at_the_end_of_sequence_as_transformers_does(answers, family):
    out, stub, _ = answers
    f = out[family]
    want = reference(f)
    assert len(want) < N and want[-1] in f["ref"].generation_config.eos_token_id  # the reference did stop
    msgs = list(stub.Generate(pb.GenerateRequest(model=family, prompt=pb.Prompt(text=PROMPT), max_new_tokens=N),
                              timeout=60))
    assert [m.token.id for m in msgs] == want
    assert [m.finish_reason for m in msgs] == [""] * (len(want) - 1) + ["stop"]
    assert msgs[-1].text == text_of(f, want[:-1])  # the end of sequence is not text
    longer = list(stub.Generate(pb.GenerateRequest(model=family, prompt=pb.Prompt(text=PROMPT), max_new_tokens=N,
                                                   ignore_eos=True), timeout=60))
    assert len(longer) == N and longer[-1].finish_reason == "length"
    assert [m.token.id for m in longer][:len(want)] == want


@pytest.mark.parametrize("family", MODELS)
def test_min_new_tokens_holds_the_end_of_sequence_back_as_transformers_does(answers, family):
    """posenc.v1's min_new_tokens and the OpenAI routes' min_tokens: the tokens are transformers' generate() with
    min_new_tokens (the end of sequence it would have chosen replaced by the most likely other token, and chosen
    again after), for a lone stream, for two prompts decoded side by side in one batch and streamed; the
    log-probabilities stay the model's own (a forward pass, nothing masked); sampled streams that end early without
    it never do with it; a value above the tokens asked for is refused naming the caller's field."""
    out, stub, sdk = answers
    f = out[family]
    plain = reference(f)
    eos = set(f["ref"].generation_config.eos_token_id)
    for least in (len(plain) + 2, N):
        want = reference(f, least=least)
        assert want[:len(plain) - 1] == plain[:-1] and want[len(plain) - 1] not in eos  # it was held back
        msgs = list(stub.Generate(pb.GenerateRequest(model=family, prompt=pb.Prompt(text=PROMPT), max_new_tokens=N,
                                                     min_new_tokens=least), timeout=60))
        assert [m.token.id for m in msgs] == want
        assert not eos & set(want[:least]) and len(want) >= least
        assert msgs[-1].finish_reason == ("length" if len(want) == N else "stop")
        assert [m.logprob for m in msgs] == pytest.approx(own_logprobs(f, f["ids"], want), abs=1e-4)
    other = f["tok"].encode("Another prompt, and a longer one: 中文").ids
    least = len(plain) + 2
    c = sdk.completions.create(model=family, prompt=[f["ids"], other], max_tokens=N, temperature=0, logprobs=0,
                               extra_body={"min_tokens": least})
    for choice, ids in zip(c.choices, (f["ids"], other), strict=True):
        want = reference(f, least=least, ids=ids)
        assert choice.text == text_of({**f, "ids": ids}, [t for t in want if t not in eos])
        assert choice.finish_reason == ("length" if len(want) == N else "stop")
        assert choice.logprobs.token_logprobs == pytest.approx(own_logprobs(f, ids, want), abs=1e-4)
    streamed = list(sdk.completions.create(model=family, prompt=PROMPT, max_tokens=N, temperature=0, stream=True,
                                           extra_body={"min_tokens": least}))
    assert "".join(x.choices[0].text for x in streamed) == text_of(f, [t for t in reference(f, least=least)
                                                                       if t not in eos])
    ended = 0
    for seed in range(8):  # sampled near the greedy path, which reaches an end of sequence
        ask = dict(model=family, prompt=pb.Prompt(text=PROMPT), max_new_tokens=N, temperature=0.3, seed=seed)
        free = list(stub.Generate(pb.GenerateRequest(**ask), timeout=60))
        ended += len(free) < N and free[-1].token.id in eos
        held = list(stub.Generate(pb.GenerateRequest(**ask, min_new_tokens=N), timeout=60))
        assert len(held) == N and not eos & {m.token.id for m in held}
    assert ended >= 2  # without min_new_tokens the same draws end early
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(model=family, prompt=pb.Prompt(text=PROMPT), max_new_tokens=4,
                                              min_new_tokens=5), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_new_tokens" in err.value.details()
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=family, prompt=PROMPT, max_tokens=4, extra_body={"min_tokens": 5})
    assert bad.value.body["param"] == "min_tokens"


@pytest.mark.parametrize("family", MODELS)
def test_generate_text_grows_by_whole_characters_to_the_whole_decode(answers, family):
    """Sampled streams (random weights pick byte pieces too): each message's text is a beginning of the final text,
    the final text the whole decode less the prompt's, wherever the tokenizer's decode keeps earlier text."""
    from tests.hf.test_detokenize import settled

    out, stub, _ = answers
    f = out[family]
    checked = 0
    for seed in range(5, 17):
        msgs = list(joined(stub.Generate(pb.GenerateRequest(model=family, prompt=pb.Prompt(text=PROMPT),
                                                            max_new_tokens=N, ignore_eos=True, temperature=1.0,
                                                            seed=seed), timeout=60)))
        ids = [m.token.id for m in msgs]
        if not settled(f["tok"], f["ids"] + ids, len(f["ids"])):
            continue  # byte pieces that join no character: the decode rewrites earlier text (see settled)
        assert msgs[-1].text == text_of(f, ids)
        assert all(msgs[-1].text.startswith(m.text) for m in msgs)
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("family", MODELS)
def test_openai_completion_text_stops_and_streams_like_transformers(answers, family):
    out, _, sdk = answers
    f = out[family]
    want = reference(f)
    c = sdk.completions.create(model=family, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=3)
    choice = c.choices[0]
    assert choice.text == text_of(f, want[:-1]) and choice.finish_reason == "stop"
    assert c.usage.completion_tokens == len(want)
    lp = choice.logprobs
    assert len(lp.tokens) == len(want)  # the end of sequence is scored (as vLLM does), though it is no text
    assert lp.text_offset[-1] == len(choice.text)
    # every other token, a bytes: one included, where the tokenizers library's decodes of the prefixes put it
    check_offsets(f["tok"], f["ids"] + want[:-1], choice.text, lp.tokens[:-1], lp.text_offset[:-1], keep=False,
                  skip=len(f["ids"]))
    streamed = list(sdk.completions.create(model=family, prompt=PROMPT, max_tokens=N, temperature=0, stream=True))
    assert "".join(x.choices[0].text for x in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("family", MODELS)
def test_echo_of_token_ids_is_the_decoded_prompt(answers, family):
    out, _, sdk = answers
    f = out[family]
    text = "Hello world there, 中文 reve"
    ids = f["tok"].encode(text).ids
    c = sdk.completions.create(model=family, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert c.choices[0].text == f["tok"].decode(ids) == text
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    # every token where the tokenizers library's decodes of the prefixes put it; each byte of 中文 where its
    # character starts (a bytes: token)
    assert check_offsets(f["tok"], ids, text, lp.tokens, lp.text_offset, keep=True) == \
        sum(t.startswith("bytes:") for t in lp.tokens) >= 2


def test_an_imported_models_own_length_is_its_limit_unless_the_worker_allows_longer(answers, tmp_path):
    from service.settings import Limits

    out, stub, sdk = answers
    info = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
    own = out["llama"]["ref"].config.max_position_embeddings
    assert info["llama"].max_model_len == own and info["llama"].max_positions == 0  # rope: no table
    assert {m.id: m.max_model_len for m in sdk.models.list().data}["llama"] == own
    with pytest.raises(openai.BadRequestError, match="max_position_embeddings") as err:
        sdk.completions.create(model="llama", prompt=[5] * (own + 1), max_tokens=1)
    assert err.value.body["param"] == "prompt"
    c = sdk.completions.create(model="llama", prompt=[5] * (own - 2), max_tokens=8, temperature=0,
                               extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 2 and c.choices[0].finish_reason == "length"
    root = next(iter(out.values()))["root"]
    longer = start(root, limits=Limits(long_context=True))
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{longer.port}")
        msgs = list(posenc_pb2_grpc.PosencStub(ch).Generate(pb.GenerateRequest(
            model="llama", prompt=pb.Prompt(tokens=pb.TokenIds(ids=[5] * (own + 1))), max_new_tokens=2,
            ignore_eos=True), timeout=60))
        assert len(msgs) == 2
        ch.close()
    finally:
        longer.stop(grace=1)
