"""Checks shared by the variants whose positions are not an index but the tokens' own doing (fox's gates, path's
Householder matrices): what an intervention may and may not do to them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from model.attention import Intervention as Edit
from model.transformer import Transformer
from service import intervention
from service.artifacts import load_artifact
from service.errors import InvalidArgument
from tests.model.test_research_variants import layer_inputs, softmax_rows


def check_layer_off(model: Transformer, folder: Path, content: Callable[[np.ndarray], np.ndarray]) -> None:
    """The worker refuses an intervention's positions in one line, and layer 0's encoding switched off gives
    PyTorch's logits under the same switch, whose layer-0 maps are the softmax of `content(x)`: the paper's content
    scores (H, T, T) from that layer's input x alone."""
    loaded = load_artifact(folder, threads=1)
    prompts = [[7, 99, 3, 140, 21], [200, 5, 17, 63, 88, 9, 250, 31, 44]]
    with pytest.raises(InvalidArgument, match="is not a function of the position index"):
        intervention.resolve(loaded, intervention.Intervention(shift=3), prompts[0], None)
    rows = [intervention.resolve(loaded, intervention.Intervention(positional_off=(0,)), p, None) for p in prompts]
    got = intervention.run(loaded, rows)["logits"]
    on = torch.ones(1, model.cfg.n_layers)
    on[0, 0] = 0.0
    edit = Edit(on, torch.ones(1, model.cfg.n_layers, model.cfg.n_heads))
    for b, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model(ids, intervention=edit)
        np.testing.assert_allclose(got[b, -len(p):], out.logits[0].numpy(), atol=1e-4, rtol=0)
        assert not np.allclose(got[b, -len(p):], model(ids).logits[0].detach().numpy(), atol=1e-3)
        x = layer_inputs(model, ids, torch.ones_like(ids))[0][0].double().numpy()
        want = softmax_rows(content(x), np.tril(np.ones((len(p), len(p)), bool)))
        np.testing.assert_allclose(out.attentions[0, 0].numpy(), want, atol=2e-5, rtol=0)
