"""posenc.v1: protobuf in, service.operations calls, protobuf out.

`PosencApi` is the translation, callable without gRPC (the HTTP front's /v1/posenc/... routes parse JSON into the
same request messages and call it); `PosencServicer` is the gRPC binding.  Errors and metrics: service/rpc.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service import intervened, intervention_pb, profile
from service.artifacts import LoadedModel
from service.generation import Emitted
from service.jobs import MapRequest
from service.maps_window import sink_mass
from service.operations import Operations
from service.rpc import capped_deadline, set_tokens, streaming, unary, wire_header
from service.sampling import SamplingParams

if TYPE_CHECKING:
    import grpc

    from service.tokenizer import Tokenizer

_ATTENTION = pb.PredictResponse.DESCRIPTOR.fields_by_name["attention"].number
_DATA = pb.AttentionMap.DESCRIPTOR.fields_by_name["data"].number
ATTENTION = {pb.ATTENTION_NONE: MapRequest.NONE, pb.ATTENTION_LAST_ROW: MapRequest.LAST_ROW,
             pb.ATTENTION_FULL: MapRequest.FULL}


def prompt_of(prompt: pb.Prompt) -> tuple[str | None, list[int] | None]:
    kind = prompt.WhichOneof("input")
    if kind == "text":
        return prompt.text, None
    if kind == "tokens":
        return None, list(prompt.tokens.ids)
    return None, []


def candidates(top: list[tuple[int, float, float]], tok: Tokenizer) -> list[pb.Candidate]:
    return [pb.Candidate(token=pb.Token(id=t, piece=tok.display(t)), probability=p, logprob=lp) for t, p, lp in top]


class PosencApi:
    """Every posenc.v1 RPC as a plain call: request message (+ deadline) -> response message(s)."""

    def __init__(self, ops: Operations):
        self.ops, self.registry = ops, ops.registry

    def list_models(self, request: pb.ListModelsRequest) -> pb.ListModelsResponse:
        out = pb.ListModelsResponse()
        for name, m in sorted(self.registry.models.items()):
            s = m.meta.sizes
            out.models.append(pb.ModelInfo(
                name=name, variant=m.meta.variant, vocab_size=s.vocab_size, d_model=s.d_model,
                n_heads=s.n_heads, n_layers=s.n_layers, parameters=s.parameters,
                max_positions=m.max_positions or 0, trained_context=m.meta.trained_context,
                heldout_loss=m.meta.heldout_loss or 0.0, sha256=m.sha256, tokenizer=m.tokenizer.kind,
                tokenizer_vocab_size=m.tokenizer.vocab_size, max_model_len=self.ops.position_limit(m) or 0,
                proof=import_proof(m), interventions=intervention_support(m),
                layer_mixers=[layer.mixer for layer in m.meta.layers], layer_mixer_maps=mixer_map_counts(m)))
        return out

    def predict(self, request: pb.PredictRequest, deadline: float | None) -> pb.PredictResponse:
        return pb.PredictResponse.FromString(self.predict_wire(request, deadline))

    def predict_wire(self, request: pb.PredictRequest, deadline: float | None) -> bytes:
        """A PredictResponse, serialised.  The attention maps go from onnxruntime's output straight into the
        answer's bytes (one copy; as AttentionMap messages they were copied four times: tobytes, into the
        message, serialising it, and by gRPC), appended after the rest: protobuf merges repeated fields however
        they are spread over the wire, so a parser sees the same message."""
        text, ids = prompt_of(request.prompt)
        edit = intervention_pb.of(request)
        args = (request.model, text, ids, request.top_k, ATTENTION.get(request.attention, MapRequest.NONE),
                list(request.layers), list(request.heads), deadline, request.query_start, request.query_count)
        effect = None
        if edit.wanted or request.mixer_maps:  # the mixers' matrices come from the maps graph, an intervention's
            p, effect = intervened.predict(self.ops, request.model, text, ids, edit, *args[3:], request.mixer_maps)
        else:
            p = self.ops.predict(*args)
        out = pb.PredictResponse(model=request.model)
        if effect is not None and edit.wanted:
            out.effect.CopyFrom(intervention_pb.effect_message(effect, p.tokenizer, p.query_start, p.sink_layers))
        out.mixer_maps.extend(pb.AttentionMap(layer=layer, head=head, shape=m.shape, data=m.astype("<f4").tobytes(),
                                              query_start=p.query_start) for layer, head, m in p.mixer_maps)
        set_tokens(out, "tokens", p.ids, p.pieces)
        out.top.extend(candidates(p.top, p.tokenizer))
        r = p.result
        assert r is not None  # Operations.predict always sets it
        out.timing.CopyFrom(pb.Timing(queue_ms=r.queue_ms, compute_ms=r.compute_ms, total_ms=p.total_ms,
                                      batch_size=r.batch_size))
        wire: bytes = out.SerializeToString()
        if not p.attention:
            return wire
        parts: list[bytes | memoryview] = [wire]
        for layer, head, amap in p.attention:
            data = np.ascontiguousarray(amap, "<f4").data.cast("B")  # a view when onnxruntime's rows are whole
            header = pb.AttentionMap(layer=layer, head=head, shape=amap.shape, query_start=p.query_start,
                                     sink_mass=sink_mass(amap) if layer in p.sink_layers else ()).SerializeToString()
            parts += [wire_header(_ATTENTION, len(header) + len(wire_header(_DATA, data.nbytes)) + data.nbytes),
                      header, wire_header(_DATA, data.nbytes), data]
        return b"".join(parts)

    def score(self, request: pb.ScoreRequest, deadline: float | None) -> pb.ScoreResponse:
        text, ids = prompt_of(request.prompt)
        edit = intervention_pb.of(request)
        effect = None
        if edit.wanted:
            toks, logprobs, tok, effect = intervened.score(self.ops, request.model, text, ids, edit, deadline)
        else:
            toks, logprobs, tok = self.ops.score(request.model, text, ids, deadline)
        total = float(sum(logprobs))
        nats = -total / len(logprobs)
        out = pb.ScoreResponse(model=request.model, logprobs=logprobs, total_logprob=total, nats_per_token=nats,
                               perplexity=float(np.exp(nats)),
                               nats_per_byte=-total / max(tok.text_bytes(toks[1:]), 1))
        set_tokens(out, "tokens", toks, tok.pieces(toks))
        if effect is not None:
            out.effect.CopyFrom(intervention_pb.effect_message(effect, tok))
        return out

    def profile(self, request: pb.ProfileRequest, deadline: float | None) -> pb.ProfileResponse:
        text, ids = prompt_of(request.prompt)
        edit, effect = intervention_pb.of(request), None
        if edit.wanted or request.mixer_maps:  # the mixers' profiles come from the maps profile graph
            p, effect = intervened.profile(self.ops, request.model, text, ids, edit, request.last, deadline,
                                           mixer_maps=request.mixer_maps)
        else:
            p = profile.profile(self.ops, request.model, text, ids, request.last, deadline)
        out = pb.ProfileResponse(model=request.model, columns=p.columns, buckets=len(p.buckets),
                                 shape=list(p.values.shape), values=np.ascontiguousarray(p.values, "<f4").tobytes(),
                                 query_start=p.query_start, query_count=p.query_count,
                                 timing=pb.Timing(queue_ms=p.queue_ms, compute_ms=p.compute_ms, total_ms=p.total_ms,
                                                  batch_size=1))
        set_tokens(out, "tokens", p.ids, p.tokenizer.pieces(p.ids))
        if effect is not None and edit.wanted:
            out.effect.CopyFrom(intervention_pb.effect_message(effect, p.tokenizer))
        out.mixer_layers.extend(p.mixer_layers)
        out.mixer_heads.extend(p.mixer_heads)
        return out

    def compare(self, request: pb.CompareRequest, deadline: float | None) -> pb.CompareResponse:
        text, ids = prompt_of(request.prompt)
        ptext, pids = prompt_of(request.permuted) if request.HasField("permuted") else (None, None)
        toks, perm, rows, tok = self.ops.compare(text, ids, ptext, pids, list(request.models), request.top_k,
                                                 deadline)
        out = pb.CompareResponse(text=tok.decode(toks), permuted_text=tok.decode(perm))
        set_tokens(out, "tokens", toks, tok.pieces(toks))
        set_tokens(out, "permuted_tokens", perm, tok.pieces(perm))
        for r in rows:
            out.models.append(pb.ModelComparison(
                model=r.model, variant=r.variant, top=candidates(r.top, r.tokenizer),
                permuted_top=candidates(r.permuted_top, r.tokenizer),
                total_variation=r.total_variation, kl_divergence=r.kl, js_divergence=r.js,
                top1_changed=r.top1_changed, error=r.error))
        return out

    def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        tok = self.ops.model(request.model).tokenizer
        ids = tok.encode(request.text)
        out = pb.TokenizeResponse(model=request.model, tokenizer=tok.kind, text_bytes=len(request.text.encode()))
        set_tokens(out, "tokens", ids, tok.pieces(ids))
        return out

    def encoding(self, request: pb.EncodingRequest) -> pb.EncodingResponse:
        tensors, note = self.ops.encoding(request.model, request.length)
        out = pb.EncodingResponse(model=request.model, variant=self.ops.model(request.model).meta.variant,
                                  note=note)
        for name, value in tensors:
            out.tensors.append(pb.Tensor(name=name, shape=list(value.shape),
                                         data=np.ascontiguousarray(value, "<f4").tobytes()))
        return out

    def generate(self, request: pb.GenerateRequest, deadline: float | None,
                 is_active: Callable[[], bool]) -> Iterator[pb.GenerateResponse]:
        text, ids = prompt_of(request.prompt)
        params = SamplingParams(max_new_tokens=request.max_new_tokens or 32, temperature=request.temperature,
                                top_k=request.top_k, top_p=request.top_p or 1.0,  # posenc.v1: top_p 0 = off
                                seed=request.seed if request.HasField("seed") else None, stop=tuple(request.stop),
                                ignore_eos=request.ignore_eos, min_new_tokens=request.min_new_tokens)
        tok = None
        edit = intervention_pb.of(request)
        stream = intervened.generate(self.ops, request.model, [(text, ids)], params, edit, deadline, is_active) \
            if edit.wanted else self.ops.generate(request.model, [(text, ids)], params, deadline, is_active)
        for _, item in stream:
            if not isinstance(item, Emitted):
                continue
            tok = tok or self.ops.model(request.model).tokenizer
            yield pb.GenerateResponse(token=pb.Token(id=item.id, piece=tok.display(item.id)), logprob=item.logprob,
                                      delta=item.delta, text=item.text if item.reason else "",
                                      finish_reason=item.reason)


class PosencServicer(posenc_pb2_grpc.PosencServicer):
    def __init__(self, ops: Operations, instance: str = ""):
        self.ops, self.registry, self.instance = ops, ops.registry, instance
        self.api = PosencApi(ops)

    def deadline(self, context: grpc.ServicerContext) -> float | None:
        return capped_deadline(context, self.registry.limits.max_request_s)

    @unary
    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        return self.api.list_models(request)

    @unary
    def Predict(self, request: pb.PredictRequest, context: grpc.ServicerContext) -> bytes:
        return self.api.predict_wire(request, self.deadline(context))  # bytes: rpc.add_servicer sends them as they are

    @unary
    def Score(self, request: pb.ScoreRequest, context: grpc.ServicerContext) -> pb.ScoreResponse:
        return self.api.score(request, self.deadline(context))

    @unary
    def Profile(self, request: pb.ProfileRequest, context: grpc.ServicerContext) -> pb.ProfileResponse:
        return self.api.profile(request, self.deadline(context))

    @unary
    def Compare(self, request: pb.CompareRequest, context: grpc.ServicerContext) -> pb.CompareResponse:
        return self.api.compare(request, self.deadline(context))

    @unary
    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        return self.api.tokenize(request)

    @unary
    def Encoding(self, request: pb.EncodingRequest, context: grpc.ServicerContext) -> pb.EncodingResponse:
        return self.api.encoding(request)

    @streaming
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        yield from self.api.generate(request, self.deadline(context), context.is_active)


def mixer_map_counts(m: LoadedModel) -> list[int]:
    """Per layer, how many exact matrices the maps graph gives (model.json's intervene.maps_layers and maps_heads);
    empty without a maps graph."""
    spec = m.meta.intervene
    if spec is None or not spec.maps_file or m.intervene_maps is None:  # none, or built from another model.onnx
        return []
    counts = dict(zip(spec.maps_layers, spec.maps_heads, strict=True))
    return [counts.get(i, 0) for i in range(m.meta.sizes.n_layers)]


def import_proof(m: LoadedModel) -> pb.ImportProof | None:
    """ListModels' record of how an imported model was proven against transformers (model.json's source.proof)."""
    proof = m.meta.source.proof if m.meta.source is not None else None
    if proof is None or not proof.passed:
        return None
    return pb.ImportProof(importer=proof.importer, reference=proof.reference, logits=proof.logits,
                          attentions=proof.attentions or 0.0)


def intervention_support(m: LoadedModel) -> pb.InterventionSupport | None:
    """ListModels' record of what a request may change on the model (model.json's intervene entry), or None when it
    has no intervention graph."""
    spec = m.meta.intervene
    if spec is None or m.intervene is None:
        return None
    return pb.InterventionSupport(positions=spec.positions, positional_off=spec.in_layers, rope_scaling=spec.rope)
