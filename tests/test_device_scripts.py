"""The shell scripts in benchmarks/ that a GPU session runs as they stand (``benchmarks/h200_switches.sh``)
call benchmarks and tests that exist, with flags those benchmarks declare. Such a script runs only on a
lent machine, where a renamed flag would cost a call of scarce device time to find; here it costs nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.sh"))
CALL = re.compile(r"python3 (benchmarks/\w+\.py)([^;|&]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
CALL_PATH = re.compile(r"python3 (benchmarks/\w+\.py)")
TEST_PATH = re.compile(r"\btests/[\w/]+\.py\b")


def logical_lines(text: str) -> list[str]:
    """The script's lines with backslash continuations joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.split(" #", 1)[0] for line in joined.splitlines() if not line.lstrip().startswith("#")]


def declared_flags(script: Path) -> set[str]:
    """The options a benchmark's argparse declares (``add_argument("--name"``)."""
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", script.read_text()))


def test_there_is_a_script_to_check():
    assert any(script.name == "h200_switches.sh" for script in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_device_script_calls_what_exists_with_declared_flags(script: Path):
    problems = []
    calls = 0
    for line in logical_lines(script.read_text()):
        for path in TEST_PATH.findall(line):
            if not (ROOT / path).exists():
                problems.append(f"{path}: no such test file")
        for benchmark, arguments in CALL.findall(line):
            calls += 1
            if not (ROOT / benchmark).exists():
                problems.append(f"{benchmark}: no such benchmark")
                continue
            unknown = set(FLAG.findall(arguments)) - declared_flags(ROOT / benchmark)
            problems += [f"{benchmark}: {flag} is not one of its options" for flag in sorted(unknown)]
    assert calls, f"{script.name} calls no benchmark: the pattern here no longer matches how it calls them"
    # flags passed through a variable (``for switch in "" --some-flag``): some benchmark it calls
    called = set().union(*(declared_flags(ROOT / b) for b in set(CALL_PATH.findall(script.read_text()))
                           if (ROOT / b).exists()))
    for line in logical_lines(script.read_text()):
        if line.lstrip().startswith("for "):
            problems += [f"{flag} (in {line.strip()!r}) is no option of a benchmark the script calls"
                         for flag in sorted(set(FLAG.findall(line)) - called)]
    assert not problems, "\n".join(problems)


def test_a_flag_the_benchmark_lacks_is_found(tmp_path: Path):
    """The check itself: a call with a flag its benchmark does not declare is reported."""
    text = "timeout 60 python3 benchmarks/sustained.py --shape qwen3-8b \\\n    --no-such-flag\n"
    line = logical_lines(text)[0]
    benchmark, arguments = CALL.findall(line)[0]
    assert set(FLAG.findall(arguments)) - declared_flags(ROOT / benchmark) == {"--no-such-flag"}
