"""Distillation flags that disagree, or a teacher that does not fit the student, are refused before Ray starts.

Each refusal is a ValueError that starts with the flag to fix and says how; the
command turns it into one line and exit 2 without starting Ray or writing the run
folder. A teacher on another tokenizer names both folders.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray

from tandem.ppo.config.file import unvalidated


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The demo's tiny student and data, a teacher on its tokenizer, and teachers that do not fit."""
    from tandem.ppo import build_base_model, write_task

    root = tmp_path_factory.mktemp("teacher-input")
    student = build_base_model(root / "student")
    prompts, _ = write_task(root / "data")
    teacher = build_base_model(root / "teacher", seed=1)
    out = {
        "student": str(student),
        "prompts": str(prompts),
        "run": str(root / "run"),
        "teacher": str(teacher),
    }

    def variant(name: str, change: Callable[[Path], None]) -> None:
        path = root / name
        shutil.copytree(teacher, path)
        change(path)
        out[name] = str(path)

    def edit_config(**fields: Any) -> Callable[[Path], None]:
        def change(path: Path) -> None:
            config = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**config, **fields}))

        return change

    def other_tokenizer(path: Path) -> None:
        file = path / "tokenizer.json"
        file.write_text(file.read_text().replace('"a": ', '"A": '))  # another vocabulary

    def no_tokenizer(path: Path) -> None:
        for file in path.glob("*token*"):
            file.unlink()
        (path / "chat_template.jinja").unlink(missing_ok=True)

    variant("other_tokenizer", other_tokenizer)
    variant("no_tokenizer", no_tokenizer)
    variant("classifier", edit_config(architectures=["LlamaForSequenceClassification"]))
    variant("short", edit_config(max_position_embeddings=16))
    variant("small_vocab", edit_config(vocab_size=10))
    return out


def values(folders: dict[str, str], **overrides: Any) -> dict[str, Any]:
    return {
        "hf_checkpoint": folders["student"],
        "prompt_data": folders["prompts"],
        "run_dir": folders["run"],
        "rollout_batch_size": 4,
        "global_batch_size": 4,
        "max_prompt_len": 32,
        "rollout_max_response_len": 4,
        "device": "cpu",
        "params_dtype": "float32",
        "teacher_hf_checkpoint": folders["teacher"],
        "opd_coef": 1.0,
        **overrides,
    }


def test_a_distillation_run_validates_alone_and_mixed(folders: dict[str, str]) -> None:
    # Alone: no reward, the teacher's signal only; mixed: beside a rule reward; as a loss with GRPO.
    unvalidated(values(folders, rm_type="none")).validate()
    unvalidated(values(folders)).validate()
    unvalidated(
        values(
            folders, advantage_estimator="grpo", n_samples_per_prompt=2, global_batch_size=8, opd_mode="loss"
        )
    ).validate()


