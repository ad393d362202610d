"""lab/tasks.py: every task's examples are answered right, as an independent solver here reads them from the text alone
(never from the generator's state or constants); they are as long as the module says, reproducible in any process,
ASCII; the scorer is exact match; and a task is one function and one registry line."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lab import tasks
from lab.tasks import TASKS, Task, examples, score

ROOT = Path(__file__).resolve().parents[2]

# --- the solvers: each parses a prompt and returns (its answer, its length); a malformed prompt fails an assert --


def solve_words(prompt: str, verb: str) -> list[str]:
    m = re.fullmatch(verb + r" the following words: ((?:[a-p] )+)\. ", prompt)
    assert m, prompt
    return m.group(1).split()


def solve_copy(prompt):
    words = solve_words(prompt, "Copy")
    return " ".join(words), len(words)


def solve_reverse(prompt):
    words = solve_words(prompt, "Reverse")
    return " ".join(reversed(words)), len(words)


def solve_counting(prompt):
    m = re.fullmatch(r"(.+) print ([abc]) ", prompt)
    assert m, prompt
    statements = re.findall(r"[abc] = 0 ;|[abc] \+\+;|pass;", m.group(1))
    assert " ".join(statements) == m.group(1), prompt  # nothing but statements
    values = {}
    for s in statements:
        if s.endswith("= 0 ;"):
            values[s[0]] = 0
        elif s.endswith("++;"):
            values[s[0]] += 1  # a KeyError: an increment of a variable never set
            assert values[s[0]] <= 10, prompt
    return str(values[m.group(2)]), len(statements)


def solve_selective_copy(prompt):
    m = re.fullmatch(r"([.a-p]+)=", prompt)
    assert m, prompt
    letters = m.group(1).replace(".", "")
    assert len(letters) == 8, prompt
    return letters, len(m.group(1))


def solve_flip_flop(prompt):
    assert re.fullmatch(r"w[01](?: [wri][01])* r", prompt), prompt
    pairs, bit = prompt.split(" "), None
    for p in pairs[:-1]:
        if p[0] == "w":
            bit = p[1]
        elif p[0] == "r":
            assert p[1] == bit, prompt  # every earlier read is right too
    return bit, len(pairs)


def mqar_parts(prompt):
    """(the context's key -> value table, the queried keys in order, the answered queries' values)."""
    context, queries = prompt.split(" | ")
    pairs, asked = context.split(" "), queries.split(" ")
    assert all(re.fullmatch(r"[a-z]{2}[0-9]", p) for p in pairs + asked[:-1]), prompt
    assert re.fullmatch(r"[a-z]{2}", asked[-1]), prompt
    table = {p[:2]: p[2] for p in pairs}
    keys = [q[:2] for q in asked]
    assert len(table) == len(pairs) and set(keys) <= set(table), prompt  # distinct keys, every query one of them
    assert len(set(keys)) == len(keys) == (len(pairs) + 1) // 2, prompt  # half the keys, each queried at most once
    assert all(table[q[:2]] == q[2:] for q in asked[:-1]), prompt  # every answered query is right
    return table, keys, [q[2:] for q in asked[:-1]]


def solve_mqar(prompt):
    table, keys, _ = mqar_parts(prompt)
    return table[keys[-1]], len(table)


INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz "
         "you about the important information there. ")
QUESTION = " What is the pass key? The pass key is "
NEEDLE = re.compile(r"The pass key is (\d+)\. Remember it\. (\d+) is the pass key\.")
FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]


def passkey_parts(prompt):
    """(the key, the filler sentences before the needle, those after)."""
    assert prompt.startswith(INTRO) and prompt.endswith(QUESTION), prompt
    body = prompt[len(INTRO):-len(QUESTION)]
    (m,) = NEEDLE.finditer(body)
    assert m.group(1) == m.group(2) and 1 <= int(m.group(1)) <= 50000, prompt
    before, after = re.findall(r"[A-Z][^.]*\.", body[:m.start()]), re.findall(r"[A-Z][^.]*\.", body[m.end():])
    assert " ".join(before + [m.group(0)] + after) == body, prompt
    return m.group(1), before, after


def solve_passkey(prompt):
    key, before, after = passkey_parts(prompt)
    filler = before + after
    assert filler == [FILLER[j % 5] for j in range(len(filler))], prompt
    return key, len(filler)


SOLVERS = {"copy": solve_copy, "reverse": solve_reverse, "counting": solve_counting,
           "selective_copy": solve_selective_copy, "flip_flop": solve_flip_flop, "mqar": solve_mqar,
           "passkey": solve_passkey}


def test_every_registered_task_has_a_solver():
    assert set(TASKS) == set(SOLVERS)


def lengths(task):
    lo, hi = task.train
    return sorted(n for n in {lo, (lo + hi) // 2, hi, 2 * hi, 16 * hi} if n <= (task.longest or n))


CASES = [(name, length) for name, t in TASKS.items() for length in lengths(t)]


@pytest.mark.parametrize(("name", "length"), CASES, ids=[f"{n}-{length}" for n, length in CASES])
def test_the_solver_agrees_with_every_answer_and_length(name, length):
    for seed in (0, 1, 2024):
        for e in examples(name, length, 6, seed):
            assert SOLVERS[name](e.prompt) == (e.answer, length)
            assert (e.task, e.length, e.text) == (name, length, e.prompt + e.answer + "\n")
            assert e.text.isascii() and "\n" not in e.prompt + e.answer and e.answer
            assert e.max_new_tokens == len(e.answer) + 1


def expected_marks(name, prompt):
    """The spans of the prompt that follow from the text before them, found here from the text alone: flip-flop's
    earlier reads' bits, MQAR's answered queries' values, the needle's second key (the solvers above check that
    each of them is right)."""
    if name == "flip_flop":
        return [m.span(1) for m in re.finditer(r"r([01])", prompt)]
    if name == "mqar":
        after = prompt.index(" | ") + 3
        return [(after + m.start(1), after + m.end(1)) for m in re.finditer(r"[a-z]{2}([0-9])", prompt[after:])]
    if name == "passkey":
        return [m.span(2) for m in NEEDLE.finditer(prompt)]
    return []


@pytest.mark.parametrize(("name", "length"), CASES, ids=[f"{n}-{length}" for n, length in CASES])
def test_the_marks_are_the_bytes_the_text_before_them_decides(name, length):
    for e in examples(name, length, 6, 3):
        assert list(e.marks) == expected_marks(name, e.prompt)
    if name in ("flip_flop", "mqar", "passkey") and length > 2:
        assert any(e.marks for e in examples(name, length, 6, 3))


def test_the_answers_vary():
    """The solvers' agreement means something: answers are not one constant (counting's mostly-pass programs and
    flip-flop's bit still vary over 40 examples)."""
    for name, t in TASKS.items():
        assert len({e.answer for e in examples(name, t.train[1], 40, 3)}) > 1, name


