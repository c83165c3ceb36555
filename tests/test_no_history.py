"""Library code states what is, not how it was found: no run letters, card names or millisecond
figures in kernels/ and ls_jax/ (code, comments and docstrings). Measurements live in
docs/performance.md and in commit messages."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("kernels", "ls_jax")
HISTORY = {
    "run letter": re.compile(r"\brun [A-Z]\b|\bruns [A-Z]-[A-Z]\b"),
    "card name": re.compile(r"\b(H100|H200|A100)\b"),
    "milliseconds": re.compile(r"\b\d+(\.\d+)? ?ms\b"),
}


def history_lines(text: str):
    """(line number, kind, line) of every line of ``text`` that cites a run, card or timing."""
    for number, line in enumerate(text.splitlines(), start=1):
        for kind, pattern in HISTORY.items():
            if pattern.search(line):
                yield number, kind, line.strip()


def test_patterns_catch_what_they_are_for():
    text = "\n".join(["x = 1  # slower in run Q", "runs T-U measured it", "on an H100:",
                      "took 5.84 ms", "12ms less", "run_sweep(args)", "runs on the GPU",
                      "terms of 8 items", "HBM bytes"])
    assert [(n, kind) for n, kind, _ in history_lines(text)] == [
        (1, "run letter"), (2, "run letter"), (3, "card name"), (4, "milliseconds"),
        (5, "milliseconds")]


def test_tests_cite_no_runs_cards_or_timings():
    """The same for tests/, but a card's name inside a string literal is data (a device kind
    the tests lower for) and this module's own examples are what the patterns must catch."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == pathlib.Path(__file__).name:
            continue
        for number, kind, line in history_lines(path.read_text()):
            if kind == "card name" and re.search(r"[\"'][^\"']*\b(H100|H200|A100)", line):
                continue
            offenders.append(f"{path.relative_to(ROOT)}:{number}: {kind}: {line[:100]}")
    assert not offenders, "history in tests:\n" + "\n".join(offenders)


def test_library_code_cites_no_runs_cards_or_timings():
    offenders = []
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, kind, line in history_lines(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {kind}: {line[:100]}")
    assert not offenders, "history in library code:\n" + "\n".join(offenders)
