"""Length-generalization tasks, as data: one generator function and one line in `TASKS` per task.

A task turns (length, seed) into examples of a prompt and its answer, both ASCII text, so that each byte is one token
of posenc's byte models. A model is asked to continue the prompt greedily; `score` compares what it wrote with the
answer by exact match. Each task has a train length range, and `test_lengths` gives 1x, 2x, 4x and 8x its longest
train length, and 16x past them.

What "length" counts, per task (the prompt's size in bytes grows linearly with it):

  copy, reverse     the words to copy (single letters, a to p)
  counting          the statements of the program before the question
  selective_copy    the slots of the input row, letters and blanks together (the letters are always 8)
  flip_flop         the instructions, the final read included
  mqar              the key-value pairs (half of the keys, rounded up, are queried)
  passkey           the filler sentences around the pass key

The answer.  `Example.answer` never holds the terminator `END` ("\\n"), nor does any prompt; a model is trained on
`Example.text` (prompt, answer, terminator). The part of a generated continuation that is its answer is the text
before the first terminator, or all of it when there is none; `score` is 1 when that part equals the answer
exactly, else 0: a longer or shorter answer is wrong, and anything after the terminator is not read. Generate at
least `Example.max_new_tokens` bytes (the answer and the terminator), stopping at the terminator or not: a
continuation cut short of the whole answer scores 0.

Marks.  Some prompts hold bytes that follow from the text before them, as the answer does: flip-flop's earlier reads,
MQAR's answered queries, the pass key's second telling. `Example.marks` lists them (byte spans of the prompt); a
model may be trained on them beside the answer (the papers train on every read and every query), and they are
never scored.

Reproducible: example i of (task, length, seed) is drawn from its own numpy Generator, seeded from the seed, a
SHA-256 of the task's name, the length and i (never Python's `hash()`, which changes between processes), so the same
arguments give the same examples in any process, and a longer list begins with the shorter one.

Torch-free and worker-free, like the studies: a study generates here and asks a worker through client/.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

END = "\n"  # ends every answer in a training text; a continuation's answer is what comes before it
FACTORS = (1, 2, 4, 8, 16)  # test lengths, as multiples of a task's longest train length; 16x is "past" 8x
LETTERS = "abcdefghijklmnop"  # the item vocabulary of copy, reverse and selective copy (16, as Mamba's)


@dataclass(frozen=True)
class Example:
    task: str
    length: int  # what the task's length counts (the module docstring), at most the task's limit
    prompt: str
    answer: str
    depth: float | None = None  # passkey: where the needle sits in the filler, 0 (first) to 1 (last); else None
    marks: tuple[tuple[int, int], ...] = ()  # spans [start, end) of the prompt that follow from the text before them

    @property
    def target(self) -> str:
        """What the model should write after the prompt: the answer and the terminator."""
        return self.answer + END

    @property
    def text(self) -> str:
        """The training text: prompt, answer, terminator."""
        return self.prompt + self.target

    @property
    def max_new_tokens(self) -> int:
        return len(self.target)


Generate = Callable[[np.random.Generator, int], dict]  # (rng, length) -> Example's fields: prompt, answer[, depth,
#                                                         marks]


@dataclass(frozen=True)
class Task:
    name: str
    generate: Generate
    train: tuple[int, int]  # the lengths trained on, both ends included
    paper: str  # whose format the task follows: authors, year, arXiv id
    about: str  # one line
    shortest: int = 1
    longest: int | None = None  # None: no limit


# --- the generators ---------------------------------------------------------------------------------------------


def _words(rng: np.random.Generator, length: int) -> list[str]:
    return [LETTERS[i] for i in rng.integers(0, len(LETTERS), length)]


def copy(rng: np.random.Generator, length: int) -> dict:
    """Kazemnejad et al. 2023's copy task ("Copy the following words: <w1> ... <wn> ." answered by the words), with
    one-letter words so that a word is one byte and the words are separated by spaces."""
    words = _words(rng, length)
    return {"prompt": f"Copy the following words: {' '.join(words)} . ", "answer": " ".join(words)}


def reverse(rng: np.random.Generator, length: int) -> dict:
    """Kazemnejad et al. 2023's reverse task: the words of the copy task, answered last first."""
    words = _words(rng, length)
    return {"prompt": f"Reverse the following words: {' '.join(words)} . ", "answer": " ".join(words[::-1])}


