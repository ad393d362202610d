"""Training: `python -m model.train --variant NAME|all [--steps N] [--corpus FILE] [--seed S] [--out DIR]`.

AdamW with linear warm-up and cosine decay on random windows of the train split; held-out loss in nats per
byte on non-overlapping windows of the held-out split.  Deterministic for a seed on a given machine.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from model import checkpoint
from model.cli import Parser
from model.config import PRESETS, ModelConfig, preset
from model.data import BUILTIN, Splits, eval_windows, load_text, random_batch, split
from model.errors import ConfigError, PosencError
from model.progress import Progress
from model.transformer import Transformer
from model.variants import VARIANT_NAMES, check_config, check_name

log = logging.getLogger(__name__)

# The default budget per variant (steps of 16 x 128 bytes), sized so `--variant all` fits in 8 minutes on two
# cores while every model gets below 1.8 nats/byte held out.  Relative encodings learn local structure at once;
# absolute ones need a few hundred more steps, and NoPE, which must infer order from the causal mask alone,
# needs the most.
DEFAULT_STEPS = {"none": 1500, "sinusoidal": 850, "learned": 650, "shaw": 400, "t5": 400, "rope": 400,
                 "alibi": 400, "fire": 400, "cpe": 600, "xl": 400, "deberta": 400, "xpos": 400, "kerple_log": 400,
                 "kerple_power": 400, "sandwich": 400, "cope": 400, "fope": 400,
                 "p_rope": 400, "ssmax": 1000, "ssmax_rope": 400, "fox": 400, "path": 400}
FIRST = "rope"  # the default model (the client's examples, the rope-scaled copies): trained and served first


def build_order(variants: list[str]) -> list[str]:
    """The order `--variant all` trains in: the default model first, then the shortest budgets, so a build that is
    served as it goes (make serve) has the most models ready soonest.  Each model is seeded on its own: the order
    changes nothing in any of them."""
    return sorted(variants, key=lambda v: (v != FIRST, DEFAULT_STEPS.get(v, max(DEFAULT_STEPS.values()))))


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    # mixed precision for training matmuls: bf16 is about 1.8x faster where the CPU has bf16 instructions and about
    # 20x slower where torch must emulate them (measured: 2.6 s vs 0.14 s per default step); auto picks
    precision: str = "auto"
    pos_lr_scale: float = 10.0  # learning-rate multiplier for the positional variant's own parameters
    threads: int = 2
    # Randomized positions (Ruoss et al. 2023, arXiv 2305.16843): 0 = each sequence at positions 0..T-1; N = each
    # training sequence at T positions drawn from [0, N) without replacement, sorted (inference is unchanged)
    random_positions: int = 0


def check_random_positions(cfg: ModelConfig, maximum: int) -> None:
    """ConfigError, one line naming the variant, when `maximum` randomized positions cannot train this config: a
    variant whose positions are not an index (PositionalVariant.index_positions: cpe's convolution, none), fewer
    positions than the context, or more than the variant has (learned: its table's rows)."""
    if not maximum:
        return
    cls = check_config(cfg)
    if not cls.index_positions:
        raise ConfigError(f"random_positions: the {cfg.variant} variant reads no position index to randomize")
    limit = cls.max_positions(cfg)
    if maximum < cfg.context or (limit is not None and maximum > limit):
        raise ConfigError(f"random_positions {maximum} for {cfg.variant}: must be at least the context "
                          f"({cfg.context}) and at most the variant's positions ({limit or 'unbounded'})")


def draw_positions(batch: int, length: int, maximum: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, length) int64: each row `length` distinct positions from [0, maximum), ascending."""
    picked = torch.rand(batch, maximum, generator=gen).argsort(dim=-1)[:, :length]
    return picked.sort(dim=-1).values


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.inference_mode()
def heldout_loss(model: Transformer, heldout: torch.Tensor, context: int, batch: int = 32) -> float:
    """Mean next-byte cross-entropy (nats per byte) over the held-out windows."""
    model.eval()
    x, y = eval_windows(heldout, context)
    total, count = 0.0, 0
    for i in range(0, len(x), batch):
        logits = model(x[i:i + batch], output_attentions=False).logits
        total += F.cross_entropy(logits.flatten(0, 1), y[i:i + batch].flatten(), reduction="sum").item()
        count += y[i:i + batch].numel()
    return total / count


def train(cfg: ModelConfig, splits: Splits, s: TrainSettings, progress: bool = True,
          corpus: str = BUILTIN) -> tuple[Transformer, dict[str, Any]]:
    check_random_positions(cfg, s.random_positions)
    torch.manual_seed(s.seed)
    torch.set_num_threads(s.threads)
    gen = torch.Generator().manual_seed(s.seed)
    pos_gen = torch.Generator().manual_seed(s.seed + 1)  # its own stream: the data order stays the plain run's
    model = Transformer(cfg)
    # Positional tables and biases start near zero and only get a small share of the gradient; a larger step
    # size lets them matter within a short budget.  They are not weight-decayed.
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.startswith("pos.") and p.dim() >= 2],
         "weight_decay": s.weight_decay, "lr_scale": 1.0},
        {"params": [p for n, p in model.named_parameters() if not n.startswith("pos.") and p.dim() < 2],
         "weight_decay": 0.0, "lr_scale": 1.0},
        {"params": list(model.pos.parameters()), "weight_decay": 0.0, "lr_scale": s.pos_lr_scale},
    ]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=s.lr, betas=(0.9, 0.95))
    bar = Progress(s.steps, cfg.variant, enabled=progress)
    start = time.perf_counter()
    model.train()
    precision = resolve_precision(s.precision)
    recent: list[float] = []
    for step in range(s.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s) * group["lr_scale"]
        x, y = random_batch(splits.train, s.batch_size, cfg.context, gen)
        ids = draw_positions(*x.shape, s.random_positions, pos_gen) if s.random_positions else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(x, output_attentions=False, position_ids=ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        recent = (recent + [loss.item()])[-50:]
        bar.update(step + 1, loss=sum(recent) / len(recent))
    bar.close()
    train_seconds = time.perf_counter() - start
    held = heldout_loss(model, splits.heldout, cfg.context)
    summary = {
        "steps": s.steps,
        "seconds": round(train_seconds, 2),
        "train_loss": round(sum(recent) / max(1, len(recent)), 4),
        "heldout_loss": round(held, 4),
        "loss_unit": "nats per byte",
        "corpus": corpus,
        "train_bytes": len(splits.train),
        "heldout_bytes": len(splits.heldout),
        "settings": {**asdict(s), "precision": precision},  # what ran (auto resolved)
        "torch": torch.__version__,
    }
    return model.eval(), summary


def cpu_has_bf16() -> bool:
    """The CPU computes bf16 natively (AVX512-BF16 or AMX): Linux's /proc/cpuinfo flags; elsewhere, no."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def resolve_precision(precision: str) -> str:
    return ("bf16" if cpu_has_bf16() else "fp32") if precision == "auto" else precision


def format_table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    lines = ["| variant | steps | seconds | train loss | held-out loss (nats/byte) |",
             "|---|---|---|---|---|"]
    for name, s in rows:
        lines.append(f"| {name} | {s['steps']} | {s['seconds']:.1f} | {s['train_loss']:.3f} | "
                     f"{s['heldout_loss']:.3f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = TrainSettings()
    p = Parser(prog="python -m model.train", description=__doc__.splitlines()[0])
    p.add_argument("--variant", required=True, help=f"one of {', '.join(VARIANT_NAMES)}, or 'all'")
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default: per variant, see DEFAULT_STEPS; 400-1500)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--precision", default=d.precision, choices=["auto", "bf16", "fp32"],
                   help="training matmul precision (weights and evaluation stay fp32); auto: bf16 where the CPU "
                        "has bf16 instructions, else fp32")
    p.add_argument("--corpus", default=None, help=f"UTF-8 text file (default: CPython's {BUILTIN})")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default="checkpoints", help="folder that receives one checkpoint per variant")
    p.add_argument("--skip-existing", action="store_true", help="keep complete checkpoints already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--random-positions", type=int, default=0, metavar="N",
                   help="train each sequence at positions drawn from [0, N), sorted (Ruoss et al. 2023); 0: off")
    p.add_argument("--threads", type=int, default=TrainSettings.threads,
                   help=f"torch threads for training (default {TrainSettings.threads}: this machine's two cores)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        variants = build_order(list(VARIANT_NAMES)) if args.variant == "all" else [args.variant]
        configs = [preset(args.preset, check_name(v)) for v in variants]  # every name before any training
        for cfg in configs:
            check_random_positions(cfg, args.random_positions)
        if (args.steps is not None and args.steps <= 0) or args.batch_size <= 0 or args.lr <= 0 or args.threads <= 0:
            raise PosencError("--steps, --batch-size, --lr and --threads must be positive")
        for parent in (Path(args.out), *Path(args.out).parents):  # before minutes of training, not after
            if parent.exists() and not parent.is_dir():
                raise PosencError(f"--out {args.out}: {parent} is a file, not a folder")
        text = load_text(args.corpus)
        splits = split(text, configs[0].context)
        rows = []
        for cfg in configs:
            out = Path(args.out) / cfg.variant
            if args.skip_existing and checkpoint.is_complete(out):
                log.info("keeping existing checkpoint %s", out)
                rows.append((cfg.variant, checkpoint.summary(out)))
                continue
            steps = args.steps or DEFAULT_STEPS[cfg.variant]
            settings = TrainSettings(steps=steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                                     warmup=min(TrainSettings.warmup, max(1, steps // 10)),
                                     precision=args.precision, threads=args.threads,
                                     random_positions=args.random_positions)
            model, summary = train(cfg, splits, settings, progress=not args.quiet,
                                   corpus=str(args.corpus or BUILTIN))
            checkpoint.save(model, out, summary)
            log.info("%s: held-out %.3f nats/byte in %.1fs -> %s", cfg.variant, summary["heldout_loss"],
                     summary["seconds"], out)
            rows.append((cfg.variant, summary))
    except PosencError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if len(rows) > 1:
        print(format_table(rows))
    else:
        print(f"{rows[0][0]}: held-out loss {rows[0][1]['heldout_loss']:.3f} nats/byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