def test_mqar_is_not_answered_by_elimination():
    """The last query's value is not the value left over once the answered queries are set aside: at the longest
    train length the context values no query has answered (the unasked keys' and the last key's) are mostly several
    different digits, so a model that eliminates without reading the key is mostly wrong, while the lookup is right."""
    determined = 0
    for e in examples("mqar", 16, 200, 8):
        table, keys, answered = mqar_parts(e.prompt)
        assert table[keys[-1]] == e.answer
        left = list(table.values())
        for v in answered:
            left.remove(v)
        assert len(left) == 16 - len(answered) == 9  # the last key's value among eight unasked keys'
        determined += len(set(left)) == 1
    assert determined == 0


def test_passkey_depth_is_where_the_needle_is():
    depths = []
    for e in examples("passkey", 16, 40, 5):
        _, before, after = passkey_parts(e.prompt)
        assert e.depth == len(before) / (len(before) + len(after))
        depths.append(e.depth)
    assert min(depths) < 0.25 and max(depths) > 0.75  # spread over the filler, not one place
    assert all(e.depth is None for name in TASKS if name != "passkey" for e in examples(name, TASKS[name].train[1], 2))


def test_test_lengths_are_multiples_of_the_longest_train_length():
    for name, t in TASKS.items():
        hi = t.train[1]
        assert tasks.test_lengths(name) == (hi, 2 * hi, 4 * hi, 8 * hi, 16 * hi), name
        for length in tasks.test_lengths(t):
            assert examples(t, length, 1)[0].length == length
    assert tasks.test_lengths(Task("short", tasks.copy, (1, 40), "p", "a", longest=200)) == (40, 80, 160)


def test_the_prompt_grows_with_the_length():
    for name, t in TASKS.items():
        lo, hi = t.train
        short, long = (max(len(e.prompt) for e in examples(name, lo, 5)), min(len(e.prompt) for e in
                                                                              examples(name, 8 * hi, 5)))
        assert long > short + 7 * hi, name


# --- reproducibility ----------------------------------------------------------------------------------------------


def test_same_seed_same_examples_and_a_longer_list_begins_with_the_shorter():
    for name, t in TASKS.items():
        hi = t.train[1]
        assert examples(name, hi, 5, 9) == examples(name, hi, 5, 9)
        assert examples(name, hi, 8, 9)[:5] == examples(name, hi, 5, 9)


