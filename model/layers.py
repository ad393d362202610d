"""The parts a block is built from, chosen by config values (never by a family's or a variant's name).

Parameter names are the checkpoint's: a LayerNorm has weight and bias, an RMSNorm only weight, the plain MLP keeps
nn.Sequential's 0/2 so checkpoints written before these choices existed still load.
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in float32 (LLaMA's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)


class L2Norm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) in float32, no weight (Llama 4's L2 norm of each head's queries and keys)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class PerHeadLayerNorm(nn.Module):
    """A bias-free LayerNorm over head_dim with its own weight per head (StableLM's qk_layernorm); x (..., H, Dh)."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight


def make_head_norm(cfg: ModelConfig, heads: int, layer: int = 0) -> nn.Module | None:
    """The norm of queries (heads = n_heads) or keys (kv_heads) cfg.qk_norm asks for in this layer (its record's
    qk_norm), or None: per head over head_dim, or (rmsnorm_all_heads) over all the heads' heads * head_dim values
    together."""
    if not cfg.layer(layer).qk_norm:
        return None
    if cfg.qk_norm == "l2":
        return L2Norm(cfg.layer_norm_eps)
    if cfg.qk_norm == "rmsnorm":
        return RMSNorm(cfg.head_dim, cfg.layer_norm_eps)
    if cfg.qk_norm == "rmsnorm_all_heads":
        return RMSNorm(heads * cfg.head_dim, cfg.layer_norm_eps)
    if cfg.qk_norm == "layernorm":
        return nn.LayerNorm(cfg.head_dim, eps=cfg.layer_norm_eps)
    if cfg.qk_norm == "layernorm_per_head":
        return PerHeadLayerNorm(heads, cfg.head_dim, cfg.layer_norm_eps)
    return None


class SquaredReLU(nn.Module):
    """relu(x)^2 (Nemotron-H's relu2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(torch.relu(x))


def make_activation(name: str) -> nn.Module:
    return {"gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"), "silu": nn.SiLU(), "relu": nn.ReLU(),
            "relu2": SquaredReLU()}[name]


class PlainMLP(nn.Sequential):
    """down(act(up(x))): GPT-2, GPT-NeoX, BLOOM and posenc's own models; width d_mlp unless given."""

    def __init__(self, cfg: ModelConfig, width: int = 0):
        width = width or cfg.d_mlp
        super().__init__(nn.Linear(cfg.d_model, width, bias=cfg.mlp_bias), make_activation(cfg.activation),
                         nn.Linear(width, cfg.d_model, bias=cfg.mlp_bias))

    @property
    def down(self) -> nn.Linear:
        return self[2]


class GateUp(nn.Module):
    """How a gated MLP joins its two projections: act(gate) * up ("gated"; SwiGLU when act is silu), or gpt-oss's
    clamped SwiGLU (up clamped to [-limit, limit] plus 1, times g * sigmoid(alpha * g), g = gate clamped above at
    limit)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.clamped, self.alpha, self.limit = cfg.mlp == "clamped_swiglu", cfg.swiglu_alpha, cfg.swiglu_limit
        self.act = make_activation(cfg.activation)

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not self.clamped:
            return self.act(gate) * up
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GatedMLP(nn.Module):
    """down(join(gate(x), up(x))), joined as GateUp says: SwiGLU when act is silu (LLaMA); width d_mlp unless given."""

    def __init__(self, cfg: ModelConfig, width: int = 0):
        super().__init__()
        width = width or cfg.d_mlp
        self.gate = nn.Linear(cfg.d_model, width, bias=cfg.mlp_bias)
        self.up = nn.Linear(cfg.d_model, width, bias=cfg.mlp_bias)
        self.down = nn.Linear(width, cfg.d_model, bias=cfg.mlp_bias)
        self.join = GateUp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.join(self.gate(x), self.up(x)))


class ExpertLinear(nn.Module):
    """n_experts linear maps side by side: weight (experts, in, out) applied as x @ weight, bias (experts, out)."""

    def __init__(self, experts: int, d_in: int, d_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, d_in, d_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(experts, d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) through every expert: (..., experts, out), as one matrix product with the experts side by side
        (the weight's transpose is a constant, folded by onnxruntime at load)."""
        E, d_in, d_out = self.weight.shape
        y = (x @ self.weight.transpose(0, 1).reshape(d_in, E * d_out)).unflatten(-1, (E, d_out))
        return y if self.bias is None else y + self.bias

    def combine(self, h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum over e of weights[..., e] * (h[..., e, :] @ weight[e] + bias[e]), h (..., experts, in): one matrix
        product over the weighted experts' inputs stacked (onnxruntime's broadcast batched MatMul is far slower)."""
        E, d_in, d_out = self.weight.shape
        y = (h * weights[..., None]).flatten(-2) @ self.weight.reshape(E * d_in, d_out)
        return y if self.bias is None else y + weights @ self.bias


class MoE(nn.Module):
    """A mixture of gated experts (plain ones, up and down alone, where mlp is "plain": Nemotron-H's), computed
    densely: every expert runs on every token and the router's weights (zero outside each token's top k) sum their
    outputs.  The router (a linear map, biased with mlp_bias) scores the
    experts; the top experts_top_k logits are softmaxed among themselves (gpt-oss's GptOssTopKRouter), or chosen and
    weighed by their sigmoids (cfg.router "sigmoid", DeepSeek-V3), beside shared experts every token takes.  Exact for
    any k; the cost is n_experts / experts_top_k times a sparse layer's, which is what a tiny model can afford and
    what one graph with no data-dependent shapes needs."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, F = cfg.n_experts, cfg.d_model, cfg.d_expert or cfg.d_mlp
        self.top_k = cfg.experts_top_k
        self.router = nn.Linear(D, E, bias=cfg.mlp_bias)
        # plain (ungated) experts are up and down alone, act(up(x)) (Nemotron-H's)
        self.gate = ExpertLinear(E, D, F, cfg.mlp_bias) if cfg.mlp != "plain" else None
        self.up = ExpertLinear(E, D, F, cfg.mlp_bias)
        self.down = ExpertLinear(E, F, D, cfg.mlp_bias)
        self.join = GateUp(cfg) if cfg.mlp != "plain" else make_activation(cfg.activation)
        self.sigmoid, self.topk_sigmoid, self.scales_input = (cfg.router == "sigmoid", cfg.router == "topk_sigmoid",
                                                              cfg.router_scales_input)
        if self.sigmoid:  # DeepSeek-V3: a bias that only chooses (e_score_correction_bias), groups, a scale
            self.choice_bias = nn.Parameter(torch.zeros(E))
            self.groups, self.groups_top_k = cfg.expert_groups, cfg.expert_groups_top_k
            self.norm, self.scale = cfg.router_norm, cfg.router_scale
        shared = PlainMLP if cfg.mlp == "plain" else GatedMLP
        self.shared = shared(cfg, cfg.shared_experts * F) if cfg.shared_experts else None
        self.shared_gate = nn.Linear(D, 1, bias=False) if cfg.shared_gate else None  # Qwen3-Next

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)  # (..., E)
        if self.topk_sigmoid:  # Llama 4's Llama4Router: the top k logits' sigmoids, 0 elsewhere
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            weights = torch.sigmoid(logits).masked_fill(logits < kth, 0.0)
        else:
            weights = self.sigmoid_weights(logits) if self.sigmoid else self.softmax_weights(logits)
        if self.scales_input:  # Llama 4: expert e reads x * weight_e; its bias-free projections scale with it
            assert self.gate is not None  # the config gives router_scales_input gated experts only
            scale = weights[..., None]
            y = self.down.combine(self.join(self.gate(x) * scale, self.up(x) * scale), torch.ones_like(weights))
        elif self.gate is None:
            y = self.down.combine(self.join(self.up(x)), weights)  # (..., E, F) -> (..., D)
        else:
            y = self.down.combine(self.join(self.gate(x), self.up(x)), weights)
        if self.shared is None:
            return y
        shared = self.shared(x)
        return y + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)

    def softmax_weights(self, logits: torch.Tensor) -> torch.Tensor:
        kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]  # the k-th largest logit
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)  # 0 off the top k

    def sigmoid_weights(self, logits: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's DeepseekV3TopkRouter, as weights over every expert (0 off the chosen ones)."""
        scores = torch.sigmoid(logits)
        choice = scores + self.choice_bias
        if self.groups > 1:  # a group ranks by its two best choice scores; experts outside the best groups drop out
            grouped = choice.unflatten(-1, (self.groups, -1))  # (..., G, E / G)
            rank = torch.topk(grouped, 2, dim=-1).values.sum(-1)  # (..., G)
            kept = rank >= torch.topk(rank, self.groups_top_k, dim=-1).values[..., -1:]
            choice = grouped.masked_fill(~kept[..., None], float("-inf")).flatten(-2)
        kth = torch.topk(choice, self.top_k, dim=-1).values[..., -1:]
        weights = scores.masked_fill(choice < kth, 0.0)
        if self.norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale


def make_mlp(cfg: ModelConfig, layer: int = 0) -> nn.Module:
    # the layer's record says whether the model's experts are here (DeepSeek-V3's first layers and half of Llama 4's
    # are dense)
    if cfg.n_experts and cfg.layer(layer).experts:
        return MoE(cfg)
    return PlainMLP(cfg) if cfg.mlp == "plain" else GatedMLP(cfg)
