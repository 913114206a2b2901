"""The package's layout holds: data flows down (no module imports one on a floor above its own)
with no circles, and docs/layout.md names every module and script (design: "Layout").

A module's floor is its folder's (engine/, spec/, ...) or, at the package root, its own name's.
Imports inside functions and under TYPE_CHECKING count: a type-only import is still an arrow a
reader follows.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "backend" / "exspec"

# Top to bottom: a module may import modules on its own floor or below it.
FLOORS = [
    {"__init__", "bench", "demo", "serving"},   # the package's face and its tools
    {"engine"},                                 # the tick
    {"spec"},                                   # proposers
    {"models"},                                 # loading, checks, compiled forwards
    {"config", "params", "vllm_args", "speculative"},   # what a user configures
    {"sampling"},                               # tokens from logits
    {"kv"},                                     # caches
    {"outputs", "errors"},                      # what the engine hands back or raises
    {"utils"},                                  # transfers, stats, threads, faults
]


def floor(module: str) -> int:
    """The floor of exspec.<...> (its first part below exspec)."""
    head = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, names in enumerate(FLOORS) if head in names)


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, package_dir: Path, known: set[str]) -> set[str]:
    """The package's modules that `path` imports (relative imports resolved; `from . import x`
    naming a module counts as importing it)."""
    name = module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    mods = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    return {name: imports(path, package, set(mods)) for name, path in mods.items()}


def upward(edges: dict[str, set[str]]) -> list[str]:
    return [f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})"
            for a, targets in sorted(edges.items()) for b in sorted(targets) if floor(b) < floor(a)]


def circles(edges: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    found = []

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                found.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_no_module_imports_one_on_a_floor_above_its_own():
    assert not upward(graph()), "imports that run back up:\n" + "\n".join(upward(graph()))


def test_no_circles():
    assert not circles(graph()), "import circles:\n" + "\n".join(circles(graph()))


def test_the_checks_see_an_upward_import_and_a_circle(tmp_path):
    """Negative control: a planted upward import and a planted circle are both reported."""
    pkg = tmp_path / "exspec"
    for folder in ("engine", "utils"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("from . import b\n")
    (pkg / "engine" / "b.py").write_text("from .a import x\n")
    (pkg / "utils" / "c.py").write_text("def f():\n    from ..engine.a import x\n")
    edges = graph(pkg)
    assert upward(edges) == ["exspec.utils.c (floor 8) imports exspec.engine.a (floor 1)"]
    assert circles(edges) == ["exspec.engine.a -> exspec.engine.b -> exspec.engine.a"]


def test_layout_page_names_every_module_and_script():
    page = (ROOT / "docs" / "layout.md").read_text()
    paths = [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py"]
    paths += [f"backend/{p.name}" for p in sorted((ROOT / "backend").glob("*.py"))]
    paths += [f"scripts/{p.name}" for p in sorted((ROOT / "scripts").glob("*.py"))]
    missing = [p for p in paths if p not in page]
    assert not missing, "docs/layout.md does not name:\n" + "\n".join(missing)
