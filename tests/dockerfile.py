"""The Dockerfile read as Docker reads it, for tests: instructions per stage, the build stage's COPY sources,
and .dockerignore's patterns (what never reaches the build context)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (REPO / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def stage(index: int) -> list[tuple[str, str]]:
    """The instructions of one stage (0: the first FROM's, -1: the last)."""
    stages: list[list[tuple[str, str]]] = []
    for name, args in instructions():
        if name == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((name, args))
    return stages[index]


def runtime_instructions() -> list[tuple[str, str]]:
    """What the image is made of: the last stage's instructions after those of the stages it is built FROM."""
    stages = {}
    for index in range(sum(name == "FROM" for name, _ in instructions())):
        (_, args), *_ = stage(index)
        stages[args.split()[-1] if " AS " in args.upper() else index] = stage(index)
    chain, current = [], stage(-1)
    while True:
        chain = current + chain
        parent = current[0][1].split()[0]
        if parent not in stages:
            return chain
        current = stages[parent]


def build_stage_copies() -> list[tuple[str, str]]:
    """(source, destination) of every COPY from the build context, destinations relative to the stage's WORKDIR
    (the package's root) without a trailing slash."""
    copies = []
    for name, args in instructions():
        if name == "COPY" and "--from" not in args:
            *sources, dest = shlex.split(args)
            for source in sources:
                # Relative to the WORKDIR (the package's root); "./" keeps the source's own name.
                copies.append((source, (Path(source).name if dest == "./" else dest).rstrip("/")))
    return copies


def dockerignore_patterns() -> list[str]:
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    # Exceptions would need Docker's full rules; refuse them rather than match them wrongly.
    assert not [p for p in patterns if p.startswith("!")], "ignored() does not handle ! exceptions"
    return patterns


def _regex(pattern: str) -> re.Pattern[str]:
    """Docker's matching (Go filepath.Match plus `**` for any number of folders) as a regular expression."""
    out, i = "", 0
    pattern = pattern.strip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether the context-relative path is left out of the build context: it, or a folder above it, matches."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(_regex(p).fullmatch(prefix) for p in patterns for prefix in prefixes)
