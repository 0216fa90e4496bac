"""Bad episode flags: `--env-path` that does not load or has the wrong signature, flags that do not go
together; each refused with one line naming the flag and the fix, exit 2, before Ray starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import ray

from tandem.ppo.app.cli import run as cli


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.ppo._demo import build_base_model

    return build_base_model(tmp_path_factory.mktemp("model") / "base")


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": "go", "label": str(d)}) + "\n" for d in range(4)))
    return path


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("ray.init was called: the input was not refused before Ray started")

    monkeypatch.setattr(ray, "init", refuse)


ENVS = """
class NoStep:
    def reset(self, sample):
        return "go"

class ResetWithoutSample:
    def reset(self):
        return "go"
    def step(self, turn):
        return None, 0.0, True

def needs_a_setting(level):
    return NoStep()

def broken_factory():
    raise RuntimeError("no game today")

def two_arguments(ctx, extra):
    return None

not_callable = 3
"""


def refused(
    capsys: pytest.CaptureFixture[str], model: Path, prompts: Path, tmp_path: Path, *flags: str
) -> str:
    run_dir = tmp_path / "run"
    argv = ["train", "--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--run-dir", str(run_dir)]
    status = cli(
        [*argv, "--device", "cpu", "--params-dtype", "float32", "--local-gpus", "1", "--no-progress", *flags]
    )
    _, err = capsys.readouterr()
    assert status == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert not run_dir.exists()
    return lines[0].removeprefix("ppo-driver train: error: ")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--env-path", "no_such_module_here:Env"], "--env-path 'no_such_module_here:Env': no module named"),
        (["--env-path", "{envs}:Missing"], "has no function 'Missing'; name one of its functions"),
        (["--env-path", "{envs}:not_callable"], "is a int, not callable"),
        (
            ["--env-path", "{envs}:needs_a_setting"],
            "the factory's signature is (level), but it is called with no argument",
        ),
        (["--env-path", "{envs}:broken_factory"], "making an environment raised RuntimeError: no game today"),
        (["--env-path", "{envs}:NoStep"], "which has no step() method"),
        (
            ["--env-path", "{envs}:ResetWithoutSample"],
            "ResetWithoutSample.reset() cannot be called with one argument",
        ),
        (["--env-path", "envs"], "--env-path: got 'envs'; write it as package.module:name"),
        (["--env-path", "textarena:NoSuchGame-v0"], "TextArena has no game 'NoSuchGame-v0'"),
        (
            ["--custom-generate-function-path", "{envs}:two_arguments"],
            "the function's signature is (ctx, extra), but it is called with one argument",
        ),
        (
            ["--env-path", "tandem.ppo._recall:RecallEnv", "--custom-generate-function-path", "{envs}:x"],
            "--env-path and --custom-generate-function-path: give one",
        ),
        (
            ["--env-path", "tandem.ppo._recall:RecallEnv", "--custom-rm-path", "{envs}:x"],
            "--custom-rm-path: with --env-path the episodes' rewards come from the environment",
        ),
        (["--env-path", "tandem.ppo._recall:RecallEnv", "--max-turns", "0"], "--max-turns: got 0"),
        (["--env-path", "tandem.ppo._recall:RecallEnv", "--env-timeout", "0"], "--env-timeout: got 0.0"),
        (
            ["--custom-generate-function-path", "{envs}:two_arguments", "--endpoint-host", "0.0.0.0"],
            "--endpoint-host: '0.0.0.0' is not the loopback",
        ),
    ],
)
def test_bad_episode_flags_are_refused_before_ray(
    flags: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: Path,
    prompts: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TANDEM_ENDPOINT_API_KEY", raising=False)
    envs = tmp_path / "envs.py"
    envs.write_text(ENVS)
    flags = [f.replace("{envs}", str(envs)) for f in flags]
    assert message in refused(capsys, model, prompts, tmp_path, *flags)


def test_a_model_without_a_chat_template_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path, prompts: Path
) -> None:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in bare.glob("chat_template.*"):
        extra.unlink()
    message = refused(capsys, bare, prompts, tmp_path, "--env-path", "tandem.ppo._recall:RecallEnv")
    assert message.startswith("--hf-checkpoint: episodes grow through the model's chat template")


def test_a_remote_endpoint_takes_its_key_from_the_environment_and_writes_it_nowhere(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: Path,
    prompts: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tandem.ppo.config.episode_fields import ENDPOINT_KEY_VARIABLE
    from tandem.ppo.config.file import unvalidated
    from tandem.ppo.config.record import write_run_config
    from tandem.ppo.rollout.episodes.endpoint import endpoint_options

    key = "k3y-that-must-not-leak"
    monkeypatch.setenv(ENDPOINT_KEY_VARIABLE, key)
    agent = tmp_path / "agent.py"
    agent.write_text("def agent(ctx):\n    return None\n")
    run_dir = tmp_path / "run"
    argv = ["train", "--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--run-dir", str(run_dir)]
    argv += ["--device", "cpu", "--params-dtype", "float32", "--local-gpus", "1", "--no-progress"]
    argv += ["--custom-generate-function-path", f"{agent}:agent", "--endpoint-host", "0.0.0.0", "--dry-run"]
    assert cli(argv) == 0  # with the key in the environment, any address is accepted
    out, err = capsys.readouterr()
    assert "0.0.0.0" in out and key not in out + err
    # The run's record holds the address, never the key; the endpoint is given the key from the environment.
    config = unvalidated({"run_dir": str(run_dir), "endpoint_host": "0.0.0.0"})
    write_run_config(config)
    record = (run_dir / "config.yaml").read_text()
    assert "endpoint_host: 0.0.0.0" in record and key not in record
    options = endpoint_options(config.endpoint_host, config.endpoint_port)
    assert options.api_key == key and key not in repr(options)
    monkeypatch.delenv(ENDPOINT_KEY_VARIABLE)
    fresh = endpoint_options("127.0.0.1", 0)  # the loopback without a key: a random one for the run
    assert len(fresh.api_key) >= 24 and fresh.api_key != endpoint_options("127.0.0.1", 0).api_key


def test_a_missing_extra_names_its_install_command(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: Path,
    prompts: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from tandem.ppo.rollout.episodes.endpoint import ChatSession

    monkeypatch.setitem(sys.modules, "textarena", None)  # `import textarena` raises ImportError
    monkeypatch.setitem(sys.modules, "openai", None)
    message = refused(capsys, model, prompts, tmp_path, "--env-path", "textarena:GuessTheNumber-v0")
    assert "TextArena is not installed; pip install 'tandem-ppo-driver[textarena]'" in message
    session = ChatSession.__new__(ChatSession)  # the client needs nothing of a running endpoint to fail
    with pytest.raises(ImportError, match=r"pip install 'tandem-ppo-driver\[openai\]'"):
        session.client()
