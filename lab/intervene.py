"""`posenc intervene`: one intervention on one prompt, beside the unchanged run (docs/interventions.md).

It asks the worker twice, both with the baseline: Predict (the next-token top-k of both runs and how far the two
distributions are apart) and Profile (each layer's attention mass by distance, heads averaged, of both runs). It
prints them and draws, per layer, the two runs' mass in each distance bucket. `sweep` asks Predict once per shift
and tabulates the divergence against it: a model whose attention is relative (RoPE) answers about 0 at every shift,
one with absolute positions (learned, sinusoidal) does not.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from client.api import Client, effect_profile, profile_values
from client.cli import show_effect, show_top
from lab.tables import Table
from model.files import atomic_write
from protos.posenc.v1 import posenc_pb2 as pb


@dataclass
class Study:
    """Predict and Profile of one prompt under one intervention, each with the unchanged run beside it."""

    predict: pb.PredictResponse
    profile: pb.ProfileResponse

    @property
    def buckets(self) -> list[str]:
        """The distance buckets' names ("0", "1", "2-3", ...)."""
        return list(self.profile.columns[:self.profile.buckets])

    def by_distance(self) -> tuple[np.ndarray, np.ndarray]:
        """(intervened, baseline): each layer's mass per distance bucket, heads averaged, [layers, buckets]."""
        n = self.profile.buckets
        return (profile_values(self.profile).mean(axis=1)[:, :n], effect_profile(self.profile).mean(axis=1)[:, :n])


def with_baseline(edit: pb.Intervention, **changes: Any) -> pb.Intervention:
    """A copy of the intervention with `baseline` set (and any scalar field in `changes`)."""
    out = pb.Intervention()
    out.CopyFrom(edit)
    out.baseline = True
    for name, value in changes.items():
        setattr(out, name, value)
    return out


def study(client: Client, model: str, text: str, edit: pb.Intervention, top_k: int = 5, last: int = 0) -> Study:
    """Predict (top `top_k`) and Profile (the last `last` query rows averaged; 0: all) under `edit`, each with its
    baseline."""
    edit = with_baseline(edit)
    return Study(client.predict(model, text, top_k=top_k, intervention=edit),
                 client.profile(model, text, last=last, intervention=edit))


def show(s: Study) -> str:
    """The effect (KL and the other divergences), both runs' top-k side by side, and per layer the attention mass by
    distance of the intervened run, the baseline and their difference."""
    pred, prof = s.predict, s.profile
    new, base = s.by_distance()
    out = [f"model {pred.model}: {len(pred.tokens)} prompt tokens", show_effect(pred.effect), "",
           "next token (intervened, then baseline):", show_top(pred.top, pred.effect.baseline_top), "",
           f"attention mass by distance, heads averaged, query rows {prof.query_start}.."
           f"{prof.query_start + prof.query_count - 1}:",
           f"{'layer':>5} {'run':<10} " + " ".join(f"{c:>9}" for c in s.buckets)]
    for layer in range(len(new)):
        for name, row in (("intervened", new[layer]), ("baseline", base[layer]),
                          ("change", new[layer] - base[layer])):
            out.append(f"{layer:>5} {name:<10} " + " ".join(f"{v:>9.4f}" for v in row))
    return "\n".join(out)


def sweep(client: Client, model: str, text: str, shifts: list[int], edit: pb.Intervention | None = None,
          top_k: int = 5) -> list[pb.Effect]:
    """Predict's effect at each shift of every position (the rest of `edit`, if given, held), each beside the
    unchanged run."""
    edit = edit or pb.Intervention()
    return [client.predict(model, text, top_k=top_k, intervention=with_baseline(edit, shift=k)).effect
            for k in shifts]


def sweep_table(model: str, shifts: list[int], effects: list[pb.Effect]) -> Table:
    """Is it relative? The divergence of the next-token distribution against the shift."""
    rows = [[str(k), f"{e.kl_divergence:.6g}", f"{e.total_variation:.6g}", f"{e.js_divergence:.6g}",
             "yes" if e.top1_changed else "no"] for k, e in zip(shifts, effects, strict=True)]
    return Table(["shift", "KL (nats)", "total variation", "JS (nats)", "top-1 changed"], rows,
                 intro=[f"model {model}: every position moved by the shift (the rest of the intervention held), "
                        "beside the unchanged run"],
                 notes=["A relative encoding (RoPE) gives about 0 at every shift; an absolute one does not."])


def _plt() -> Any:
    # lazy: matplotlib costs 55 MB of RSS to import (66 MB against a bare interpreter's 11, measured);
    # only pictures need it, and it is the lab extra, not the client's install
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out: str | Path) -> Path:
    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    atomic_write(Path(out), buf.getvalue())
    return Path(out)


def draw(s: Study, out: str | Path, title: str = "") -> Path:
    """A panel per layer: the baseline's and the intervened run's attention mass in each distance bucket (heads
    averaged), as bars side by side."""
    plt = _plt()
    new, base = s.by_distance()
    layers, cols = len(new), min(len(new), 4)
    rows = -(-layers // cols)
    fig, axes = plt.subplots(rows, cols, squeeze=False, sharey=True, layout="constrained",
                             figsize=(1.0 + 3.4 * cols, 0.8 + 2.8 * rows))
    x = np.arange(len(s.buckets))
    for i, ax in enumerate(axes.flat):
        if i >= layers:
            ax.axis("off")
            continue
        ax.bar(x - 0.2, base[i], 0.4, label="baseline", color="#8c8c8c")
        ax.bar(x + 0.2, new[i], 0.4, label="intervened", color="#d62728")
        ax.set_xticks(x, s.buckets, fontsize=7, rotation=45)
        ax.set_title(f"layer {i}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        if i % cols == 0:
            ax.set_ylabel("attention mass")
        if i // cols == rows - 1:
            ax.set_xlabel("distance (query - key)")
    axes.flat[0].legend(fontsize=7)
    effect = s.predict.effect
    fig.suptitle(f"{title or s.predict.model}: {effect.description}; next-token KL {effect.kl_divergence:.3g} nats",
                 fontsize=10)
    return _save(fig, out)


def draw_sweep(model: str, shifts: list[int], effects: list[pb.Effect], out: str | Path) -> Path:
    """KL and total variation against the shift (a symmetric log axis: the shift may be 0)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(shifts, [e.kl_divergence for e in effects], marker="o", label="KL (nats)")
    ax.plot(shifts, [e.total_variation for e in effects], marker="s", label="total variation")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_yscale("symlog", linthresh=1e-12)  # 0 at a shift of 0, tiny for RoPE
    ax.set(xlabel="shift of every position", ylabel="divergence from the unshifted run",
           title=f"{model}: is its attention relative?")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, out)
