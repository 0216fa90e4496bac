"""Each wheel declares what its code imports, no more and no less (issue 13, "Dependencies").

The wheels are built, and each one's `Requires-Dist` is compared with the imports
(read with `ast`) of the Python files inside that same wheel:

1. every distribution the code imports is declared (in the base dependencies, or
   in an extra when every import of it is lazy: inside a function, or under a
   `try` that catches ImportError);
2. every declared distribution, base or extra, is imported somewhere (or is in
   `NEEDED_BUT_NOT_IMPORTED`, with the reason);
3. a distribution declared only under an extra is never imported at module level,
   where a user without the extra would meet a bare ImportError.

Imports under `if TYPE_CHECKING:` are for the type checker: they count as a use
(rule 2) but never require a declaration (rule 1).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # folder -> (distribution, import name)
    "placement": ("tandem-placement", "tandem.placement"),
    "lifecycle": ("tandem-lifecycle", "tandem.lifecycle"),
    "value-transfer": ("tandem-value-transfer", "tandem.value_transfer"),
    "megatron-backend": ("tandem-megatron-backend", "tandem.megatron"),
    "ppo-driver": ("tandem-ppo-driver", "tandem.ppo"),
}
# Import name (first component; for `tandem`, the first two) -> distribution.
IMPORT_TO_DIST = {
    "yaml": "pyyaml",
    "tensorboardX": "tensorboardx",
    "math_verify": "math-verify",
    "safetensors": "safetensors",
    "torch": "torch",
    "triton": "triton",
    "ray": "ray",
    "megatron": "megatron-core",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "tyro": "tyro",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
    "requests": "requests",
    "numpy": "numpy",
    "torch_memory_saver": "torch-memory-saver",
    "sglang": "sglang",
    "datasets": "datasets",
    "huggingface_hub": "huggingface-hub",
    "pyarrow": "pyarrow",
    "xxhash": "xxhash",
    "gguf": "gguf",
    "tensorboard": "tensorboard",
    "PIL": "pillow",
    "pandas": "pandas",
    "wandb": "wandb",
    "mlflow": "mlflow-skinny",
    "textarena": "textarena",
    "openai": "openai",
    "tandem.placement": "tandem-placement",
    "tandem.lifecycle": "tandem-lifecycle",
    "tandem.value_transfer": "tandem-value-transfer",
    "tandem.megatron": "tandem-megatron-backend",
    "tandem.ppo": "tandem-ppo-driver",
}
# Declared on purpose though the package's code never imports them: distribution -> why.
NEEDED_BUT_NOT_IMPORTED = {
    "tandem-lifecycle": {
        "numpy": "without numpy `import torch` warns 'Failed to initialize NumPy', an error under -W error",
    },
    "tandem-ppo-driver": {
        "accelerate": "extra gguf: transformers refuses to load a GGUF file without it (fetch-model)",
        "tensorboard": "the `tensorboard` command that opens RUN_DIR/tensorboard (the [tensorboard] extra)",
    },
}


@dataclass(frozen=True)
class Found:
    """One import of a third-party distribution in a wheel's code."""

    dist: str
    where: str  # file:line
    lazy: bool  # inside a function or a try/except ImportError: fine for an extra
    type_only: bool  # under `if TYPE_CHECKING:`


