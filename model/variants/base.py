"""The three hooks every positional variant plugs into (ARCHITECTURE.md section 3), with no-op defaults.

Shapes: x (B, T, D); q, k (B, H, T, Dh); q_pos (B, T) and k_pos (B, S) are int64 positions derived from the
attention mask (cumsum - 1), where S = past + new.  A bias is (B, H, T, S) or broadcastable to it.
One instance is shared by all layers (T5 does the same with its bucket table); a variant with per-layer weights
keeps a list of them and indexes it with the `layer` score_bias receives.

Rule for every hook: compute from the positions at run time.  No tables sized for one length, no buffers cached
behind Python shape checks: the exporter would bake them into the graph.
"""

from __future__ import annotations

import torch
from torch import nn

from model import rope_scaling
from model.config import ModelConfig
from model.errors import ConfigError


class PositionalVariant(nn.Module):
    name = "none"
    # What the variant supports, asked by the exporter and the worker's model.json instead of its name:
    # compact_layout: the fast graph may take the compact layout (export/gqa.py, GroupQueryAttention with each row's
    # cache from slot 0): attention reads the causal/padding mask alone and positions enter by rotating q and k or
    # not at all.  (The variants that only add to the embeddings leave attention alone too, but their fast graph
    # has not been checked in that layout: False.)
    compact_layout = False
    # rope_scaled: the config's rope_scaling (model/rope_scaling/) sets the variant's frequencies; any other variant
    # refuses a scaling.
    rope_scaled = False
    # index_positions: the encoding is a function of each token's position index (embed, score_bias, rotate read
    # positions as numbers), so a caller may give positions other than 0 .. T-1 (randomized positions in training);
    # False for one whose positions are not an index (cpe's convolution over its neighbours) or that has none.
    index_positions = True
    # False when score_bias ignores q: the model then computes the bias once per forward for all layers.
    query_dependent_bias = True
    # Multiplies the attention's content score q.k / sqrt(Dh) (DeBERTa's three-term 1/sqrt(3 Dh) scale).
    content_scale = 1.0
    # Set by Transformer.use_onnx_ops for export: a variant may then write its hook with torch.onnx.ops (RoPE).
    onnx_ops = False
    # rotate_layer is part of the content score, not of the positions (fox: its gate's channel kept out of q.k): a
    # layer whose encoding an intervention switches off still takes it (its score bias goes).
    rotation_is_content = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        """ConfigError, one line naming the field, for a config this variant cannot run (ModelConfig checked what
        every model shares).  An override calls this one too."""
        scaling = rope_scaling.get(cfg.rope_scaling)
        if scaling.name != rope_scaling.NONE and not cls.rope_scaled:
            raise ConfigError(f"rope_scaling applies to the rope variant only, not {cfg.variant}")
        if cfg.local_rope_base and not cls.rope_scaled:  # per-layer RoPE: which layers rotate, and by what base
            raise ConfigError(f"local_rope_base applies to the rope variant only, not {cfg.variant}")
        for i in range(cfg.n_layers):
            if cfg.layer(i).encoding != "model" and not cls.rope_scaled:
                raise ConfigError(f"layer {i}'s encoding {cfg.layer(i).encoding!r} (a per-layer RoPE) applies to the "
                                  f"rope variant only, not {cfg.variant}")

    @classmethod
    def max_positions(cls, cfg: ModelConfig) -> int | None:
        """How many positions the model accepts (past + new); None means unbounded (model.json's max_positions)."""
        return None

    def check_length(self, total: int) -> None:
        """Raise SequenceTooLongError when past + new positions exceed what the variant supports."""

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x

    def state_spec(self) -> list[tuple[str, tuple[int, ...]]]:
        """Decoding state besides keys and values: (name, per-row shape), fixed size (cpe: the last inputs)."""
        return []

    def embed_state(self, x: torch.Tensor, new_mask: torch.Tensor,
                    state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """For variants with state_spec: transform the new embeddings (B, T, D) given the carried state and the
        new tokens' mask (B, T), returning the state after them."""
        return x, state

    def bias_reads_keys(self) -> bool:
        """True when score_bias needs this layer's queries and every key (Shaw, Transformer-XL, DeBERTa): the ONNX
        Attention graph then keeps the keys in (B, H, S, Dh) itself instead of letting the Attention node cache them."""
        return self.query_dependent_bias and type(self).score_bias is not PositionalVariant.score_bias

    def score_bias(self, q: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor, *,
                   k: torch.Tensor | None = None, layer: int = 0) -> torch.Tensor | None:
        """A bias added to the scaled scores q.k / sqrt(Dh).  k (B, H, S, Dh) is every key the queries see (past +
        new, after rotate) and `layer` the block's index, for variants whose bias reads the keys (Transformer-XL's
        u term, DeBERTa's position-to-content) or has per-layer weights.  Query-free variants get q = k = None."""
        return None

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the new queries and keys; both sit at `positions` (B, T) (the new keys are the new tokens; cached
        keys were rotated when they were new).  (B, H, T, Dh) as a rule; (B, T, H * Dh) when onnx_ops is set and
        bias_reads_keys() is False (the export's Attention-23 graph takes its inputs that way)."""
        return q, k

    def rotate_layer(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, layer: int,
                     rope: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `layer`'s rotation, as rotate() takes its inputs: rotate() itself unless the variant's layers
        differ (RoPE's NoPE layers and local base, from the layers' records).  `rope`: an intervention's frequencies
        (model.attention.Intervention.rope), which a RoPE variant's model-scaled layers take per row."""
        return self.rotate(q, k, positions)

    @classmethod
    def in_layers(cls) -> bool:
        """Whether the encoding acts inside the attention layers (a rotation or a score bias), so that one layer's
        encoding can be switched off (an intervention's `positional_off`); False for encodings added to the
        embeddings (sinusoidal, learned, cpe) or none at all."""
        return cls.rotate is not PositionalVariant.rotate or cls.rotate_layer is not PositionalVariant.rotate_layer \
            or cls.score_bias is not PositionalVariant.score_bias


def distance(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """i - j for every query/key pair: (B, 1, T, S) int64, >= 0 on every key a causal query may see."""
    return (q_pos[:, :, None] - k_pos[:, None, :])[:, None]


def token_slots(k_pos: torch.Tensor) -> torch.Tensor:
    """(B, S) 1 where a key slot holds a real token, 0 on a pad: a real token's mask-derived position is above the
    slot's before it, a pad's repeats it (a left pad at slot 0 counts as 1: no real key comes before it)."""
    return torch.cat((torch.ones_like(k_pos[:, :1]), (k_pos[:, 1:] > k_pos[:, :-1]).to(k_pos.dtype)), dim=1)
