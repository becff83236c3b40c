"""docs/BAD_INPUTS.md against the tests it names: every row's test exists, and where that test
states the message it expects (the case tables of tests/integration/test_bad_inputs.py), the
row quotes that message's words. A message hsx no longer prints (rows 17-18 quoted "expected a
JSONL dataset file" long after it said otherwise) fails here, in seconds, not in a reader's
hands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "BAD_INPUTS.md"
# The doc's placeholders and the tests' values for them (a line number, numbers in messages).
_LINE = re.compile(r"\.jsonl:(\d+|L)\b")
_MODEL_PATH = re.compile(r"^\S*/model(?=[/:;]| |$)")  # the tests' model copy: the doc's PATH
_TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)(?:\[([^\]]+)\])?")


def doc_rows() -> list[tuple[str, str, list[tuple[str, str, str | None]]]]:
    """(row number, the message column, the tests it names) for each row of the doc's tables."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.fullmatch(r"R?\d+", cells[0]):
            continue
        tests = [(m[0], m[1], m[2] or None) for m in _TEST.findall(cells[-1])]
        rows.append((cells[0], cells[2], tests))
    return rows


def literal_fragments(pattern: str) -> list[str]:
    """The literal runs of a regular expression (what its message must contain word for word),
    those of 6 characters or more."""
    fragments: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            following = pattern[i + 1]
            if following.isalnum():  # \d, \w, \S: a class, not a literal
                fragments.append("".join(current))
                current = []
            else:
                current.append(following)
            i += 2
            continue
        if char in ".^$*+?|()":
            # A quantifier binds the character before it: that one is no longer literal.
            if char in "*+?" and current:
                current.pop()
            fragments.append("".join(current))
            current = []
        elif char == "[":
            fragments.append("".join(current))
            current = []
            i = pattern.index("]", i + 1)
        elif char == "{" and re.match(r"\{\d+(,\d*)?\}", pattern[i:]):
            if current:
                current.pop()
            fragments.append("".join(current))
            current = []
            i = pattern.index("}", i)
        else:
            current.append(char)
        i += 1
    fragments.append("".join(current))
    return [f.strip() for f in fragments if len(f.strip()) >= 6]


def normalized(text: str) -> str:
    return " ".join(_MODEL_PATH.sub("PATH", _LINE.sub(".jsonl:L", text)).replace("`", "").split())


def expected_messages() -> dict[tuple[str, str], str]:
    """(test function, case id) -> the pattern that test asserts, from its case tables."""
    from tests.integration import test_bad_inputs as cases

    tables = {
        "test_a_bad_dataset_line_is_refused_by_its_line": cases.LINE_CASES,
        "test_a_bad_config_json_is_refused_before_prefect_starts": cases.CONFIG_CASES,
        "test_a_bad_setting_is_refused_naming_it": cases.OPTION_CASES,
        "test_a_bad_model_folder_fails_preflight_before_the_model_load": cases.PREFLIGHT_CASES,
    }
    found = {(test, case[0]): str(case[-1]) for test, table in tables.items() for case in table}
    for kind, message in cases.NO_FILE_CASES.items():
        found[("test_a_dataset_path_that_is_no_file", kind)] = re.escape(message)
    return found


def test_the_fragment_reader_keeps_only_literal_text() -> None:
    assert literal_fragments(r"data\.jsonl:2: expected a JSON object, found .*'\{oops'") == [
        "data.jsonl:2: expected a JSON object, found",
        "'{oops'",
    ]
    assert literal_fragments(r"expected [\d,]+ bytes; found \d+ of them") == [
        "expected",
        "bytes; found",
        "of them",
    ]


def test_every_row_names_a_test_that_exists() -> None:
    rows = doc_rows()
    assert len(rows) > 50, f"expected the doc's tables to parse, found {len(rows)} rows"
    missing = []
    for number, _, tests in rows:
        for path, function, case in tests:
            source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
            if f"def {function}(" not in source:
                missing.append(f"row {number}: {path}::{function} (no such test)")
            elif case and "..." not in case and f'"{case}"' not in source:
                missing.append(f"row {number}: {path}::{function}[{case}] (no such case)")
    assert not missing, "docs/BAD_INPUTS.md names tests that do not exist:\n" + "\n".join(missing)


def test_every_row_quotes_what_its_test_expects() -> None:
    expected = expected_messages()
    wrong = []
    checked = 0
    for number, message, tests in doc_rows():
        for _, function, case in tests:
            pattern = expected.get((function, case or ""))
            if pattern is None:
                continue
            checked += 1
            quoted = normalized(message)
            absent = [f for f in literal_fragments(pattern) if normalized(f) not in quoted]
            if absent:
                wrong.append(f"row {number} ({function}[{case}]): the test expects {absent}")
    assert checked >= 30, f"expected most rows checked against their tests, found {checked}"
    assert not wrong, "docs/BAD_INPUTS.md quotes messages its tests do not see:\n" + "\n".join(
        wrong
    )
