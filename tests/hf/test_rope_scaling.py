"""Every RoPE scaling type transformers implements, imported from a tiny LlamaForCausalLM that carries it and run in
onnxruntime against transformers' eager forward: prefill below and past the original length on a left-padded
batch, and KV-cache steps across it (dynamic NTK and LongRoPE switch there).  Plus --rope-scaling, the override
at import and in rope-scale, and the refusals.

transformers computes dynamic's and longrope's frequencies from the longest row of the batch it is given (and its
dynamic module remembers the longest length it has seen); posenc computes them per row, so a request's answer
never depends on what it was batched with.  Each row is therefore compared with transformers running that row
alone, from a freshly built rotary module, through its own cache."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.__main__ import main
from tests.hf.helpers import VOCAB, perturb, tokenizer_json

L0 = 32  # the original (trained) length every scaled config names
THETA = 100.0  # a small base, so the tiny head's 8 pairs span fast and slow wavelengths over L0
LONG = [1.0 + 0.7 * i for i in range(8)]
SHORT = [1.0 + 0.05 * i for i in range(8)]
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    # DeepSeek's form: its own ramp bounds and the attention factor from two mscales (the defaults: ROTARY below)
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": L0, "beta_fast": 8.0,
             "beta_slow": 0.5, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": L0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                 "original_max_position_embeddings": L0},
}
# These come from an unscaled folder through --rope-scaling (the override at import); the others from the folder's
# own config.json.  Either way transformers runs the same weights with that scaling as the reference.
BY_OVERRIDE = ("linear", "yarn", "llama3")
# More forms of each type, checked at the rotation alone (cheap: no export) against transformers' rotary module
ROTARY = {**SCALINGS,
          "yarn-default": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0},
          "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0,
                                    "attention_factor": 0.8, "beta_fast": 16.0},
          "llama3-narrow": {"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": L0,
                            "low_freq_factor": 2.0, "high_freq_factor": 3.0},
          "longrope-attention-factor": {**SCALINGS["longrope"], "attention_factor": 1.3},
          "dynamic-2": {"rope_type": "dynamic", "factor": 2.0}}
pytestmark = pytest.mark.xdist_group("rope-scaling")  # one worker builds the artifacts once (make test)


def llama_config(rope: dict | None):
    import transformers as tf

    params = {"rope_theta": THETA, **(rope or {"rope_type": "default"})}
    # dynamic divides by max_position_embeddings; the others name their original length
    max_positions = L0 if params["rope_type"] in ("dynamic", "default") else 4 * L0
    return tf.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, intermediate_size=48, max_position_embeddings=max_positions,
                          rms_norm_eps=1e-6, rope_parameters=params, tie_word_embeddings=False, vocab_size=VOCAB,
                          bos_token_id=0, eos_token_id=0)


def save(rope: dict | None, folder):
    import tokenizers
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(llama_config(rope)).eval()
    hf.config._attn_implementation = "eager"
    perturb(hf, 0)
    hf.save_pretrained(folder, safe_serialization=True)
    tf.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer_json())).save_pretrained(
        folder)
    return hf


def reference(folder, rope: dict):
    """transformers' model from `folder`'s weights with this rope_parameters (eager attention)."""
    import transformers as tf

    hf = tf.LlamaForCausalLM.from_pretrained(folder, config=llama_config(rope)).eval()
    hf.config._attn_implementation = "eager"
    return hf


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """Per type: the folder, transformers' model and the imported artifact (one export each)."""
    root = tmp_path_factory.mktemp("rope-scaling")
    plain = root / "hf" / "plain"
    save(None, plain)
    out = {"plain": {"folder": plain}}
    for name, rope in SCALINGS.items():
        art = root / "artifacts" / name
        if name in BY_OVERRIDE:
            folder = plain
            assert main(["--from-hf", str(plain), "--out", str(art), "--rope-scaling", json.dumps(rope),
                         "--validate-max-length", "8",
                         "--interventions", "off"]) == 0
            hf = reference(plain, rope)
        else:
            folder = root / "hf" / name
            hf = save(rope, folder)
            assert main(["--from-hf", str(folder), "--out", str(art), "--validate-max-length", "8",
                         "--interventions", "off"]) == 0
        out[name] = {"folder": folder, "hf": hf, "artifact": art}
    return out


