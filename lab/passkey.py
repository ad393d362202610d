"""Passkey retrieval against any served model, over a grid of prompt lengths x needle depths: whether the model
found the key, and where it looked.

The prompt is lab/tasks.py's passkey format (Mohtashami & Jaggi 2023, Landmark Attention, arXiv:2305.16300: their
introduction, filler sentences, "The pass key is K. Remember it. K is the pass key." and their question), so the
lab's models trained on that task read it as they were trained; here the needle sits at a chosen depth instead of a
random one, and the filler is sized to a length in the model's own tokens (the worker's Tokenize: the text is built
first and measured, for every tokenizer, bytes included).

Per cell (length, depth), `n` examples, each with its own key (the same keys at every depth of a length: drawn with
lab.tasks.rng_for from the seed, the length and the example's index):

  accuracy      the first integer of the greedy continuation is the key (the paper's reading)
  exact         lab.tasks.score: the continuation up to its first newline is the key (the lab's trained format)
  needle_mass   per layer, the attention of the prompt's last row (the query that answers) on the needle's tokens,
                summed over those keys and averaged over heads (Predict, ATTENTION_LAST_ROW)
  control_mass  the same over a span of the haystack as long as the needle, about half the haystack away from it:
                what a span of that size gets when nothing in it matters (the haystack: the introduction and the
                filler, every token before the question but the first, which many heads use as a sink)

The needle's tokens are found by tokenizing the prompt whole and the text before and after the needle alone: the
tokens the whole prompt shares with the text before (from the start) and with the text after (from the end) are not
the needle's, the rest are (for a byte model the exact bytes; for BPE a token merging a boundary counts as the
needle's). Generation goes through posenc.v1 Generate or the worker's OpenAI completions (`api="openai"`), both on
the prompt's token ids, so the tokens generated from are the tokens whose attention is measured.

Client-only, like the other studies: tokens, answers and attention all come from the worker.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from client.api import Client, attention_maps
from lab.tables import Table
from lab.tasks import PASSKEY_FILLER, PASSKEY_INTRO, PASSKEY_QUESTION, Example, rng_for, score
from protos.posenc.v1 import posenc_pb2 as pb

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the needle sits in the filler: 0 first, 1 last
FACTORS = (0.25, 0.5, 1.0, 2.0)  # default lengths, as multiples of the model's trained context
SIZING_KEY = 12345  # a five-digit key: the prompt a length's filler is sized with
APIS = ("posenc", "openai")


def pieces(key: int, sentences: int, at: int) -> tuple[str, str, str]:
    """The prompt as (text before the needle, the needle, text after it): lab.tasks.passkey's prompt with the needle
    after `at` of `sentences` filler sentences (tests/lab/test_passkey.py checks the joined text against the task's
    own examples)."""
    filler = [PASSKEY_FILLER[j % len(PASSKEY_FILLER)] for j in range(sentences)]
    before = f"{PASSKEY_INTRO} " + "".join(f"{f} " for f in filler[:at])
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    after = "".join(f" {f}" for f in filler[at:]) + f" {PASSKEY_QUESTION}"
    return before, needle, after


def place(depth: float, sentences: int) -> int:
    """The filler sentences before the needle at `depth` (rounded half up)."""
    return min(sentences, int(depth * sentences + 0.5))


def shared_head(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def shared_tail(a: list[int], b: list[int]) -> int:
    return shared_head(a[::-1], b[::-1])


def control_span(needle: tuple[int, int], haystack: tuple[int, int]) -> tuple[int, int] | None:
    """A span of the haystack as long as the needle, not overlapping it, whose start is nearest to half the haystack
    away from the needle's start; None when the haystack has no room for one."""
    (ns, ne), (fs, fe) = needle, haystack
    width, half = ne - ns, (fe - fs) // 2
    starts = [s for s in range(fs, fe - width + 1) if s + width <= ns or s >= ne]
    if not starts or width <= 0:
        return None
    s = min(starts, key=lambda s: (abs(abs(s - ns) - half), s))
    return s, s + width


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    key: int
    needle: tuple[int, int]  # token positions [start, end)
    control: tuple[int, int] | None
    text: str


