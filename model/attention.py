"""A transformer block's attention, and the positions every layer reads.

`Positions` is built once per forward (Transformer.forward) from the attention mask and handed to every block;
`Attention` makes q, k and v from the hidden state (`project`), applies the variant's rotation and score bias, the
masks, soft-cap and sinks, caches keys and values with kv_heads heads, and reads the heads' weighted values back
(`output`).  model/mla.py's LatentAttention replaces only `projections`, `project` and `output`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.layers import L2Norm, make_head_norm
from model.variants import PositionalVariant

KV = tuple[torch.Tensor, torch.Tensor]


class Intervention(NamedTuple):
    """One forward's changes to what positions do, per batch row (the intervention graph's inputs, export/intervene.py).
    Neutral values (all ones, `rope` unused) compute what the plain forward does.  With the positions themselves
    (Transformer.forward's position_ids) they answer "what if": other positions, a layer's encoding off, heads
    ablated, another RoPE scaling."""
    on: torch.Tensor  # (B, L) float: 1 keeps layer l's positional computation, 0 removes it (no rotation, no bias)
    keep: torch.Tensor  # (B, L, H) float: 1 keeps head h's output, 0 zeroes it before the output projection
    # RoPE's frequencies for the layers that rotate with the model's own scaling, per row: (inv_freq (B, d_rot/2),
    # the factor cos and sin are multiplied by (B,), use (B,): 1 takes these, 0 the model's own); None: the model's
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def mix(on: torch.Tensor, changed: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
    """Per row, `changed` where on is 1 and `plain` where it is 0, exactly (on (B,), broadcast over the rest)."""
    on = on.reshape(on.shape[0], *([1] * (changed.dim() - 1))).to(changed.dtype)
    return changed * on + plain * (1 - on)


class Positions(NamedTuple):
    """Everything positional one forward computes once and every layer reads (built by Transformer.forward)."""
    variant: PositionalVariant  # the hooks that turn these positions into encodings
    q: torch.Tensor  # (B, T) int64 positions of the new tokens (queries and new keys)
    k: torch.Tensor  # (B, S) int64 positions of every key, past + new
    mask: torch.Tensor  # (B, 1 or H, T, S) added to the scaled scores: causal + padding mask and query-free bias
    real: torch.Tensor  # (B, 1, T, 1) 1 on a real query's row, 0 on a pad's (whose probabilities it zeroes)
    window: torch.Tensor | None = None  # mask with the sliding window too, for the layers that use one
    chunk: torch.Tensor | None = None  # mask with the chunks too (a query sees its own block), for chunked layers
    temperature: torch.Tensor | None = None  # (B, T, 1) the queries' factor in the tempered layers (Llama 4's NoPE)
    # with an intervention: the query-free bias kept apart from the masks (each layer adds it, or not), and the changes
    bias: torch.Tensor | None = None
    intervention: Intervention | None = None
    slots: torch.Tensor | None = None  # (B, S) the attention mask: 1 on a real slot (a mixer's map places its keys)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position of every slot: number of real tokens before it.  Pad slots get 0 (they are masked anyway)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)

class Attention(nn.Module):
    # Set for export by Transformer.use_onnx_ops (python -m export --attention onnx, the default): attention written
    # with torch.onnx.ops.attention, one ONNX Attention-23 node (qk_matmul_output_mode=3 returns the probabilities).
    # Eager PyTorch always runs the explicit path below; the exporter proves the two graphs agree.
    onnx_ops = False

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim, self.layer = cfg.n_heads, cfg.kv_heads, cfg.head_dim, layer
        self.projections(cfg)
        self.q_norm, self.k_norm = make_head_norm(cfg, cfg.n_heads, layer), make_head_norm(cfg, cfg.kv_heads, layer)
        self.qk_norm_all_heads = cfg.qk_norm == "rmsnorm_all_heads"
        self.v_norm = L2Norm(cfg.layer_norm_eps) if cfg.v_norm else None  # Gemma 4: each head's values, no weight
        spec = cfg.layer(layer)  # this layer's record: which mask, whether its queries are tempered
        self.windowed, self.chunked, self.tempered = spec.attention == "sliding", spec.attention == "chunked", \
            spec.temperature
        self.softcap = cfg.attn_softcap  # a model constant: cap * tanh(scores / cap) before the mask (Gemma 2)
        self.scale_dim = cfg.attn_scale_dim or cfg.head_dim
        # gpt-oss: a learned logit per head joins each row's softmax as one more key with no value; ONNX's
        # Attention has no such input, so these layers keep the explicit path in an exported graph too
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attn_sinks else None
        # Qwen3-Next's gated attention: each head's output channel times sigmoid of its own projection of x
        self.gate = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias) if cfg.attn_gate else None

    def projections(self, cfg: ModelConfig) -> None:
        """The input and output projections: one for [Q all heads | K all kv heads | V all kv heads], and out."""
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.out = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.out_bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, T, H * Dh), k and v (B, T, KVH * Dh), normed where the config says, before RoPE."""
        B, T, _ = x.shape
        H, KVH, Dh = self.n_heads, self.kv_heads, self.head_dim
        qkv = self.qkv(x)  # sliced, not unpacked or split: those export as a sequence of tensors
        q, k, v = qkv[..., :H * Dh], qkv[..., H * Dh:(H + KVH) * Dh], qkv[..., (H + KVH) * Dh:]
        if self.q_norm is not None and self.qk_norm_all_heads:  # OLMo 2: over every head's values at once
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.q_norm is not None:  # each head's queries and keys normalised over head_dim, before RoPE
            q = self.q_norm(q.reshape(B, T, H, Dh)).reshape(B, T, H * Dh)
            k = self.k_norm(k.reshape(B, T, KVH, Dh)).reshape(B, T, KVH * Dh)
        if self.v_norm is not None:
            v = self.v_norm(v.reshape(B, T, KVH, Dh)).reshape(B, T, KVH * Dh)
        return q, k, v

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """The attention's output (B, T, D) from the heads' weighted values y (B, T, H * Dh)."""
        return self.out(y)

    def forward(self, x: torch.Tensor, positions: Positions, past: KV) -> tuple[torch.Tensor, ...]:
        """positions.mask is added to the scaled scores: the most negative float on every key a query may not see
        (so its probability is exactly 0 and a pad query's row stays finite) plus a query-free bias;
        positions.real zeroes a pad query's probabilities.  Keys and values are cached with kv_heads heads."""
        pos, real = positions.variant, positions.real
        mask = positions.window if self.windowed else positions.chunk if self.chunked else positions.mask
        B, T, _ = x.shape
        H, KVH, Dh = self.n_heads, self.kv_heads, self.head_dim
        q, k, v = self.project(x)
        if self.tempered:  # a model constant: these queries scaled by their position's temperature (rotation-free)
            q = q * positions.temperature
        scale = pos.content_scale / math.sqrt(self.scale_dim)  # DeBERTa's content_scale: a model constant
        if self.onnx_ops and self.sinks is None and not pos.bias_reads_keys():
            # Attention-23 on (B, T, heads * Dh) inputs appends the new keys and values to the past itself and
            # groups query heads onto kv heads: no reshapes, transposes or concatenations around it in the graph
            q, k = self._rotate(q, k, positions)
            mask = self._layer_bias(mask, positions)
            y, k, v, probs = torch.onnx.ops.attention(q, k, v, mask, past[0], past[1], q_num_heads=H,
                                                      kv_num_heads=KVH, scale=scale, softcap=self.softcap,
                                                      qk_matmul_output_mode=3)
            y = self._ablate(self._gated(y * real[:, 0], x), positions)
            return self.output(y), self._onnx_probs(probs, k, real), (k, v)
        q = q.view(B, T, H, Dh).transpose(1, 2)  # (B, H, T, Dh)
        k, v = (t.view(B, T, KVH, Dh).transpose(1, 2) for t in (k, v))  # (B, KVH, T, Dh)
        # new keys are the new tokens: they sit at the queries' positions
        q, k = self._rotate(q, k, positions)
        mask = self._layer_bias(mask, positions)
        k = torch.cat((past[0], k), dim=2)  # (B, KVH, S, Dh)
        v = torch.cat((past[1], v), dim=2)
        present = (k, v)
        if KVH != H:  # a model constant: grouped-query attention; kv head j serves query heads j*g .. j*g+g-1
            k, v = (t[:, :, None].expand(-1, -1, H // KVH, -1, -1).reshape(B, H, -1, Dh) for t in (k, v))

        if pos.query_dependent_bias:
            bias = pos.score_bias(q, positions.q, positions.k, k=k, layer=self.layer)
            if bias is not None and positions.intervention is not None:
                bias = bias * self._on(positions, 4)
            mask = mask if bias is None else mask + bias
        # the scale applies to q: T x Dh products, not T x S scores
        if self.onnx_ops and self.sinks is None:
            y, _, _, probs = torch.onnx.ops.attention(q, k, v, mask, scale=scale, softcap=self.softcap,
                                                      qk_matmul_output_mode=3)
            y, probs = y * real, self._onnx_probs(probs, k, real)
        else:
            scores = (q * scale) @ k.transpose(-1, -2)
            if self.softcap:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            if self.sinks is None:
                probs = F.softmax(scores + mask, dim=-1) * real  # (B, H, T, S)
            else:  # the sink's column takes its share of each row and is dropped: rows sum to 1 - its mass
                sink = self.sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
                probs = F.softmax(torch.cat((scores + mask, sink), dim=-1), dim=-1)[..., :-1] * real
            y = probs @ v
        y = self._ablate(self._gated(y.transpose(1, 2).reshape(B, T, H * Dh), x), positions)
        return self.output(y), probs, present

    def _gated(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (B, T, H * Dh) times sigmoid(gate(x)) where the config gates the output (attn_gate)."""
        return y if self.gate is None else y * torch.sigmoid(self.gate(x))

    # --- interventions (positions.intervention; None in every plain forward) ----------------------------------

    def _on(self, positions: Positions, dims: int) -> torch.Tensor:
        """This layer's switch per row, shaped to broadcast over a (B, ...) tensor of `dims` dims."""
        assert positions.intervention is not None
        on = positions.intervention.on[:, self.layer]
        return on.reshape(on.shape[0], *([1] * (dims - 1)))

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, positions: Positions) -> tuple[torch.Tensor, torch.Tensor]:
        """The variant's rotation of this layer; under an intervention with its frequencies, and per row either it
        or none (the layer's encoding switched off)."""
        edit = positions.intervention
        if edit is None or positions.variant.rotation_is_content:
            return positions.variant.rotate_layer(q, k, positions.q, self.layer)
        rq, rk = positions.variant.rotate_layer(q, k, positions.q, self.layer, rope=edit.rope)
        if rq is q and rk is k:  # nothing rotated in this layer (NoPE): nothing to switch
            return q, k
        on = edit.on[:, self.layer]
        return mix(on, rq, q), mix(on, rk, k)

    def _layer_bias(self, mask: torch.Tensor, positions: Positions) -> torch.Tensor:
        """The query-free bias an intervention keeps apart, added here where this layer's encoding is on."""
        if positions.bias is None:
            return mask
        return mask + positions.bias * self._on(positions, 4).to(positions.bias.dtype)

    def _ablate(self, y: torch.Tensor, positions: Positions) -> torch.Tensor:
        """y (B, T, H * Dh) with the ablated heads' outputs zeroed (before the output projection)."""
        edit = positions.intervention
        if edit is None:
            return y
        B, T, _ = y.shape
        keep = edit.keep[:, self.layer].to(y.dtype)  # (B, H)
        return (y.reshape(B, T, self.n_heads, -1) * keep[:, None, :, None]).reshape(B, T, -1)

    def _onnx_probs(self, probs: torch.Tensor, k: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Attention-23's probabilities, pad queries' rows zeroed.  Shape inference gives that output a key length
        of 0 (onnxruntime then warns on every run); a reshape to the runtime shape (k: (B, H, S, Dh)) replaces it."""
        B, H, T, _ = probs.shape
        return probs.reshape(B, H, T, k.shape[2]) * real
