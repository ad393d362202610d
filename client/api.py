"""Typed helpers over posenc.v1: one object per worker (or replica set), plain arguments in, messages out.

    from client.api import Client
    with Client("127.0.0.1:50051") as c:
        resp = c.predict("rope", "dog bites man", attention="last")
        for msg in c.generate("alibi", "The ", max_new_tokens=16):
            print(msg.text)
        moved = c.predict("rope", "dog bites man", intervention=intervention(shift=1000, baseline=True))
        print(moved.effect.kl_divergence)  # about 0: RoPE's scores depend only on position differences
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from client.channel import TLS, channel_for
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc

ATTENTION = {"none": pb.ATTENTION_NONE, "last": pb.ATTENTION_LAST_ROW, "full": pb.ATTENTION_FULL}


def joined(stream) -> Iterator[pb.GenerateResponse]:
    """A Generate stream's messages, each given its text so far (the joined deltas); the call is cancelled if
    the reader stops early."""
    text = ""
    try:
        for msg in stream:
            text += msg.delta
            if not msg.finish_reason:  # the last message carries the whole text itself
                msg.text = text
            yield msg
    finally:
        stream.cancel()


def prompt(value: str | list[int]) -> pb.Prompt:
    """Text, or token ids."""
    if isinstance(value, str):
        return pb.Prompt(text=value)
    return pb.Prompt(tokens=pb.TokenIds(ids=[int(i) for i in value]))


def attention_maps(resp: pb.PredictResponse) -> list[tuple[int, int, np.ndarray]]:
    """(layer, head, map) of a PredictResponse, each map a float32 array (rows, keys)."""
    return [(m.layer, m.head, np.frombuffer(m.data, "<f4").reshape(m.shape)) for m in resp.attention]


def intervention(positions: Iterable[int] = (), shift: int = 0, stretch: float = 1.0, next_position: int | None = None,
                 positional_off: Iterable[int] = (), ablate_heads: Iterable[tuple[int, int]] = (),
                 rope_scaling: dict[str, Any] | str | None = None, baseline: bool = False) -> pb.Intervention:
    """A request's change to what the model's positions do (docs/interventions.md): `positions` one per prompt token,
    or token i at shift + round(i * stretch); `next_position` the first generated token's (Generate);
    `positional_off` the layers whose positional computation is removed; `ablate_heads` (layer, head) pairs whose
    output is zeroed; `rope_scaling` another RoPE scaling as transformers' rope_parameters (a dict, or its JSON
    text); `baseline` also runs the unchanged request and reports the effect (not Generate).  The defaults change
    nothing: a stretch of 1 is left unset on the wire (0 means 1 there)."""
    msg = pb.Intervention(positions=[int(p) for p in positions], shift=int(shift),
                          positional_off=[int(layer) for layer in positional_off],
                          ablate_heads=[pb.HeadRef(layer=int(layer), head=int(head)) for layer, head in ablate_heads],
                          baseline=bool(baseline))
    if float(stretch) != 1.0:
        msg.stretch = float(stretch)
    if next_position is not None:
        msg.next_position = int(next_position)
    if rope_scaling is not None:
        msg.rope_scaling = rope_scaling if isinstance(rope_scaling, str) else json.dumps(rope_scaling)
    return msg


def effect_maps(resp: pb.PredictResponse) -> list[tuple[int, int, np.ndarray]]:
    """(layer, head, map) of the unchanged run beside an intervened Predict (its effect's baseline_attention), as
    attention_maps() gives the intervened run's; empty without `baseline` or attention."""
    return [(m.layer, m.head, np.frombuffer(m.data, "<f4").reshape(m.shape)) for m in resp.effect.baseline_attention]


def profile_values(resp: pb.ProfileResponse) -> np.ndarray:
    """A ProfileResponse's values as a float32 array [layers, heads, columns]."""
    return np.frombuffer(resp.values, "<f4").reshape(resp.shape)


def effect_profile(resp: pb.ProfileResponse) -> np.ndarray:
    """The unchanged run's profile beside an intervened Profile (its effect's baseline_profile), shaped as
    profile_values(); ValueError when the request did not ask for the baseline."""
    if not resp.effect.has_baseline:
        raise ValueError("the profile carries no baseline: ask with intervention(..., baseline=True)")
    return np.frombuffer(resp.effect.baseline_profile, "<f4").reshape(resp.shape)


class Client:
    """A client of one worker or a replica set over posenc.v1.  `target`, `lb` and `tls` make the channel
    (client.channel.channel_for: HOST:PORT, a comma-separated list, or dns:///NAME:PORT); `channel` uses one made
    elsewhere instead.  `timeout` is the deadline of every call, in seconds.  A call the worker refuses raises
    grpc.RpcError with the status the Errors page gives for it.  Use it as a context manager, or call close()."""

    def __init__(self, target: str = "127.0.0.1:50051", lb: str | None = None, tls: TLS | None = None,
                 timeout: float = 60.0, channel: grpc.Channel | None = None):
        self.channel = channel or channel_for(target, lb, tls)
        self.stub = posenc_pb2_grpc.PosencStub(self.channel)
        self.timeout = timeout

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel (a channel given to the constructor too); calls in flight are cancelled."""
        self.channel.close()

    def list_models(self) -> pb.ListModelsResponse:
        """The served models: name, variant, size, context, tokenizer and held-out loss of each."""
        return self.stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout)

    def predict(self, model: str, text: str | list[int], top_k: int = 5, attention: str = "none",
                layers: Sequence[int] = (), heads: Sequence[int] = (),
                intervention: pb.Intervention | None = None) -> pb.PredictResponse:
        """The `top_k` most likely next tokens after the prompt (text, or token ids), and with `attention` "last"
        (the last query's row) or "full" (every row) the attention maps of `layers` and `heads` (empty: all of
        them); attention_maps() turns them into arrays.  Under an `intervention` (intervention()) the answer's
        `effect` says what it changed; with its baseline, effect_maps() gives the unchanged maps."""
        req = pb.PredictRequest(model=model, prompt=prompt(text), top_k=top_k, attention=ATTENTION[attention],
                                layers=layers, heads=heads)
        if intervention is not None:
            req.intervention.CopyFrom(intervention)
        return self.stub.Predict(req, timeout=self.timeout)

    def score(self, model: str, text: str | list[int], intervention: pb.Intervention | None = None
              ) -> pb.ScoreResponse:
        """The log-probability of each token of the text given the ones before it, their total, nats per token and
        per byte, and the perplexity.  Under an `intervention` with its baseline, the effect carries the unchanged
        log-probabilities and each token's change (intervened minus baseline)."""
        req = pb.ScoreRequest(model=model, prompt=prompt(text))
        if intervention is not None:
            req.intervention.CopyFrom(intervention)
        return self.stub.Score(req, timeout=self.timeout)

    def profile(self, model: str, text: str | list[int], last: int = 0,
                intervention: pb.Intervention | None = None) -> pb.ProfileResponse:
        """How far each layer's heads look: attention mass per distance bucket, on the first position, and entropy,
        averaged over the last `last` query rows (0: all); profile_values() gives the array.  Under an
        `intervention` with its baseline, effect_profile() gives the unchanged run's."""
        req = pb.ProfileRequest(model=model, prompt=prompt(text), last=last)
        if intervention is not None:
            req.intervention.CopyFrom(intervention)
        return self.stub.Profile(req, timeout=self.timeout)

    def compare(self, text: str | list[int], permuted: str | list[int] | None = None, models: Sequence[str] = (),
                top_k: int = 5) -> pb.CompareResponse:
        """One prompt through several models (`models`; empty: every served model) beside the same tokens in
        another order: `permuted`, or when None the prompt's words reversed (its ids reversed for token ids).  For
        each model, the top next tokens after both and how far the two distributions are apart."""
        req = pb.CompareRequest(prompt=prompt(text), models=models, top_k=top_k)
        if permuted is not None:
            req.permuted.CopyFrom(prompt(permuted))
        return self.stub.Compare(req, timeout=self.timeout)

    def tokenize(self, model: str, text: str) -> pb.TokenizeResponse:
        """The text in the model's tokens (ids and display pieces); runs no model and has no position limit."""
        return self.stub.Tokenize(pb.TokenizeRequest(model=model, text=text), timeout=self.timeout)

    def encoding(self, model: str, length: int = 64) -> pb.EncodingResponse:
        """The model's positional encoding at positions 0 .. length-1, as its artifact's encoding graph computes
        it (tensors whose names say what they hold)."""
        return self.stub.Encoding(pb.EncodingRequest(model=model, length=length), timeout=self.timeout)

    def generate(self, model: str, text: str | list[int], max_new_tokens: int = 32, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 0.0, seed: int | None = None,
                 stop: Sequence[str] = (), ignore_eos: bool = False,
                 intervention: pb.Intervention | None = None, min_new_tokens: int = 0
                 ) -> Iterator[pb.GenerateResponse]:
        """Generate's stream, one message per token, each with its text so far in `text` (the wire carries only each
        token's `delta`; this joins them).  It ends at the model's end of sequence (finish_reason "stop") unless
        ignore_eos, and not before min_new_tokens tokens.  Leaving the loop early cancels the call.  Under an
        `intervention` (without baseline, which Generate refuses) every token is generated under it, from its
        `next_position` when given."""
        req = pb.GenerateRequest(model=model, prompt=prompt(text), max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_k=top_k, top_p=top_p, stop=stop, ignore_eos=ignore_eos,
                                 min_new_tokens=min_new_tokens, **({"seed": seed} if seed is not None else {}))
        if intervention is not None:
            req.intervention.CopyFrom(intervention)
        return joined(self.stub.Generate(req, timeout=self.timeout))
