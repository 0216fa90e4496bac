"""A reward model that is not one, or reward flags that disagree, are refused before Ray starts, naming the flag."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tandem.ppo.config.file import unvalidated
from tandem.ppo.rollout.reward_model import read_reward_model_folder

from .conftest import save_reward_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The demo's tiny policy and data, reward models on its tokenizer, and broken reward-model folders."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from tandem.ppo import build_base_model, write_task
    from tandem.ppo._tiny import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("rm-input")
    policy = build_base_model(root / "policy")
    prompts, _ = write_task(root / "data")
    tokenizer = AutoTokenizer.from_pretrained(str(policy))
    shape = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, "eos_token_id": 2}

    def rm(name: str, **kwargs: Any) -> str:
        path = root / name
        save_reward_model(path, **{**shape, **kwargs})
        build_tiny_tokenizer(path)
        return str(path)

    out = {"policy": str(policy), "prompts": str(prompts), "run": str(root / "run"), "rm": rm("rm")}
    out["two_labels"] = rm("two-labels", num_labels=2)
    out["short"] = rm("short", max_position_embeddings=16)
    no_weights = Path(rm("no-weights"))
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    out["no_weights"] = str(no_weights)
    no_head = Path(rm("no-head"))
    weights = load_file(str(no_head / "model.safetensors"))
    save_file(
        {k: v for k, v in weights.items() if not k.startswith("score.")}, str(no_head / "model.safetensors")
    )
    out["no_head"] = str(no_head)
    other = Path(rm("other-tokenizer"))
    (other / "tokenizer.json").write_text(
        (other / "tokenizer.json").read_text().replace('"a": ', '"A": ')  # another vocabulary
    )
    out["other_tokenizer"] = str(other)
    no_template = Path(rm("no-template"))
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    out["no_template"] = str(no_template)
    return out


def values(folders: dict[str, str], **overrides: Any) -> dict[str, Any]:
    return {
        "hf_checkpoint": folders["policy"],
        "prompt_data": folders["prompts"],
        "run_dir": folders["run"],
        "rollout_batch_size": 4,
        "global_batch_size": 4,
        "max_prompt_len": 32,
        "rollout_max_response_len": 4,
        "device": "cpu",
        "params_dtype": "float32",
        "rm_type": "model",
        "reward_model": folders["rm"],
        **overrides,
    }


def test_a_reward_model_run_and_mixed_rewards_validate(folders: dict[str, str]) -> None:
    unvalidated(values(folders)).validate()
    unvalidated(
        values(
            folders,
            reward_weights="model=1.0,exact_match=0.5,custom=-0.25",
            custom_rm_path="tandem.ppo._demo:digit_reward",
        )
    ).validate()
    unvalidated(values(folders, reward_model_input="chat")).validate()
    # Rule rewards alone may be weighted too.
    unvalidated(
        values(folders, rm_type="exact_match", reward_model=None, reward_weights="exact_match=2,math=1")
    ).validate()


BAD: list[tuple[str, str, Callable[[dict[str, str]], dict[str, Any]]]] = [
    ("--reward-model", "not set", lambda f: {"reward_model": None}),
    ("--reward-model", "no readable config.json", lambda f: {"reward_model": f["rm"] + "-missing"}),
    ("--reward-model", "not a sequence-classification model", lambda f: {"reward_model": f["policy"]}),
    ("--reward-model", "2 labels", lambda f: {"reward_model": f["two_labels"]}),
    ("--reward-model", "no weights", lambda f: {"reward_model": f["no_weights"]}),
    ("--reward-model", "no `score.weight`", lambda f: {"reward_model": f["no_head"]}),
    (
        "--reward-model",
        "max_position_embeddings (16)",
        lambda f: {"reward_model": f["short"], "max_prompt_len": 16},
    ),
    ("--reward-model", "no reward uses it", lambda f: {"rm_type": "exact_match"}),
    ("--reward-model-input", "tokenizer of", lambda f: {"reward_model": f["other_tokenizer"]}),
    (
        "--reward-model-input",
        "no chat template",
        lambda f: {"reward_model": f["no_template"], "reward_model_input": "chat"},
    ),
    ("--reward-weights", "unknown term 'modle'", lambda f: {"reward_weights": "modle=1"}),
    ("--reward-weights", "not a number", lambda f: {"reward_weights": "model=high"}),
    ("--reward-weights", "given twice", lambda f: {"reward_weights": "model=1,model=2"}),
    ("--reward-weights", "every weight is 0", lambda f: {"reward_weights": "model=0"}),
    ("--reward-weights", "not NAME=WEIGHT", lambda f: {"reward_weights": "model"}),
    (
        "--reward-weights",
        "--rm-type is 'exact_match'",
        lambda f: {"rm_type": "exact_match", "reward_weights": "model=1"},
    ),
    ("--reward-weights", "--custom-rm-path is not set", lambda f: {"reward_weights": "model=1,custom=1"}),
    ("--rm-type", "not among the run's rewards", lambda f: {"reward_weights": "exact_match=1"}),
    (
        "--custom-rm-path",
        "no `custom` term",
        lambda f: {"reward_weights": "model=1", "custom_rm_path": "a.b:c"},
    ),
    ("--reward-model-gpu-share", "(0, 1)", lambda f: {"reward_model_gpu_share": 1.0}),
    (
        "--reward-model-max-tokens-per-gpu",
        "positive integer",
        lambda f: {"reward_model_max_tokens_per_gpu": 0},
    ),
    ("--hf-checkpoint", "sequence-classification model", lambda f: {"hf_checkpoint": f["rm"]}),
]


@pytest.mark.parametrize(("flag", "problem", "breaks"), BAD, ids=[f"{b[0]}:{b[1]}" for b in BAD])
def test_bad_reward_input_is_refused_naming_the_flag(
    folders: dict[str, str], flag: str, problem: str, breaks: Callable[[dict[str, str]], dict[str, Any]]
) -> None:
    with pytest.raises(ValueError) as info:
        unvalidated(values(folders, **breaks(folders))).validate()
    message = str(info.value)
    assert message.startswith(flag + ":") and problem in message, message


def test_the_command_exits_2_with_one_line_naming_the_flag(
    folders: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.ppo.app.cli import run

    argv = ["train", "--hf-checkpoint", folders["policy"], "--prompt-data", folders["prompts"]]
    argv += ["--run-dir", folders["run"], "--rm-type", "model", "--reward-model", folders["two_labels"]]
    assert run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ppo-driver train: error: --reward-model:"), err
    assert not Path(folders["run"]).exists()  # refused before anything was written


def test_the_folder_check_reads_num_labels_as_transformers_does(tmp_path: Path) -> None:
    # No num_labels and no id2label in config.json: transformers builds 2 labels.
    path = tmp_path / "rm"
    save_reward_model(path)
    config = json.loads((path / "config.json").read_text())
    config.pop("id2label", None), config.pop("label2id", None), config.pop("num_labels", None)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="2 labels"):
        read_reward_model_folder(path, "--reward-model")
    shutil.rmtree(path)
