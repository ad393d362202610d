"""PaTH attention (Yang, Shen, Wen, Tan, Mishra, Ren, Panda, Kim 2025, "PaTH Attention: Position Encoding via
Accumulating Householder Transformations", arXiv 2505.16381, section 3).

Each token t brings a Householder-like matrix H_t = I - beta_t w_t w_t^T (w_t a unit vector, beta_t in (0, 2)), and
query i reads key j through every matrix between them:

  logit_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(d)   (j <= i; the key's own H_j is not applied),

which is PaTH's whole positional signal: no other positional encoding.  With every beta_t = 0 it is plain attention
without positions (NoPE); a reflection (beta = 2) flips the sign of the component along w_t.

Where w_t and beta_t live: each key head's channels are [k (c) | w (c) | beta logit (1) | unused], c = (d - 1) // 2,
all from the model's key projection (a learned linear map of the layer's input, as the paper's W_w and W_beta);
w_t is that slice L2-normalized and beta_t = 2 sigmoid(logit).  rotate_layer zeroes every query channel past the
first c, so the content score q . k / sqrt(d) reads k's first c channels alone (the sqrt(d) is the attention's own, a
model constant); that zeroing is content, not position (rotation_is_content).  The keys keep w and beta as projected,
so the KV cache carries every earlier token's matrix and a cached key never changes: each call recomputes the products
from the cached keys (the reference implementation instead rewrites every cached key in place at each step,
k_j <- H_t k_j, which an append-only cache cannot do).  The paper's layer passes w through a 3-tap causal convolution
before the norm; here w is the projection alone (a convolution would need the neighbouring tokens of every slot, pads
in the middle of a row included).  Under grouped-query attention a key head's matrices serve its group.

The paper's UT transform (section 3.2) writes the products in closed form: with G_ut = beta_u w_u . w_t for u > t
(strictly lower), the row vector s_i solving s_i (I + G) = b_i, b_it = q_i . w_t for t <= i, gives
q_i^T H_i ... H_{j+1} = q_i^T - sum_{t=j+1}^{i} beta_t s_it w_t^T, so

  logit_ij = (q_i . k_j - sum_{t>j} s_it beta_t w_t . k_j) / sqrt(d),

and the second term is the bias.  Over all S slots that is O(S^3) per head.  In PyTorch score_bias uses it within
blocks of CHUNK slots only (chunked_bias): a query is carried through its own block's matrices and a key through
those after it in its block by the same transform, and each whole block between them is one c x c matrix, H_end ...
H_start = I - W^T diag(beta) (I + N)^-1 W with N_tu = beta_u w_t . w_u for u < t (the compact WY form), so a call
costs O(S^2 c) per head at these sizes (c <= CHUNK), differentiable, for training.  An exported graph walks the keys
last first instead (a torch scan, an ONNX Scan; householder_logits): the carry holds every query's row v_i = q_i^T
H_i ... H_{j+1}, the step for key j reads v_i . k_j and then applies H_j to the queries at or after slot j, v_i <-
v_i - beta_j (v_i . w_j) w_j^T.  That is O(T S c) per head and call in S steps: a decode step over S cached keys is
O(S c), so served models take prompts of thousands of tokens.  Both are float64, and the exporter's parity check
holds one against the other.  A pad's beta is 0 (its H is the identity), told from the mask-derived positions as fox
tells them, so pads anywhere in a row change nothing.

Positions are the matrices' doing, not an index: index_positions = False (no randomized positions, no positions
given by an intervention); switching a layer's encoding off removes the bias, leaving NoPE attention on the content
channels.
"""

from __future__ import annotations

import math

import torch
from torch._higher_order_ops.scan import scan

from model.config import ModelConfig
from model.deltanet import l2_normalized
from model.errors import ConfigError
from model.variants.base import PositionalVariant, token_slots


def channels(head_dim: int) -> int:
    """c: the content (and w) channels of a head of head_dim channels; channel 2c holds beta's logit."""
    return (head_dim - 1) // 2


