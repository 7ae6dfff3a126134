"""The README and docs/ name only paths that exist: every repository path they mention (in prose,
backticks or code blocks: ``workers/models/runner/target.py``), every ``python -m`` module of the
project and every relative link. Files move; prose that still points at the old place sends a
newcomer nowhere.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a path is checked when it starts with one of these (the repository's tracked top-level folders and files)
FOLDERS = ("workers", "orchestrator", "tools", "tests", "benchmarks", "sweeps", "docs", "data", "notebooks", ".ci")
FILES = ("Makefile", "pyproject.toml", "README.md")
PACKAGES = ("workers", "orchestrator", "tools", "benchmarks")  # `python -m <module>` names checked as modules

WORDS = re.compile(r"[\s=\"'()\[\]`*;]+")  # what separates words in prose, markdown and shell
LINK = re.compile(r"\]\(([^)\s]+)\)")
MODULE = re.compile(r"python -m ([A-Za-z_][\w.]*)")
BRACES = re.compile(r"\{([^{}]*)\}")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def expand(word: str) -> list[str]:
    """``data/prompts/{math,code}.jsonl`` -> both paths (one level of braces, as the docs write them)."""
    match = BRACES.search(word)
    if not match or "," not in match.group(1):
        return [word]
    return [p for choice in match.group(1).split(",")
            for p in expand(word[: match.start()] + choice + word[match.end():])]


def named_paths(text: str) -> set[str]:
    """Repository paths named anywhere in ``text``. Placeholders (``<study>``, ``...``, ``$OUT``) name no
    one file and are skipped; ``path:line`` and ``path#anchor`` keep the path."""
    found = set()
    for word in WORDS.split(text):
        word = re.sub(r"(:\d+|#[\w-]*)$", "", word.rstrip(".:,?!"))
        if any(mark in word for mark in ("<", "...", "$")):
            continue
        for path in expand(word):
            if path in FILES or (path.split("/", 1)[0] in FOLDERS and "/" in path):
                found.add(path.rstrip("/"))
    return found


def named_modules(text: str) -> set[str]:
    return {m for m in MODULE.findall(text) if m.split(".", 1)[0] in PACKAGES}


def missing(text: str, document: Path) -> list[str]:
    """What ``text`` (the content of ``document``) names that does not exist."""
    gone = [p for p in sorted(named_paths(text)) if not (ROOT / p).exists()]
    for module in sorted(named_modules(text)):
        base = ROOT.joinpath(*module.split("."))
        if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists() or (base / "__main__.py").exists()):
            gone.append(f"python -m {module}")
    for target in LINK.findall(text):
        target = target.split("#", 1)[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            if not (document.parent / target).exists():
                gone.append(f"link {target}")
    return gone


def test_the_checked_folders_exist():
    assert all((ROOT / name).exists() for name in FOLDERS + FILES)
    assert (ROOT / "docs").is_dir() and len(documents()) > 1


def test_every_path_the_docs_name_exists():
    problems = {str(d.relative_to(ROOT)): missing(d.read_text(), d) for d in documents()}
    assert not {d: p for d, p in problems.items() if p}, problems


def test_the_check_finds_stale_paths():
    """The finder on planted text: a moved file, a dead module, a broken link, in prose, backticks,
    code blocks and braces; placeholders and outside paths are left alone."""
    text = ("Targets run in `workers/static_target.py`, see [the GPU notes](docs/no_such.md#top).\n"
            "```bash\npython -m workers.no_such_module --x 1\npython benchmarks/demo_pair.py\n```\n"
            "Sets: `data/prompts/{math,nope}.jsonl`; reports go to `reports/<study>/`; `/usr/lib/x.py`;\n"
            "    the layout: tests/gone/ and sweeps/demo.yaml, **orchestrator/gone.py**.")
    assert missing(text, ROOT / "README.md") == [
        "data/prompts/nope.jsonl", "docs/no_such.md", "orchestrator/gone.py", "tests/gone", "workers/static_target.py",
        "python -m workers.no_such_module", "link docs/no_such.md"]
    assert named_paths(text) >= {"benchmarks/demo_pair.py", "data/prompts/math.jsonl", "sweeps/demo.yaml"}