class Tokens:
    """A model's tokenizer through the worker's Tokenize (cached per text)."""

    def __init__(self, client: Client, model: str):
        self.client, self.model, self.seen = client, model, {}

    def __call__(self, text: str) -> list[int]:
        if text not in self.seen:
            self.seen[text] = [t.id for t in self.client.tokenize(self.model, text).tokens]
        return self.seen[text]

    def prompt(self, key: int, sentences: int, at: int) -> Prompt:
        before, needle, after = pieces(key, sentences, at)
        ids = self(before + needle + after)
        start, end = shared_head(ids, self(before)), len(ids) - shared_tail(ids, self(after))
        question = len(ids) - shared_tail(ids, self(f" {PASSKEY_QUESTION}"))
        span = (start, max(start, end))
        return Prompt(ids, key, span, control_span(span, (1, max(1, question))), before + needle + after)

    def sentences_for(self, length: int) -> tuple[int, int]:
        """(filler sentences, their prompt's tokens): the most sentences whose prompt (with a five-digit key and the
        needle in the middle) is at most `length` tokens; (0, tokens with one sentence) when even one is too many."""
        def size(n: int) -> int:
            return len(self.prompt(SIZING_KEY, n, n // 2).ids)

        one, eleven = size(1), size(11)
        if one > length:
            return 0, one
        n = max(1, 1 + int((length - one) * 10 / max(eleven - one, 1)))
        while n > 1 and size(n) > length:
            n -= 1
        while size(n + 1) <= length:
            n += 1
        return n, size(n)


def first_integer(text: str) -> str | None:
    found = re.search(r"\d+", text)
    return found.group() if found else None


def needle_mass(resp: pb.PredictResponse, span: tuple[int, int] | None, layers: int) -> list[float] | None:
    """Per layer, the last row's attention summed over the span's keys, averaged over the heads."""
    if span is None:
        return None
    sums: list[list[float]] = [[] for _ in range(layers)]
    for layer, _head, grid in attention_maps(resp):
        sums[layer].append(float(grid[-1, span[0]:span[1]].astype(np.float64).sum()))
    return [float(np.mean(s)) if s else float("nan") for s in sums]


def complete_openai(url: str, model: str, ids: list[int], max_tokens: int, timeout: float) -> str:
    """Greedy text from an OpenAI completions endpoint (`url`: its base, with or without /v1) for token ids."""
    base = url.rstrip("/")
    endpoint = base + ("/completions" if base.endswith("/v1") else "/v1/completions")
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(endpoint, body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def measure(client: Client, info: pb.ModelInfo, p: Prompt, api: str, url: str | None) -> dict[str, Any]:
    """One example: the greedy continuation, both scores, the needle's and the control's attention mass."""
    answer = str(p.key)
    budget = len(answer) + 1  # the answer and the terminator, lab.tasks' Example.max_new_tokens
    if api == "openai":
        text = complete_openai(url or "", info.name, p.ids, budget, client.timeout)
    else:
        text = ""
        for msg in client.generate(info.name, p.ids, budget, temperature=0.0):
            text = msg.text
    resp = client.predict(info.name, p.ids, top_k=1, attention="last")
    example = Example(task="passkey", length=0, prompt=p.text, answer=answer)
    return {"key": p.key, "tokens": len(p.ids), "needle": list(p.needle),
            "control": list(p.control) if p.control else None, "continuation": text,
            "found": int(first_integer(text) == answer), "exact": score(example, text),
            "needle_mass": needle_mass(resp, p.needle, info.n_layers),
            "control_mass": needle_mass(resp, p.control, info.n_layers)}


def mean_rows(rows: list[list[float] | None]) -> list[float] | None:
    kept = [r for r in rows if r is not None]
    return [round(float(x), 6) for x in np.mean(kept, axis=0)] if kept else None


def check_grid(lengths, depths, n: int, seed: int, api: str, url: str | None) -> None:
    """Bad input, one message: every check the study makes before it calls the worker."""
    if not lengths or any(int(x) != x or x <= 0 for x in lengths) or len(set(lengths)) != len(lengths):
        raise ValueError(f"lengths must be distinct whole numbers of tokens > 0, got {list(lengths)}")
    if not depths or any(not 0 <= d <= 1 for d in depths) or len(set(depths)) != len(depths):
        raise ValueError(f"depths must be distinct numbers from 0 (first) to 1 (last), got {list(depths)}")
    if n <= 0 or seed < 0:
        raise ValueError(f"n ({n}) must be > 0 and seed ({seed}) >= 0")
    if api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
    if (api == "openai") != bool(url):
        raise ValueError("--api openai needs --url (the worker's HTTP base, e.g. http://127.0.0.1:8000), and "
                         "only it takes one")


def default_lengths(info: pb.ModelInfo) -> list[int]:
    if info.trained_context <= 0:
        raise ValueError(f"{info.name} reports no trained context: give the lengths")
    return sorted({max(1, round(f * info.trained_context)) for f in FACTORS})


def run_model(client: Client, info: pb.ModelInfo, lengths: list[int], depths: list[float], n: int, seed: int,
              api: str, url: str | None, concurrency: int) -> dict[str, Any]:
    tokens = Tokens(client, info.name)
    cells, jobs = [], []
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for length in lengths:
            sentences, size = tokens.sentences_for(length)
            for depth in depths:
                cell: dict[str, Any] = {"length": length, "depth": depth}
                cells.append(cell)
                if sentences == 0:
                    cell["unavailable"] = f"shorter than the prompt with one filler sentence ({size} tokens)"
                    continue
                if info.max_model_len and size + 6 > info.max_model_len:
                    cell["unavailable"] = f"beyond its {info.max_model_len} positions (prompt and answer)"
                    continue
                at = place(depth, sentences)
                keys = [int(rng_for(seed, "passkey-grid", length, i).integers(1, 50001)) for i in range(n)]
                prompts = [tokens.prompt(k, sentences, at) for k in keys]
                cell.update(sentences=sentences, at=at, placed=round(at / sentences, 4))
                jobs.append((cell, [pool.submit(measure, client, info, p, api, url) for p in prompts]))
        for cell, futures in jobs:
            found = [f.result() for f in futures]
            cell.update(tokens=round(float(np.mean([e["tokens"] for e in found])), 1),
                        needle_tokens=round(float(np.mean([e["needle"][1] - e["needle"][0] for e in found])), 2),
                        accuracy=round(float(np.mean([e["found"] for e in found])), 4),
                        exact=round(float(np.mean([e["exact"] for e in found])), 4),
                        needle_mass=mean_rows([e["needle_mass"] for e in found]),
                        control_mass=mean_rows([e["control_mass"] for e in found]), examples=found)
    return {"variant": info.variant, "trained_context": info.trained_context, "max_model_len": info.max_model_len,
            "tokenizer": info.tokenizer or "bytes-utf8", "layers": info.n_layers, "lengths": lengths, "cells": cells}


def study(client: Client, models: list[str], lengths: list[int] | None = None, depths=DEPTHS, n: int = 5,
          seed: int = 0, api: str = "posenc", url: str | None = None, concurrency: int = 4) -> dict[str, Any]:
    """The grid for each model (lengths None: FACTORS x each model's trained context)."""
    depths = [float(d) for d in depths]
    check_grid(lengths or [1], depths, n, seed, api, url)
    listing = {m.name: m for m in client.list_models().models}
    unknown = [m for m in models if m not in listing]
    if unknown or not models:
        raise ValueError(f"unknown model(s) {', '.join(unknown) or '(none given)'}; served: "
                         f"{', '.join(sorted(listing))}")
    start = time.monotonic()
    rows = {m: run_model(client, listing[m], sorted(lengths) if lengths else default_lengths(listing[m]), depths, n,
                         seed, api, url, concurrency) for m in models}
    return {"study": "passkey retrieval", "protocol": __doc__.split("\n\n")[2].strip(), "api": api, "n": n,
            "seed": seed, "depths": depths, "seconds": round(time.monotonic() - start, 1), "models": rows}


def layer_mean(values: list[float] | None) -> float | None:
    return float(np.mean(values)) if values else None


def tables(result: dict[str, Any]) -> list[Table]:
    """Per model: depth x length, each cell "accuracy · needle mass (control mass)", the masses averaged over
    layers (per layer: the JSON, and the picture)."""
    out = []
    for name, row in result["models"].items():
        rows = []
        for depth in result["depths"]:
            shown = []
            for cell in (c for c in row["cells"] if c["depth"] == depth):
                if "unavailable" in cell:
                    shown.append("n/a")
                    continue
                control = layer_mean(cell["control_mass"])
                shown.append(f"{cell['accuracy']:.2f} · {layer_mean(cell['needle_mass']):.3f}"
                             + (f" ({control:.3f})" if control is not None else ""))
            rows.append([f"{depth:g}", *shown])
        out.append(Table(["depth", *(str(x) for x in row["lengths"])], rows, intro=[
            f"{name} ({row['variant']}, trained context {row['trained_context']}): accuracy · attention mass of the "
            "last prompt row on the needle (on a control span as long), layers averaged; columns: prompt "
            "length in tokens"]))
    return out