BAD: list[tuple[str, str, str, Callable[[dict[str, str]], dict[str, Any]]]] = [
    (
        "--opd-coef",
        "--teacher-hf-checkpoint is not set",
        "or set --opd-coef 0",
        lambda f: {"teacher_hf_checkpoint": None},
    ),
    ("--teacher-hf-checkpoint", "--opd-coef is 0", "give --opd-coef", lambda f: {"opd_coef": 0.0}),
    (
        "--rm-type",
        "no teacher to learn from",
        "or choose a reward",
        lambda f: {"rm_type": "none", "teacher_hf_checkpoint": None, "opd_coef": 0.0},
    ),
    (
        "--teacher-hf-checkpoint",
        "is not the student's (--hf-checkpoint",
        "give a teacher on the student's tokenizer",
        lambda f: {"teacher_hf_checkpoint": f["other_tokenizer"]},
    ),
    (
        "--teacher-hf-checkpoint",
        "has no tokenizer",
        "save the tokenizer",
        lambda f: {"teacher_hf_checkpoint": f["no_tokenizer"]},
    ),
    (
        "--teacher-hf-checkpoint",
        "not a causal LM",
        "AutoModelForCausalLM",
        lambda f: {"teacher_hf_checkpoint": f["classifier"]},
    ),
    (
        "--teacher-hf-checkpoint",
        "max_position_embeddings (16)",
        "lower those",
        lambda f: {"teacher_hf_checkpoint": f["short"]},
    ),
    (
        "--teacher-hf-checkpoint",
        "10 rows of output head",
        "at least the student's vocabulary",
        lambda f: {"teacher_hf_checkpoint": f["small_vocab"]},
    ),
    (
        "--teacher-hf-checkpoint",
        "no readable config.json",
        "point it at",
        lambda f: {"teacher_hf_checkpoint": f["teacher"] + "-missing"},
    ),
    ("--teacher-gpu-share", "(0, 1)", "must lie in", lambda f: {"teacher_gpu_share": 1.0}),
    (
        "--teacher-max-tokens-per-gpu",
        "positive integer",
        "positive integer",
        lambda f: {"teacher_max_tokens_per_gpu": 0},
    ),
    (
        "--opd-mode",
        "--advantage-estimator grpo takes one reward per sample",
        "set --opd-mode to loss",
        lambda f: {"advantage_estimator": "grpo", "n_samples_per_prompt": 2, "global_batch_size": 8},
    ),
    ("--opd-coef", "it must be a finite number >= 0", ">= 0", lambda f: {"opd_coef": -1.0}),
    (
        "--opd-mode",
        "--opd-coef is 0",
        "leave --opd-mode unset",
        lambda f: {"opd_mode": "loss", "opd_coef": 0.0, "teacher_hf_checkpoint": None},
    ),
]


@pytest.mark.parametrize(("flag", "problem", "fix", "breaks"), BAD, ids=[f"{b[0]}:{b[1]}" for b in BAD])
def test_bad_distillation_input_is_refused_naming_the_flag_and_the_fix(
    folders: dict[str, str],
    flag: str,
    problem: str,
    fix: str,
    breaks: Callable[[dict[str, str]], dict[str, Any]],
) -> None:
    with pytest.raises(ValueError) as info:
        unvalidated(values(folders, **breaks(folders))).validate()
    message = str(info.value)
    assert message.startswith(flag + ":") and problem in message and fix in message, message


def test_a_teacher_on_another_tokenizer_names_both_folders(folders: dict[str, str]) -> None:
    with pytest.raises(ValueError) as info:
        unvalidated(values(folders, teacher_hf_checkpoint=folders["other_tokenizer"])).validate()
    message = str(info.value)
    assert folders["other_tokenizer"] in message and folders["student"] in message, message


@pytest.mark.parametrize(
    ("flags", "start"),
    [
        (["--opd-coef", "1.0"], "--opd-coef:"),
        (["--opd-coef", "1.0", "--teacher-hf-checkpoint", "other_tokenizer"], "--teacher-hf-checkpoint:"),
    ],
)
def test_the_command_exits_2_with_one_line_before_ray(
    folders: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    start: str,
) -> None:
    from tandem.ppo.app.cli import run

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("ray.init was called: the input was not refused before Ray started")

    monkeypatch.setattr(ray, "init", refuse)
    argv = ["train", "--hf-checkpoint", folders["student"], "--prompt-data", folders["prompts"]]
    argv += ["--run-dir", folders["run"], *[folders.get(f, f) for f in flags]]
    assert run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ppo-driver train: error: {start}"), err
    assert not Path(folders["run"]).exists()  # refused before anything was written


def test_every_node_must_see_the_teachers_folder(folders: dict[str, str], tmp_path: Path) -> None:
    from tandem.ppo.loop.node_checks import folders_to_check

    lock = tmp_path / "run.lock"
    lock.write_text("pid 1")
    checks = folders_to_check(unvalidated(values(folders)), lock)
    assert ("--teacher-hf-checkpoint", str(Path(folders["teacher"]) / "config.json"), None) in checks
    without = folders_to_check(unvalidated(values(folders, teacher_hf_checkpoint=None, opd_coef=0.0)), lock)
    assert [flag for flag, _, _ in without] == ["--hf-checkpoint", "--run-dir"]
