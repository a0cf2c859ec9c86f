"""The dry run of tools/gpu_check.sh, in one process: every python step the GPU call would run, minus the running.

``gpu_check.sh --dry-run`` lists each stage's script and arguments (one tab-separated line: stage, script, args...);
this imports each script and parses exactly those arguments with its own parser. Scripts of tools/gpu_check/ also
run their ``preflight`` (the modules they will import, the config fields they will set); any other script (the op
bench) is stopped right after its parser accepted the arguments. Then every third-party package imported at module
level by the code that ran (this project's modules, and anywhere in the check's scripts) must be on the device image
(image_packages.txt) or among the carried wheels (wheels.lock): the GPU machine can install nothing else.

    python tools/gpu_check/dry_run.py /tmp/gpu_check/dry_run.txt
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import wheels  # noqa: E402

REPO = common.REPO
LOCAL_ROOTS = {"megatron_rlvr", "tests", "tools", *(p.stem for p in HERE.glob("*.py"))}


class _Parsed(Exception):
    """Raised by the patched parse_args: a foreign script's arguments were accepted; do not run it."""


def load_script(path: Path):
    name = "gpu_check_dry_" + "".join(c if c.isalnum() else "_" for c in str(path.with_suffix("")))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def check_invocation(script: Path, argv: list[str]) -> list[str]:
    """Parse ``argv`` with the script's own parser (and run its preflight); notes, or SystemExit with the error."""
    module = load_script(script)
    if hasattr(module, "build_parser") and hasattr(module, "preflight"):
        return module.preflight(module.build_parser().parse_args(argv)) or []
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        module.main(argv)
    except _Parsed:
        return []
    finally:
        argparse.ArgumentParser.parse_args = original
    raise SystemExit(f"{script}: main() returned without parsing its arguments")


def _imports(tree: ast.AST, module_level_only: bool) -> set[str]:
    """Top-level package names imported by ``tree``: at module level only, or anywhere; not inside a try (an
    optional import) nor an ``if TYPE_CHECKING`` block."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Try):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name.split(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.add(child.module.split(".")[0])
            visit(child)

    visit(tree)
    return found


def third_party_imports(scripts: list[Path]) -> dict[str, set[str]]:
    """{top-level package: the files importing it} for this project's loaded modules (module level) and the
    check's scripts (anywhere)."""
    files = {
        Path(m.__file__).resolve(): True
        for name, m in list(sys.modules.items())
        if name.split(".")[0] == "megatron_rlvr" and getattr(m, "__file__", None)
    }
    files |= {s.resolve(): False for s in scripts}
    files |= {p.resolve(): False for p in HERE.glob("*.py")}
    users: dict[str, set[str]] = {}
    for path, module_level_only in files.items():
        if path.suffix != ".py":
            continue
        for top in _imports(ast.parse(path.read_text()), module_level_only):
            if top not in sys.stdlib_module_names and top not in LOCAL_ROOTS and top != "__future__":
                users.setdefault(top, set()).add(str(path))
    return users


def check_packages(users: dict[str, set[str]]) -> list[str]:
    providers = importlib.metadata.packages_distributions()
    available = wheels.image_packages() | {e.project for e in wheels.read_lock()}
    problems = []
    for top, where in sorted(users.items()):
        dists = {canonicalize_name(d) for d in providers.get(top, [])}
        if not dists:
            problems.append(f"'{top}' (imported by {sorted(where)[0]}): no installed distribution provides it here")
        elif not dists & available:
            problems.append(
                f"'{top}' (from {sorted(dists)}, imported by {sorted(where)[0]}) is neither on the device "
                f"image nor in wheels.lock: the GPU call would fail to import it"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("listing", type=Path, help="gpu_check.sh's list of invocations")
    args = parser.parse_args(argv)
    failures: list[str] = []
    scripts: list[Path] = []
    lines = [line.split("\t") for line in args.listing.read_text().splitlines() if line.strip()]
    if not lines:
        failures.append(f"{args.listing}: no invocation listed")
    for stage, script, *script_args in lines:
        path = REPO / script  # relative to the repository (an absolute path stays itself)
        scripts.append(path)
        try:
            notes = check_invocation(path, script_args)
        except SystemExit as exc:  # argparse's exit on a bad argument, or a preflight's refusal
            failures.append(f"{stage}: {script} {' '.join(script_args)}: exit {exc.code}")
            continue
        except Exception as exc:  # an import error or a broken script: what the GPU call would die of
            failures.append(f"{stage}: {script}: {type(exc).__name__}: {exc}")
            continue
        print(f"dry run: {stage}: {script} ok" + "".join(f"\n  note: {n}" for n in notes))
    failures += check_packages(third_party_imports(scripts))
    for f in failures:
        print(f"dry run FAILED: {f}", file=sys.stderr)
    if failures:
        return 1
    print(
        f"dry run ok: {len(lines)} invocations parsed and imported; third-party imports all on the device image "
        "or carried"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