def _import_names(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.ImportFrom):
        if node.level or node.module is None:
            return  # relative: the package itself
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
        names = [a.name for a in node.names]
    for name in names:
        parts = name.split(".")
        yield ".".join(parts[:2]) if parts[0] == "tandem" else parts[0]


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    caught = handler.type
    names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(
    node: ast.AST, lazy: bool, type_only: bool
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, lazy, type_only
        return
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        lazy = True
    if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
        for child in node.body:
            yield from _walk(child, True, type_only)
        for rest in (*node.handlers, *node.orelse, *node.finalbody):
            yield from _walk(rest, lazy, type_only)
        return
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.body:
            yield from _walk(child, lazy, True)
        for child in node.orelse:
            yield from _walk(child, lazy, type_only)
        return
    for child in ast.iter_child_nodes(node):
        yield from _walk(child, lazy, type_only)


def imports_of_wheel(wheel: Path, own: str) -> list[Found]:
    """Third-party and other-tandem imports of the .py files in `wheel` (stdlib and `own` left out)."""
    found = []
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not name.endswith(".py"):
                continue
            tree = ast.parse(archive.read(name), filename=name)
            for node, lazy, type_only in _walk(tree, False, False):
                for imported in _import_names(node):
                    top = imported.split(".")[0]
                    if top in sys.stdlib_module_names or top == "__future__" or imported == own:
                        continue
                    if imported == "tandem":
                        continue  # `import tandem` alone names only the namespace
                    assert imported in IMPORT_TO_DIST, (
                        f"{name}:{node.lineno} imports {imported!r}; add its distribution to IMPORT_TO_DIST"
                    )
                    found.append(
                        Found(
                            canonicalize_name(IMPORT_TO_DIST[imported]),
                            f"{name}:{node.lineno}",
                            lazy,
                            type_only,
                        )
                    )
    return found


def requires_dist(wheel: Path) -> tuple[set[str], dict[str, set[str]]]:
    """(base dependencies, {extra: its dependencies}) of a wheel, as canonical distribution names."""
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(archive.read(metadata_name).decode())
    base: set[str] = set()
    extras: dict[str, set[str]] = {extra: set() for extra in headers.get_all("Provides-Extra") or []}
    for line in headers.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        marker = requirement.marker
        if marker is None:
            base.add(name)
            continue
        # A platform or Python-version marker holds (or not) whatever the extra: still a base
        # dependency. Only a marker that holds for some extras and not without one names extras.
        if marker.evaluate({"extra": ""}):
            base.add(name)
            continue
        matched = [extra for extra in extras if marker.evaluate({"extra": extra})]
        if not matched:
            base.add(name)
        for extra in matched:
            extras[extra].add(name)
    return base, extras


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The five wheels, built from this tree: distribution name -> wheel path."""
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        ["sh", str(ROOT / "uvw"), "build", "--all-packages", "--wheel", "--quiet", "-o", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    built = {}
    for dist, _ in PACKAGES.values():
        matches = list(out.glob(f"{dist.replace('-', '_')}-*.whl"))
        assert len(matches) == 1, f"{dist}: expected one wheel in {sorted(p.name for p in out.iterdir())}"
        built[dist] = matches[0]
    return built


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_requires_dist_matches_the_imports(wheels: dict[str, Path], folder: str) -> None:
    dist, module = PACKAGES[folder]
    base, extras = requires_dist(wheels[dist])
    found = imports_of_wheel(wheels[dist], module)
    declared = base | set().union(*extras.values())
    allowed_unused = set(NEEDED_BUT_NOT_IMPORTED.get(dist, {}))
    problems = []

    # 1. Every import is declared.
    for f in found:
        if not f.type_only and f.dist not in declared:
            problems.append(f"{f.where} imports {f.dist}, which {dist} does not declare")
    # 2. Every declaration is imported.
    used = {f.dist for f in found}
    for name in sorted(base - used - allowed_unused):
        problems.append(f"{dist} declares {name} but its code never imports it")
    for extra, names in sorted(extras.items()):
        for name in sorted(names - used - allowed_unused):
            problems.append(f"{dist}[{extra}] declares {name} but its code never imports it")
    # 3. What only an extra provides is imported lazily.
    for f in found:
        if f.dist in declared - base and not (f.lazy or f.type_only):
            problems.append(
                f"{f.where} imports {f.dist} at module level, but {dist} declares it only under an extra; "
                "import it inside the function that needs it (with the install command in the ImportError)"
            )
    assert not problems, "\n".join(dict.fromkeys(problems))  # each once, in order


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_declared_exceptions_are_still_needed(folder: str) -> None:
    """An entry of NEEDED_BUT_NOT_IMPORTED names a dependency the package really declares."""
    dist, _ = PACKAGES[folder]
    pyproject = (ROOT / "packages" / folder / "pyproject.toml").read_text()
    for name in NEEDED_BUT_NOT_IMPORTED.get(dist, {}):
        assert f'"{name}' in pyproject, f"{dist}: {name} is listed as needed but not declared"


def test_the_import_reader_sees_lazy_guarded_and_type_only_imports(tmp_path: Path) -> None:
    """The reader itself, on a hand-made wheel: each kind of import is classified as the rules need."""
    source = (
        "from __future__ import annotations\n"
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from . import sibling\n"
        "from tandem.placement import Slot\n"
        "if TYPE_CHECKING:\n"
        "    import ray\n"
        "try:\n"
        "    import yaml\n"
        "except ImportError:\n"
        "    yaml = None\n"
        "def f():\n"
        "    import megatron.core\n"
    )
    wheel = tmp_path / "x-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("tandem/x/mod.py", source)
    found = {f.dist: (f.lazy, f.type_only) for f in imports_of_wheel(wheel, "tandem.x")}
    assert found == {
        "torch": (False, False),
        "tandem-placement": (False, False),
        "ray": (False, True),
        "pyyaml": (True, False),
        "megatron-core": (True, False),
    }
