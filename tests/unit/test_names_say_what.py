"""Comments, docstrings and test names say what the code does or what was measured, not when or in
which issue it was found or which round of checking found it. What is looked at is only what a
reader reads as prose about the code: comments (tokenize), string statements (ast: module, class
and function docstrings, and the bare strings that document an attribute), the names of test
functions and test classes, and the names of test files. Runtime strings (error messages, log lines,
HTTP bodies, help texts) are what the program says and are not looked at. _PROSE and _NAME list the
forms refused; the planted sources at the end show the check catching them and passing prose that
says what.

Nothing is allow-listed. One pattern is narrowed on purpose: a bare number sign followed by four or
more digits is an upstream pull request (FlyDSL's, in flyserve/vllm), the kernel revision whose
interface the code depends on - a what, not a when. This project's own issues have one to three
digits, and a bare number sign with those is refused.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("flyserve", "scripts", "tests", "benchmarks")

# Prose: an issue by number, or named as the thing the code answers to; a round of checking (its
# item, finding or reader); a numbered stop or round; a numbered item of a list kept elsewhere; and
# a bare project issue number.
_PROSE = re.compile(
    r"""
      \bissues?[\s_-]*\#?\d+                     # issue 13, issues 13, 20, issue-13, issue #13
    | \bthe\s+issue\b                            # the issue's targets, see the issue's list
    | \b(?:attack|attacker|attacker's|earlier|last|previous|first|second|this|that|the|a|an)
        \s+review\b                              # attacker review, the review, an earlier review
    | \breview(?:er)?'s\b                        # the review's case
    | \breviews?\s+(?:round|item|finding|of)s?\b  # review round, review item 6, review finding
    | \(review\b | \breview\)                    # (review ...), (... review)
    | \breview[\s_-]*\d+                         # review 13, review_13
    | \b(?:round|stop|pass)\s+\d+\b              # round 2, stop 20
    | \blast\s+round\b
    | \bitems?\s+\d+(?:'s)?\b                    # item 5, items 3 and 4, item 3's forgery
    | (?<![\w&/\#])\#\d{1,3}\b                   # #13 (not #1056, not a URL's #1023-core-schema)
    """,
    re.IGNORECASE | re.VERBOSE | re.MULTILINE,
)

# Test names: the same, in a name's spelling. A bare leading number is not refused: test_050_,
# test_034_ and test_45_ name FlyDSL 0.5.0, vLLM 0.34 and 45 requests, and a number that indexes an
# issue's list cannot be told from those by its spelling.
_NAME = re.compile(r"issue_?\d|review|round_?\d|stop_?\d|item_?\d", re.IGNORECASE)


def _py_files() -> Iterator[Path]:
    for top in SCANNED:
        for p in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in p.parts:
                yield p


def findings(source: str, where: str = "<source>") -> list[str]:
    """Each reference to an issue or a round of checking in ``source``'s comments, string statements
    and test names, as 'where:line: what'."""
    found: list[str] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and (m := _PROSE.search(tok.string)):
            found.append(f"{where}:{tok.start[0]}: comment {m.group(0)!r}: {tok.string.strip()}")
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for m in _PROSE.finditer(node.value.value):
                line = node.lineno + node.value.value.count("\n", 0, m.start())
                found.append(f"{where}:{line}: docstring {m.group(0)!r}")
        elif _is_test(node) and (m := _NAME.search(node.name)):
            found.append(f"{where}:{node.lineno}: test name {node.name} ({m.group(0)!r})")
    return found


def _is_test(node: ast.AST) -> bool:
    """A test function (test_*) or a test class (Test*), as pytest collects them."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return node.name.startswith("test")
    return isinstance(node, ast.ClassDef) and node.name.startswith("Test")


def scan(sources: dict[str, str]) -> list[str]:
    """findings() of each source (its name -> its text)."""
    found: list[str] = []
    for where, source in sources.items():
        # Tokenizing and parsing every file takes seconds; a comment, a docstring or a name that
        # matches is also a match in the raw text, so files with none are not looked at closer.
        if _PROSE.search(source) or _NAME.search(source):
            found += findings(source, where)
    return found


def misnamed(paths: list[str]) -> list[str]:
    """The test files among ``paths`` whose name refers to an issue or a round of checking."""
    return [p for p in paths if Path(p).name.startswith("test") and _NAME.search(Path(p).stem)]


@pytest.mark.slow  # 2.7 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_comments_docstrings_and_test_names_say_what_not_when() -> None:
    found = scan({str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in _py_files()})
    assert not found, "say what, not when:\n" + "\n".join(found)


def test_test_file_names_say_what_they_pin() -> None:
    assert not misnamed([str(p.relative_to(ROOT)) for p in _py_files()])


# ---------------------------------------------------------------- the check itself, on planted sources

_PLANTED = '''
"""Reads ranks' files (issue 13): a FIFO froze the reader."""

LIMIT = 8  # the cap from the attacker review of stop 20
SCHEMA = 2  # see #13 and the issue's list

ANCHOR = 3
"""A bare attribute docstring (issues 13, 22)."""


def f():
    """Review finding: the read blocked."""
    return "see issue 30"  # item 3's forgery


def test_review_13_a_header_is_refused():
    pass


def test_item_5_a_fifo_is_skipped():
    pass


class TestIssue22:
    pass
'''


def test_the_check_finds_each_planted_reference() -> None:
    got = scan({"planted.py": _PLANTED})
    assert got == findings(_PLANTED, "planted.py")
    assert sum(g.split(": ", 1)[1].startswith("comment") for g in got) == 3
    assert any("comment '#13'" in g for g in got)
    assert any("docstring 'issue 13'" in g for g in got)
    assert any("docstring 'issues 13'" in g for g in got)
    assert any("docstring 'Review finding'" in g for g in got)
    assert any("'attacker review'" in g for g in got) and any("item 3's" in g for g in got)
    names = sorted(g.split("test name ")[1].split(" ")[0] for g in got if "test name" in g)
    assert names == ["TestIssue22", "test_item_5_a_fifo_is_skipped", "test_review_13_a_header_is_refused"]
    assert not any("issue 30" in g for g in got)  # a runtime string is the program's, not looked at
    assert misnamed(["tests/unit/test_control_attack_review.py", "tests/unit/test_issue_13.py",
                     "tests/unit/test_hostile_state_files_and_requests.py"]) == [
        "tests/unit/test_control_attack_review.py", "tests/unit/test_issue_13.py"]  # fmt: skip


def test_the_check_passes_what_says_what() -> None:
    clean = '''
"""Reads ranks' files through safe_read: a FIFO would otherwise freeze the reader for ever."""

LIMIT = 8  # 600 stale files took 1.2 s to read; 256 is the cap (#1056 reads the cache in place)
SCHEMA = 1  # https://yaml.org/spec/1.2.2/#1023-core-schema


def test_a_fifo_in_ranks_is_skipped_and_live_ranks_still_count():
    return "issue 13"
'''
    assert findings(clean) == [] and scan({"clean.py": clean}) == []
