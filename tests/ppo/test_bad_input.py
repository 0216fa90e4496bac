"""Bad input to `ppo-driver train`: one line naming the field, file, line or flag and the fix, exit 2, before Ray.

Each case runs the command (`cli.run`, in this process) and checks what the user
sees: exactly one line on stderr (no traceback, nothing else), the exit status,
that Ray never started, and that the run folder is as it was (no stub folder, no
rewritten config.yaml). A few cases run the console script in a subprocess,
where the interpreter itself would print (a closed pipe).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import ray

from tandem.ppo.app.cli import run as cli
from tandem.ppo.config.file import parse_config

from .test_run_folder import finished_run, snapshot


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Hugging Face folder (weights, tokenizer), the demo's."""
    from tandem.ppo._demo import build_base_model

    return build_base_model(tmp_path_factory.mktemp("model") / "base")


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{d}+1", "label": str(d + 1)}) + "\n" for d in range(9)))
    return path


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case here must end before Ray starts: starting it fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("ray.init was called: the input was not refused before Ray started")

    monkeypatch.setattr(ray, "init", refuse)


def train(
    capsys: pytest.CaptureFixture[str], model: Path, prompts: Path, run_dir: Path, *flags: str
) -> tuple[int, str, str]:
    """`ppo-driver train` with the tiny model and `flags`; (status, stdout, stderr)."""
    argv = ["train", "--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--run-dir", str(run_dir)]
    status = cli(
        [*argv, "--device", "cpu", "--params-dtype", "float32", "--local-gpus", "1", "--no-progress", *flags]
    )
    out, err = capsys.readouterr()
    return status, out, err


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ppo-driver train: error: "), err
    return lines[0].removeprefix("ppo-driver train: error: ")


# --- YAML -----------------------------------------------------------------------------------------


def test_a_yaml_value_of_the_wrong_type_names_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path, prompts: Path
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("num_rollout: 2\ngamma: high\n")
    status, _, err = train(capsys, model, prompts, tmp_path / "run", "--config", str(config))
    assert status == 2
    assert one_line(err) == (
        f"--config {config}, line 2: gamma: got 'high'; it must be a number (as for --gamma); fix that value"
    )
    assert not (tmp_path / "run").exists()


def test_yaml_numbers_are_read_as_the_flags_read_them(tmp_path: Path, model: Path, prompts: Path) -> None:
    config = tmp_path / "run.yaml"
    # YAML 1.1 reads 1e-3 as a string, and "4" is a string.
    config.write_text(
        "lr: 1e-3\nnum_rollout: '4'\neval_interval: None\nrollout_stop_token_ids: [3, 5]\nasync: false\n"
    )
    argv = ["--config", str(config), "--hf-checkpoint", str(model), "--prompt-data", str(prompts)]
    parsed = parse_config(argv, validate=False)
    assert parsed.lr == 1e-3 and parsed.num_rollout == 4 and parsed.eval_interval is None
    assert parsed.rollout_stop_token_ids == (3, 5) and parsed.async_mode is False
    for text, match in (
        (
            "num_rollout: 2.5\n",
            r"line 1: num_rollout: got 2.5; it must be an integer \(as for --num-rollout\)",
        ),
        ("use_critic: maybe\n", r"use_critic: got 'maybe'; it must be true or false"),
        ("rollout_engine: vllm\n", r"rollout_engine: got 'vllm'; it must be one of 'embedded', 'sglang'"),
        ("rollout_stop_token_ids: 3\n", r"rollout_stop_token_ids: got 3; it must be a list"),
    ):
        config.write_text(text)
        with pytest.raises(ValueError, match=match):
            parse_config(argv, validate=False)


def test_a_config_file_that_is_not_utf8_is_named(tmp_path: Path, model: Path, prompts: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_bytes(b"lr: 0.001\nrun_dir: caf\xe9\n")
    with pytest.raises(ValueError, match=r"^--config: .*run.yaml' is not UTF-8 text"):
        parse_config(["--config", str(config)], validate=False)


# --- data files -----------------------------------------------------------------------------------


def test_prompts_without_labels_are_refused_under_a_label_reward(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path
) -> None:
    data = tmp_path / "nolabel.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{d}+1", "answer": str(d + 1)}) + "\n" for d in range(5)))
    status, _, err = train(capsys, model, data, tmp_path / "run")
    assert status == 2
    line = one_line(err)
    assert line.startswith(
        f"--prompt-data: {data}: 5 of its 5 prompts have no 'label' field (the first: prompt 1)"
    )
    assert "--rm-type exact_match compares each response with its label" in line and "--label-key" in line
    assert not (tmp_path / "run").exists()