class Graph:
    def __init__(self, folder):
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.intra_op_num_threads = 1
        self.session = ort.InferenceSession(str(folder / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        self.meta = json.loads((folder / "model.json").read_text())
        self.outputs = [o["name"] for o in self.meta["outputs"]]
        self.carried = [s["input"] for s in self.meta["state"]]

    def empty(self, b):
        s = self.meta["sizes"]
        return [np.zeros((b, s["n_kv_heads"], 0, s["head_dim"]), np.float32) for _ in self.carried]

    def run(self, ids, mask, past):
        out = self.session.run(self.outputs, {"input_ids": np.asarray(ids, np.int64),
                                              "attention_mask": np.asarray(mask, np.int64),
                                              **dict(zip(self.carried, past, strict=True))})
        return out[0], out[1], out[2:]


def fresh_rotary(hf):
    """A rotary module as a freshly loaded model has it (transformers' dynamic one remembers past lengths)."""
    rotary = hf.model.rotary_emb
    hf.model.rotary_emb = type(rotary)(hf.config)


def transformers_row(hf, tokens: list[int], steps: list[int]):
    """Logits and attentions of one unpadded row in transformers: its prefill, then one cached call per step."""
    fresh_rotary(hf)
    results = []
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([tokens]), use_cache=True, output_attentions=True)
        results.append(out)
        past = out.cache
        for t in steps:
            out = hf(input_ids=torch.tensor([[t]]), cache=past, use_cache=True, output_attentions=True)
            past = out.cache
            results.append(out)
    return results


def check_row(ref, logits, attentions, n_new: int, past_real: int):
    """ref: transformers' output for this row's n_new real queries; logits (n_new, V) and attentions (layers,
    heads, n_new, S) from the graph, S ending in the row's past_real + n_new real keys."""
    d_logits = np.abs(ref.logits[0].numpy() - logits).max()
    keys = past_real + n_new
    d_attn = max(np.abs(a[0].numpy() - attentions[layer][:, :, -keys:]).max()
                 for layer, a in enumerate(ref.attentions))
    assert d_logits <= 1e-4 and d_attn <= 3e-5, (d_logits, d_attn)
    return d_logits


@pytest.mark.parametrize("name", ROTARY)
def test_rotation_equals_transformers_rotary_module(name):
    """posenc's rope (the config the importer builds) rotates queries and keys as transformers' rotary module does,
    at lengths below, at and past L0, each from a fresh module."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from model.config import ModelConfig
    from model.hf.families.base import Fields
    from model.variants.rope import Rope

    hf_cfg = llama_config(ROTARY[name])
    data = {"rope_parameters": ROTARY[name], "rope_theta": THETA,
            "max_position_embeddings": hf_cfg.max_position_embeddings}
    cfg = ModelConfig(variant="rope", d_model=32, n_heads=2, d_head=16, context=hf_cfg.max_position_embeddings,
                      **Fields(data, "config.json").rope())
    g = torch.Generator().manual_seed(0)
    for n in (5, L0, L0 + 1, 3 * L0):
        q, k = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
        cos, sin = LlamaRotaryEmbedding(hf_cfg)(q, torch.arange(n)[None])
        want = apply_rotary_pos_emb(q, k, cos, sin)
        got = Rope(cfg).rotate(q, k, torch.arange(n)[None])
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=0), (n, (a - b).abs().max())


@pytest.mark.parametrize("name", SCALINGS)
def test_prefill_below_and_past_the_original_length_equals_transformers(scaled, name):
    entry = scaled[name]
    graph, hf = Graph(entry["artifact"]), entry["hf"]
    g = torch.Generator().manual_seed(1)
    length = 3 * L0 - 11  # rows of 85, 40 and 9 real tokens: past, just past and below L0
    real = [length, L0 + 8, 9]
    ids = torch.randint(1, 300, (3, length), generator=g)
    mask = torch.zeros(3, length, dtype=torch.int64)
    for r, n in enumerate(real):
        mask[r, length - n:] = 1
    logits, attentions, _ = graph.run(ids, mask, graph.empty(3))
    for r, n in enumerate(real):
        ref = transformers_row(hf, ids[r, length - n:].tolist(), [])[0]
        check_row(ref, logits[r, -n:], attentions[r, :, :, -n:], n, 0)


@pytest.mark.parametrize("name", SCALINGS)
def test_cache_steps_across_the_original_length_equal_transformers(scaled, name):
    """A left-padded batch decodes one token per call: row 0 crosses L0 (dynamic's base and longrope's factors
    change between two steps while the cache keeps keys rotated the earlier way, as in transformers), row 1 stays
    below it."""
    entry = scaled[name]
    graph, hf = Graph(entry["artifact"]), entry["hf"]
    g = torch.Generator().manual_seed(2)
    real, steps = [L0 - 4, 10], 8
    width = max(real)
    ids = torch.randint(1, 300, (2, width), generator=g)
    mask = torch.zeros(2, width, dtype=torch.int64)
    for r, n in enumerate(real):
        mask[r, width - n:] = 1
    new = torch.randint(1, 300, (2, steps), generator=g)
    refs = [transformers_row(hf, ids[r, width - n:].tolist(), new[r].tolist()) for r, n in enumerate(real)]
    logits, attentions, past = graph.run(ids, mask, graph.empty(2))
    for r, n in enumerate(real):
        check_row(refs[r][0], logits[r, -n:], attentions[r, :, :, -n:], n, 0)
    for s in range(steps):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.int64)], dim=1)
        logits, attentions, past = graph.run(new[:, s:s + 1], mask, past)
        for r, n in enumerate(real):
            check_row(refs[r][s + 1], logits[r], attentions[r], 1, n + s)


def test_the_artifact_records_its_scaling_and_the_scaling_matters(scaled):
    """model.json carries the scaling (and the override, where one was given); and honest: transformers with the
    default rotation answers differently past L0, so a graph that ignored the scaling would fail the tests above."""
    for name, rope in SCALINGS.items():
        manifest = json.loads((scaled[name]["artifact"] / "manifest.json").read_text())
        assert manifest["validation"]["passed"]
        meta = json.loads((scaled[name]["artifact"] / "model.json").read_text())
        assert meta["config"]["rope_scaling"] == rope["rope_type"] and meta["config"]["rope_base"] == THETA
        assert meta["source"].get("rope_scaling") == (rope if name in BY_OVERRIDE else None)
        if rope["rope_type"] != "linear":
            assert meta["config"]["rope_original_context"] == L0
    plain = reference(scaled["plain"]["folder"], {"rope_type": "default"})
    tokens = torch.randint(1, 300, (1, 2 * L0), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        unscaled = plain(input_ids=tokens).logits[0].numpy()
    for name in SCALINGS:
        graph = Graph(scaled[name]["artifact"])
        logits, _, _ = graph.run(tokens, np.ones((1, 2 * L0), np.int64), graph.empty(1))
        assert np.abs(logits[0] - unscaled).max() > 1e-2, name


def test_encoding_shows_the_frequencies_after_scaling(scaled):
    """encoding.onnx's rotary_frequencies are transformers' inv_freq at the length asked for (longrope's switch
    at L0 included), and the note names the scaling and its attention factor."""
    names = ["rotary_frequencies", "rotary_cos", "rotary_sin"]
    for name in ("yarn", "longrope"):
        entry = scaled[name]
        session = ort.InferenceSession(str(entry["artifact"] / "encoding.onnx"), providers=["CPUExecutionProvider"])
        meta = json.loads((entry["artifact"] / "model.json").read_text())
        for n in (L0 - 2, 2 * L0):
            freqs, cos, sin = session.run(names, {"positions": np.arange(n, dtype=np.int64)})
            fresh_rotary(entry["hf"])
            rotary = entry["hf"].model.rotary_emb
            want_cos, _ = rotary(torch.zeros(1), torch.arange(n)[None])
            np.testing.assert_allclose(freqs, rotary.inv_freq.numpy(), rtol=1e-6)
            np.testing.assert_allclose(cos, want_cos[0, :, :8].numpy(), atol=1e-6)
            np.testing.assert_allclose(cos ** 2 + sin ** 2, rotary.attention_scaling ** 2, rtol=1e-5)
        note = meta["encoding"]["note"]
        assert SCALINGS[name]["rope_type"] in note and f"{rotary.attention_scaling:.4f}" in note


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "axial", "factor": 2.0}, "rope_type = 'axial' is not supported"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fsat": 16}, "rope_parameters.beta_fsat is not supported"),
    ({"rope_type": "linear", "factor": 4.0, "low_freq_factor": 1.0},
     "rope_parameters.low_freq_factor is not supported with rope_type 'linear' (used by llama3)"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3,
      "original_max_position_embeddings": 16}, "rope_short_factor must have one number per rotated pair (8)"),
    ({"rope_type": "yarn", "factor": 0.5}, "rope_parameters.factor = 0.5 must be >= 1"),
    ("not json", "--rope-scaling is not JSON"),
])
def test_refusals_name_the_field_exit_2_and_write_nothing(scaled, tmp_path, capsys, rope, message):
    folder = scaled["plain"]["folder"]
    out = tmp_path / "out"
    code = main(["--from-hf", str(folder), "--out", str(out), "--rope-scaling",
                 rope if isinstance(rope, str) else json.dumps(rope)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_the_encoding_rpc_shows_each_served_models_scaling(scaled):
    """Through a real worker: the Encoding RPC of every imported scaled model names its scaling in the note and
    returns its frequencies at the length asked for (longrope's switch at L0 seen from the client)."""
    import grpc

    from protos.posenc.v1 import posenc_pb2 as pb
    from protos.posenc.v1 import posenc_pb2_grpc
    from tests.serving import start

    root = scaled["linear"]["artifact"].parent
    srv = start(root)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = posenc_pb2_grpc.PosencStub(channel)
            for name, rope in SCALINGS.items():
                freqs = {}
                for n in (L0, 2 * L0):
                    resp = stub.Encoding(pb.EncodingRequest(model=name, length=n), timeout=30)
                    assert resp.note.startswith(f"rope {rope['rope_type']} x"), resp.note
                    (t,) = [t for t in resp.tensors if t.name == "rotary_frequencies"]
                    freqs[n] = np.frombuffer(t.data, "<f4")
                    fresh_rotary(scaled[name]["hf"])
                    rotary = scaled[name]["hf"].model.rotary_emb
                    rotary(torch.zeros(1), torch.arange(n)[None])
                    np.testing.assert_allclose(freqs[n], rotary.inv_freq.numpy(), rtol=1e-6)
                switched = not np.array_equal(freqs[L0], freqs[2 * L0])
                assert switched == (rope["rope_type"] in ("dynamic", "longrope")), name
    finally:
        srv.stop(grace=1)


@pytest.fixture(scope="module")
def served_long(scaled):
    """A worker over every scaled artifact, prompts past max_position_embeddings allowed (--long-context 1)."""
    from service.settings import Limits
    from tests.serving import start

    srv = start(scaled["linear"]["artifact"].parent, limits=Limits(long_context=True))
    yield srv
    srv.stop(grace=1)


@pytest.fixture(scope="module")
def served_tight(scaled):
    """The same worker with a token budget per call of 24 (--batch-tokens 24): its first piece of a prompt would stop
    short of the original length L0."""
    from service.server import Server
    from service.settings import Batching, Limits, Settings

    srv = Server(Settings(model_dir=scaled["linear"]["artifact"].parent, host="127.0.0.1", port=0, threads=1,
                          metrics_port=-1, http_port=-1, batching=Batching(batch_tokens=24),
                          limits=Limits(long_context=True))).start()
    yield srv
    srv.stop(grace=1)


def transformers_logprobs(hf, tokens: list[int]) -> np.ndarray:
    """log p(token t+1 | tokens 0..t) from transformers' forward of the whole sequence, a fresh rotary module."""
    fresh_rotary(hf)
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=torch.tensor([tokens])).logits[0].double(), -1).numpy()
    return logp[np.arange(len(tokens) - 1), tokens[1:]]


