"""No import cycles between the modules of a package, and tandem.megatron's layers import only downwards.

Every import that runs counts, also one inside a function: a lazy import hides a
cycle from the interpreter, not from the reader who has to know which module comes
first. An import under `if TYPE_CHECKING:` never runs; it names a type for the
checker and orders nothing, so it is left out.
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
    "megatron-backend": "tandem.megatron",
    "ppo-driver": "tandem.ppo",
}


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of `tree` that run: all but those under `if TYPE_CHECKING:`."""
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
        ):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [
        n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in typing_only
    ]


def module_imports(folder: str, package: str, *, packages: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (the package's `__init__` left out).

    `packages`: a subpackage imported as such (`from tandem.ppo.engines import EngineGroup`) is
    its `__init__` (`engines.__init__`), kept in the targets.
    """
    src = ROOT / "packages" / folder / "src" / Path(*package.split("."))
    modules = {p.relative_to(src).with_suffix("").as_posix().replace("/", "."): p for p in src.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.rsplit(".", 1)[0] if "." in name else ""
        targets: set[str] = set()
        for node in runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)] if here else []
                    stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
                elif node.module and node.module.startswith(package + "."):
                    stem = node.module.removeprefix(package + ".")
                elif node.module == package:  # `from tandem.ppo import startup`
                    stem = ""
                else:
                    continue
                for alias in node.names:
                    for candidate in (f"{stem}.{alias.name}".lstrip("."), stem, f"{stem}.__init__"):
                        if candidate in modules:
                            targets.add(candidate)
                            break
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(package + "."):
                        targets.add(alias.name.removeprefix(package + "."))
        graph[name] = {
            t for t in targets if t != name and (not t.endswith("__init__") or (packages and t != "__init__"))
        }
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


def test_imports_for_the_type_checker_only_are_left_out() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nimport a\nif TYPE_CHECKING:\n    import b\n")
    assert [a.name for n in runtime_imports(tree) if isinstance(n, ast.Import) for a in n.names] == ["a"]


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"_a": {"_b"}, "_b": {"_c"}, "_c": {"_a"}}) == ["_a", "_b", "_c", "_a"]
    assert find_cycle({"_a": {"_b"}, "_b": set()}) is None


def test_the_moved_names_are_still_public() -> None:
    from tandem.lifecycle._cuda import require_cuda
    from tandem.placement import PlacementTimeoutError
    from tandem.placement._errors import PlacementTimeoutError as moved

    assert PlacementTimeoutError is moved and issubclass(moved, TimeoutError)
    assert callable(require_cuda)


MEGATRON_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("runtime", ("runtime.",)),
    ("shared data", ("choices", "batch")),
    ("algorithms", ("algorithms.",)),
    ("models", ("models.",)),
    (
        "the seam",
        (
            "config",
            "_config_fields",
            "_training_fields",
            "_algorithm_fields",
            "_config_checks",
            "_algorithm_checks",
            "_field_error",
            "payloads",
        ),
    ),
    ("worker", ("worker.",)),
    ("group", ("group.",)),
)
"""tandem.megatron's layers, lowest first: a module may import its own layer's and lower layers' modules.

Each subpackage's `__init__` docstring says the same in words."""

PURE = {
    "runtime": {"megatron", "transformers", "ray"},
    "algorithms": {"megatron", "transformers", "ray", "safetensors", "tandem"},
    "group": {"megatron", "torch", "transformers"},
    "the seam": {"megatron", "transformers", "ray"},
}
"""Per layer, the top-level names of distributions its modules never import (`tandem` except
`tandem.megatron.choices`, for the pure algorithms)."""


def megatron_layer(module: str) -> int:
    """The index of `module`'s layer in `MEGATRON_LAYERS`."""
    for index, (_, members) in enumerate(MEGATRON_LAYERS):
        if any(module == m or (m.endswith(".") and module.startswith(m)) for m in members):
            return index
    raise AssertionError(f"tandem.megatron.{module}: in no layer of MEGATRON_LAYERS; add it to one")


def test_every_megatron_module_has_a_layer_and_imports_only_downwards() -> None:
    graph = module_imports("megatron-backend", "tandem.megatron")
    upward = []
    for module, targets in graph.items():
        if module.endswith("__init__"):
            continue
        for target in targets:
            if megatron_layer(target) > megatron_layer(module):
                upward.append(
                    f"{module} ({MEGATRON_LAYERS[megatron_layer(module)][0]}) -> "
                    f"{target} ({MEGATRON_LAYERS[megatron_layer(target)][0]})"
                )
    assert not upward, "tandem.megatron: imports against the layering: " + "; ".join(sorted(upward))


def external_imports(path: Path) -> set[str]:
    """The dotted names `path` imports absolutely (every import, also one inside a function)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("layer", sorted(PURE))
def test_the_pure_layers_import_no_heavy_stack(layer: str) -> None:
    src = ROOT / "packages" / "megatron-backend" / "src" / "tandem" / "megatron"
    (members,) = [m for name, m in MEGATRON_LAYERS if name == layer]
    paths = [
        p
        for p in src.rglob("*.py")
        if any(
            (m.endswith(".") and p.relative_to(src).as_posix().startswith(m[:-1] + "/"))
            or p.relative_to(src).as_posix() == f"{m}.py"
            for m in members
        )
    ]
    assert paths, layer
    found = []
    for path in paths:
        for name in external_imports(path):
            top = name.split(".")[0]
            allowed = name == "tandem.megatron.choices" or (layer != "algorithms" and top == "tandem")
            allowed = allowed or name.startswith("tandem.megatron.algorithms")
            if top in PURE[layer] and not allowed:
                found.append(f"{path.relative_to(src)} imports {name}")
    assert not found, f"tandem.megatron {layer}: " + "; ".join(found)


def test_the_layer_check_finds_an_upward_import() -> None:
    assert (
        megatron_layer("algorithms.gae")
        < megatron_layer("worker.roles")
        < megatron_layer("group.train_group")
    )
    with pytest.raises(AssertionError, match="in no layer"):
        megatron_layer("stray")


PPO_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engines", ("engines.",)),
    ("rollout", ("rollout.",)),
    ("config", ("config.",)),
    ("run", ("run.",)),
    ("loop", ("loop.",)),
    ("app", ("app.", "_demo", "_sums", "_tiny", "_recall")),
)
"""tandem.ppo's layers, lowest first: a module may import its own layer's and lower layers' modules (a
subpackage imported as such counts as its layer). `_demo`, `_sums` and `_tiny` stay where run configs name
them (`tandem.ppo._demo:digit_reward`) and belong to the command. Each subpackage's `__init__` docstring
says the same in words."""

PPO_LIGHT = {"config": {"torch", "ray", "megatron"}}
"""Per layer, the top-level names of distributions its modules never import, lazily or not: the config is
read, checked and printed (`--help`, `--dry-run`) without torch, Ray or Megatron."""


def layer_of(module: str, layers: tuple[tuple[str, tuple[str, ...]], ...], package: str) -> int:
    """The index of `module`'s layer in `layers`."""
    for index, (_, members) in enumerate(layers):
        if any(module == m or (m.endswith(".") and module.startswith(m)) for m in members):
            return index
    raise AssertionError(f"{package}.{module}: in no layer; add it to one")


def test_every_ppo_module_has_a_layer_and_imports_only_downwards() -> None:
    graph = module_imports("ppo-driver", "tandem.ppo", packages=True)
    upward = []
    for module, targets in graph.items():
        if module == "__init__":
            continue
        for target in targets:
            if layer_of(target, PPO_LAYERS, "tandem.ppo") > layer_of(module, PPO_LAYERS, "tandem.ppo"):
                mine, theirs = (
                    PPO_LAYERS[layer_of(m, PPO_LAYERS, "tandem.ppo")][0] for m in (module, target)
                )
                upward.append(f"{module} ({mine}) -> {target} ({theirs})")
    assert not upward, "tandem.ppo: imports against the layering: " + "; ".join(sorted(upward))


def test_the_ppo_layers_read_as_their_inits_say() -> None:
    src = ROOT / "packages" / "ppo-driver" / "src" / "tandem" / "ppo"
    for name, _ in PPO_LAYERS[:-1]:
        doc = " ".join((ast.get_docstring(ast.parse((src / name / "__init__.py").read_text())) or "").split())
        assert "may import" in doc, f"tandem.ppo.{name}: its __init__ says what it may import"


@pytest.mark.parametrize("layer", sorted(PPO_LIGHT))
def test_the_light_ppo_layers_import_no_heavy_stack(layer: str) -> None:
    src = ROOT / "packages" / "ppo-driver" / "src" / "tandem" / "ppo" / layer
    found = [
        f"{path.name} imports {name}"
        for path in sorted(src.rglob("*.py"))
        for name in external_imports(path)
        if name.split(".")[0] in PPO_LIGHT[layer]
    ]
    assert not found, f"tandem.ppo.{layer}: " + "; ".join(found)


def test_the_ppo_layer_check_finds_an_upward_import() -> None:
    assert layer_of("engines._group", PPO_LAYERS, "p") < layer_of("config.checks", PPO_LAYERS, "p")
    assert layer_of("loop.driver", PPO_LAYERS, "p") < layer_of("_demo", PPO_LAYERS, "p")
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("stray", PPO_LAYERS, "p")
