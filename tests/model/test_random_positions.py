"""Randomized positions (Ruoss et al. 2023) as a training option: model/train.py's random_positions and the
transformer's position_ids.  A model trained with it sees the drawn positions (ALiBi's bias and the learned table's
rows at those positions, recomputed here from the paper's formulas); the default path is the plain one, bit for bit."""

import pytest
import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from model import checkpoint
from model.config import preset
from model.data import load_text, split
from model.errors import ConfigError
from model.train import TrainSettings, check_random_positions, draw_positions, main, train
from model.transformer import Block
from model.variants import REGISTRY
from tests.model.helpers import tiny_model

STEPS = dict(steps=2, batch_size=3, threads=1, warmup=1, precision="fp32")


def test_drawn_positions_are_distinct_sorted_and_in_range():
    p = draw_positions(64, 10, 40, torch.Generator().manual_seed(3))
    assert p.shape == (64, 10) and p.dtype == torch.int64
    assert bool((p[:, 1:] > p[:, :-1]).all()) and int(p.min()) >= 0 and int(p.max()) < 40
    assert int(p.max()) > 30  # drawn from the whole range, not 0..9
    assert torch.equal(p, draw_positions(64, 10, 40, torch.Generator().manual_seed(3)))
    assert torch.equal(draw_positions(2, 5, 5, torch.Generator().manual_seed(0)), torch.arange(5).expand(2, 5))


def trained_seeing(variant: str, maximum: int) -> tuple[list, list[torch.Tensor]]:
    """Train the tiny preset for two steps: what the first block received on each forward (its input and the
    Positions bundle), and each forward's token ids, read by hooks on every module (nothing is replaced)."""
    cfg = preset("tiny", variant)
    seen, batches = [], []

    def watch(mod, args):
        if isinstance(mod, Block) and mod.attn.layer == 0:
            seen.append((args[0].detach(), args[1]))
        elif isinstance(mod, torch.nn.Embedding) and mod.num_embeddings == cfg.vocab_size:
            batches.append(args[0].clone())

    handle = register_module_forward_pre_hook(watch)
    try:
        train(cfg, split(load_text(None), cfg.context), TrainSettings(**STEPS, random_positions=maximum),
              progress=False)
    finally:
        handle.remove()
    return seen, batches


def test_alibi_trained_on_random_positions_sees_their_bias():
    seen, _ = trained_seeing("alibi", 64)
    _, positions = seen[0]
    q = positions.q
    T = q.shape[1]
    assert q.shape == (3, T) and bool((q[:, 1:] > q[:, :-1]).all()) and not torch.equal(q[0], torch.arange(T))
    assert torch.equal(positions.k, q)
    slopes = torch.tensor([2.0 ** (-8 * h / 4) for h in range(1, 5)])  # Press et al.'s slopes for 4 heads
    expected = -slopes[None, :, None, None] * (q[:, None, :, None] - q[:, None, None, :]).float()
    causal = torch.ones(T, T).tril().bool()
    assert torch.allclose(positions.mask[..., causal], expected[..., causal], atol=1e-6)


def test_learned_reads_the_table_rows_of_the_given_positions():
    model = tiny_model("learned", context=64)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    far = draw_positions(2, 10, 64, torch.Generator().manual_seed(2))
    seen = []
    handle = model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    with torch.no_grad():
        model(ids, position_ids=far)
    handle.remove()
    assert int(far.max()) >= 10
    assert torch.equal(seen[0], model.tok.weight[ids] + model.pos.table.weight[far])


def test_random_positions_keep_the_plain_runs_data_order():
    _, plain = trained_seeing("rope", 0)
    _, drawn = trained_seeing("rope", 64)
    assert len(plain) == len(drawn) > 2  # two steps, then the held-out loss's batches
    assert all(torch.equal(a, b) for a, b in zip(plain, drawn, strict=True))


@pytest.mark.parametrize("variant", sorted(REGISTRY))
def test_default_positions_are_the_explicit_count_bit_for_bit(variant):
    model = tiny_model(variant)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids).logits
        explicit = model(ids, position_ids=torch.arange(12).expand(2, 12)).logits
    assert torch.equal(plain, explicit)


@pytest.mark.parametrize("variant", sorted(REGISTRY))
def test_every_index_variant_takes_the_option_and_the_others_refuse(variant):
    cfg = preset("tiny", variant)
    if variant in ("cpe", "cope", "fox", "path", "none"):  # a convolution, contextual counts, gates, matrices, nothing
        with pytest.raises(ConfigError, match=f"the {variant} variant reads no position index"):
            check_random_positions(cfg, 16)
        return
    check_random_positions(cfg, 16)
    model = tiny_model(variant)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    far = draw_positions(2, 8, 16, torch.Generator().manual_seed(2))
    with torch.no_grad():  # the positions reach the variant: the output moves with them
        assert not torch.allclose(model(ids).logits, model(ids, position_ids=far).logits)


def test_learned_refuses_more_positions_than_its_table():
    with pytest.raises(ConfigError, match="random_positions 17 for learned"):
        check_random_positions(preset("tiny", "learned"), 17)
    with pytest.raises(ConfigError, match="at least the context"):
        check_random_positions(preset("tiny", "rope"), 8)


def test_cli_flag_trains_and_records_it(tmp_path, capsys):
    args = ["--preset", "tiny", "--steps", "2", "--batch-size", "2", "--quiet", "--threads", "1", "--out",
            str(tmp_path)]
    assert main(["--variant", "t5", "--random-positions", "64", *args]) == 0
    assert checkpoint.read_meta(tmp_path / "t5")["training"]["settings"]["random_positions"] == 64
    assert main(["--variant", "cpe", "--random-positions", "64", *args]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "error: random_positions: the cpe variant reads no position index to randomize"
