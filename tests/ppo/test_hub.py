"""`--hf-checkpoint org/name`: hub ids resolve through huggingface_hub's cache, offline too.

The hub cache is a temporary folder laid out as huggingface_hub lays it out
(`models--org--name/refs/main` naming a snapshot, `snapshots/<commit>/` holding
the files), filled with the demo's tiny model. huggingface_hub reads
`HF_HUB_OFFLINE` and `HF_HUB_CACHE` when it is imported, so each case runs in
a fresh interpreter with them set.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.ppo._demo import build_base_model, write_task
from tandem.ppo.config.hub import looks_like_hub_id, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    model = build_base_model(root / "built")
    repo = root / "cache" / "models--tandem-test--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return root / "cache"


def _offline(hub_cache: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache), RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_hub_id_resolves_to_the_cached_snapshot_offline(hub_cache: Path, tmp_path: Path) -> None:
    train, _ = write_task(tmp_path / "data")
    code = (
        "from tandem.ppo._demo import DEMO_DEFAULTS\n"
        "from tandem.ppo.config.file import parse_config\n"
        f"c = parse_config(['--hf-checkpoint', 'tandem-test/tiny-llama', '--prompt-data', {str(train)!r},"
        f" '--run-dir', {str(tmp_path / 'run')!r}, '--eval-interval', 'None'], base=DEMO_DEFAULTS)\n"
        "print(c.hf_checkpoint)\n"
    )
    proc = _offline(hub_cache, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = Path(proc.stdout.strip().splitlines()[-1])
    assert resolved == hub_cache / "models--tandem-test--tiny-llama" / "snapshots" / COMMIT
    assert (resolved / "config.json").is_file() and (resolved / "tokenizer.json").is_file()


def test_unknown_hub_id_offline_is_refused_naming_the_flag(hub_cache: Path, tmp_path: Path) -> None:
    train, _ = write_task(tmp_path / "data")
    code = (
        "import sys\n"
        "from tandem.ppo.app.cli import run\n"
        f"sys.exit(run(['train', '--hf-checkpoint', 'tandem-test/no-such-model', '--prompt-data', {str(train)!r}]))\n"
    )
    proc = _offline(hub_cache, code)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith(
        "ppo-driver train: error: --hf-checkpoint: folder 'tandem-test/no-such-model' is missing"
    )
    assert "HF_HUB_OFFLINE" in err and "Traceback" not in proc.stderr


def test_local_paths_are_never_looked_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A folder that exists is taken as it is, even when it looks like org/name.
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/name") == "org/name"
    # A missing path is no hub id: the folder checks say "folder missing", and the hub id to give instead.
    from tandem.ppo.rollout.preflight import check_model_folder

    for path in ("./runs/x", str(tmp_path / "abs" / "x"), "org/other"):  # org/ exists: a path
        assert resolve_model_path(path) == path
        with pytest.raises(ValueError) as info:
            check_model_folder(path, "--hf-checkpoint")
        assert str(info.value).startswith(
            f"--hf-checkpoint: folder {path!r} is missing (no {(tmp_path / path).resolve()}); "
        ), info.value
        assert f"or give its hub id instead (--hf-checkpoint ORG/{Path(path).name}" in str(info.value)
    assert looks_like_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not looks_like_hub_id("a/b/c") and not looks_like_hub_id("plain") and not looks_like_hub_id("/a/b")


def test_a_missing_folder_that_looks_like_a_hub_id_says_both(hub_cache: Path, tmp_path: Path) -> None:
    """The Qwen example's `models/Qwen2.5-0.5B-Instruct` without `models/`: no folder there, and no such
    repository in the cache; the message says "folder missing" first, and what to do for either."""
    code = (
        "import os, sys\n"
        f"os.chdir({str(tmp_path)!r})\n"
        "from tandem.ppo.config.hub import resolve_model_path\n"
        "resolve_model_path('models/Qwen2.5-0.5B-Instruct')\n"
    )
    proc = _offline(hub_cache, code)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith(
        "ValueError: --hf-checkpoint: folder 'models/Qwen2.5-0.5B-Instruct' is missing (no "
        f"{tmp_path / 'models' / 'Qwen2.5-0.5B-Instruct'}), and as a hub id the Hugging Face cache has no "
        "snapshot of it (offline: HF_HUB_OFFLINE=1"
    ), err
    assert "if it is a folder, download the model there (`hf download ORG/Qwen2.5-0.5B-Instruct" in err


def test_eval_resolves_hub_ids_as_train_does(hub_cache: Path) -> None:
    code = "from tandem.ppo.app.evaluate import resolve_model_dir\nprint(resolve_model_dir('tandem-test/tiny-llama'))\n"
    proc = _offline(hub_cache, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = Path(proc.stdout.strip().splitlines()[-1])
    assert resolved == hub_cache / "models--tandem-test--tiny-llama" / "snapshots" / COMMIT