def transformers_greedy(hf, tokens: list[int], n: int) -> list[int]:
    """transformers' generate(), greedy, n tokens whatever they are (no end-of-sequence id)."""
    from transformers import GenerationConfig

    fresh_rotary(hf)
    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = hf.generate(torch.tensor([tokens]), generation_config=config)[0, len(tokens):].tolist()
    assert len(out) == n
    return out


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
@pytest.mark.parametrize("budget, lengths", [(None, (300, 600)), (24, (40, 100))])
def test_prompts_longer_than_one_engine_call_equal_transformers(scaled, request, name, budget, lengths):
    """dynamic and longrope take their frequencies from the length the sequence has reached: transformers rotates a
    prompt's keys with the frequencies of the whole prompt's length.  Through a served worker, prompts longer than
    the engine's budget per call (the worker's own, 256 new tokens, and a lowered one where the first piece would
    stop short of the original length L0, where longrope switches factors): Score's log-probabilities equal
    transformers' forward of the whole prompt, and a Generate after such a prompt transformers' greedy generate()."""
    from service.sampling import SamplingParams
    from service.settings import Batching

    hf, srv = scaled[name]["hf"], request.getfixturevalue("served_tight" if budget else "served_long")
    limit = srv.registry.engine(name).prompts.budget  # new tokens per call
    assert limit == (budget or Batching().batch_tokens)
    rng = np.random.default_rng(7)
    for n in lengths:
        assert n > limit and n > L0  # more than one call's worth, past the original length
        ids = rng.integers(1, 300, n).tolist()
        _, logprobs, _ = srv.ops.score(name, None, ids)
        d = np.abs(np.array(logprobs) - transformers_logprobs(hf, ids)).max()
        assert d <= 1e-4, (name, n, d)
    steps = 12
    ids = rng.integers(1, 300, lengths[0]).tolist()
    params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    got = [item.id for _, item in srv.ops.generate(name, [(None, ids)], params) if hasattr(item, "id")]
    assert got == transformers_greedy(hf, ids, steps), name