def _key_step(carry, key):
    """One key slot j of the exported walk (last first): each query's logit against key j, then H_j applied to the
    queries at or after slot j.  carry: v (B, H, T, c) and the queries' slots (T,); key: w_j, beta_j (B, H), the
    key's content k_j (B, H, c) and j."""
    v, query_slots = carry
    w, beta, content, j = key
    logit = (v * content[:, :, None, :]).sum(-1)  # (B, H, T)
    along = (v * w[:, :, None, :]).sum(-1, keepdim=True)
    applies = (query_slots >= j).to(v.dtype)[:, None]  # (T, 1): H_j sits between query i and the keys before j
    return (v - applies * beta[:, :, None, None] * along * w[:, :, None, :], query_slots.clone()), logit


def householder_logits(q, w, beta, content):
    """(B, H, T, S): q_i^T H_i ... H_{j+1} k_j for every query i (the last T of the S slots) and key j <= i, and
    q_i . k_j for j > i, by a scan over the keys last first.  q (B, H, T, c), w (B, H, S, c) unit rows, beta
    (B, H, S), content (B, H, S, c)."""
    T, S = q.shape[2], w.shape[2]
    slots = torch.arange(S, device=q.device)
    # detached: an exported graph is never differentiated, and torch's scan cannot trace a gradient of this carry
    keys = tuple(x.detach() for x in (w.permute(2, 0, 1, 3), beta.permute(2, 0, 1), content.permute(2, 0, 1, 3)))
    _, logits = scan(_key_step, (q.detach().contiguous(), slots[S - T:]), (*keys, slots), reverse=True)
    return logits.permute(1, 2, 3, 0)


CHUNK = 64  # chunked_bias's block of slots


