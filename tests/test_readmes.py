"""Every package README as a user meets it (issue 13, "READMEs").

- It has at least one ```python example, and its examples run as written: all of
  one README's python blocks, in order, as one script in a fresh interpreter, in
  an empty folder (what a user who copies them does). READMEs whose examples
  start Ray or Megatron are `slow`.
- It says how to install the package from this repository, and does not promise
  `pip install tandem-...` from PyPI, where our names are not.
- Its links resolve both in the repository and in the wheel's metadata (where
  the README is the long description, away from the repository): no relative
  links, and the files it names (`docs/...`, `bench/...`) exist.

Their shell commands, and those of README.md and docs/*.md, run in
tests/test_doc_commands.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted(ROOT.glob("packages/*/README.md"))
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
# Examples that start a Ray cluster or Megatron workers take from half a minute to a few minutes.
SLOW = re.compile(
    r"^\s*(import ray|from ray\b|from tandem\.(megatron|ppo)\b|import tandem\.(megatron|ppo)\b)", re.M
)
RUN_TIMEOUT_S = 850  # below pytest's per-test timeout, so a hang reports the README's output


def blocks(readme: Path, language: str) -> list[str]:
    return [code for lang, code in FENCE.findall(readme.read_text()) if lang == language]


def _folder(readme: Path) -> str:
    return readme.parent.name


def _run_params() -> list:
    params = []
    for readme in READMES:
        code = "\n".join(blocks(readme, "python"))
        marks = [pytest.mark.slow] if SLOW.search(code) else []
        params.append(pytest.param(readme, id=_folder(readme), marks=marks))
    return params


def test_every_package_has_a_readme() -> None:
    folders = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
    assert [_folder(r) for r in READMES] == folders


@pytest.mark.parametrize("readme", READMES, ids=_folder)
def test_the_readme_opens_with_a_python_example(readme: Path) -> None:
    assert blocks(readme, "python"), f"packages/{_folder(readme)}/README.md has no ```python example"


@pytest.mark.parametrize("readme", _run_params())
def test_the_readme_examples_run_as_written(readme: Path, tmp_path: Path) -> None:
    code = "\n\n".join(blocks(readme, "python"))
    assert code, f"packages/{_folder(readme)}/README.md has no ```python example to run"
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    try:
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"")[-3000:], (err.stderr or b"")[-3000:]
        pytest.fail(f"packages/{_folder(readme)}/README.md: still running after {RUN_TIMEOUT_S} s\n{output}")
    assert done.returncode == 0, (
        f"packages/{_folder(readme)}/README.md: its example failed (exit {done.returncode})\n"
        f"--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-6000:]}"
    )


@pytest.mark.parametrize("readme", READMES, ids=_folder)
def test_the_readme_says_how_to_install_from_the_repository(readme: Path) -> None:
    text = readme.read_text()
    folder = _folder(readme)
    assert re.search(rf"pip install .*\./packages/{re.escape(folder)}\b", text), (
        f"packages/{folder}/README.md: say how to install from a clone (pip install ./packages/{folder})"
    )
    assert "not on PyPI" in text, f"packages/{folder}/README.md: say that the tandem names are not on PyPI"
    for code in blocks(readme, "bash") + blocks(readme, "sh") + blocks(readme, ""):
        promised = re.findall(r"^\s*(?:pip install|uv add|uv pip install)\s+['\"]?tandem-[\w-]+", code, re.M)
        assert not promised, f"packages/{folder}/README.md promises an install from PyPI: {promised}"


@pytest.mark.parametrize("readme", READMES, ids=_folder)
def test_the_readme_links_resolve_in_the_repository_and_in_the_wheel(readme: Path) -> None:
    text = readme.read_text()
    folder = _folder(readme)
    targets = re.findall(r"\]\(([^)\s]+)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)
    relative = [t for t in targets if not re.match(r"(https?://|mailto:|#)", t)]
    assert not relative, (
        f"packages/{folder}/README.md links {relative}: a relative link breaks in the wheel's metadata; "
        "name the file in the text (`docs/design.md` of the Tandem repository) or link a full URL"
    )
    for stale in ("DESIGN.md", "STYLE.md"):
        assert stale not in text, f"packages/{folder}/README.md names {stale}; the design is docs/design.md"
    for named in re.findall(r"`((?:docs|bench|tools|tests)/[\w./-]+)`", text):
        assert (ROOT / named).exists(), f"packages/{folder}/README.md names {named}, which does not exist"


@pytest.mark.parametrize("folder", sorted(_folder(r) for r in READMES))
def test_the_package_imports_under_warnings_as_errors(folder: str) -> None:
    """`import tandem.<x>` must not warn (issue 13: torch's NumPy warning broke it under -W error)."""
    import tomllib

    module = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())["tool"]["uv"][
        "build-backend"
    ]["module-name"]
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", f"import {module}"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
