"""Decoder-only transformer with explicit attention, KV cache and per-head attention probabilities.

Reads top-down in build order: attention, block, model.  The positional variant enters only through its three
hooks; nothing here branches on the variant name.  Positions always come from the attention mask
(cumsum - 1 over past + new), so a left-padded row, a cached decode step and an unpadded full forward see the
same positions.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.layers import make_head_norm, make_mlp, make_norm
from model.variants import PositionalVariant, build_variant

KV = tuple[torch.Tensor, torch.Tensor]


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # (B, T, V)
    attentions: torch.Tensor | None  # (B, L, H, T, S) post-softmax probabilities, exactly 0 where masked
    presents: tuple[KV, ...]  # per layer (key, value), each (B, H, S, Dh); keys after rotation
    state: tuple[torch.Tensor, ...] = ()  # the variant's own decoding state after these tokens (cpe), if any


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
        self.windowed, self.chunked, self.tempered = cfg.windowed(layer), cfg.chunked(layer), cfg.tempered(layer)
        self.softcap = cfg.attn_softcap  # a model constant: cap * tanh(scores / cap) before the mask (Gemma 2)
        self.scale_dim = cfg.attn_scale_dim or cfg.head_dim
        # gpt-oss: a learned logit per head joins each row's softmax as one more key with no value; ONNX's
        # Attention has no such input, so these layers keep the explicit path in an exported graph too
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attn_sinks else None

    def projections(self, cfg: ModelConfig) -> None:
        """The input and output projections: one for [Q all heads | K all kv heads | V all kv heads], and out."""
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.out = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.out_bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, T, H * Dh), k and v (B, T, KVH * Dh), before RoPE."""
        B, T, _ = x.shape
        H, KVH, Dh = self.n_heads, self.kv_heads, self.head_dim
        qkv = self.qkv(x)  # sliced, not unpacked or split: those export as a sequence of tensors
        q, k, v = qkv[..., :H * Dh], qkv[..., H * Dh:(H + KVH) * Dh], qkv[..., (H + KVH) * Dh:]
        if self.q_norm is not None and self.qk_norm_all_heads:  # OLMo 2: over every head's values at once
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.q_norm is not None:  # each head's queries and keys normalised over head_dim, before RoPE
            q = self.q_norm(q.reshape(B, T, H, Dh)).reshape(B, T, H * Dh)
            k = self.k_norm(k.reshape(B, T, KVH, Dh)).reshape(B, T, KVH * Dh)
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
            q, k = pos.rotate_layer(q, k, positions.q, self.layer)
            y, k, v, probs = torch.onnx.ops.attention(q, k, v, mask, past[0], past[1], q_num_heads=H,
                                                      kv_num_heads=KVH, scale=scale, softcap=self.softcap,
                                                      qk_matmul_output_mode=3)
            return self.output(y * real[:, 0]), self._onnx_probs(probs, k, real), (k, v)
        q = q.view(B, T, H, Dh).transpose(1, 2)  # (B, H, T, Dh)
        k, v = (t.view(B, T, KVH, Dh).transpose(1, 2) for t in (k, v))  # (B, KVH, T, Dh)
        # new keys are the new tokens: they sit at the queries' positions
        q, k = pos.rotate_layer(q, k, positions.q, self.layer)
        k = torch.cat((past[0], k), dim=2)  # (B, KVH, S, Dh)
        v = torch.cat((past[1], v), dim=2)
        present = (k, v)
        if KVH != H:  # a model constant: grouped-query attention; kv head j serves query heads j*g .. j*g+g-1
            k, v = (t[:, :, None].expand(-1, -1, H // KVH, -1, -1).reshape(B, H, -1, Dh) for t in (k, v))

        if pos.query_dependent_bias:
            bias = pos.score_bias(q, positions.q, positions.k, k=k, layer=self.layer)
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
        return self.output(y.transpose(1, 2).reshape(B, T, H * Dh)), probs, present

    def _onnx_probs(self, probs: torch.Tensor, k: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Attention-23's probabilities, pad queries' rows zeroed.  Shape inference gives that output a key length
        of 0 (onnxruntime then warns on every run); a reshape to the runtime shape (k: (B, H, S, Dh)) replaces it."""
        B, H, T, _ = probs.shape
        return probs.reshape(B, H, T, k.shape[2]) * real


def make_attention(cfg: ModelConfig, layer: int) -> Attention:
    """A block's attention: multi-head latent attention where the config has a latent (mla_kv_rank), else Attention."""
    if not cfg.mla_kv_rank:
        return Attention(cfg, layer)
    # lazy: model.mla's LatentAttention subclasses Attention; imported at the top, the two modules would form a cycle
    from model.mla import LatentAttention

    return LatentAttention(cfg, layer)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.parallel, self.shared, self.post = cfg.parallel_residual, cfg.shared_norm, cfg.post_norm
        self.ln1 = make_norm(cfg) if cfg.pre_norm else nn.Identity()  # OLMo 2: only the branches' outputs normed
        self.attn = make_attention(cfg, layer)
        if not self.shared:
            self.ln2 = make_norm(cfg) if cfg.pre_norm else nn.Identity()
        self.mlp = make_mlp(cfg, layer)
        if cfg.sandwich_norm:  # Gemma 2: each branch's output normed before its residual add
            self.ln_attn_out, self.ln_mlp_out = make_norm(cfg), make_norm(cfg)

    def forward(self, x: torch.Tensor, positions: Positions, past: KV) -> tuple[torch.Tensor, ...]:
        if self.post:  # OPT-350m: x = ln(x + f(x)) around each branch
            a, probs, present = self.attn(x, positions, past)
            x = self.ln1(x + a)
            return self.ln2(x + self.mlp(x)), probs, present
        h = self.ln1(x)
        a, probs, present = self.attn(h, positions, past)
        if self.parallel:  # GPT-NeoX: both branches read the block's input (GPT-J: the same normed input)
            return x + a + self.mlp(h if self.shared else self.ln2(x)), probs, present
        if hasattr(self, "ln_attn_out"):
            x = x + self.ln_attn_out(a)
            return x + self.ln_mlp_out(self.mlp(self.ln2(x))), probs, present
        x = x + a
        x = x + self.mlp(self.ln2(x))
        return x, probs, present


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = build_variant(cfg)
        if cfg.embed_norm:
            self.ln_emb = make_norm(cfg)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.Identity() if cfg.post_norm else make_norm(cfg)  # post-norm blocks end normed
        if not cfg.tie_head:
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.head_bias)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2: scale residual projections by depth
            nn.init.normal_(block.attn.out.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))
            nn.init.normal_(block.mlp.down.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding) and m.weight.shape[0] > 0:
            nn.init.normal_(m.weight, std=0.02)

    def use_onnx_ops(self, on: bool = True) -> Transformer:
        """Write attention (and RoPE's rotation) with torch.onnx.ops for export (Attention-23, RotaryEmbedding-23);
        see Attention.onnx_ops.  Returns the model."""
        for block in self.blocks:
            block.attn.onnx_ops = on
        self.pos.onnx_ops = on
        return self

    def empty_past(self, batch: int) -> tuple[KV, ...]:
        shape = (batch, self.cfg.kv_heads, 0, self.cfg.head_dim)
        z = self.tok.weight.new_zeros(shape)
        return tuple((z, z) for _ in range(self.cfg.n_layers))

    def initial_state(self, batch: int) -> tuple[torch.Tensor, ...]:
        """The variant's decoding state before any token (zeros), one tensor per state_spec entry."""
        return tuple(self.tok.weight.new_zeros((batch, *shape)) for _, shape in self.pos.state_spec())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: tuple[KV, ...] | None = None, output_attentions: bool = True,
                state: tuple[torch.Tensor, ...] | None = None) -> ModelOutput:
        B, T = input_ids.shape
        past = past_key_values if past_key_values is not None else self.empty_past(B)
        P = past[0][0].shape[2]
        if attention_mask is None:
            attention_mask = torch.ones(B, P + T, dtype=torch.int64, device=input_ids.device)
        if not torch.compiler.is_exporting():
            self.pos.check_length(P + T)
            if attention_mask.shape != (B, P + T):
                raise ValueError(f"attention_mask must be (batch, past + new) = ({B}, {P + T}), "
                                 f"got {tuple(attention_mask.shape)}")

        k_pos = positions_from_mask(attention_mask)  # (B, S)
        q_pos = k_pos[:, -T:]  # (B, T)
        # causal by slot index (new token t sits at slot P + t) and never onto a padded key
        q_idx = torch.arange(T, device=input_ids.device) + (attention_mask.shape[1] - T)
        k_idx = torch.arange(attention_mask.shape[1], device=input_ids.device)
        allowed = (k_idx[None, :] <= q_idx[:, None])[None, None] & attention_mask.bool()[:, None, None, :]
        masked = torch.zeros(allowed.shape, dtype=self.tok.weight.dtype, device=input_ids.device)
        window, chunk, temperature = None, None, None
        if self.cfg.attention_chunk:  # a model constant: a query sees only the keys of its own block of positions
            C = self.cfg.attention_chunk
            same = (torch.div(q_pos, C, rounding_mode="floor")[:, :, None] ==
                    torch.div(k_pos, C, rounding_mode="floor")[:, None, :])[:, None]  # (B, 1, T, S)
            chunk = masked.masked_fill(~(allowed & same), torch.finfo(masked.dtype).min)
        if self.cfg.temperature_floor:  # a model constant: log1p(floor((p + 1) / floor)) * scale + 1 per query
            steps = torch.floor((q_pos.to(torch.float32) + 1.0) / self.cfg.temperature_floor)
            temperature = (torch.log1p(steps) * self.cfg.temperature_scale + 1.0)[..., None].to(masked.dtype)
        if self.cfg.sliding_window:  # a model constant: keys at position distance >= the window are hidden too
            inside = (q_pos[:, :, None] - k_pos[:, None, :] < self.cfg.sliding_window)[:, None]  # (B, 1, T, S)
            window = masked.masked_fill(~(allowed & inside), torch.finfo(masked.dtype).min)
        masked = masked.masked_fill(~allowed, torch.finfo(masked.dtype).min)  # (B, 1, T, S), added to scores
        real = attention_mask[:, None, -T:, None].to(masked.dtype)  # (B, 1, T, 1): 0 on a pad query's row

        tokens = self.tok(input_ids)
        if self.cfg.embed_scale != 1.0:  # a model constant (Gemma: sqrt(d_model))
            tokens = tokens * self.cfg.embed_scale
        x = self.pos.embed(tokens, q_pos)  # (B, T, D)
        if self.cfg.embed_norm:
            x = self.ln_emb(x)
        new_state: tuple[torch.Tensor, ...] = ()
        if self.pos.state_spec():  # a model constant: only stateful variants (cpe) take this path
            state = state if state is not None else self.initial_state(B)
            x, new_state = self.pos.embed_state(x, attention_mask[:, -T:], state)
        # a bias that ignores the queries is the same in every layer: folded into the mask once
        if not self.pos.query_dependent_bias:
            bias = self.pos.score_bias(None, q_pos, k_pos)
            masked = masked + bias
            window = None if window is None else window + bias
            chunk = None if chunk is None else chunk + bias
        positions = Positions(self.pos, q_pos, k_pos, masked, real, window, chunk, temperature)
        all_probs, presents = [], []
        for block, layer_past in zip(self.blocks, past, strict=True):
            x, probs, present = block(x, positions, layer_past)
            all_probs.append(probs)
            presents.append(present)
        h = self.ln_f(x)
        logits = h @ self.tok.weight.t() if self.cfg.tie_head else self.head(h)  # (B, T, V)
        if self.cfg.logit_scale != 1.0:  # a model constant (Cohere)
            logits = logits * self.cfg.logit_scale
        if self.cfg.final_softcap:  # a model constant (Gemma 2's final_logit_softcapping)
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        attentions = torch.stack(all_probs, dim=1) if output_attentions else None  # training skips the copy
        return ModelOutput(logits, attentions, tuple(presents), new_state)
