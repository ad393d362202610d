"""Attention heatmaps for the client: a grid of layers x heads with token labels, written as a PNG.

Client-side only (matplotlib is a build/client dependency, never imported by the worker).  The panels fill the
canvas (constrained layout, shared axes labelled once on the outer edge) and the labels keep one readable size:
every token up to about two dozen per panel side, beyond that every k-th token with its position, so a
128-token map stays legible.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import BinaryIO

import numpy as np

FONT = 8.0  # points: tick labels (titles are larger)
DPI = 110
PANEL_MIN, PANEL_MAX = 2.4, 4.2  # inches per panel side
LABEL_PITCH = 1.45  # a label needs this many times its font size along the axis


def label_step(n: int, side_inches: float, font: float = FONT) -> int:
    """Label every k-th token so that neighbouring labels never overlap along a side of `side_inches`."""
    fits = max(1, int(side_inches * 72 / (font * LABEL_PITCH)))
    return max(1, math.ceil(n / fits))


def figure(maps: list[tuple[int, int, np.ndarray]], pieces: list[str], title: str = ""):
    """The matplotlib Figure (maps: (layer, head, grid) with grid (queries, keys); the last len(grid) tokens are
    the query rows)."""
    # lazy: matplotlib costs 55 MB of RSS to import (66 MB against a bare interpreter's 11, measured);
    # only pictures need it, and it is the lab extra, not the client's install
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    layers = sorted({m[0] for m in maps})
    heads = sorted({m[1] for m in maps})
    rows_q, n_keys = maps[0][2].shape
    width = min(max(0.2 * n_keys, PANEL_MIN), PANEL_MAX)
    height = min(max(width * rows_q / n_keys, 0.9), PANEL_MAX)
    pieces = [p.replace("␠", "␣") for p in pieces]  # DejaVu Sans has no U+2420
    short = [p if len(p) <= 6 else p[:5] + "…" for p in pieces] + [""] * max(0, n_keys - len(pieces))
    margin = 0.75 + 0.06 * FONT * max((len(s) for s in short), default=1)  # room for the outer labels
    fig, axes = plt.subplots(len(layers), len(heads), squeeze=False, sharex=True, sharey=True, layout="constrained",
                             figsize=(width * len(heads) + margin + 1.0, height * len(layers) + margin + 0.5))
    step_x = label_step(n_keys, width)
    step_y = label_step(rows_q, height)

    def labels(indices: range, offset: int, step: int) -> tuple[list[int], list[str]]:
        ticks = list(indices)[::step]
        return ticks, [short[offset + i] if step == 1 else f"{offset + i} {short[offset + i]}" for i in ticks]

    image = None
    for (layer, head, grid) in maps:
        ax = axes[layers.index(layer)][heads.index(head)]
        image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        ax.set_title(f"layer {layer} head {head}", fontsize=FONT + 1, pad=3)
    for ax in axes.flat:
        ax.tick_params(length=2, pad=1, labelsize=FONT)
    ticks, names = labels(range(n_keys), 0, step_x)
    for ax in axes[-1]:
        ax.set_xticks(ticks, names, rotation=90, fontsize=FONT)
    ticks, names = labels(range(rows_q), n_keys - rows_q, step_y)
    for ax in axes[:, 0]:
        ax.set_yticks(ticks, names, fontsize=FONT)
    fig.supxlabel("key", fontsize=FONT + 1)
    fig.supylabel("query", fontsize=FONT + 1)
    if title:
        fig.suptitle(title, fontsize=FONT + 3)
    fig.colorbar(image, ax=axes, shrink=0.8, aspect=30, pad=0.01, label="attention probability")
    return fig


def draw(maps: list[tuple[int, int, np.ndarray]], pieces: list[str], out: str | Path, title: str = "") -> Path:
    """Writes the heatmaps as a PNG to `out` (a path or a binary file-like object)."""
    import matplotlib.pyplot as plt  # lazy: as in figure() above, imported only for a picture

    fig = figure(maps, pieces, title)
    try:
        if hasattr(out, "write"):  # a file-like object (the lab report keeps PNGs in memory)
            fig.savefig(out, format="png", dpi=DPI)
            return out
        out = Path(out)
        fig.savefig(out, dpi=DPI)
        return out
    finally:
        plt.close(fig)


def profile_heatmap(resp, out: str | Path | BinaryIO) -> Path | BinaryIO:
    """A posenc.v1 ProfileResponse as a layer x distance heatmap (each layer's heads averaged: the attention mass in
    each log-2 distance bucket), a column for the first position's mass beside it; written as a PNG."""
    # lazy: matplotlib (see figure())
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = np.frombuffer(resp.values, "<f4").reshape(resp.shape).mean(axis=1)  # (layers, columns)
    names = list(resp.columns[:resp.buckets]) + ["first"]
    grid = np.concatenate([values[:, :resp.buckets], values[:, [list(resp.columns).index("first")]]], axis=1)
    layers = grid.shape[0]
    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * len(names), 1.2 + 0.35 * layers), dpi=DPI, layout="constrained")
    image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=max(float(grid.max()), 1e-6))
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=FONT)
    ax.set_yticks(range(layers), [str(i) for i in range(layers)], fontsize=FONT)
    ax.axvline(resp.buckets - 0.5, color="white", linewidth=1.5)
    ax.set_xlabel("distance from the query (log-2 buckets) | mass on the first position", fontsize=FONT)
    ax.set_ylabel("layer", fontsize=FONT)
    ax.set_title(f"{resp.model}: attention mass by distance, {resp.query_count} query rows of {len(resp.tokens)}, "
                 "heads averaged", fontsize=FONT + 1)
    fig.colorbar(image, ax=ax, shrink=0.9).ax.tick_params(labelsize=FONT)
    path = out if hasattr(out, "write") else Path(out)  # a file object: the report keeps the PNG in memory
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
