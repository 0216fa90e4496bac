"""A run folder as users move it and commands read it: relative paths, CPU settings, eval's own settings, --dry-run."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tandem.ppo.app import machine
from tandem.ppo.app.cli import EvalArgs, run
from tandem.ppo.app.evaluate import EVAL_DEFAULTS, eval_settings
from tandem.ppo.config import PPOConfig
from tandem.ppo.config.file import read_run_config, read_yaml, unvalidated
from tandem.ppo.config.record import RUN_CONFIG_MARKER, write_run_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _hf_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def _config(run_dir: Path, **values: Any) -> PPOConfig:
    return unvalidated({"run_dir": str(run_dir), **values})


def test_a_moved_run_reads_its_own_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    outside = _hf_folder(tmp_path / "models" / "base")
    run_dir = Path("runs/a")
    _hf_folder(run_dir / "base")
    (run_dir / "data").mkdir()
    (run_dir / "data" / "train.jsonl").write_text("")
    (run_dir / "reward.py").write_text("def f(s):\n    return [0.0] * len(s)\n")
    config = _config(
        run_dir,
        hf_checkpoint="runs/a/base",
        critic_hf_checkpoint=str(outside),
        ref_load="org/model-on-the-hub",
        prompt_data="runs/a/data/train.jsonl",
        save="runs/a/ckpt",  # inside the run, not written yet
        custom_rm_path="runs/a/reward.py:f",
    )
    path = write_run_config(config)
    text = path.read_text()
    assert text.startswith(RUN_CONFIG_MARKER + "\n")
    stored = yaml.safe_load(text)
    assert stored["run_dir"] == "." and stored["hf_checkpoint"] == "./base" and stored["save"] == "./ckpt"
    assert stored["critic_hf_checkpoint"] == str(outside.resolve())
    assert stored["ref_load"] == "org/model-on-the-hub" and stored["custom_rm_path"] == "./reward.py:f"

    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(run_dir, moved)
    shutil.rmtree(run_dir)
    read = read_run_config(moved)
    assert Path(read.run_dir) == moved
    assert Path(read.hf_checkpoint) == moved / "base" and (Path(read.hf_checkpoint) / "config.json").is_file()
    assert Path(read.prompt_data) == moved / "data" / "train.jsonl"
    assert Path(read.actor_save) == moved / "ckpt"
    assert read.custom_rm_path == f"{moved / 'reward.py'}:f"
    assert read.critic_hf_checkpoint == str(outside.resolve()) and read.ref_load == "org/model-on-the-hub"
    # As --config too: a run's config.yaml resumes the run where it now is.
    assert Path(unvalidated(read_yaml(moved / "config.yaml")).run_dir) == moved


def test_a_user_yaml_keeps_paths_relative_to_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "run.yaml").write_text("hf_checkpoint: ./models/x\nprompt_data: data.jsonl\n")
    values = read_yaml(tmp_path / "conf" / "run.yaml")
    assert values == {"hf_checkpoint": "./models/x", "prompt_data": "data.jsonl"}


def test_read_run_config_names_the_folder_without_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^RUN_DIR: .* has no config.yaml"):
        read_run_config(tmp_path)


# --- the machine ----------------------------------------------------------------------------------


def test_cpu_settings_fill_in_what_a_cpu_run_needs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(machine, "has_local_gpu", lambda: False)
    config = _config(Path("r"), actor_num_gpus_per_node=2, offload_backend="torch_memory_saver")
    with caplog.at_level(logging.INFO, logger="tandem"):
        adapted, changes = machine.adapt_to_machine(config)
        machine.announce(changes)
    assert (adapted.device, adapted.params_dtype, adapted.local_gpus) == ("cpu", "float32", 2)
    assert adapted.offload_backend == "pinned_host"
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.ppo.machine"]
    assert len(lines) == 1 and "--device cpu" in lines[0] and "--local-gpus 2" in lines[0], lines
    # What the user set stays; nothing to say when nothing changes.
    caplog.clear()
    mine = _config(Path("r"), device="cpu", params_dtype="float32", local_gpus=3)
    with caplog.at_level(logging.INFO, logger="tandem"):
        assert machine.adapt_to_machine(mine) == (mine, {})
        machine.announce({})
    assert not caplog.records


@pytest.mark.parametrize("setting", ["gpu", "cluster", "cuda"])
def test_cpu_settings_stay_off_with_a_gpu_a_cluster_or_cuda_asked(
    monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    monkeypatch.setattr(machine, "has_local_gpu", lambda: setting == "gpu")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if setting == "cluster":
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    config = _config(Path("r"), device="cuda" if setting == "cuda" else "auto")
    assert machine.adapt_to_machine(config) == (config, {})


# --- eval uses the run's own settings ----------------------------------------------------------------


def _eval_args(model: str, **flags: Any) -> EvalArgs:
    return EvalArgs(model=model, data="x.jsonl", **flags)


def test_eval_takes_the_runs_reward_and_lengths(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        custom_rm_path="tandem.ppo._demo:digit_reward",
        rollout_max_response_len=1,
        max_prompt_len=32,
        eval_temperature=0.5,
        n_samples_per_eval_prompt=3,
        accuracy_threshold=0.9,
        apply_chat_template=False,
        input_key="question",
        label_key="answer",
        rollout_stop_token_ids=(7,),
    )
    write_run_config(config)
    settings = eval_settings(_eval_args(str(tmp_path)))
    assert settings.reward == "tandem.ppo._demo:digit_reward"
    assert (settings.max_response_len, settings.max_prompt_len, settings.temperature) == (1, 32, 0.5)
    assert (settings.n_samples_per_prompt, settings.accuracy_threshold) == (3, 0.9)
    assert not settings.apply_chat_template and settings.stop_token_ids == (7,)
    assert (settings.input_key, settings.label_key) == ("question", "answer")
    # Flags override the run; --rm-type alone replaces the run's own reward.
    given = eval_settings(_eval_args(str(tmp_path), rm_type="math", max_response_len=64, temperature=0.0))
    assert (given.reward, given.max_response_len, given.temperature) == ("math", 64, 0.0)


def test_eval_of_a_run_of_episodes_plays_them(tmp_path: Path) -> None:
    config = _config(tmp_path, env_path="tandem.ppo._recall:RecallEnv", custom_rm_path=None, max_turns=2)
    write_run_config(config)
    settings = eval_settings(_eval_args(str(tmp_path)))
    assert settings.episodes_of is not None and settings.episodes_of.max_turns == 2
    assert settings.reward == "the environment of tandem.ppo._recall:RecallEnv"


def test_eval_of_a_bare_model_folder_uses_the_defaults(tmp_path: Path) -> None:
    settings = eval_settings(_eval_args(str(_hf_folder(tmp_path / "hf"))))
    assert settings.reward == EVAL_DEFAULTS["rm_type"] and settings.source == "defaults"
    assert dataclasses.asdict(settings)["max_response_len"] == EVAL_DEFAULTS["max_response_len"]
    assert settings.base is None  # nothing to compare the weights with


def test_eval_compares_with_the_runs_base_or_the_one_given(tmp_path: Path) -> None:
    base = _hf_folder(tmp_path / "base")
    write_run_config(_config(tmp_path / "run", hf_checkpoint=str(base), rollout_dtype="bfloat16"))
    settings = eval_settings(_eval_args(str(tmp_path / "run")))
    assert (settings.base, settings.dtype) == (str(base), "bfloat16")
    other = _hf_folder(tmp_path / "other")
    assert eval_settings(_eval_args(str(tmp_path / "run"), base=str(other))).base == str(other)
    with pytest.raises(ValueError, match="--base"):
        eval_settings(_eval_args(str(tmp_path / "run"), base=str(tmp_path / "nowhere")))


def test_weights_changed_counts_the_elements_that_differ_in_the_engines_dtype(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from tandem.ppo.app.evaluate import weights_changed

    base = {"a": torch.ones(4, 5), "b": torch.zeros(3), "only_in_base": torch.ones(2)}
    mine = {k: v.clone() for k, v in base.items() if k != "only_in_base"}
    mine["a"][0, :3] += 0.5  # 3 elements, another value in float32 and in bfloat16
    mine["a"][2, 1] += 2**-12  # 1 element, in float32 only: 1 + 2**-12 rounds to 1 in bfloat16
    mine["b"][2] = -0.0  # the sign of zero is another bit pattern
    save_file(base, str(_hf_folder(tmp_path / "base") / "model.safetensors"))
    save_file(mine, str(_hf_folder(tmp_path / "mine") / "model.safetensors"))
    assert weights_changed(tmp_path / "mine", tmp_path / "base", "float32") == (5, 23)
    assert weights_changed(tmp_path / "mine", tmp_path / "base", "bfloat16") == (4, 23)
    save_file({"c": torch.ones(1)}, str(_hf_folder(tmp_path / "stranger") / "model.safetensors"))
    with pytest.raises(ValueError, match="--base"):
        weights_changed(tmp_path / "mine", tmp_path / "stranger")


# --- --dry-run and examples/ --------------------------------------------------------------------


def _tiny_inputs(tmp_path: Path) -> list[str]:
    from tandem.ppo import build_base_model, write_task

    model = build_base_model(tmp_path / "base")
    train, evaluation = write_task(tmp_path / "data")
    return ["--hf-checkpoint", str(model), "--prompt-data", str(train), "--eval-prompt-data", str(evaluation)]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_a_dry_run(
    example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(machine, "has_local_gpu", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run_dir = tmp_path / "run"
    given = read_yaml(example)
    if "hf_checkpoint" in given:
        # A model and data of CPU size in place of the example's own files; every other field as written.
        argv = ["train", "--config", str(example), *_tiny_inputs(tmp_path), "--run-dir", str(run_dir)]
    else:
        argv = ["demo", "--config", str(example), "--run-dir", str(run_dir)]
    assert run([*argv, "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)
    skip = {"hf_checkpoint", "prompt_data", "eval_prompt_data", "run_dir", "params_dtype", "offload_backend"}
    for key, value in given.items():
        if key not in skip:
            assert resolved[key] == value, key
    assert resolved["device"] == "cpu" and resolved["local_gpus"] == 1
    assert "#   GPU 0 (bundle 0): actor rank 0 (0.4), critic rank 0 (0.4), embedded engine 0 (0.2)" in out
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()


def test_dry_run_shows_each_role_on_its_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "train",
        *_tiny_inputs(tmp_path),
        "--run-dir",
        str(tmp_path / "run"),
        "--actor-num-gpus-per-node",
        "2",
        "--no-colocate",
        "--rollout-num-gpus",
        "1",
        "--advantage-estimator",
        "grpo",
        "--n-samples-per-prompt",
        "2",
        "--local-gpus",
        "3",
        "--device",
        "cpu",
        "--params-dtype",
        "float32",
        "--dry-run",
    ]
    assert run(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#   GPU")]
    assert lines == [
        "#   GPU 0 (bundle 0): actor rank 0 (0.4)",
        "#   GPU 1 (bundle 1): actor rank 1 (0.4)",
        "#   GPU 2 (bundle 2): embedded engine 0 (1)",
    ]


def test_dry_run_of_a_bad_config_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", *_tiny_inputs(tmp_path), "--global-batch-size", "7", "--dry-run"]
    assert run(argv) == 2
    assert "--global-batch-size" in capsys.readouterr().err


def test_eval_args_fields_all_default_to_the_run() -> None:
    # Every scoring setting of `eval` must fall back to the run's (None) so that a run is scored as trained.
    defaults = {f.name: f.default for f in dataclasses.fields(EvalArgs)}
    for name in (*EVAL_DEFAULTS, "custom_rm_path", "base"):
        assert defaults[name] is None, name
    assert SimpleNamespace(**defaults).seed == 1234


def test_export_writes_beside_the_runs_own_hf_folder_and_says_what_it_replaces(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`ppo-driver export RUN_DIR` never overwrites RUN_DIR/hf (the run's own export): it writes
    RUN_DIR/hf-rollout-K beside it; a folder it does replace (--out, or that same rollout's) is named."""
    from tandem.ppo.app.evaluate import export_folder

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert export_folder(str(run_dir), None, 7) == run_dir / "hf"
    assert not caplog.records
    (run_dir / "hf").mkdir()
    assert export_folder(str(run_dir), None, 7) == run_dir / "hf-rollout-7"
    (record,) = caplog.records
    assert record.getMessage() == (
        f"{run_dir / 'hf'} holds the run's own export: the actor of rollout 7 goes beside it, to "
        f"{run_dir / 'hf-rollout-7'}"
    )
    caplog.clear()
    (run_dir / "hf-rollout-7").mkdir()
    assert export_folder(str(run_dir), None, 7) == run_dir / "hf-rollout-7"
    assert [r.getMessage() for r in caplog.records][
        -1
    ] == f"replacing {run_dir / 'hf-rollout-7'} (a folder that exists)"
    caplog.clear()
    out = tmp_path / "exported"
    assert export_folder(str(run_dir), str(out), 7) == out and not caplog.records
    out.mkdir()
    assert export_folder(str(run_dir), str(out), 7) == out
    assert [r.getMessage() for r in caplog.records] == [f"replacing {out} (a folder that exists)"]