# The types whose frequencies transformers recomputes from the length each call reaches: those its
# dynamic_rope_update decorator (modeling_rope_utils) updates, "dynamic" in rope_type and "longrope"
FOLLOW_THE_LENGTH = ("dynamic", "longrope")


def test_the_worker_runs_length_dependent_scalings_prompts_whole(scaled, served_long):
    """model.json says which models must run a prompt whole (the worker cannot ask the scaling's class: it needs
    torch), the types transformers recomputes per length and no other; a served model of each runs a prompt of
    several budgets in one call, every other type in pieces.  The worker's rule for artifacts written before
    model.json said so names the same types."""
    from service.model_json import LEGACY_WHOLE_PROMPTS

    assert LEGACY_WHOLE_PROMPTS == FOLLOW_THE_LENGTH
    ids = np.random.default_rng(8).integers(1, 300, 600).tolist()
    for name, rope in SCALINGS.items():
        model, engine = served_long.registry.models[name], served_long.registry.engine(name)
        pieces, rows = engine.stats.pieces, engine.stats.rows_run
        served_long.ops.score(name, None, ids)
        whole = rope["rope_type"] in FOLLOW_THE_LENGTH
        assert model.meta.whole_prompts is whole, name
        assert engine.prompts.whole_prompts == whole and (engine.stats.pieces - pieces == 0) == whole, name
        assert engine.stats.rows_run - rows == (1 if whole else 3), name