COUNT_WEIGHTS = {"set": 1, "increment": 7, "pass": 50}  # CoPE's statement weights
COUNT_VARIABLES = "abc"
COUNT_MAX = 10
_COUNT_KINDS = list(COUNT_WEIGHTS)
# the cumulative distribution Generator.choice(p=...) builds from the weights, a draw being one uniform double on it:
# choice's own draws, without its checks of p on every statement
_COUNT_P = np.array(list(COUNT_WEIGHTS.values()), float) / sum(COUNT_WEIGHTS.values())
_COUNT_CDF = _COUNT_P.cumsum() / _COUNT_P.cumsum()[-1]


def _statement(rng: np.random.Generator, values: dict[str, int]) -> str:
    """One statement drawn by CoPE's weights; an increment of an unset variable, or past COUNT_MAX, is drawn again."""
    while True:
        kind = _COUNT_KINDS[int(_COUNT_CDF.searchsorted(rng.random(), side="right"))]
        if kind == "pass":
            return "pass;"
        if kind == "set":
            var = COUNT_VARIABLES[rng.integers(len(COUNT_VARIABLES))]
            values[var] = 0
            return f"{var} = 0 ;"
        if values:
            var = sorted(values)[rng.integers(len(values))]
            if values[var] < COUNT_MAX:
                values[var] += 1
                return f"{var} ++;"


def counting(rng: np.random.Generator, length: int) -> dict:
    """Golovneva et al. 2024 (CoPE, arXiv 2405.18719)'s counting task: a program of `length` statements, `v = 0 ;`,
    `v ++;` and `pass;` drawn 1 : 7 : 50 over the variables a, b, c, values at most 10, then `print v` answered by
    v's value. As there, a program that sets no variable is drawn again."""
    while True:
        values: dict[str, int] = {}
        program = [_statement(rng, values) for _ in range(length)]
        if values:
            break
    var = sorted(values)[rng.integers(len(values))]
    return {"prompt": f"{' '.join(program)} print {var} ", "answer": str(values[var])}


SELECTIVE_DATA = 8  # the letters to select in every row
BLANK = "."


def selective_copy(rng: np.random.Generator, length: int) -> dict:
    """Gu & Dao 2023 (Mamba, arXiv 2312.00752)'s selective copy, as Golovneva et al. 2024 (CoPE, arXiv 2405.18719)
    test it: 8 letters scattered among blanks in a row of `length` slots (one byte each, the blank a "."), then "=",
    answered by the letters in order. Longer rows are sparser: the letters stay 8."""
    row = np.full(length, BLANK)
    where = np.sort(rng.choice(length, SELECTIVE_DATA, replace=False))
    row[where] = _words(rng, SELECTIVE_DATA)
    return {"prompt": "".join(row) + "=", "answer": "".join(row[where])}


FLIP_FLOP_P = {"i": 0.8, "w": 0.1, "r": 0.1}  # FFL(0.8): the instructions between the first write and the last read


