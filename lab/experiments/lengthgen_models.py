"""make lengthgen's models: their architecture, training data and loop, greedy decoding in PyTorch, and the worker's
answers to the test examples (lab/experiments/lengthgen.py runs them over every task, row and seed).

The contexts: a model is trained at its task's trained_context (the positions of a text at the longest train
length), which its config's `context` holds and the exporter writes as model.json's trained_context; a variant whose
positions are bounded (learned: the table's rows) holds instead the positions of the longest test example
(context_of), so that it is asked every length rather than refused, and its trained_context says that table. A
randomized row draws its positions from [0, the longest test example) whatever its config's context.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import numpy as np

from client.api import Client
from lab.tasks import END, Example, examples, rng_for, score, task_of, test_lengths

FACTORS = (1, 2, 4, 8)  # test lengths as multiples of the longest train length
EVAL_SEED = 1_000_003  # the test examples: one fixed set for every model, apart from every training seed
TRAIN_SAMPLE, TRAIN_SAMPLE_SEED = 256, 1_000_033  # the examples trained_context measures
DIGEST_SAMPLE = 4  # examples per train length in a cell's examples_sha256
ANSWER_S = 3600.0  # a served answer's deadline, client and worker: generous, for the longest prompts on a busy core
RANDOM = "+random"
# the models: posenc's architecture, small enough that 2 CPUs train one in seconds; each variant's own sizes are
# model.config's defaults (T5's 32 buckets to 128, Shaw's clip 16, FIRE's 32 hidden, CPE's kernel 8)
ARCH = {"d_model": 64, "n_heads": 4, "n_layers": 2, "d_mlp": 256}
BATCH, LR, WARMUP = 32, 3e-3, 0.05
ADAMW = {"weight_decay": 0.01, "betas": [0.9, 0.95]}  # every model's optimizer settings beside LR
# every Linear weight's initial standard deviation (train_one; 1/sqrt(d_model) at ARCH's 64), in place of the model's
# own 0.02: at 0.02 these tiny models stay at chance on MQAR and selective copy for the sanity budgets (the probes
# beside lengthgen.SANITY)
INIT_STD = 0.125


def rows() -> list[str]:
    """Every variant of the registry, then `VARIANT+random` for each that takes randomized positions (asked)."""
    # lazy: torch (213 MB) loads only when models are built; --report-only and the figure tests draw without it
    from model.config import ModelConfig
    from model.errors import ConfigError
    from model.train import check_random_positions
    from model.variants import REGISTRY

    out = list(REGISTRY)
    for name in REGISTRY:
        try:
            check_random_positions(ModelConfig(variant=name, context=64), 64)
        except ConfigError:
            continue
        out.append(name + RANDOM)
    return out


def eval_set(task: str, n: int, factors: tuple[int, ...] = FACTORS) -> dict[int, list[Example]]:
    """The examples every model of the task is asked: n per length at 1x..8x (`factors`)."""
    return {f: examples(task, length, n, EVAL_SEED) for f, length in zip(FACTORS, test_lengths(task), strict=False)
            if f in factors}


def context_of(tests: dict[int, list[Example]]) -> int:
    """The positions the longest test example needs (prompt, answer, terminator): the learned table's rows."""
    return max(len(e.text) for exs in tests.values() for e in exs)


def examples_sha256(task: str, tests: dict[int, list[Example]]) -> str:
    """SHA-256 of the examples a cell follows from: the task's train lengths, DIGEST_SAMPLE training examples at each
    of them and the test examples (each prompt, answer and marks). A change to a task's generator at any length
    changes it, so a cell kept from before the change is not read back as this task's."""
    low, high = task_of(task).train
    sample = [e for n in range(low, high + 1) for e in examples(task, n, DIGEST_SAMPLE, TRAIN_SAMPLE_SEED)]
    rows = [[e.prompt, e.answer, [list(m) for m in e.marks]]
            for e in sample + [e for f in sorted(tests) for e in tests[f]]]
    return hashlib.sha256(json.dumps([[low, high], rows]).encode()).hexdigest()


def trained_context(task: str, train: tuple[int, int] | None = None) -> int:
    """The positions a training sequence takes at the task's longest train length (its text less the last byte,
    which is only a target), the longest of TRAIN_SAMPLE examples: the context the models are trained at."""
    longest = (train or task_of(task).train)[1]
    return max(len(e.text) for e in examples(task, longest, TRAIN_SAMPLE, TRAIN_SAMPLE_SEED)) - 1


