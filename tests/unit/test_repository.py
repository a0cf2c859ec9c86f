"""The repository keeps its own house rules: every document the code cites exists, every module says what it is for
and stays small, and the package's imports form layers without cycles (tools/checks/check_imports.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_rlvr"
CODE_DIRS = ("megatron_rlvr", "tools", "launch", "tests", "configs", ".ci")
CODE_SUFFIXES = {".py", ".sh", ".yaml", ".toml", ".ini", ""}
MAX_MODULE_LINES = 500

# a document: anything under docs/, or an upper-case name like README.md
DOC_CITATION = re.compile(r"(?<![\w/.-])((?:docs/[\w./-]+|[A-Z][A-Z0-9_-]*)\.md)\b")
# a module of this package named by its path inside the package, e.g. rollout/transfer.py or runtime/cpu/shims.py
MODULE_CITATION = re.compile(r"(?<![\w/.-])((?:[a-z_]+/)+[a-z_]+\.py)\b")


def _code_files() -> list[Path]:
    files = [ROOT / "setup.py", ROOT / "pyproject.toml"]
    for top in CODE_DIRS:
        files += [
            p
            for p in (ROOT / top).rglob("*")
            if p.is_file() and p.suffix in CODE_SUFFIXES and "__pycache__" not in p.parts
        ]
    return files


def _cited(pattern: re.Pattern, tops: tuple[str, ...] = CODE_DIRS) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _code_files():
        if path.relative_to(ROOT).parts[0] not in tops and path.parent != ROOT:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in pattern.finditer(line):
                found.setdefault(match.group(1), []).append(f"{path.relative_to(ROOT)}:{number}")
    return found


def test_every_document_the_code_cites_is_in_the_repository():
    cited = _cited(DOC_CITATION)
    assert "docs/algorithms.md" in cited  # the losses cite it: the scan sees the code
    missing = {
        doc: where
        for doc, where in cited.items()
        if not (ROOT / doc).is_file() and not any(p.name == doc for p in ROOT.glob("*.md"))
    }
    assert not missing, f"cited documents that do not exist: {missing}"


def test_every_module_path_the_code_names_exists():
    names = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    cited = _cited(MODULE_CITATION, ("megatron_rlvr", "tools", "launch", "configs"))  # tests name made-up files
    missing = {ref: where for ref, where in cited.items() if not any(n == ref or n.endswith("/" + ref) for n in names)}
    assert not missing, f"module paths named in the code that do not exist: {missing}"


def test_every_module_has_a_docstring_and_stays_small():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT)
        if text.strip() and not re.match(r'\s*(?:#[^\n]*\n\s*)*[rub]?"""', text):
            problems.append(f"{name}: no module docstring")
        if len(text.splitlines()) > MAX_MODULE_LINES:
            problems.append(f"{name}: {len(text.splitlines())} lines (the house limit is {MAX_MODULE_LINES})")
    assert not problems, "\n".join(problems)


def test_imports_form_layers_without_cycles():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "checks" / "check_imports.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"\d+ modules, \d+ imports: 0 findings", out.stdout)


def test_the_import_check_sees_a_cycle_and_an_upward_import(tmp_path, capsys):
    """The checker itself: a package with a cycle and an upward import is reported (it can fail)."""
    sys.path.insert(0, str(ROOT / "tools" / "checks"))
    try:
        import check_imports
    finally:
        sys.path.pop(0)
    pkg = tmp_path / "megatron_rlvr"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "high.py").write_text("from megatron_rlvr.low import a\n")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from megatron_rlvr.low import b\nimport megatron_rlvr.high\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from megatron_rlvr.low import a\n")
    (tmp_path / "pyproject.toml").write_text(
        '[[tool.importlinter.contracts]]\ntype = "layers"\nlayers = ["high", "low"]\n'
    )
    assert check_imports.main(["--root", str(tmp_path)]) == 1
    findings = capsys.readouterr().out.splitlines()
    assert any(
        f.startswith("cycle: ") and "megatron_rlvr.low.a" in f and "megatron_rlvr.low.b" in f for f in findings
    ), findings
    assert any("upward import: megatron_rlvr.low.a imports megatron_rlvr.high" in f for f in findings), findings


@pytest.mark.parametrize("doc", ["docs/design.md", "docs/algorithms.md"])
def test_the_design_documents_exist(doc):
    assert (ROOT / doc).is_file()