def test_prompts_without_labels_under_a_custom_reward_warn_once_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tandem.ppo.rollout.data import PromptRecord
    from tandem.ppo.rollout.preflight import check_prompt_labels

    records = [PromptRecord(i, "p", None, None if i % 2 else "x") for i in range(6)]
    check_prompt_labels(records, "t.jsonl", reward="exact_match", custom=True, label_key="label")
    (record,) = caplog.records
    assert "3 of its 6 prompts have no 'label' field (the first: prompt 2)" in record.getMessage()


def test_a_non_utf8_byte_names_the_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path
) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"prompt": "1+1", "label": "2"}\n{"prompt": "caf\xe9", "label": "3"}\n')
    status, _, err = train(capsys, model, data, tmp_path / "run")
    assert status == 2
    assert one_line(err) == (
        f"--prompt-data: {data}, line 2: byte 0xe9 at column 16 is not UTF-8; save the file as UTF-8 text"
    )


def test_an_empty_prompt_names_the_flag_file_and_line_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path
) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in ("0+1", "", "2+1")))
    status, _, err = train(capsys, model, data, tmp_path / "run", "--no-apply-chat-template")
    assert status == 2
    assert one_line(err).startswith(f"--prompt-data: {data}, line 2: the prompt is empty (no tokens)")
    assert not (tmp_path / "run").exists()


