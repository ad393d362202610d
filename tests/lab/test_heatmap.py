"""The attention PNG's geometry: panels fill the canvas, nothing is cut off, and the token labels keep a readable
size without overlapping, from 16 tokens to 128 (the default models' trained context)."""

import matplotlib
import numpy as np
import pytest

from lab import heatmap

matplotlib.use("Agg")

TEXT = "The function len() returns the number of items in a container. It works on strings, lists and dicts. "


def causal_maps(n, layers=4, heads=4, rows=None):
    rng = np.random.default_rng(n)
    out = []
    for layer in range(layers):
        for head in range(heads):
            scores = rng.normal(size=(n, n)) * 2
            scores[np.triu_indices(n, 1)] = -np.inf
            p = np.exp(scores - scores.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            out.append((layer, head, p[-(rows or n):].astype(np.float32)))
    return out


def pieces(n):
    return ["␠" if c == " " else c for c in (TEXT * 2)[:n]]


def drawn(maps, labels):
    fig = heatmap.figure(maps, labels, title="rope: 'The function len()'")
    fig.canvas.draw()
    return fig, fig.canvas.get_renderer()


@pytest.mark.parametrize("n, rows", [(16, None), (128, None), (40, 1)])
def test_panels_fill_the_canvas_and_labels_stay_readable(n, rows):
    import matplotlib.pyplot as plt

    fig, renderer = drawn(causal_maps(n, rows=rows), pieces(n))
    try:
        width, height = fig.bbox.width, fig.bbox.height
        panels = [ax for ax in fig.axes if ax.images]
        assert len(panels) == 16
        covered = sum(ax.get_window_extent().width * ax.get_window_extent().height for ax in panels)
        assert covered / (width * height) > 0.5, covered / (width * height)  # the old layout left ~0.37
        for text in fig.findobj(matplotlib.text.Text):  # nothing drawn outside the canvas
            if text.get_visible() and text.get_text():
                box = text.get_window_extent(renderer)
                assert box.x0 >= -1 and box.y0 >= -1 and box.x1 <= width + 1 and box.y1 <= height + 1, text
        bottom_left = panels[-len([ax for ax in panels if ax.get_subplotspec().is_last_row()])]
        for axis, along in ((bottom_left.get_xticklabels(), 0), (bottom_left.get_yticklabels(), 1)):
            labels = [t for t in axis if t.get_text()]
            want = (n if along == 0 else (rows or n))
            assert len(labels) == want if want <= 24 else len(labels) >= 16  # every token, or every k-th
            assert all(t.get_fontsize() >= 8 for t in labels)  # 8 pt at 110 dpi: 12 pixels
            boxes = sorted((t.get_window_extent(renderer) for t in labels),
                           key=lambda b: (b.x0, b.y0)[along])
            for a, b in zip(boxes, boxes[1:], strict=False):  # neighbours do not overlap along the axis
                assert (a.x1 <= b.x0 + 0.5) if along == 0 else (a.y1 <= b.y0 + 0.5)
        if n > 24:  # a thinned axis names the positions it labels
            assert bottom_left.get_xticklabels()[1].get_text().split()[0].isdigit()
    finally:
        plt.close(fig)


def test_one_panel_and_the_png(tmp_path):
    import matplotlib.image

    out = heatmap.draw([(3, 1, causal_maps(8, 1, 1)[0][2])], pieces(8), tmp_path / "one.png", title="one")
    pixels = matplotlib.image.imread(str(out))
    assert pixels.shape[0] > 300 and pixels.shape[1] > 300 and pixels[..., :3].std() > 0.05