def flip_flop(rng: np.random.Generator, length: int) -> dict:
    """Liu et al. 2023 (Exposing Attention Glitches with Flip-Flop Language Modeling, arXiv 2306.00946): `length`
    instructions (w: write, r: read, i: ignore) each with a bit, the first a write and the last a read, the others
    drawn i.i.d. as FFL(0.8); a read's bit is the last written bit, the other bits are random. Byte form: an
    instruction and its bit are two bytes ("w1"), instructions are separated by spaces, and the prompt ends with the
    final "r", answered by its bit. The earlier reads' bits are the marks."""
    ops, probs = list(FLIP_FLOP_P), list(FLIP_FLOP_P.values())
    kinds = ["w"] + [ops[k] for k in rng.choice(len(ops), length - 2, p=probs)] + ["r"]
    pairs, memory = [], ""
    for kind in kinds:
        bit = memory if kind == "r" else str(rng.integers(2))
        memory = bit if kind == "w" else memory
        pairs.append(kind + bit)
    reads = tuple((3 * i + 1, 3 * i + 2) for i, kind in enumerate(kinds[:-1]) if kind == "r")
    return {"prompt": " ".join(pairs)[:-1], "answer": pairs[-1][1], "marks": reads}


MQAR_KEYS = [a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"]


def mqar_queried(length: int) -> int:
    """How many of `length` keys an MQAR prompt queries: half, rounded up (the one key of a single pair)."""
    return (length + 1) // 2


def mqar(rng: np.random.Generator, length: int) -> dict:
    """Arora et al. 2023 (Zoology, arXiv 2312.04927)'s multi-query associative recall: `length` key-value pairs,
    then queries of mqar_queried of the keys (half, rounded up), a random subset in random order, each followed by
    its value. Byte form: a key is two letters (676 keys, distinct in an example), a value one digit (keys and values
    from disjoint alphabets, as Zoology's halves of the vocabulary; values may repeat), a pair is "ab3", pairs and
    queries are separated by spaces and the two parts by " | ", the queries follow one another without Zoology's
    random gaps, and the prompt stops after the last query's key, so the model answers that query with the earlier
    ones (answered) before it. Their values are the marks.

    Why a subset: Zoology queries every key once, but its inputs never hold a query's value (only its labels do),
    while a text prompt shows the earlier answers. Were every key queried here, the last query's value would be the
    one context value no earlier query has used, answerable by elimination without reading the key. With half the
    keys queried, about half are never asked, so the last key is one of several unasked ones and only looking it up
    answers it. A subset rather than queries drawn with replacement keeps Zoology's rule that a key is queried at
    most once, so no query repeats an earlier one whose answer sits nearer than the pair."""
    keys = [MQAR_KEYS[k] for k in rng.choice(len(MQAR_KEYS), length, replace=False)]
    values = [str(v) for v in rng.integers(0, 10, length)]
    order = rng.permutation(length)[:mqar_queried(length)]
    context = " ".join(k + v for k, v in zip(keys, values, strict=True))
    queries = [keys[q] + values[q] for q in order[:-1]] + [keys[order[-1]]]
    start = len(context) + len(" | ")
    answered = tuple((start + 4 * j + 2, start + 4 * j + 3) for j in range(len(order) - 1))
    return {"prompt": f"{context} | {' '.join(queries)}", "answer": values[order[-1]], "marks": answered}


PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                 "I will quiz you about the important information there.")
PASSKEY_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                  "There and back again.")
PASSKEY_QUESTION = "What is the pass key? The pass key is "


def passkey(rng: np.random.Generator, length: int) -> dict:
    """Mohtashami & Jaggi 2023 (Landmark Attention, arXiv 2305.16300)'s passkey retrieval: their introduction, then
    `length` filler sentences (their five, repeated in order) with "The pass key is K. Remember it. K is the pass
    key." between two of them at a uniform depth, then their question; K is uniform in 1..50000. The answer is K's
    digits alone (the paper reads the first integer in the first 100 tokens generated). The needle's second K is the
    mark."""
    key, at = int(rng.integers(1, 50001)), int(rng.integers(0, length + 1))
    filler = [PASSKEY_FILLER[j % len(PASSKEY_FILLER)] for j in range(length)]
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    body = " ".join(filler[:at] + [needle] + filler[at:])
    second = len(PASSKEY_INTRO) + 1 + len(" ".join(filler[:at] + [""])) + needle.index(f". {key} is") + 2
    return {"prompt": f"{PASSKEY_INTRO} {body} {PASSKEY_QUESTION}", "answer": str(key), "depth": at / length,
            "marks": ((second, second + len(str(key))),)}