def train_batch(task: str, seed: int, step: int, train: tuple[int, int], batch: int = BATCH):
    """Step `step`'s batch of seed `seed`, the same for every row: (ids (B, T), targets (B, T), weights (B, T)).
    Rows are right-padded with 0 (causal attention: a pad after the text changes nothing before it); the weights
    are 1 on the answer, its terminator and the prompt's marks (lab.tasks: the bytes that follow from those before).
    """
    # lazy: torch (213 MB) loads only when models train
    import torch

    t = task_of(task)
    lengths = np.random.default_rng([seed, step]).integers(train[0], train[1] + 1, batch)
    texts = [Example(task=task, length=int(n), **t.generate(rng_for(seed, task, int(n), step * batch + b), int(n)))
             for b, n in enumerate(lengths)]
    width = max(len(e.text) for e in texts)
    ids = torch.zeros(batch, width, dtype=torch.int64)
    weights = torch.zeros(batch, width - 1)
    for b, e in enumerate(texts):
        ids[b, :len(e.text)] = torch.tensor(list(e.text.encode("ascii")))
        weights[b, len(e.prompt) - 1:len(e.text) - 1] = 1.0  # predicting target byte j from the byte before it
        for start, end in e.marks:
            weights[b, start - 1:end - 1] = 1.0
    return ids[:, :-1], ids[:, 1:], weights


def config_for(row: str, context: int, trained: int, arch: dict | None = None):
    """The ModelConfig of a row: `context` (model.json's trained_context) is the context trained at, except for a
    variant whose positions are bounded (learned: its table) or a randomized row of one, which takes `context`
    positions, the longest test example, so that it is asked every length."""
    # lazy: torch (213 MB) loads with model.variants only when models are built
    from model.config import ModelConfig
    from model.variants import REGISTRY

    variant = row.removesuffix(RANDOM)
    cfg = ModelConfig(variant=variant, context=trained, **(arch or ARCH))
    bounded = REGISTRY[variant].max_positions(cfg) is not None
    return cfg.replace(context=context) if bounded else cfg