def chunked_bias(q, w, beta, content, chunk: int = CHUNK):
    """householder_logits minus q . k (0 for j > i), in blocks of `chunk` slots, differentiable: O(S^2 c + S chunk^2
    + S^2 c^2 / chunk) time and O(S^2) memory per head, whatever T (every slot's row is computed; a cached decode step
    in PyTorch costs what its prompt did; the exported graphs walk instead).  Within a block the UT form (a unit
    lower-triangular solve of chunk x chunk); across blocks each query carried through its own block's matrices
    (q~_i^T = q_i^T H_i ... H_start), each key through the matrices after it in its block (k~_j = H_end ... H_{j+1}
    k_j), and every whole block between them as one c x c product F = H_end ... H_start = I - W^T diag(beta)
    (I + N)^-1 W, N_tu = beta_u w_t . w_u for u < t (the compact WY form).  The queries are the last T slots.
    Within a block the correction is computed as such (so beta -> 0 gives 0, and a key's own slot exactly 0);
    across blocks it is the carried logit minus q . k."""
    B, H, T, c = q.shape
    S = w.shape[2]
    n = -(-S // chunk)
    extra = n * chunk - S  # padding slots: beta 0, so their matrices are the identity

    def blocks(x):
        return torch.nn.functional.pad(x, (0, 0, 0, extra)).view(B, H, n, chunk, c)

    Q = blocks(torch.cat((q.new_zeros(B, H, S - T, c), q), dim=2))
    W, K = blocks(w), blocks(content)
    be = torch.nn.functional.pad(beta, (0, extra)).view(B, H, n, chunk)
    a = torch.arange(chunk, device=q.device)
    lower, upto = a[:, None] > a[None, :], a[:, None] >= a[None, :]
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    WW, WK = W @ W.transpose(-1, -2), W @ K.transpose(-1, -2)  # [u, t] = w_u . w_t; [t, j] = w_t . k_j
    # queries: s (I + G) = b, G_ut = beta_u w_u . w_t (u > t), b_it = q_i . w_t (t <= i); s_it = 0 past i
    s = torch.linalg.solve_triangular(eye + torch.where(lower, be[..., :, None] * WW, 0.0),
                                      torch.where(upto, Q @ W.transpose(-1, -2), 0.0),
                                      upper=False, left=False, unitriangular=True) * be[..., None, :]
    intra = -s @ torch.where(lower, WK, 0.0)  # [i, j], j <= i in one block: -sum_{t>j} s_it beta_t w_t . k_j
    Qt = Q - s @ W
    # keys: (I + N) r_j = c_j, c_jt = w_t . k_j for t > j
    nn_ = eye + torch.where(lower, WW * be[..., None, :], 0.0)
    r = torch.linalg.solve_triangular(nn_.transpose(-1, -2), torch.where(lower.T, WK.transpose(-1, -2), 0.0),
                                      upper=True, left=False, unitriangular=True)
    Kt = K - (r * be[..., None, :]) @ W
    F = (torch.eye(c, dtype=q.dtype, device=q.device)
         - W.transpose(-1, -2) @ (be[..., :, None] * torch.linalg.solve_triangular(nn_, W, upper=False,
                                                                                     unitriangular=True)))
    below: dict[tuple[int, int], torch.Tensor] = {}
    X = Qt  # at distance d, blocks m = d .. n - 1: q~_i^T F_{m-1} ... F_{m-d+1} for the queries of block m
    for d in range(1, n):
        X = X[:, :, 1:]
        cross = (X @ Kt[:, :, :n - d].transpose(-1, -2)  # block (m, m - d): q~^T F ... k~ - q . k
                 - Q[:, :, d:] @ K[:, :, :n - d].transpose(-1, -2))
        for m in range(d, n):
            below[m, m - d] = cross[:, :, m - d]
        X = X @ F[:, :, :n - d]  # one more whole block, F_{m-d}, before the next distance
    zero = q.new_zeros(B, H, chunk, chunk)
    rows = [torch.cat([below[m, j] if j < m else intra[:, :, m] if j == m else zero for j in range(n)], dim=-1)
            for m in range(n)]
    return torch.cat(rows, dim=-2)[:, :, S - T:S, :S]


class Path(PositionalVariant):
    name = "path"
    index_positions = False  # the transformations come from the tokens, not from a position index
    rotation_is_content = True  # rotate_layer keeps w and beta out of the content score: never switched off

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        super().check_config(cfg)
        if cfg.head_dim < 3:
            raise ConfigError("path takes each key head's channels for k, w and beta: head_dim must be >= 3")
        if cfg.mla_kv_rank:
            raise ConfigError("path reads w and beta from each key head's channels; mla_kv_rank's latent keys have "
                              "none of their own")
        for name in ("attn_scale_dim", "attn_softcap"):  # the bias is scaled as q.k / sqrt(head_dim), added uncapped
            if getattr(cfg, name):
                raise ConfigError(f"{name} applies to q.k alone, which would split path's logit from its "
                                  "Householder correction: path takes 0")

    def rotate_layer(self, q, k, positions, layer, rope=None):
        """The queries past their first c channels set to 0 (the keys' hold w and beta, which no query reads); keys as
        projected."""
        c = channels(q.shape[-1])
        return torch.cat((q[..., :c], torch.zeros_like(q[..., c:])), dim=-1), k

    def score_bias(self, q, q_pos, k_pos, *, k=None, layer=0):
        """(B, H, T, S): minus the Householder products' correction to q . k, scaled as the content score."""
        d = q.shape[-1]
        c = channels(d)
        step = token_slots(k_pos)
        kd = k.double()
        w = l2_normalized(kd[..., c:2 * c])  # (B, H, S, c)
        beta = 2.0 * torch.sigmoid(kd[..., 2 * c]) * step[:, None, :].double()  # (B, H, S): 0 on a pad
        scale, qd, content = self.content_scale / math.sqrt(d), q.double()[..., :c], kd[..., :c]
        if torch.onnx.is_in_onnx_export():  # the walk over the keys: O(T S c) in S steps
            return ((householder_logits(qd, w, beta, content) - qd @ content.transpose(-1, -2)) * scale).to(q.dtype)
        return (chunked_bias(qd, w, beta, content) * scale).to(q.dtype)  # blocks: O(S^2 c), differentiable
