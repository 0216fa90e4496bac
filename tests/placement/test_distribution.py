"""The tandem-placement wheel depends on Ray alone, and the code imports nothing else."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PACKAGE = Path(__file__).resolve().parents[2] / "packages" / "placement"
SOURCE = PACKAGE / "src" / "tandem" / "placement"


def test_declared_dependencies_are_ray_only() -> None:
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    assert [Requirement(d).name for d in project["dependencies"]] == ["ray"]
    assert not project.get("optional-dependencies")


def test_the_code_imports_only_the_standard_library_ray_and_itself() -> None:
    found: set[str] = set()
    for path in SOURCE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    assert found, "the scan found no imports at all"
    assert found - set(sys.stdlib_module_names) == {"ray"}


@pytest.mark.slow
def test_built_wheel_requires_only_ray(tmp_path: Path) -> None:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("uv not found (run the tests through `./uvw run`)")
    root = PACKAGE.parents[1]
    subprocess.run(
        [uv, "build", "--package", "tandem-placement", "--wheel", "-o", str(tmp_path)],
        cwd=root,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("tandem_placement-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [
            line.split(":", 1)[1].strip()
            for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    assert [Requirement(r).name for r in requires] == ["ray"]
    # One shared namespace: the wheel must not ship tandem/__init__.py.
    assert "tandem/__init__.py" not in names and "tandem/placement/__init__.py" in names
