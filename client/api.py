"""Typed helpers over posenc.v1: one object per worker (or replica set), plain arguments in, messages out.

    from client.api import Client
    with Client("127.0.0.1:50051") as c:
        resp = c.predict("rope", "dog bites man", attention="last")
        for msg in c.generate("alibi", "The ", max_new_tokens=16):
            print(msg.text)
"""

from __future__ import annotations

from collections.abc import Iterator

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
                layers: list[int] = (), heads: list[int] = ()) -> pb.PredictResponse:
        """The `top_k` most likely next tokens after the prompt (text, or token ids), and with `attention` "last"
        (the last query's row) or "full" (every row) the attention maps of `layers` and `heads` (empty: all of
        them); attention_maps() turns them into arrays."""
        return self.stub.Predict(pb.PredictRequest(model=model, prompt=prompt(text), top_k=top_k,
                                                   attention=ATTENTION[attention], layers=layers, heads=heads),
                                 timeout=self.timeout)

    def score(self, model: str, text: str | list[int]) -> pb.ScoreResponse:
        """The log-probability of each token of the text given the ones before it, their total, nats per token and
        per byte, and the perplexity."""
        return self.stub.Score(pb.ScoreRequest(model=model, prompt=prompt(text)), timeout=self.timeout)

    def compare(self, text: str | list[int], permuted: str | list[int] | None = None, models: list[str] = (),
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
                 stop: list[str] = (), ignore_eos: bool = False) -> Iterator[pb.GenerateResponse]:
        """Generate's stream, one message per token, each with its text so far in `text` (the wire carries only each
        token's `delta`; this joins them).  It ends at the model's end of sequence (finish_reason "stop") unless
        ignore_eos.  Leaving the loop early cancels the call."""
        req = pb.GenerateRequest(model=model, prompt=prompt(text), max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_k=top_k, top_p=top_p, stop=stop, ignore_eos=ignore_eos,
                                 **({"seed": seed} if seed is not None else {}))
        return joined(self.stub.Generate(req, timeout=self.timeout))
