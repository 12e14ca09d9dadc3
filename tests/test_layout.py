"""The layout is the architecture: packages import only downwards in DESIGN.md's order, and no
two modules import each other, directly or round a loop."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def treadle_imports() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports, anywhere in it (inside
    functions and TYPE_CHECKING blocks too). AssertionError for an import of a module of the
    package that does not exist."""
    modules = {module_name(p): p for p in (ROOT / "treadle").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    missing = []
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        ours = {m for m in found if m == "treadle" or m.startswith("treadle.")}
        missing += [f"{name} imports {m}" for m in sorted(ours - modules.keys())]
        graph[name] = {m for m in ours & modules.keys() if m != name}
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)
    return graph


def design_layers() -> list[list[str]]:
    """DESIGN.md's layers, bottom first: each line of its `layers` block names units."""
    text = (ROOT / "DESIGN.md").read_text()
    block = re.search(r"<!-- layers -->\n```\n(.*?)```", text, re.S)
    assert block, "DESIGN.md has no layers block"
    lines = [line.split("#")[0] for line in block[1].splitlines()]
    return [[u.strip() for u in line.split(",") if u.strip()] for line in reversed(lines)
            if line.strip()]


def unit_of(module: str, units: list[str]) -> str:
    matches = [u for u in units if module == u or module.startswith(u + ".")]
    assert matches, f"{module} is in no layer of DESIGN.md"
    return max(matches, key=len)


def test_packages_import_only_downwards_in_designs_order():
    layers = design_layers()
    level = {unit: i for i, line in enumerate(layers) for unit in line}
    units = list(level)
    upward = []
    for module, imports in sorted(treadle_imports().items()):
        mine = unit_of(module, units)
        for imported in sorted(imports):
            theirs = unit_of(imported, units)
            if theirs != mine and level[theirs] >= level[mine]:
                upward.append(f"{module} ({mine}) imports {imported} ({theirs})")
    assert not upward, "imports up or across DESIGN.md's layers:\n" + "\n".join(upward)


def test_no_import_loop_between_modules():
    graph = treadle_imports()
    loops = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                loops.append(" -> ".join(path[path.index(imported):] + [imported]))
            elif imported not in state:
                visit(imported, path + [imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not loops, "import loops:\n" + "\n".join(loops)


def test_every_module_has_a_layer():
    units = [u for line in design_layers() for u in line]
    for module in treadle_imports():
        unit_of(module, units)
