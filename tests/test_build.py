"""The build (issue 13): all five wheels and sdists build, and their metadata is complete and valid.

What a user installing one of them meets: the name and version of its pyproject,
the Apache-2.0 license expression with the LICENSE file itself inside, the README
as the long description, Python >= 3.12, the package's own module (and no
`tandem/__init__.py`, which would break the shared namespace).
"""

from __future__ import annotations

import subprocess
import tarfile
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.metadata import Metadata

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["placement", "lifecycle", "value-transfer", "megatron-backend", "ppo-driver"]


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`uv build --all-packages` (wheels and sdists, the wheels built from the sdists) into one folder."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        ["sh", str(ROOT / "uvw"), "build", "--all-packages", "--quiet", "-o", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return out


def _project(folder: str) -> dict:
    return tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())["project"]


def _stem(folder: str) -> str:
    project = _project(folder)
    return f"{project['name'].replace('-', '_')}-{project['version']}"


def test_every_package_builds_a_wheel_and_an_sdist(dists: Path) -> None:
    expected = sorted(f"{_stem(f)}{suffix}" for f in FOLDERS for suffix in ("-py3-none-any.whl", ".tar.gz"))
    assert sorted(p.name for p in dists.iterdir() if p.suffix in (".whl", ".gz")) == expected


@pytest.mark.parametrize("folder", FOLDERS)
def test_wheel_metadata_is_valid_and_complete(dists: Path, folder: str) -> None:
    project = _project(folder)
    wheel = dists / f"{_stem(folder)}-py3-none-any.whl"
    dist_info = f"{_stem(folder)}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        raw = archive.read(f"{dist_info}/METADATA")
        shipped = f"{dist_info}/licenses/LICENSE"
        license_text = archive.read(shipped).decode() if shipped in names else ""
    metadata = Metadata.from_email(raw, validate=True)  # raises on any invalid field
    assert metadata.name == project["name"] and str(metadata.version) == project["version"]
    assert str(metadata.requires_python) == ">=3.12"
    assert metadata.license_expression == "Apache-2.0"
    assert metadata.license_files == ["LICENSE"], 'declare license-files = ["LICENSE"] in the pyproject'
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    readme = (ROOT / "packages" / folder / "README.md").read_text()
    assert metadata.description_content_type == "text/markdown"
    assert Parser().parsestr(raw.decode()).get_payload().strip() == readme.strip()
    module = project["name"].removeprefix("tandem-").replace("-", "_")
    module = {"megatron_backend": "megatron", "ppo_driver": "ppo"}.get(module, module)
    assert f"tandem/{module}/__init__.py" in names and f"tandem/{module}/py.typed" in names
    assert "tandem/__init__.py" not in names, "tandem is a namespace shared by five wheels"


@pytest.mark.parametrize("folder", FOLDERS)
def test_sdist_holds_what_rebuilds_the_wheel(dists: Path, folder: str) -> None:
    with tarfile.open(dists / f"{_stem(folder)}.tar.gz") as archive:
        names = {Path(n).relative_to(_stem(folder)).as_posix() for n in archive.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "LICENSE", "PKG-INFO"} <= names


def test_the_license_is_one_text_everywhere() -> None:
    """The root LICENSE and each package's copy (the one its wheel ships) are the same Apache-2.0 text."""
    root = (ROOT / "LICENSE").read_text()
    assert root.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in root
    for folder in FOLDERS:
        path = ROOT / "packages" / folder / "LICENSE"
        assert path.exists() and path.read_text() == root, f"packages/{folder}/LICENSE differs from LICENSE"