def test_a_prompt_longer_than_the_models_context_names_the_flags_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path
) -> None:
    """The tiny model's context is 64 positions (max_position_embeddings); --max-prompt-len 100 keeps a
    70-token prompt that no engine could take."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in ("0+1", "1" * 70)))
    status, _, err = train(
        capsys, model, data, tmp_path / "run", "--max-prompt-len", "100", "--no-apply-chat-template",
        "--rollout-max-response-len", "2",
    )  # fmt: skip
    assert status == 2
    line = one_line(err)
    assert line.startswith(
        f"--max-prompt-len: {data}, line 2: the prompt has 70 tokens, but the model's context is 64 "
        f"(max_position_embeddings in {model / 'config.json'})"
    )
    assert "lower --max-prompt-len to at most 62" in line and "--rollout-max-response-len 2" in line
    assert not (tmp_path / "run").exists()


def test_dropped_prompts_are_said_once_with_the_count_and_the_flag(
    tmp_path: Path, model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tandem.ppo.config import PPOConfig
    from tandem.ppo.rollout.preflight import read_inputs

    data = tmp_path / "p.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in ("0+1", "9" * 20, "8" * 30, "1"))
    )
    config = PPOConfig(
        hf_checkpoint=str(model), prompt_data=str(data), max_prompt_len=10, apply_chat_template=False
    )
    inputs = read_inputs(config)
    assert inputs.dataset.num_dropped == 2
    (record,) = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert record.getMessage() == (
        f"--prompt-data: {data}: 2 of its 4 prompts are longer than --max-prompt-len 10 tokens and are "
        f"dropped (the first: {data}, line 2, 20 tokens); raise --max-prompt-len to keep them"
    )


# --- model folders ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("removed", "expected"),
    [
        ("*.safetensors", "has a config.json but no weights"),
        ("tokenizer*", "has no tokenizer"),
    ],
)
def test_a_model_folder_without_weights_or_tokenizer_is_refused_before_ray(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: Path,
    prompts: Path,
    removed: str,
    expected: str,
) -> None:
    broken = tmp_path / "model"
    shutil.copytree(model, broken)
    for path in broken.glob(removed):
        path.unlink()
    status, _, err = train(capsys, broken, prompts, tmp_path / "run")
    assert status == 2
    line = one_line(err)
    assert line.startswith(f"--hf-checkpoint: '{broken}' {expected}")
    assert "install sentencepiece" not in line  # the misleading hint transformers gives


# --- the algorithms' flags --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "start", "fix"),
    [
        (("--critic-updates-per-step", "0"), "--critic-updates-per-step: got 0", "positive integer"),
        (("--length-adaptive-gae-alpha", "0"), "--length-adaptive-gae-alpha: got 0.0", "finite number > 0"),
        (("--length-adaptive-gae-alpha", "-0.05"), "--length-adaptive-gae-alpha: got -0.05", "VAPO's 0.05"),
        (
            ("--loss-type", "cispo", "--eps-clip-c", "3"),
            "--eps-clip-c: 3.0 is PPO's dual clip",
            "unset --eps-clip-c, or use --loss-type ppo",
        ),
        (
            (
                "--advantage-estimator",
                "grpo",
                "--n-samples-per-prompt",
                "2",
                "--critic-updates-per-step",
                "2",
            ),
            "--critic-updates-per-step: set, but --advantage-estimator grpo trains no critic",
            "use --advantage-estimator gae",
        ),
        (
            ("--memory-plan", "fit", "--no-offload-train"),
            "--memory-plan: fit chooses what the actor and the critic put to sleep",
            "drop --no-offload-train, or use --memory-plan whole",
        ),
        (("--memory-plan", "fit"), "--memory-plan: fit on --device cpu needs", "give --gpu-memory-gib"),
        (("--optimizer-pieces", "0"), "--optimizer-pieces: got 0", "give a whole number from 1 to 64"),
        (
            ("--optimizer-pieces", "2", "--offload-backend", "torch_memory_saver", "--device", "cuda"),
            "--optimizer-pieces: 2 splits the pinned_host backend's optimizer tags",
            "use offload_backend pinned_host, or leave it unset",
        ),
        (
            ("--memory-plan", "whole", "--no-overlap-moves"),
            "--no-overlap-moves: set, but --memory-plan whole moves whole roles",
            "use --memory-plan fit, or drop --no-overlap-moves",
        ),
        (
            ("--memory-plan", "whole", "--no-prefetch-wakes"),
            "--no-prefetch-wakes: set, but --memory-plan whole wakes each role as its turn begins",
            "use --memory-plan fit, or drop --no-prefetch-wakes",
        ),
        (  # the default, auto, plans nothing on the CPU (the command's --device cpu on this machine)
            ("--no-overlap-moves",),
            "--no-overlap-moves: set, but --memory-plan auto takes no plan on --device cpu",
            "use --memory-plan fit with --gpu-memory-gib, or drop --no-overlap-moves",
        ),
        (
            ("--no-prefetch-wakes", "--no-offload-train"),
            "--no-prefetch-wakes: set, but --memory-plan auto takes no plan with --no-offload-train",
            "drop --no-offload-train, or drop --no-prefetch-wakes",
        ),
        (
            ("--gpu-memory-gib", "8", "--memory-margin-gib", "8"),
            "--memory-margin-gib: 8 GiB leaves nothing of --gpu-memory-gib 8",
            "give a margin below the GPU's memory",
        ),
        (("--gpu-memory-gib", "-1"), "--gpu-memory-gib: -1.0", "give a number of GiB >= 0"),
        (
            ("--rollout-kv-cache-backend", "torch_memory_saver"),
            "--rollout-kv-cache-backend: torch_memory_saver is the embedded engine's on CUDA",
            "--device cpu); use torch",
        ),
        (
            ("--use-sequence-packing", "--packed-attention", "varlen"),
            "--packed-attention: 'varlen' is flash attention, CUDA with bfloat16 or float16 only",
            "use 'blocks' there",
        ),
    ],
)
def test_the_algorithms_flags_are_refused_before_ray_naming_the_flag_and_the_fix(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: Path,
    prompts: Path,
    flags: tuple[str, ...],
    start: str,
    fix: str,
) -> None:
    status, _, err = train(capsys, model, prompts, tmp_path / "run", "--rollout-batch-size", "4", *flags)
    assert status == 2
    line = one_line(err)
    assert line.startswith(start), line
    assert fix in line, line
    assert not (tmp_path / "run").exists()  # nothing written


# --- the reward function ----------------------------------------------------------------------------


def test_a_reward_with_the_wrong_signature_is_refused_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path, prompts: Path
) -> None:
    reward = tmp_path / "my_reward.py"
    reward.write_text("def reward(prompt, response):\n    return 1.0\n")
    status, _, err = train(capsys, model, prompts, tmp_path / "run", "--custom-rm-path", f"{reward}:reward")
    assert status == 2
    assert one_line(err) == (
        f"--custom-rm-path '{reward}:reward': the function's signature is reward(prompt, response), but a reward "
        "takes one argument, the list of samples; write it as def reward(samples: list[RewardInput]) -> "
        "list[float] (async def works too)"
    )


def test_a_reward_that_fails_is_one_line_and_exit_2() -> None:
    from tandem.ppo.rollout.rewards import RewardError, RewardInput, compute_rewards
    from tandem.ppo.run.errors import failure_line

    inputs = [RewardInput("p", "r", "l", index=i) for i in range(3)]
    for fn, expected in (
        (lambda s: [None] * len(s), "returned None for sample 0"),
        (lambda s: [float("nan")] * len(s), "returned nan for sample 0"),
        (lambda s: ["1.0"] * len(s), "returned '1.0' for sample 0"),
        (lambda s: [1.0], "returned 1 rewards for 3 samples"),
        (lambda s: 1 / 0, "raised on sample 0"),
    ):
        with pytest.raises(RewardError) as info:
            compute_rewards(fn, inputs)
        failure = failure_line(info.value)
        assert failure is not None and failure[0] == 2 and "\n" not in failure[1]
        assert expected in failure[1]


# --- Ray and the terminal -----------------------------------------------------------------------------


def test_a_ray_address_where_nothing_answers_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path, prompts: Path
) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    status, _, err = train(capsys, model, prompts, tmp_path / "run", "--ray-address", f"127.0.0.1:{port}")
    assert status == 2
    line = one_line(err)
    assert line.startswith(f"--ray-address: nothing answers at 127.0.0.1:{port} (Connection refused)")
    assert f"ray start --head --port {port}" in line
    assert not (tmp_path / "run").exists()


def test_a_ray_address_where_another_server_answers_names_the_gcs_port(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: Path,
    prompts: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An HTTP server (as Ray's dashboard at 8265) answers, but not as Ray's GCS: refused at once (`ray.init`
    retried there for more than 10 minutes); a port that accepts and never answers is refused once the
    check's timeout (shortened here) has passed."""
    import http.server
    import socket
    import threading

    from tandem.ppo.loop import cluster

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        status, _, err = train(capsys, model, prompts, tmp_path / "run", "--ray-address", f"127.0.0.1:{port}")
    finally:
        server.shutdown()
        server.server_close()
    assert status == 2
    line = one_line(err)
    assert line.startswith(f"--ray-address: 127.0.0.1:{port} answers, but not as Ray's GCS (it speaks HTTP/1")
    assert "port 6379 unless `ray start --head --port` chose another" in line
    assert not (tmp_path / "run").exists()

    monkeypatch.setattr(cluster, "RAY_ADDRESS_TIMEOUT_S", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        status, _, err = train(capsys, model, prompts, tmp_path / "run", "--ray-address", f"127.0.0.1:{port}")
    assert status == 2
    assert one_line(err).startswith(
        f"--ray-address: 127.0.0.1:{port} accepts connections but does not answer as Ray's GCS within 0.5 s"
    )


@pytest.mark.parametrize("command", ["demo", "train"])
def test_help_into_a_closed_pipe_prints_nothing_else(command: str) -> None:
    # The reader is gone before the help is written (as with `| head` once head has its line).
    with subprocess.Popen(
        [sys.executable, "-m", "tandem.ppo.app.cli", command, "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=300)
    assert err == ""
    assert proc.returncode == 141


# --- the run folder -----------------------------------------------------------------------------------


def test_a_run_folder_in_use_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path, prompts: Path
) -> None:
    from tandem.ppo.run.lock import RunLock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = RunLock.acquire(run_dir)  # another run (a second open file: refused as another process is)
    try:
        status, _, err = train(capsys, model, prompts, run_dir)
    finally:
        holder.release()
    assert status == 2
    assert one_line(err).startswith(f"--run-dir: {run_dir} is in use by another run, pid ")


def _finished(tmp_path: Path, model: Path, prompts: Path) -> Path:
    run_dir = tmp_path / "run"
    finished_run(
        run_dir, model, 2, prompt_data=str(prompts), device="cpu", params_dtype="float32", local_gpus=1
    )
    return run_dir


def test_a_finished_run_started_again_is_complete_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path, prompts: Path
) -> None:
    run_dir = _finished(tmp_path, model, prompts)
    before = snapshot(run_dir)
    status, out, err = train(capsys, model, prompts, run_dir, "--num-rollout", "2", "--no-export-hf")
    assert status == 0, err
    assert out.splitlines()[0].startswith(
        f"run complete: {run_dir} holds every rollout (0..1); nothing to do"
    )
    assert snapshot(run_dir) == before


def test_resuming_with_a_changed_lr_is_refused_before_ray_and_the_folder_is_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path, prompts: Path
) -> None:
    run_dir = _finished(tmp_path, model, prompts)
    before = snapshot(run_dir)
    status, _, err = train(
        capsys, model, prompts, run_dir, "--num-rollout", "4", "--lr", "0.5", "--no-export-hf"
    )
    assert status == 2
    line = one_line(err)
    assert line.startswith(
        f"--lr: cannot change when resuming {run_dir} after rollout 1: --lr was 1e-06, now 0.5"
    )
    assert "These may change on resume: the run length (--num-rollout)" in line
    assert snapshot(run_dir) == before


