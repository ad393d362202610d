"""Attention heatmaps for the client: a grid of layers x heads with token labels, written as a PNG.

Client-side only (matplotlib is a build/client dependency, never imported by the worker).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def draw(maps: list[tuple[int, int, np.ndarray]], pieces: list[str], out: str | Path, title: str = "") -> Path:
    """maps: (layer, head, grid) with grid (queries, keys); the last len(grid) tokens are the query rows."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    layers = sorted({m[0] for m in maps})
    heads = sorted({m[1] for m in maps})
    n_keys = maps[0][2].shape[1]
    rows_q = maps[0][2].shape[0]
    cell = max(2.2, min(0.28 * n_keys, 6.0))
    fig, axes = plt.subplots(len(layers), len(heads), squeeze=False,
                             figsize=(cell * len(heads) + 1, max(cell * rows_q / n_keys, 1.2) * len(layers) + 1))
    pieces = [p.replace("␠", "␣") for p in pieces]  # DejaVu Sans has no U+2420
    labels = [p if len(p) <= 6 else p[:5] + "…" for p in pieces]
    show_labels = n_keys <= 48
    image = None
    for (layer, head, grid) in maps:
        ax = axes[layers.index(layer)][heads.index(head)]
        image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        ax.set_title(f"layer {layer} head {head}", fontsize=8)
        if show_labels:
            ax.set_xticks(range(n_keys), labels[:n_keys], rotation=90, fontsize=6)
            ax.set_yticks(range(rows_q), labels[n_keys - rows_q:n_keys], fontsize=6)
        else:
            ax.set_xticks([])
            ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=10)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention probability")
    if hasattr(out, "write"):  # a file-like object (the lab report keeps PNGs in memory)
        fig.savefig(out, format="png", dpi=110)
        plt.close(fig)
        return out
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
