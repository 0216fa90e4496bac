"""The `ppo-driver` command line: subcommands, --version, one-line errors naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.ppo.app.cli import COMMANDS, run


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    flat = " ".join(text.split())
    for name in ("train", "demo", "eval", "export", "plot"):
        assert f"{name} {COMMANDS[name][1]}" in flat, name


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.ppo import __version__

    with pytest.raises(SystemExit):
        run(["--version"])
    assert __version__ in capsys.readouterr().out


def test_bad_value_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    status = run(["demo", "--run-dir", str(tmp_path), "--global-batch-size", "7"])
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--global-batch-size" in err and "Traceback" not in err


def test_demo_flags_have_no_args_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run(["demo", "--help"])
    text = capsys.readouterr().out
    assert "--num-rollout" in text and "--args." not in text


def test_missing_file_is_refused_by_flag(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    status = run(["train", "--hf-checkpoint", str(tmp_path), "--prompt-data", "/no/such.jsonl"])
    assert status == 2
    err = capsys.readouterr().err
    assert "--hf-checkpoint" in err or "--prompt-data" in err


def test_demo_model_must_be_known(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    assert run(["demo", "--model", "gpt-17", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--model: got 'gpt-17'; choose one of tiny, smollm2" in err


def test_the_lora_demo_gets_a_model_its_adapters_can_answer_with(tmp_path: Path) -> None:
    """`--lora-rank` gives the demo its LoRA model (the output layer's init times `LORA_HEAD_SCALE`, in a
    folder of its own) and a larger entropy bonus, unless the flags give another."""
    from safetensors.torch import load_file

    from tandem.ppo._demo import DEMO_DEFAULTS, LORA_DEMO_DEFAULTS, LORA_HEAD_SCALE, prepare_demo

    full = prepare_demo({**DEMO_DEFAULTS, "run_dir": str(tmp_path)})
    lora = prepare_demo({**DEMO_DEFAULTS, "run_dir": str(tmp_path), "lora_rank": 8})
    assert (lora["entropy_coef"], full["entropy_coef"]) == (LORA_DEMO_DEFAULTS["entropy_coef"], 0.003)
    assert Path(lora["hf_checkpoint"]) == tmp_path / "base-lora"
    heads = [
        load_file(str(Path(c["hf_checkpoint"]) / "model.safetensors"))["lm_head.weight"] for c in (full, lora)
    ]
    assert torch.equal(heads[1], heads[0] * LORA_HEAD_SCALE)  # the same seed: the same model but its head
    given = prepare_demo({**DEMO_DEFAULTS, "run_dir": str(tmp_path), "lora_rank": 8, "entropy_coef": 0.0})
    assert given["entropy_coef"] == 0.0


def test_demo_dry_run_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model and the task are built in a scratch folder to validate the config, which then names
    where a run writes them; SmolLM2 is validated only from the cache, never fetched by a dry run."""
    run_dir = tmp_path / "demo"
    assert run(["demo", "--dry-run", "--run-dir", str(run_dir)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "\nhf_checkpoint: ./base\n" in out and "\nprompt_data: ./data/train.jsonl\n" in out  # RUN_DIR's
    assert "# dry run: config valid" in out
    assert not run_dir.exists()
    # The multi-turn task the same way.
    assert run(["demo", "--task", "recall", "--dry-run", "--run-dir", str(run_dir)]) == 0, (
        capsys.readouterr().err
    )
    out = capsys.readouterr().out
    assert "\nprompt_data: ./data/recall.jsonl\n" in out and "# dry run: config valid" in out
    assert not run_dir.exists()

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    assert run(["demo", "--model", "smollm2", "--dry-run", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "--dry-run: SmolLM2-135M-Instruct is not in the cache yet" in err
    assert "ppo-driver fetch-model smollm2" in err
    assert not run_dir.exists() and not (tmp_path / "cache").exists()
