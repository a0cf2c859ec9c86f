"""The command blocks of README.md and docs/*.md, with the doc-test directives written beside them.

A fenced block whose info string starts with ``bash`` must say where it runs: ``bash cpu`` (one CPU machine after
the quick start), ``bash cluster`` or ``bash gpu``. Directives are HTML comments on the lines right before the
fence (invisible on the rendered page), one per line, at any indentation:

    <!-- doc-test: skip: REASON -->        the block is not run; REASON is printed by the test
    <!-- doc-test: s|OLD|NEW| [why] -->    before running, replace every OLD by NEW (literal text; the character
                                           after ``s`` is the delimiter; free text after it says why). OLD must
                                           occur in the block: a stale override fails
    <!-- doc-test: long: REASON -->        runs only with DOC_TEST_LONG=1 (over the test's time budget); REASON
                                           says what it costs
    <!-- doc-test: timeout SECONDS -->     the block's time limit (default 600)

The grammar is documented in docs/development.md ("Documented commands").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
KINDS = ("cpu", "cluster", "gpu")
DEFAULT_TIMEOUT = 600.0

_FENCE = re.compile(r"^(\s*)```(.*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doc-test:\s*(.*?)\s*-->\s*$")


class DocTestError(ValueError):
    """A block without a place to run, or a directive that does not parse or does not apply."""


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the block's first command (the fence is the line before)
    info: str  # the fence's info string, e.g. "bash cpu"
    text: str  # the block as shown, indentation removed
    skip: str = ""  # the skip reason, if any
    long: str = ""  # why it runs only with DOC_TEST_LONG=1, if it does
    subs: list[tuple[str, str]] = field(default_factory=list)
    timeout: float = DEFAULT_TIMEOUT

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def kind(self) -> str:
        """cpu | cluster | gpu for a bash block ('' when unmarked); 'other' for every other language."""
        words = self.info.split()
        if not words or words[0] != "bash":
            return "other"
        return words[1] if len(words) > 1 and words[1] in KINDS else ""

    def runnable_text(self) -> str:
        """The block with its overrides applied; DocTestError when an override's text is not in the block."""
        text = self.text
        for old, new in self.subs:
            if old not in text:
                raise DocTestError(f"{self.where}: doc-test override s|{old}|{new}|: {old!r} is not in the block")
            text = text.replace(old, new)
        return text


def doc_files(repo: Path = REPO) -> list[Path]:
    """README.md, then the docs pages in name order: the order the test runs their blocks in."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def _parse_directive(body: str, block: Block) -> None:
    if body.startswith("skip:"):
        block.skip = body[len("skip:") :].strip()
        if not block.skip:
            raise DocTestError(f"{block.where}: doc-test skip needs a reason: <!-- doc-test: skip: REASON -->")
    elif body.startswith("long:"):
        block.long = body[len("long:") :].strip()
        if not block.long:
            raise DocTestError(f"{block.where}: doc-test long needs a reason: <!-- doc-test: long: REASON -->")
    elif body.startswith("timeout "):
        try:
            block.timeout = float(body.split()[1])
        except (IndexError, ValueError):
            raise DocTestError(f"{block.where}: doc-test {body!r}: expected 'timeout SECONDS'") from None
    elif len(body) >= 4 and body[0] == "s":
        delim = body[1]
        parts = body[2:].split(delim, 2)
        if len(parts) != 3 or not parts[0] or (parts[2] and not parts[2].startswith(" ")):
            raise DocTestError(f"{block.where}: doc-test {body!r}: expected s{delim}OLD{delim}NEW{delim} [why]")
        block.subs.append((parts[0], parts[1]))
    else:
        raise DocTestError(
            f"{block.where}: doc-test {body!r}: expected 'skip: REASON', 'long: REASON', 's|OLD|NEW|' or 'timeout N'"
        )


def parse_blocks(path: Path, repo: Path = REPO) -> list[Block]:
    """Every fenced block of one Markdown file, with the directives right above it."""
    lines = path.read_text(encoding="utf-8").split("\n")
    rel = str(path.relative_to(repo))
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info = m.group(1), m.group(2).strip()
        end = i + 1
        while end < len(lines) and not re.match(rf"^{indent}```\s*$", lines[end]):
            end += 1
        if end == len(lines):
            raise DocTestError(f"{rel}:{i + 1}: the fence is never closed")
        body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : end]]
        block = Block(rel, i + 2, info, "\n".join(body) + "\n")
        j = i - 1
        directives = []
        while j >= 0 and _DIRECTIVE.match(lines[j]):
            directives.insert(0, _DIRECTIVE.match(lines[j]).group(1))
            j -= 1
        for d in directives:
            _parse_directive(d, block)
        blocks.append(block)
        i = end + 1
    return blocks


def all_blocks(repo: Path = REPO) -> list[Block]:
    return [b for path in doc_files(repo) for b in parse_blocks(path, repo)]


def commands(text: str) -> list[str]:
    """The block's commands: backslash continuations joined, comments and blank lines dropped."""
    out, current = [], ""
    for line in text.split("\n"):
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip() and not current.strip().startswith("#"):
            out.append(current.strip())
        current = ""
    return out