KAZEMNEJAD = "Kazemnejad et al. 2023, The Impact of Positional Encoding on Length Generalization, arXiv:2305.19466"
COPE = "Golovneva et al. 2024, Contextual Position Encoding (CoPE), arXiv:2405.18719"
TASKS: dict[str, Task] = {t.name: t for t in (
    Task("copy", copy, (1, 20), KAZEMNEJAD, "repeat the words"),
    Task("reverse", reverse, (1, 20), KAZEMNEJAD, "repeat the words, last first"),
    Task("counting", counting, (3, 32), COPE, "the value of a variable after set, increment and pass statements"),
    Task("selective_copy", selective_copy, (16, 64), f"Gu & Dao 2023, Mamba, arXiv:2312.00752; as in {COPE}",
         "the letters among the blanks, in order", shortest=SELECTIVE_DATA),
    Task("flip_flop", flip_flop, (8, 64), "Liu et al. 2023, Exposing Attention Glitches with Flip-Flop Language "
         "Modeling, arXiv:2306.00946", "the last written bit, at the final read", shortest=2),
    Task("mqar", mqar, (1, 16), "Arora et al. 2023, Zoology, arXiv:2312.04927",
         "the value of the last queried key", longest=len(MQAR_KEYS)),
    Task("passkey", passkey, (2, 16), "Mohtashami & Jaggi 2023, Landmark Attention, arXiv:2305.16300",
         "the number hidden in the filler"),
)}


# --- using them ---------------------------------------------------------------------------------------------------


def task_of(task: str | Task) -> Task:
    if isinstance(task, Task):
        return task
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    return TASKS[task]


def rng_for(seed: int, name: str, length: int, index: int) -> np.random.Generator:
    """The Generator of example `index` of (seed, name, length): the same in every process."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng(np.random.SeedSequence([seed, digest, length, index]))


def examples(task: str | Task, length: int, n: int, seed: int = 0) -> list[Example]:
    """`n` examples of `length` (the module docstring says what it counts per task), reproducible from `seed` (>= 0).
    """
    t = task_of(task)
    if not t.shortest <= length <= (t.longest or length):
        raise ValueError(f"{t.name}: length {length} outside {t.shortest}..{t.longest or 'any'}")
    if n < 0 or seed < 0:
        raise ValueError(f"n ({n}) and seed ({seed}) must be at least 0")
    out = [Example(task=t.name, length=length, **t.generate(rng_for(seed, t.name, length, i), length))
           for i in range(n)]
    for e in out:
        if not (e.prompt + e.answer).isascii() or END in e.prompt + e.answer:
            raise ValueError(f"{t.name}: an example is not ASCII, or holds the terminator: {e!r}")
        if not all(0 < a < b <= len(e.prompt) for a, b in e.marks):
            raise ValueError(f"{t.name}: a mark is not a span of the prompt past its first byte: {e.marks}")
    return out


def test_lengths(task: str | Task) -> tuple[int, ...]:
    """1x, 2x, 4x, 8x the longest train length, and 16x past them (only lengths the task allows)."""
    t = task_of(task)
    return tuple(f * t.train[1] for f in FACTORS if t.longest is None or f * t.train[1] <= t.longest)


def answer_of(text: str) -> str:
    """The answer part of a generated continuation: the text before the first terminator, or all of it."""
    return text.split(END, 1)[0]


def score(example: Example, text: str) -> int:
    """Exact match: 1 when the continuation's answer part (`answer_of`) is the example's answer, else 0."""
    return int(answer_of(text) == example.answer)
