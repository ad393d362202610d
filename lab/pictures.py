"""The lab's pictures (matplotlib lives here and in lab/heatmap.py only): extrapolation plot, encoding pictures,
the passkey grid."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import numpy as np

from lab.studies import per_byte
from model.files import atomic_write
from protos.posenc.v1 import posenc_pb2 as pb


def _plt():
    # lazy: matplotlib costs 55 MB of RSS to import (66 MB against a bare interpreter's 11, measured);
    # only pictures need it, and it is the lab extra, not the client's install
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: str | Path | None) -> bytes:
    """PNG bytes of a figure, also written to `out` when given (atomically)."""
    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    data = buf.getvalue()
    if out is not None:
        atomic_write(Path(out), data)
    return data


def extrapolation_plot(result: dict[str, Any], out: str | Path | None = None) -> bytes:
    plt = _plt()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7 + 1.6 * (len(rows) > 12), 4.5))
    for i, (name, row) in enumerate(rows.items()):
        pts = [(f, per_byte(row["cells"][str(f)])) for f in result["factors"] if per_byte(row["cells"][str(f)])]
        if pts:
            xs, ys = zip(*pts, strict=True)
            # matplotlib's cycle has ten colours: each further ten lines take another dash and marker
            style = i // 10 % 3
            ax.plot(xs, ys, marker="os^"[style], linestyle=("-", "--", ":")[style],
                    label=f"{name}" + (" (table ends at 1x)" if len(pts) == 1 else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(result["factors"], [f"{f}x" for f in result["factors"]])
    ax.set_xlabel("evaluation length / trained context")
    ax.set_ylabel("held-out perplexity per byte (log)")
    ax.set_title("Train short, test long: perplexity beyond the trained context")
    ax.grid(True, which="both", alpha=0.3)
    # Beside the axes, not on them: with every variant the legend would cover the lines' long-context ends.
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), ncol=1 + (len(rows) > 12), frameon=False)
    return _save(fig, out)


def tensors_of(resp: pb.EncodingResponse) -> dict[str, np.ndarray]:
    return {t.name: np.frombuffer(t.data, "<f4").reshape(t.shape) for t in resp.tensors}


def _causal(grid: np.ndarray) -> np.ndarray:
    """Future keys (above the diagonal) blanked: a causal model never uses them."""
    out = grid.astype(np.float64).copy()
    out[np.triu_indices(grid.shape[-1], 1)] = np.nan
    return out


def layer_groups(freqs: np.ndarray) -> list[tuple[str, np.ndarray | None]]:
    """Layers with the same frequencies together: ("layers 0, 2: RoPE", row) or ("layer 3: no RoPE", None)."""
    groups: dict[bytes, list[int]] = {}
    for i, row in enumerate(freqs):
        groups.setdefault(row.tobytes(), []).append(i)
    out = []
    for key, layers in groups.items():
        row = np.frombuffer(key, dtype=freqs.dtype)
        where = f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}"
        out.append((f"{where}: no RoPE", None) if not row.any() else
                   (f"{where}: RoPE, slowest pair {row.min():.3g} rad/pos", row))
    return out


def encoding_plot(resp: pb.EncodingResponse, out: str | Path | None = None) -> bytes:
    plt = _plt()
    t = tensors_of(resp)
    title = f"{resp.model} ({resp.variant})"
    if "position_embedding" in t:
        e = t["position_embedding"]
        norm = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
        im = axes[0].imshow(e.T, aspect="auto", cmap="RdBu_r", interpolation="nearest")
        what = ("what the convolution adds to a constant input" if resp.variant == "cpe"
                else "position embedding added to each token")
        axes[0].set(title=what, xlabel="position", ylabel="dimension")
        fig.colorbar(im, ax=axes[0])
        im = axes[1].imshow(norm @ norm.T, cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
        axes[1].set(title="cosine similarity between positions", xlabel="position", ylabel="position")
        fig.colorbar(im, ax=axes[1])
    elif "score_bias" in t:
        b = t["score_bias"]
        heads = b.shape[0]
        cols = min(heads, 4)
        rows = math.ceil(heads / cols) + 1
        fig = plt.figure(figsize=(3.2 * cols, 3.0 * rows))
        for h in range(heads):
            ax = fig.add_subplot(rows, cols, h + 1)
            im = ax.imshow(_causal(b[h]), cmap="magma", interpolation="nearest")
            ax.set_title(f"head {h}", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            fig.colorbar(im, ax=ax, shrink=0.8)
        ax = fig.add_subplot(rows, 1, rows)
        n = b.shape[-1]
        for h in range(heads):
            ax.plot(np.arange(n), b[h, n - 1, ::-1], label=f"head {h}")  # last query: bias by distance
        ax.set(xlabel="distance to the key (query at the last position)", ylabel="bias added to the score")
        ax.legend(fontsize=7, ncol=min(heads, 8))
        ax.grid(alpha=0.3)
        probed = ("shaw", "xl", "deberta", "cope", "fox", "path")  # biases that read queries or keys
        how = " (for constant unit-norm queries and keys)" if resp.variant in probed else ""
        title += f": attention score bias per head{how}, queries by keys"
    elif "rotary_cos" in t:
        cos, scores = t["rotary_cos"], t["rotary_scores"]
        freqs = t["rotary_frequencies"]  # the graph's own (fope's clipped pairs: 0, where atan2 would say pi/4)
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
        im = axes[0].imshow(cos.T, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
        axes[0].set(title="cos(position x frequency) per rotation pair", xlabel="position", ylabel="pair")
        fig.colorbar(im, ax=axes[0])
        if "layer_frequencies" in t:  # the layers rotate differently: one line per kind of layer
            for label, rows in layer_groups(t["layer_frequencies"]):
                if rows is not None:
                    axes[1].semilogy(np.arange(len(rows)), rows, marker=".", label=label)
                else:
                    axes[1].plot([], [], ls="none", label=label)
            axes[1].legend(fontsize=7)
        else:
            axes[1].semilogy(np.arange(len(freqs)), np.abs(freqs) + 1e-12, marker=".")
        axes[1].set(title="rotation frequency per pair (rad / position)", xlabel="pair", ylabel="theta")
        axes[1].grid(alpha=0.3)
        n = scores.shape[0]
        axes[2].plot(np.arange(n), scores[n - 1, ::-1])
        axes[2].set(title="q.k of equal vectors vs distance", xlabel="distance", ylabel="score / head_dim")
        axes[2].grid(alpha=0.3)
    elif "query_scale" in t:
        f = t["query_scale"]  # (layers, heads, length)
        fig, ax = plt.subplots(figsize=(6, 4))
        for h in range(f.shape[1]):
            ax.plot(np.arange(f.shape[2]), f[0, h], label=f"head {h}")
        ax.set(xlabel="query position", ylabel="factor on the query (layer 0)")
        ax.legend(fontsize=7, ncol=min(f.shape[1], 8))
        ax.grid(alpha=0.3)
        title += ": each query scaled by s log(position + 1), s per layer and head (Scalable-Softmax)"
    else:
        n = 16
        fig, ax = plt.subplots(figsize=(5, 4.5))
        ax.imshow(np.tril(np.ones((n, n))), cmap="Greys", vmin=0, vmax=1.5, interpolation="nearest")
        ax.set(title="the causal mask: the only source of order", xlabel="key", ylabel="query")
        title += f": {resp.note or 'no positional encoding'}"
    fig.suptitle(title, fontsize=10)
    return _save(fig, out)


def _grid(row: dict[str, Any], depths: list[float], value) -> np.ndarray:
    """depth x length of value(cell), NaN where a cell is unavailable."""
    grid = np.full((len(depths), len(row["lengths"])), np.nan)
    for cell in row["cells"]:
        if "unavailable" not in cell:
            grid[depths.index(cell["depth"]), row["lengths"].index(cell["length"])] = value(cell)
    return grid


def passkey_plot(result: dict[str, Any], out: str | Path | None = None, most_layers: int = 6) -> bytes:
    """The passkey study (lab/passkey.py), a row per model: accuracy, then the last prompt row's attention mass on the
    needle per layer (at most `most_layers`, spread over the depth), then the control span's (layers averaged); each
    panel depth x length, grey where a cell is unavailable, every cell labelled with its value."""
    plt = _plt()
    depths, models = result["depths"], result["models"]
    panels = {name: min(row["layers"], most_layers) for name, row in models.items()}
    cols = 2 + max(panels.values())
    fig, axes = plt.subplots(len(models), cols, squeeze=False, layout="constrained",
                             figsize=(2.0 + 1.9 * cols, 0.9 + 0.33 * len(depths) * len(models) + 0.6 * len(models)))
    cmap = plt.get_cmap("viridis").with_extremes(bad="#cccccc")
    for r, (name, row) in enumerate(models.items()):
        layers = sorted({round(i * (row["layers"] - 1) / max(panels[name] - 1, 1)) for i in range(panels[name])})
        shown = [("accuracy", lambda c: c["accuracy"], 1.0)]
        shown += [(f"needle mass, layer {k}", lambda c, k=k: c["needle_mass"][k], None) for k in layers]
        shown += [("control mass, layers mean",
                   lambda c: np.mean(c["control_mass"]) if c["control_mass"] else np.nan, None)]
        grids = [_grid(row, depths, value) for _, value, _ in shown]
        top = max([np.nanmax(g) for g in grids[1:] if np.isfinite(g).any()] + [1e-6])
        for c, ax in enumerate(axes[r]):
            if c >= len(shown):
                ax.axis("off")
                continue
            title, grid = shown[c][0], grids[c]
            ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=shown[c][2] or top, aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                if np.isfinite(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if v < 0.6 * (shown[c][2] or top) else "black")
            ax.set_xticks(range(len(row["lengths"])), [str(x) for x in row["lengths"]], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
            ax.set_title(title, fontsize=8)
            ax.set_xlabel("prompt tokens", fontsize=7)
            if c == 0:
                ax.set_ylabel(f"{name}\n(context {row['trained_context']})\nneedle depth", fontsize=8)
    fig.suptitle("Passkey retrieval: found it (accuracy) and looked at it (last row's attention on the needle)",
                 fontsize=10)
    return _save(fig, out)
