"""posenc.v1's Intervention and Effect messages <-> service/intervention.py's record and service/intervened.py's
Effect (the gRPC front and the posenc JSON routes, which parse JSON into the same messages)."""

from __future__ import annotations

from typing import Any

import numpy as np

from protos.posenc.v1 import posenc_pb2 as pb
from service import intervention
from service.intervened import Effect
from service.intervention import Intervention
from service.maps_window import sink_mass


def from_message(msg: pb.Intervention) -> Intervention:
    """The request's intervention; a bad rope_scaling JSON is INVALID_ARGUMENT naming it."""
    scaling = None
    if msg.rope_scaling.strip():
        scaling = intervention.parse({"rope_scaling": msg.rope_scaling}).rope_scaling
    return Intervention(tuple(msg.positions), msg.shift, msg.stretch or 1.0,
                        msg.next_position if msg.HasField("next_position") else None,
                        tuple(msg.positional_off), tuple((h.layer, h.head) for h in msg.ablate_heads), scaling,
                        msg.baseline)


def of(request: Any) -> Intervention:
    """A request message's intervention (the empty one when it has none)."""
    return from_message(request.intervention) if request.HasField("intervention") else Intervention()


def effect_message(effect: Effect, tok: Any, query_start: int = 0, sink_layers: frozenset[int] = frozenset()
                   ) -> pb.Effect:
    out = pb.Effect(positions=effect.positions, description=effect.description, has_baseline=effect.has_baseline,
                    kl_divergence=effect.kl, total_variation=effect.total_variation, js_divergence=effect.js,
                    top1_changed=effect.top1_changed, baseline_logprobs=effect.baseline_logprobs,
                    logprob_change=effect.logprob_change)
    out.baseline_top.extend(pb.Candidate(token=pb.Token(id=t, piece=tok.display(t)), probability=p, logprob=lp)
                            for t, p, lp in effect.baseline_top)
    for layer, head, amap in effect.baseline_maps:
        out.baseline_attention.append(pb.AttentionMap(
            layer=layer, head=head, shape=amap.shape, data=np.ascontiguousarray(amap, "<f4").tobytes(),
            query_start=query_start, sink_mass=sink_mass(amap) if layer in sink_layers else ()))
    if effect.baseline_profile is not None:
        out.baseline_profile = np.ascontiguousarray(effect.baseline_profile, "<f4").tobytes()
    return out

