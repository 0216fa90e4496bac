"""The monorepo's own rules: package layout, the pin scheme of docs/versioning.md, and
the dependency boundaries of docs/design.md ("Packages")."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # folder -> import name
    "placement": "tandem.placement",
    "lifecycle": "tandem.lifecycle",
    "value-transfer": "tandem.value_transfer",
    "megatron-backend": "tandem.megatron",
    "ppo-driver": "tandem.ppo",
}
# Distributions each package must not declare (docs/design.md, "must not depend on").
FORBIDDEN = {
    "placement": {
        "torch",
        "megatron-core",
        "tandem-lifecycle",
        "tandem-value-transfer",
        "tandem-megatron-backend",
        "tandem-ppo-driver",
    },
    "lifecycle": {
        "ray",
        "megatron-core",
        "tandem-placement",
        "tandem-value-transfer",
        "tandem-megatron-backend",
        "tandem-ppo-driver",
    },
    "value-transfer": {
        "megatron-core",
        "tandem-placement",
        "tandem-lifecycle",
        "tandem-megatron-backend",
        "tandem-ppo-driver",
    },
    "megatron-backend": {"tandem-ppo-driver"},
    "ppo-driver": set(),
}
# Modules a fresh `import <package>` must not pull in.
IMPORT_BOUNDARIES = {
    "tandem.placement": ("ray", "torch"),
    "tandem.lifecycle": ("ray", "megatron", "torch_memory_saver"),
    "tandem.value_transfer": ("megatron",),
}


def _pyproject(folder: str) -> dict:
    return tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())


def _versions() -> dict[str, Version]:
    return {_pyproject(f)["project"]["name"]: Version(_pyproject(f)["project"]["version"]) for f in PACKAGES}


def test_members_are_the_five_packages() -> None:
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert root["tool"]["uv"]["package"] is False
    found = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
    assert found == sorted(PACKAGES)
    for name in _versions():
        assert root["tool"]["uv"]["sources"][name] == {"workspace": True}


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_package_layout(folder: str) -> None:
    pkg = ROOT / "packages" / folder
    meta = _pyproject(folder)["project"]
    assert meta["name"] == f"tandem-{folder}"
    assert (pkg / "README.md").read_text().strip(), "each package has its own README"
    # One implicit namespace shared by independent distributions: no tandem/__init__.py.
    assert not (pkg / "src" / "tandem" / "__init__.py").exists()
    module_dir = pkg / "src" / Path(*PACKAGES[folder].split("."))
    assert (module_dir / "__init__.py").exists()
    assert _pyproject(folder)["tool"]["uv"]["build-backend"]["module-name"] == PACKAGES[folder]


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_internal_pins_follow_the_scheme(folder: str) -> None:
    versions = _versions()
    for dep in map(Requirement, _pyproject(folder)["project"].get("dependencies", [])):
        assert dep.name not in FORBIDDEN[folder], f"{folder} must not depend on {dep.name} (docs/design.md)"
        if dep.name not in versions:
            continue
        current = versions[dep.name]
        if current.major == 0:
            expected = f"<0.{current.minor + 1},>=0.{current.minor}"
        else:
            expected = f"<{current.major + 1},>={current.major}.{current.minor}"
        assert str(dep.specifier) == expected, f"{folder}: pin of {dep.name} should be {expected!r}"
        assert current in dep.specifier


@pytest.mark.parametrize(("module", "banned"), sorted(IMPORT_BOUNDARIES.items()))
def test_import_boundary(module: str, banned: tuple[str, ...]) -> None:
    code = (
        f"import sys, {module}\n"
        f"loaded = [m for m in {banned!r} if m in sys.modules]\n"
        "print(','.join(loaded))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"


@pytest.mark.parametrize("module", sorted(PACKAGES.values()))
def test_imports_from_a_source_tree_without_metadata(module: str) -> None:
    """On the offline GPU host the packages run from `src/` on PYTHONPATH, with no installed metadata."""
    code = (
        "import importlib.metadata as md\n"
        "def missing(name):\n"
        "    raise md.PackageNotFoundError(name)\n"
        "md.version = missing\n"
        f"import {module}\n"
        f"print({module}.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0+unknown"


def test_megatron_backend_exports_resolve_lazily() -> None:
    """Every name in `tandem.megatron.__all__` resolves; the PPO math alone does not load megatron-core."""
    code = (
        "import sys, tandem.megatron as m\n"
        "from tandem.megatron import compute_gae, policy_loss, value_loss, approx_kl, RolloutBatch\n"
        "assert 'megatron.core' not in sys.modules, 'the PPO math pulled in megatron-core'\n"
        "missing = [n for n in m.__all__ if getattr(m, n, None) is None]\n"
        "assert not missing, missing\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def _fake_uv(tmp_path: Path) -> dict[str, str]:
    """An environment whose `uv` only records its arguments (one call a line) in tmp_path/calls."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "uv"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls"}\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "UV_PROJECT_ENVIRONMENT"}
    return env | {"PATH": f"{bin_dir}:{env['PATH']}"}


def test_uvw_compiles_bytecode_at_sync_and_before_the_first_run_only(tmp_path: Path) -> None:
    """`./uvw sync` compiles the environment; `./uvw run` does not (uv's project-wide setting would
    compile all of it again at every run, astral-sh/uv#12202), except the first, which syncs first."""
    import shutil

    env = _fake_uv(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "uvw", project / "uvw")
    calls = tmp_path / "calls"

    def uvw(*args: str) -> list[str]:
        calls.unlink(missing_ok=True)
        subprocess.run([str(project / "uvw"), *args], cwd=project, env=env, check=True)
        return [line for line in calls.read_text().splitlines() if line != "--version"]

    assert uvw("sync", "--locked") == ["sync --compile-bytecode --locked"]
    assert uvw("run", "pytest") == ["sync --compile-bytecode", "run pytest"]  # no .venv yet
    (project / ".venv").mkdir()
    assert uvw("run", "--locked", "pytest") == ["run --locked pytest"]
    assert uvw("lock") == ["lock"]
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]
    assert "compile-bytecode" not in settings


def test_a_run_through_uvw_compiles_nothing() -> None:
    """The real uv on this checkout's environment: a run prints no "Bytecode compiled" line."""
    proc = subprocess.run(
        [str(ROOT / "uvw"), "run", "--locked", "python", "-c", "pass"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Bytecode compiled" not in proc.stderr, proc.stderr[-2000:]
