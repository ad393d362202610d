"""The training loop the benchmarks' small Hugging Face LLaMAs share (lab.experiments.scaling, bench.peers_trained
and the notebook's imported model): AdamW with a one-cycle schedule, random windows of the token stream, gradients
clipped at 1, progress every 100 steps on stderr."""

from __future__ import annotations

import sys
from typing import Any


def train_causal_lm(model: Any, ids: Any, steps: int, batch: int, context: int, seed: int,
                    label: str = "") -> list[float]:
    """Train `model` (a transformers causal LM) in place on `ids` (a 1-D int64 tensor) for `steps` steps of `batch`
    windows of `context` tokens drawn with a generator seeded by `seed`; the per-step losses, the model left in eval
    mode."""
    # lazy: torch (213 MB) loads only when a study trains; --plot-only and the figure tests draw without it
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.05)
    g = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - context - 1, (batch,), generator=g).tolist()
        x = torch.stack([ids[s:s + context] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0:
            print(f"{label}step {step + 1}/{steps}: loss {sum(losses[-100:]) / 100:.3f}", file=sys.stderr, flush=True)
    model.eval()
    return losses
