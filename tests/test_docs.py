"""The documentation: the site builds strict, its figures equal the results files, its links resolve, and it reads
as documentation (no history, no sessions), with a README short enough to read."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import docs

ROOT = Path(__file__).resolve().parent.parent
MKDOCS = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file"]
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def build(root: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(MKDOCS + [str(root / "mkdocs.yml"), "--site-dir", str(out)], cwd=root, env=ENV,
                          capture_output=True, text=True, timeout=120)


def copy_docs(tmp_path: Path) -> Path:
    """README.md, mkdocs.yml, docs/ and bench/results/ in a folder of their own, free to damage."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copytree(ROOT / "bench" / "results", root / "bench" / "results")
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copy(ROOT / "ARCHITECTURE.md", root / "ARCHITECTURE.md")
    shutil.copy(ROOT / "bench" / "mkdocs_hooks.py", root / "bench" / "mkdocs_hooks.py")
    return root


def test_site_builds_strict(tmp_path):
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert "Layers and arrows" in (tmp_path / "site" / "architecture.html").read_text()  # from ARCHITECTURE.md


def test_strict_build_fails_on_a_dead_link_and_on_a_page_missing_from_the_nav(tmp_path):
    root = copy_docs(tmp_path)
    errors = root / "docs" / "errors.md"
    errors.write_text(errors.read_text() + "\nSee [the limits](limits-that-do-not-exist.md).\n")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0 and "limits-that-do-not-exist.md" in done.stderr
    errors.write_text(errors.read_text().replace("See [the limits](limits-that-do-not-exist.md).\n", ""))
    (root / "docs" / "orphan.md").write_text("# Not in the nav\n")
    done = build(root, tmp_path / "site2")
    assert done.returncode != 0 and "orphan.md" in done.stderr


def test_every_generated_figure_equals_its_results_file():
    assert docs.stale() == {}, "run `make docs`: " + ", ".join(str(p.relative_to(ROOT)) for p in docs.stale())


def test_the_docs_carry_generated_figures_and_none_typed_by_hand_passes(tmp_path):
    """Change one digit inside a generated table (and, separately, an inline figure) by hand: the check fails."""
    root = copy_docs(tmp_path)
    errors: list[str] = []
    before = set(docs.stale(root, errors=errors))
    good = [p for p in docs.pages(root) if not any(e.startswith(str(p.relative_to(root)) + ":") for e in errors)]
    tables = [(p, m) for p in good for m in docs.TABLE.finditer(p.read_text()) if re.search(r"\d", m["body"])]
    figures = [(p, m) for p in good for m in docs.FIG.finditer(p.read_text())]
    assert len(tables) >= 5 and len(figures) >= 3, "the docs should take their figures from bench/results"
    for page, m in (tables[len(tables) // 2], figures[0]):
        text = page.read_text()
        digit = m.start("body") + re.search(r"\d", m["body"]).start()
        changed = text[:digit] + str((int(text[digit]) + 1) % 10) + text[digit + 1:]
        page.write_text(changed)
        assert set(docs.stale(root, errors=[])) - before == {page}, f"a hand-changed figure in {page.name} passed"
        page.write_text(text)


def test_a_marker_naming_nothing_is_one_line_and_exit_2(tmp_path):
    results = docs.Results(ROOT / "bench" / "results")
    with pytest.raises(docs.DocsError, match="no results file"):
        docs.fill("<!-- table: no-such-file/x -->\n<!-- /table -->", results)
    with pytest.raises(docs.DocsError, match="has no table 'nope'"):
        docs.fill("<!-- table: soak/nope -->\n<!-- /table -->", results)
    root = copy_docs(tmp_path)
    (root / "docs" / "errors.md").write_text("<!-- fig: soak/no_such_key -->1<!-- /fig -->\n")
    errors: list[str] = []
    docs.stale(root, errors=errors)
    assert any(re.match(r"docs/errors.md: .*no_such_key", e) for e in errors), errors
    done = subprocess.run([sys.executable, "-m", "bench.docs", "--check", "--no-such-flag"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move the rest into docs/"


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_every_relative_link_resolves():
    bad = []
    for page in docs.pages():
        for target in links(page):
            path = target.split("#", 1)[0]
            if not path:
                continue
            dest = (page.parent / path).resolve()
            inside = ROOT / "docs" if page.parent.name == "docs" else ROOT
            if not dest.exists() or not dest.is_relative_to(inside):
                bad.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not bad, bad
    assert links(ROOT / "README.md"), "the README should link into docs/"


# A page is documentation: what posenc does and how to use it.  Who wrote it, when, in which working session and
# what an earlier version did belong in git.
HISTORY = re.compile(
    r"\b(?:this|that|previous|last|earlier|next|first|second|third|fourth|fifth|sixth) sessions?\b"
    r"|\bsession'?s (?:final|changes|code|run|VM)\b|\bprevious run\b|\bearlier runs?\b|\bthe last run\b"
    r"|\bthe old README\b|\bengineers?\b|\bcoordinator\b|\blab notebook\b|\bwas stale\b|\(was \d"
    r"|\bissue (?:#?\d+)\b|\bduring development\b", re.I)


def test_no_page_speaks_of_sessions_people_or_history():
    found = [f"{p.relative_to(ROOT)}:{n}: {m.group(0)!r}" for p in docs.pages() + [ROOT / "mkdocs.yml"]
             for n, line in enumerate(p.read_text().splitlines(), 1) for m in [HISTORY.search(line)] if m]
    assert not found, found


def test_the_history_check_catches_what_it_should():
    for line in ("measured on the fifth session's final code", "The previous run (11:25)", "(was 720 MB)",
                 "the engineers measured", "as in issue 9"):
        assert HISTORY.search(line), line
    for line in ("one onnxruntime session per model", "the session's intra-op threads", "InferenceSession"):
        assert not HISTORY.search(line), line


def test_no_file_cites_notes_outside_the_repository():
    """Design notes the code relies on live in docs/design.md, not in files the repository does not have."""
    # the notes were cited by file name (the design file, or the folder of reference notes): in code, neither string
    # at all (the grep); in other files a URL that merely contains the word and a slash is not one
    code = re.compile("DESIGN" + r"\.md|" + "reference" + "/")
    prose = re.compile("DESIGN" + r"\.md|(?<![\w./-])" + "reference" + "/")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    cites = [f"{name}:{n}" for name in tracked.split() if (ROOT / name).is_file()
             and name.endswith((".py", ".md", ".proto", ".yml", ".yaml", ".toml", ".txt", ".sh", "Makefile"))
             for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
             if (code if name.endswith(".py") else prose).search(line)]
    assert not cites, cites