def test_a_bad_data_path_never_reaches_a_finished_runs_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path, prompts: Path
) -> None:
    run_dir = _finished(tmp_path, model, prompts)
    before = snapshot(run_dir)
    status, _, err = train(capsys, model, tmp_path / "missing.jsonl", run_dir, "--num-rollout", "3")
    assert status == 2
    assert one_line(err).startswith("--prompt-data: file ")
    assert snapshot(run_dir) == before


# --- LoRA -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--lora-rank", "0"], "--lora-rank: got 0; it must be a positive integer"),
        (["--critic-lora-rank", "-1"], "--critic-lora-rank: got -1; it must be a positive integer"),
        (["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha: got 0.0; it must be a finite number > 0"),
        (
            ["--lora-rank", "8", "--lora-target-modules", "q_proj", "c_attn"],
            "--lora-target-modules: 'c_attn' is not a linear layer of this model; it has q_proj, k_proj, "
            "v_proj, o_proj, gate_proj, up_proj, down_proj",
        ),
        (["--critic-lora-alpha", "4"], "--critic-lora-alpha: set, but --critic-lora-rank is unset"),
        (["--lora-rank", "8", "--lora-dropout", "1.0"], "--lora-dropout: got 1.0; it must lie in [0, 1)"),
        (
            ["--lora-rank", "8", "--lora-dropout", "0.1", "--reuse-old-log-probs", "True"],
            "--reuse-old-log-probs: the old log-probs are not the update's own here: lora_dropout",
        ),
        (["--lora-sync", "adapters"], "--lora-sync: adapters, but --lora-rank is unset"),
        (
            [
                "--lora-rank",
                "8",
                "--lora-sync",
                "adapters",
                "--rollout-engine",
                "sglang",
                "--sglang-urls",
                "http://127.0.0.1:9",
            ],
            "--lora-sync: adapters needs the embedded engine",
        ),
    ],
)
def test_lora_flags_that_cannot_work_are_refused_before_ray_naming_the_flag(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: Path,
    prompts: Path,
    flags: list[str],
    expected: str,
) -> None:
    status, _, err = train(capsys, model, prompts, tmp_path / "run", *flags)
    assert status == 2
    assert one_line(err).startswith(expected), err
    assert not (tmp_path / "run").exists()


def test_a_lora_actor_takes_no_other_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path, prompts: Path
) -> None:
    """Its reference is its base with the adapters off: another --ref-load is refused before Ray."""
    other = shutil.copytree(model, tmp_path / "other")
    status, _, err = train(
        capsys, model, prompts, tmp_path / "run", "--lora-rank", "8", "--ref-load", str(other)
    )
    assert status == 2
    assert one_line(err).startswith(
        f"--ref-load: {str(other)!r} with --lora-rank; a LoRA actor's reference"
    ), err
    assert not (tmp_path / "run").exists()
