"""The package's shape, as a newcomer meets it: imports flow one way (no cycle, counting imports inside functions
and under TYPE_CHECKING), few modules at the top, classes and functions small enough to hold in one's head, and
imports inside functions only where they buy start-up time, saying so."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hf_moe_offload"
MAX_TOP_LEVEL_MODULES = 12
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80
# Modules whose function-local imports of the package are there to keep `hf-moe-offload --help` fast.
STARTUP_IMPORTERS = {"hf_moe_offload.cli"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The package module a dotted name refers to (its longest known prefix), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path) -> list[tuple[str, ast.stmt, bool]]:
    """(imported package module, the import statement, whether it sits inside a function)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                stem = ".".join(anchor + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target)
            # A package's __init__ handing on its own submodules' names ties nothing.
            if resolved and resolved != module and not (is_package and resolved.startswith(module + ".")):
                found.append((resolved, node, id(node) in inside))
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(edges) | {w for targets in edges.values() for w in targets}):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for target, _node, _local in _imports(module, path):
            edges[module].add(target)
    cycles = _cycles(edges)
    assert cycles == [], "import cycles:\n" + "\n".join(
        " -> ".join(c) + "\n  " + "\n  ".join(f"{a} imports {b}" for a in c for b in sorted(edges[a]) if b in c)
        for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    """The check itself can fail: two modules importing each other are reported."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_few_modules_at_the_package_top():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_class_or_function_too_large_to_hold():
    too_large = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            limit = {ast.ClassDef: MAX_CLASS_LINES, ast.FunctionDef: MAX_FUNCTION_LINES,
                     ast.AsyncFunctionDef: MAX_FUNCTION_LINES}.get(type(node))
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                too_large.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines (limit {limit})")
    assert too_large == [], "\n".join(too_large)


def test_function_local_imports_only_where_they_buy_start_up_time_and_say_so():
    """Inside a function the package is imported only by the CLI; any other import there (an optional or heavy
    dependency) carries a comment saying why it is not at module level."""
    problems = []
    for module, path in MODULES.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        tree = ast.parse("\n".join(lines))
        functions = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        local = {id(n): n for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        package_local = {id(node) for target, node, is_local in _imports(module, path) if is_local}
        for key, node in local.items():
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            if key in package_local and module not in STARTUP_IMPORTERS:
                problems.append(f"{where}: imports the package inside a function")
            elif module not in STARTUP_IMPORTERS:
                said = "#" in lines[node.end_lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
                if not said:
                    problems.append(f"{where}: no comment says why this import is inside a function")
    assert problems == [], "\n".join(problems)