# vLLM's max_model_len for each artifact (vllm/config: _get_and_verify_max_len): max_position_embeddings x factor
# for linear and dynamic, original_max_position_embeddings x factor for yarn, max_position_embeddings for llama3 and
# longrope.  linear, yarn and llama3 come from the plain folder (max_position_embeddings = L0) by --rope-scaling.
SERVED = {"linear": L0 * 4, "dynamic": L0 * 4, "yarn": L0 * 8, "llama3": L0, "longrope": 4 * L0}


def test_the_default_length_follows_what_the_scaling_is_for(scaled):
    """Without --long-context, each imported model takes the positions its scaling is for, as vLLM derives them:
    ListModels and /v1/models say so, a prompt filling them runs, one more position is refused naming the limit."""
    import grpc
    import openai

    from protos.posenc.v1 import posenc_pb2 as pb
    from protos.posenc.v1 import posenc_pb2_grpc
    from tests.serving import start

    srv = start(scaled["linear"]["artifact"].parent, http_port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = posenc_pb2_grpc.PosencStub(channel)
            listed = {m.name: m.max_model_len for m in stub.ListModels(pb.ListModelsRequest(), timeout=30).models}
            assert {name: listed[name] for name in SERVED} == SERVED
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="unused", max_retries=0)
            cards = {m.id: m.model_extra["max_model_len"] for m in client.models.list().data}
            assert {name: cards[name] for name in SERVED} == SERVED
            ids = np.random.default_rng(5).integers(1, VOCAB, SERVED["dynamic"] + 1).tolist()
            fits = stub.Score(pb.ScoreRequest(model="dynamic", prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids[:-1]))),
                              timeout=60)
            assert len(fits.logprobs) == SERVED["dynamic"] - 1
            with pytest.raises(grpc.RpcError) as err:
                stub.Score(pb.ScoreRequest(model="dynamic", prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids))),
                           timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "128" in err.value.details()
    finally:
        srv.stop(grace=1)
