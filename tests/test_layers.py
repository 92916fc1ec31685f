"""The layer map of DEVELOPING.md, executable: a package imports only packages of lower layers, and no module
imports itself back through others.

Every import of every module of kvrt (``kvrt/``, ``bindings/``, ``kernels/``) is read with :mod:`ast`, inside
functions too. The layer map leaves out imports for type checking only (``if TYPE_CHECKING:``), since they run
nowhere; the cycle check counts them, since a type that two modules need of each other belongs below both.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"kvrt": ROOT / "kvrt", "kvrt.bindings": ROOT / "bindings", "kvrt.kernels": ROOT / "kernels"}
# DEVELOPING.md's drawing, bottom up; a unit is a subpackage of kvrt or a top-level module of it
LAYERS: list[set[str]] = [
    {"errors"},
    {"bindings", "kernels"},
    {"_handle", "_files", "checks", "prefixes", "system"},
    {"engine"},
    {"accounting", "modelfiles"},
    {"state"},
    {"runtime"},
    {"branching", "memory", "stream"},
    {"serve"},
    {"__init__", "cluster"},  # the public facade (re-exports); Ray Serve replicas (the cluster extra): neither
    # imports the other, so `import kvrt` never needs ray
    {"commands"},
    {"cli"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def modules() -> Iterator[tuple[str, str, Path]]:
    """(module name, its unit, file) of every module of the package."""
    for base, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((base, *parts)).removesuffix(".__init__")
            if base != "kvrt":
                unit = base.split(".")[1]
            else:
                unit = parts[0]
            yield name, unit, path


def imported_units(path: Path) -> Iterator[tuple[str, int]]:
    """The kvrt units ``path`` imports and the line of each import (type-checking-only imports left out)."""
    def walk(node: ast.AST) -> Iterator[ast.AST]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                yield from (n for orelse in child.orelse for n in [orelse, *walk(orelse)])
                continue
            yield child
            yield from walk(child)

    for node in walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvrt" and len(parts) > 1:
                yield parts[1], node.lineno
            elif parts[0] == "kvrt":
                yield "__init__", node.lineno


def test_every_unit_of_the_package_is_on_the_map():
    assert {unit for _, unit, _ in modules()} <= set(RANK)


def test_no_module_imports_its_own_layer_or_one_above():
    upward = []
    for _, unit, path in modules():
        for target, line in imported_units(path):
            if target != unit and RANK[target] >= RANK[unit]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({unit}, layer {RANK[unit]}) imports {target} "
                              f"(layer {RANK[target]})")
    assert not upward, "imports against the layer map of DEVELOPING.md:\n" + "\n".join(upward)


def test_only_the_bench_command_imports_the_harnesses():
    importers = {str(path.relative_to(ROOT)) for _, _, path in modules()
                 if any(isinstance(node, (ast.Import, ast.ImportFrom)) and "kvrt_bench" in ast.unparse(node)
                        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))}
    assert importers <= {"kvrt/commands/bench.py"}


def imported_modules(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports, and the line of each import: every
    import, type-checking-only ones and those inside functions included. ``from P import n`` is module ``P.n``
    when there is one, else ``P``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def nearest(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [nearest(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else nearest(base)
                       for alias in node.names]
        else:
            continue
        yield from ((target, node.lineno) for target in targets if target is not None and target != name)


def test_no_import_cycles_between_modules():
    paths = {name: path for name, _, path in modules()}
    graph = {name: dict(imported_modules(name, path, set(paths))) for name, path in paths.items()}
    cycles: list[list[str]] = []  # Tarjan's strongly connected components: each of two or more modules is a cycle
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for target in graph[node]:
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in graph:
        if name not in order:
            visit(name)
    found = [f"a circle of {len(cycle)} modules:\n" + "\n".join(
        f"  {paths[m].relative_to(ROOT)} imports "
        + ", ".join(f"{t} (line {line})" for t, line in sorted(graph[m].items()) if t in cycle) for m in cycle)
        for cycle in cycles]
    assert not cycles, "modules that import each other, directly or around a circle:\n" + "\n".join(found)
