"""No import cycles between the modules of a package (issue 10: `_backend` ⇄ `_memory_saver`, `_groups` ⇄ `_probe`).

Every import counts, also one inside a function: a lazy import hides a cycle
from the interpreter, not from the reader who has to know which module comes first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # folder -> import name
    "placement": "tandem.placement",
    "lifecycle": "tandem.lifecycle",
    "value-transfer": "tandem.value_transfer",
}


def module_imports(folder: str, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (the package's `__init__` left out)."""
    src = ROOT / "packages" / folder / "src" / Path(*package.split("."))
    modules = {p.relative_to(src).with_suffix("").as_posix().replace("/", "."): p for p in src.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.rsplit(".", 1)[0] if "." in name else ""
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)] if here else []
                    stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
                elif node.module and node.module.startswith(package + "."):
                    stem = node.module.removeprefix(package + ".")
                else:
                    continue
                for alias in node.names:
                    for candidate in (f"{stem}.{alias.name}".lstrip("."), stem):
                        if candidate in modules:
                            targets.add(candidate)
                            break
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(package + "."):
                        targets.add(alias.name.removeprefix(package + "."))
        graph[name] = {t for t in targets if t != name and not t.endswith("__init__")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that starts and ends at the same module, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_no_import_cycles(folder: str) -> None:
    cycle = find_cycle(module_imports(folder, PACKAGES[folder]))
    assert cycle is None, f"tandem {folder}: import cycle {' -> '.join(cycle)}"


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"_a": {"_b"}, "_b": {"_c"}, "_c": {"_a"}}) == ["_a", "_b", "_c", "_a"]
    assert find_cycle({"_a": {"_b"}, "_b": set()}) is None


def test_the_moved_names_are_still_public() -> None:
    from tandem.lifecycle._cuda import require_cuda
    from tandem.placement import PlacementTimeoutError
    from tandem.placement._errors import PlacementTimeoutError as moved

    assert PlacementTimeoutError is moved and issubclass(moved, TimeoutError)
    assert callable(require_cuda)