def test_different_seeds_lengths_and_indices_differ():
    for name, t in TASKS.items():
        hi = t.train[1]
        a, b = examples(name, hi, 5, 0), examples(name, hi, 5, 1)
        assert [e.prompt for e in a] != [e.prompt for e in b], name
        assert len({e.prompt for e in a}) > 1, name
        assert examples(name, hi, 1, 0)[0].prompt != examples(name, hi - 1, 1, 0)[0].prompt, name


DUMP = "import json, sys; from lab.tasks import TASKS, examples; json.dump({n: [e.text for e in examples(n, " \
       "t.train[1], 3, 42)] for n, t in TASKS.items()}, sys.stdout)"


def test_another_process_with_another_hash_seed_draws_the_same_examples():
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", DUMP], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    assert json.loads(done.stdout) == {n: [e.text for e in examples(n, t.train[1], 3, 42)] for n, t in TASKS.items()}


# --- the scorer -----------------------------------------------------------------------------------------------------


def test_score_is_exact_match_of_the_text_before_the_terminator():
    for name, t in TASKS.items():
        for e in examples(name, t.train[1], 3, 4):
            a = e.answer
            assert score(e, a) == score(e, e.target) == score(e, a + "\nanything after") == 1, name
            wrong = a[:-1] + ("0" if a[-1] != "0" else "1")
            assert score(e, wrong) == score(e, wrong + "\n") == 0, name  # one byte changed
            assert score(e, "x" + a[1:] + "\n") == 0, name
            assert score(e, a + "x\n") == score(e, a + " ") == score(e, " " + a) == 0, name  # an extra byte
            assert score(e, a[:-1]) == score(e, a[:-1] + "\n") == score(e, "") == score(e, "\n" + a) == 0, name


# --- bad arguments ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "length", "n", "seed", "match"), [
    ("sorting", 5, 1, 0, "unknown task 'sorting'; tasks: copy, reverse"),
    ("copy", 0, 1, 0, "length 0 outside 1..any"),
    ("selective_copy", 7, 1, 0, "length 7 outside 8..any"),
    ("flip_flop", 1, 1, 0, "length 1 outside 2"),
    ("mqar", 677, 1, 0, "length 677 outside 1..676"),
    ("copy", 3, -1, 0, "n .-1. and seed .0. must be at least 0"),
    ("copy", 3, 1, -2, "seed .-2. must be at least 0"),
])
def test_bad_arguments_are_one_clear_error(name, length, n, seed, match):
    with pytest.raises(ValueError, match=match):
        examples(name, length, n, seed)


def test_a_generator_that_breaks_the_rules_is_refused(monkeypatch):
    for bad in ({"prompt": "caf\u00e9 ", "answer": "x"}, {"prompt": "two\nlines ", "answer": "x"}):
        monkeypatch.setitem(TASKS, "bad", Task("bad", lambda rng, length, b=bad: b, (1, 2), "none", "breaks"))
        with pytest.raises(ValueError, match="bad: an example is not ASCII, or holds the terminator"):
            examples("bad", 1, 1)


# --- adding a task: one function and one registry line --------------------------------------------------------------


def double(rng, length):
    """A toy task: each letter twice."""
    letters = "".join("xyz"[i] for i in rng.integers(0, 3, length))
    return {"prompt": f"Double: {letters} = ", "answer": "".join(c + c for c in letters)}


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(TASKS, "double", Task("double", double, (1, 10), "a toy", "each letter twice"))  # the line
    return "double"


def test_a_registered_task_is_used_through_the_same_functions(toy):
    assert tasks.test_lengths(toy) == (10, 20, 40, 80, 160)
    (e,) = examples(toy, 80, 1, 7)
    letters = re.fullmatch(r"Double: ([xyz]+) = ", e.prompt).group(1)
    assert e.answer == "".join(c * 2 for c in letters) and e.length == len(letters) == 80
    assert examples(toy, 80, 1, 7) == [e] and examples(toy, 80, 1, 8) != [e]
    assert score(e, e.target) == 1 and score(e, e.answer[1:]) == 0
    assert set(TASKS) - set(SOLVERS) == {toy}  # so test_every_registered_task_has_a_solver would fail now


def test_a_task_is_unknown_until_registered():
    with pytest.raises(ValueError, match="unknown task 'double'"):
        examples("double", 3, 1)


# --- the documentation's examples are what the generators draw --------------------------------------------------


def test_the_docs_show_each_task_with_a_real_example():
    doc = (ROOT / "docs" / "lab.md").read_text()
    shown = re.findall(r"^- \*\*(\w+)\*\* \(length (\d+)\).*?:\s+`([^`]*)` → `([^`]*)`", doc, re.M | re.S)
    assert sorted(name for name, *_ in shown) == sorted(TASKS)
    for name, length, prompt, answer in shown:
        (e,) = examples(name, int(length), 1, 0)
        assert (e.prompt, e.answer) == (prompt, answer), name
