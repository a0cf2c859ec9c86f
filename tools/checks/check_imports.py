"""Import cycles and upward imports in megatron_rlvr, counting every import (function-local and TYPE_CHECKING ones
too: a cycle that only a local import keeps working is still a cycle a reader has to untangle).

    python tools/checks/check_imports.py            # exit 0 when there is none, 1 with one line per finding
    python tools/checks/check_imports.py --graph    # also print the package-level graph (who imports whom)
    python tools/checks/check_imports.py --root DIR # another checkout (DIR/megatron_rlvr, DIR/pyproject.toml)

The layers are read from the `layers` contract in pyproject.toml ([tool.importlinter]), the one list that
`lint-imports` checks too; this script adds what that contract cannot say: cycles between modules of one package.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "megatron_rlvr"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a function or class: its module
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE + ".") and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
                continue
            if child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def layers(root: Path = ROOT) -> list[list[str]]:
    """The layers contract of pyproject.toml, highest first; each layer a list of sibling modules."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]
    for contract in config["contracts"]:
        if contract["type"] == "layers":
            return [[f"{PACKAGE}.{m.strip()}" for m in layer.replace("|", " ").split()] for layer in contract["layers"]]
    raise SystemExit("pyproject.toml: no layers contract under [tool.importlinter]")


def wing(module: str, names: dict[str, int]) -> str | None:
    while module and module not in names:
        module = module.rpartition(".")[0]
    return module or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", action="store_true", help="print the package-level import graph")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to check (default: this one)")
    args = parser.parse_args(argv)
    found = modules(args.root)
    graph = {name: imports_of(path, name, set(found)) for name, path in found.items()}
    problems = [f"cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    rank = {m: i for i, layer in enumerate(layers(args.root)) for m in layer}
    wings: dict[str, set[str]] = defaultdict(set)
    for source, targets in graph.items():
        a = wing(source, rank)
        for target in targets:
            b = wing(target, rank)
            if a is None or b is None or a == b:
                continue
            wings[a].add(b)
            if rank[b] < rank[a]:
                problems.append(f"upward import: {source} imports {target} ({b} is a higher layer than {a})")
            elif rank[b] == rank[a]:
                problems.append(f"sideways import: {source} imports {target} (siblings in one layer)")
    if args.graph:
        for a in sorted(wings, key=lambda m: (rank[m], m)):
            print(f"{a} -> {', '.join(sorted(wings[a]))}")
    for line in problems:
        print(line)
    print(
        f"{len(found)} modules, {sum(map(len, graph.values()))} imports: "
        f"{len(problems)} finding{'s' * (len(problems) != 1)}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
