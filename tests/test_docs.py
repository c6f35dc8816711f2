"""The docs cite files that exist: every repo path in backticks or a fenced block, every test
cited by name, and every relative link. Their prose also wraps at 100 columns, as the code does.

The performance pages cite hundreds of result files, scripts and probes by path; a file moved
or renamed without its citations leaves a number nobody can trace. This reads the docs
themselves, so a citation that breaks fails here.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted({ROOT / "README.md", *(ROOT / "docs").glob("*.md"),  # a set: docs/README.md
               *(ROOT / "docs").glob("**/README.md"), *(ROOT / "benchmarks").glob("**/README.md")})
# A backticked token starting with one of these is a claim that the path is in the repo.
TOP = ("src/", "tests/", "benchmarks/", "configs/", "docs/", ".ci/")
# Cited before they exist, and the docs say so: where a lent GPU's results are to be committed.
NOT_YET = {"benchmarks/results/gpu/"}
# a fenced block, also one indented in a list item: its lines, as code
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
CODE = re.compile(r"`([^`]+)`")  # an inline span, which may wrap onto the next line
PLACEHOLDER = re.compile(r"[<>\[\]$]|NAME|\.\.\.|_Tt(?![a-z0-9])")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def expand(path: str) -> list[str]:
    """`a_{1,2}t.json` -> [`a_1t.json`, `a_2t.json`]; `{1..4}` as the shell spells it."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            choices.append([part])
        elif ".." in part:
            lo, hi = part.split("..")
            choices.append([str(n) for n in range(int(lo), int(hi) + 1)])
        else:
            choices.append(part.split(","))
    return ["".join(c) for c in itertools.product(*choices)]


def cited_paths(text: str) -> set[str]:
    """Repo paths in backticks or fenced blocks (also inside commands), less placeholders:
    NAME, <x>, $X, [opt], and the pages' `_Tt` for "T threads"."""
    out = set()
    for span in [*FENCE.findall(text), *CODE.findall(FENCE.sub("", text))]:
        for token in span.split():
            token = token.strip("(),;:'\"`").rstrip(".")
            if not token.startswith(TOP) or PLACEHOLDER.search(token):
                continue
            out.update(expand(token.split("::")[0]))  # a test's id: its file
    return out


def exists(path: str) -> bool:
    if any(c in path for c in "*?"):
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_path_exists(doc: Path) -> None:
    missing = sorted(p for p in cited_paths(doc.read_text()) - NOT_YET if not exists(p))
    assert not missing, f"{doc.relative_to(ROOT)} cites paths not in the repo: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_test_exists(doc: Path) -> None:
    """`tests/test_x.py::test_name` names a test function in that file."""
    cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)", doc.read_text())
    missing = [f"{f}::{name}" for f, name in cited
               if not re.search(rf"^def {name}\(", (ROOT / f).read_text(), re.M)]
    assert not missing, f"{doc.relative_to(ROOT)} cites tests that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    targets = [t.split("#")[0] for t in LINK.findall(doc.read_text())]
    missing = sorted(t for t in targets
                     if t and not re.match(r"[a-z]+:", t) and not (doc.parent / t).exists())
    assert not missing, f"{doc.relative_to(ROOT)} links to paths not in the repo: {missing}"


WIDTH = 100  # ruff's line length, for prose read as source
#: blocks whose lines cannot wrap, or whose wrapping is their content (ATX headings: below)
UNWRAPPED = {"fence", "code_block", "table_open"}
MD = MarkdownIt("commonmark").enable("table")
MARKERS = re.compile(r"^(\s*(>|[-*+]|\d+[.)])\s+)*")  # quote and list markers a line opens with


def long_prose_lines(text: str) -> list[int]:
    """Line numbers of prose lines over WIDTH characters: not in a code block (fenced or
    indented, also inside a list), a table or a `#` heading, as a Markdown parser reads them,
    and not one unbreakable token (a long URL) after its quote or list markers."""
    fixed: set[int] = set()
    for tok in MD.parse(text):
        if tok.map and (tok.type in UNWRAPPED
                        or (tok.type == "heading_open" and tok.markup.startswith("#"))):
            fixed.update(range(tok.map[0], tok.map[1]))
    return [n + 1 for n, line in enumerate(text.split("\n"))
            if n not in fixed and len(line) > WIDTH and " " in MARKERS.sub("", line).strip()]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_prose_wraps_at_100_columns(doc: Path) -> None:
    long = long_prose_lines(doc.read_text())
    assert not long, f"{doc.relative_to(ROOT)}: lines over {WIDTH} characters: {long}"


def test_the_width_check_sees_a_long_line() -> None:
    text = "\n".join([
        "ok", "x " * 51, "", "| a | b |", "|---|---|", "| " + "a " * 60 + "|", "",
        "# " + "h " * 60, "```", "c " * 60, "```", "", "- " + "w " * 50,
        "- item:", "", "      " + "code " * 30, "", "http://" + "u" * 120, "",
        "> " + "q " * 50, "> - http://" + "u" * 120, "", "setext " * 20, "---", "",
        "<!-- " + "html " * 30 + "-->"])
    assert long_prose_lines(text) == [2, 13, 20, 23, 26]


def test_not_yet_is_not_stale() -> None:
    """A path cited before it exists leaves the list once it does, and is then checked."""
    assert not [p for p in NOT_YET if exists(p)]


def test_the_check_sees_a_broken_citation() -> None:
    """The extraction is not vacuous: it finds paths in commands, braces, globs, spans that
    wrap onto the next line and fenced blocks, also one indented in a list item."""
    text = ("run `python benchmarks/plot.py A.json --out DIR` on "
            "`benchmarks/results/session31/full_{1,2}t.json` and `tests/no_such_*.py`; see\n"
            "`benchmarks/bench_decode.py\n--config configs/addition/pre.toml`, and\n"
            "```bash\nmake bench  # `docs/performance.md`\npython benchmarks/run_all.py\n```\n"
            "- an item:\n\n  ```bash\n  python benchmarks/targets.py\n  ```\n"
            "`configs/addition/NAME.toml` and `benchmarks/results/full_Tt.json` are placeholders; "
            "`tests/test_docs.py::test_the_check_sees_a_broken_citation` is a test")
    cited = cited_paths(text)
    assert cited == {"benchmarks/plot.py", "benchmarks/results/session31/full_1t.json",
                     "benchmarks/results/session31/full_2t.json", "tests/no_such_*.py",
                     "tests/test_docs.py", "benchmarks/bench_decode.py",
                     "configs/addition/pre.toml", "docs/performance.md", "benchmarks/run_all.py",
                     "benchmarks/targets.py"}
    assert [p for p in sorted(cited) if not exists(p)] == ["tests/no_such_*.py"]
    assert expand("x_{1..3}") == ["x_1", "x_2", "x_3"]