def train_one(task: str, row: str, seed: int, context: int, steps: int = 0, seconds: float = 0.0,
              train: tuple[int, int] | None = None, batch: int = BATCH, arch: dict | None = None,
              init_std: float = INIT_STD, lr: float = LR, curriculum: list | tuple = (),
              tail: list | tuple = ()):
    """A model of `arch` (ARCH) for `row` trained on `task` for `steps` steps or `seconds` seconds (AdamW at `lr`;
    the learning rate warms up over the first 5% of the budget, then decays by a cosine to a tenth), every Linear
    weight drawn from N(0, init_std) in place of the model's own initialisation; (model, summary).
    `context`: the positions of the longest test example (config_for; a randomized row's range).
    `curriculum`: [(longest, n), ...], phases that come first, each n steps on the train lengths up to `longest`
    (the shortest unchanged); the steps after them train on every train length. One schedule spans them all.
    `tail`: (n, rate), n more steps on every train length at the constant `rate` once that schedule has ended (a
    restart at a moderate rate after the decay, for a circuit that forms late)."""
    # lazy: torch (213 MB) loads only when models train
    import torch
    import torch.nn.functional as F

    from model.train import check_random_positions, draw_positions
    from model.transformer import Transformer

    randomized = row.endswith(RANDOM)
    train = train or task_of(task).train
    spans, end = [], 0  # (the step a phase ends before, its train lengths)
    for longest_, n in curriculum:
        if seconds or not train[0] <= longest_ <= train[1] or n <= 0:
            raise ValueError(f"a curriculum phase is (longest, steps) with longest in {train} and a step budget: "
                             f"{(longest_, n)}")
        end += n
        spans.append((end, (train[0], longest_)))
    if curriculum and end >= steps:
        raise ValueError(f"the curriculum's {end} steps leave none of {steps} for every train length")
    if tail and (seconds or steps <= 0 or len(tail) != 2 or int(tail[0]) <= 0 or not 0 < float(tail[1]) <= lr):
        raise ValueError(f"a tail is (steps, rate) with steps > 0 and a rate in (0, {lr}], after a budget in steps: "
                         f"{tuple(tail)}")
    after = int(tail[0]) if tail else 0
    cfg = config_for(row, context, trained_context(task, train), arch)
    check_random_positions(cfg, context if randomized else 0)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=init_std)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=ADAMW["weight_decay"], betas=tuple(ADAMW["betas"]))
    pos_gen = torch.Generator().manual_seed(seed + 1)
    start, step, recent, longest = time.perf_counter(), 0, [], 0
    model.train()
    while True:
        done = max(step / steps if steps else 0.0, (time.perf_counter() - start) / seconds if seconds else 0.0)
        if done >= 1.0 and step >= steps + after:
            break
        if done >= 1.0:  # the tail
            rate = float(tail[1])
        else:
            rate = lr * (done / WARMUP if done < WARMUP else 0.1 + 0.45 * (1 + math.cos(math.pi * done)))
        for group in opt.param_groups:
            group["lr"] = rate
        span = next((lengths for before, lengths in spans if step < before), train)
        x, y, w = train_batch(task, seed, step, span, batch)
        longest = max(longest, x.shape[1])
        ids = draw_positions(*x.shape, context, pos_gen) if randomized else None
        logits = model(x, output_attentions=False, position_ids=ids).logits
        loss = (F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none") * w.flatten()).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = (recent + [loss.item()])[-20:]
        step += 1
    summary = {"steps": step, "seconds": round(time.perf_counter() - start, 2), "batch": batch,
               "train_loss": round(sum(recent) / max(1, len(recent)), 4),
               "loss_unit": "nats per trained byte (answer, terminator, marks)",
               "task": task, "train_lengths": list(train), "random_positions": context if randomized else 0,
               "seed": seed, "context": cfg.context, "longest_trained": longest, "init_std": init_std, "lr": lr}
    if curriculum:
        summary["curriculum"] = [list(phase) for phase in curriculum]
    if tail:
        summary["tail"] = [after, float(tail[1])]
    return model.eval(), summary


def greedy(model, prompt: str, max_new_tokens: int) -> str:
    """The model's greedy continuation in PyTorch (KV cache, the variant's state), stopping after the terminator:
    what the worker is checked against."""
    # lazy: torch (213 MB) loads only when models run in process
    import torch

    out_ids: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([list(prompt.encode("utf-8"))]), output_attentions=False)
        for _ in range(max_new_tokens):
            nxt = int(out.logits[0, -1].argmax())
            out_ids.append(nxt)
            if bytes([nxt]) == END.encode():
                break
            out = model(torch.tensor([[nxt]]), past_key_values=out.presents, state=out.state or None,
                        output_attentions=False)
    return bytes(out_ids).decode("utf-8", errors="replace")


def served_answers(target: str, model: str, tests: dict[int, list[Example]],
                   until_wrong: bool = False) -> dict[int, list[str]]:
    """Each test example's continuation from the worker's greedy Generate (client.api), stopping at the terminator,
    per factor; eight requests in flight, which the worker's engine batches.  With `until_wrong`, a continuation
    also stops (its call cancelled) at its first character that departs from the answer and its terminator: its
    exact match (lab.tasks.score) is 0 whatever would follow, so scoring needs no more of it, and a model that is
    wrong early on a long answer (copy at 8x: a thousand characters) costs a few steps instead of all of them."""
    with Client(target, timeout=ANSWER_S) as client, ThreadPoolExecutor(max_workers=8) as pool:
        def ask(e: Example) -> str:
            text, right = "", e.answer + END
            with closing(client.generate(model, e.prompt, max_new_tokens=e.max_new_tokens, stop=[END])) as stream:
                for msg in stream:  # closing the stream cancels the call (client.api.joined)
                    text = msg.text
                    if until_wrong and not right.startswith(text):
                        break
            return text

        return {f: list(pool.map(ask, exs)) for f, exs in tests.items()}


def served_scores(target: str, model: str, tests: dict[int, list[Example]]) -> dict[int, list[int]]:
    """Each test example's exact-match score (lab.tasks.score) on the worker's answer, per factor."""
    answers = served_answers(target, model, tests, until_wrong=True)
    return {f: [score(e, text) for e, text in zip(exs, answers[f], strict=True)] for f, exs in tests.items()}


def model_name(row: str, seed: int) -> str:
    return f"{row.replace(RANDOM, '-random')}-s{seed}"
