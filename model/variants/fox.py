"""The Forgetting Transformer, FoX (Lin, Nikishin, He, Courville 2025, "Forgetting Transformer: Softmax Attention
with a Forget Gate", ICLR 2025, arXiv 2503.02130, section 2).

Each head has a scalar forget gate per token, f_t = sigmoid(w_f . x_t + b_f), and the attention of query i on key j
is down-weighted by every gate between them:

  o_i = sum_j softmax_j(q_i . k_j / sqrt(d) + D_ij) v_j,   D_ij = sum_{l = j+1}^{i} log f_l   (D_ii = 0),

which is FoX's whole positional signal: the paper uses no other positional encoding.  With every f_l = f the bias is
(i - j) log f, ALiBi's shape with a slope learned per head; a data-dependent f makes the decay contextual.

Where w_f . x_t + b_f lives: the last channel of each head's key projection (the model's qkv projection, with its
bias where the config has qkv_bias) is the forget logit, so the gate is a learned linear map of the layer's input
as in the paper, at the cost of one of the head's d channels for the content score: rotate_layer sets the queries'
last channel to 0, so q . k / sqrt(d) sums the other d - 1 (the sqrt(d) is the attention's own; a model constant).
Keys keep the logit as it was projected, so the KV cache carries every earlier gate and a cached step's bias reads
them there: nothing else is cached, and a cached key never changes.  That zeroing is part of the content
computation, not of the positions (rotation_is_content): a layer whose encoding an intervention switches off keeps
it and loses D only.  Under grouped-query attention a key head's gate serves its group of query heads.

score_bias sums the log-gates of the slots that hold a real token (told from the mask-derived positions as cope
tells them: a real token's position is above the slot before it, a pad's repeats it), as prefix sums c over the
keys in float64, D_ij = c_i - c_j; a pad in the middle of a row adds nothing, left pads come before every key a real
query sees.  Masked pairs get finite values the mask hides.

Positions are the gates' doing, not an index: index_positions = False (no randomized positions, no positions given
by an intervention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.errors import ConfigError
from model.variants.base import PositionalVariant, token_slots


class Fox(PositionalVariant):
    name = "fox"
    index_positions = False  # the decay comes from the gates, not from a position index
    rotation_is_content = True  # rotate_layer frees the gate's channel from the content score: never switched off

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        super().check_config(cfg)
        if cfg.head_dim < 2:
            raise ConfigError("fox takes one channel of each key head for its forget gate: head_dim must be >= 2")
        if cfg.mla_kv_rank:
            raise ConfigError("fox reads its forget gate from each key head's last channel; mla_kv_rank's latent "
                              "keys have none of their own")

    def rotate_layer(self, q, k, positions, layer, rope=None):
        """The queries' last channel set to 0 (the keys' is the forget logit, which no query reads); keys as
        projected."""
        return torch.cat((q[..., :-1], torch.zeros_like(q[..., -1:])), dim=-1), k

    def score_bias(self, q, q_pos, k_pos, *, k=None, layer=0):
        """D (B, H, T, S) from the log forget gates in every key's last channel."""
        T, S = q.shape[2], k.shape[2]
        step = token_slots(k_pos)
        log_f = F.logsigmoid(k[..., -1].double()) * step[:, None, :].double()  # (B, H, S): 0 on a pad
        c = log_f.cumsum(-1)  # c_t = sum of log f_l for l <= t
        return (c[..., S - T:, None] - c[..., None, :]).to(q.dtype)  # c_i - c_j = sum over l in (j, i]
