"""`PPOConfig.validate`: every rule of a run's config, each refusal a ValueError naming the flag and the fix.

The driver's own rules are here (numbers, the placement plan, files, the trackers'
extras, how a rollout splits); the estimator's (`estimator_plan`), the reward
model's (`rollout.reward_model.check_reward_config`) and the teacher's
(`rollout.teacher.check_teacher_config`) live beside the code they serve. The train
workers' rules are `WorkerConfig`'s and run in that one place:
`check_workers` builds the run's `actor_config()` and `critic_config()` (which
checks their fields), asks each for its world, role and model checks, and renders
each refusal (a `FieldError`: the field, the message and the fields it mentions)
with flags for field names (`fields.flag`). The rules read the unchecked fields
(`RunFields`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.megatron.config import FieldError
from tandem.ppo.config.episode_fields import ENDPOINT_KEY_VARIABLE
from tandem.ppo.config.estimator_plan import check_estimator_plan
from tandem.ppo.config.fields import RunFields, flag
from tandem.ppo.rollout.model_folder import missing_folder
from tandem.ppo.rollout.reward_model import RM_TYPES, check_reward_config
from tandem.ppo.rollout.teacher import check_teacher_config

if TYPE_CHECKING:
    from tandem.megatron.choices import Role
    from tandem.megatron.config import WorkerConfig

__all__ = ["check_config", "check_trackers", "check_workers"]


def check_config(config: RunFields) -> None:
    """Check the whole config; a ValueError naming the flag and the fix otherwise."""
    _check_required(config)
    _check_driver_numbers(config)
    _check_plan(config)
    _check_memory_plan(config)
    check_estimator_plan(config)
    _check_files(config)
    _check_episodes(config)
    check_trackers(config)
    check_reward_config(config)
    check_teacher_config(config)
    check_workers(config)
    _check_split(config)


def check_workers(config: RunFields) -> None:
    """The train workers' rules (`WorkerConfig`'s) for this run, on both roles' configs; ValueError naming the flag."""
    try:
        actor = config.actor_config()
        critic = config.critic_config()
        roles: list[tuple[Role, WorkerConfig]] = [("actor", actor)]
        if critic is not None:
            roles.append(("critic", critic))
        for role, worker in roles:
            worker.check_world(config.actor_num_gpus, role=role)
        for role, worker in roles:
            worker.check_role(role)
            worker.check_model(role)
    except FieldError as exc:
        fields = {f.name for f in dataclasses.fields(config)}
        raise ValueError(exc.render(lambda name: flag(name) if name in fields else f"`{name}`")) from None


def check_trackers(config: RunFields) -> None:
    """ValueError naming `--use-wandb` / `--use-mlflow` when the tracker asked for is not installed
    (the extras `tandem-ppo-driver[wandb]`, `[mlflow]`; `run.trackers` imports them when asked)."""
    if config.use_wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            "--use-wandb: wandb is not installed; pip install 'tandem-ppo-driver[wandb]' (or wandb), "
            "or drop --use-wandb"
        )
    if config.use_mlflow and importlib.util.find_spec("mlflow") is None:
        raise ValueError(
            "--use-mlflow: MLflow is not installed; pip install 'tandem-ppo-driver[mlflow]' "
            "(or mlflow-skinny), or drop --use-mlflow"
        )


def _check_required(config: RunFields) -> None:
    if not config.hf_checkpoint:
        raise ValueError(
            "--hf-checkpoint: not set; point it at a Hugging Face model folder (config.json, "
            "safetensors, tokenizer)"
        )
    if not config.prompt_data:
        raise ValueError("--prompt-data: not set; point it at a JSONL file of prompts and labels")


def _check_driver_numbers(config: RunFields) -> None:
    positive = {
        "num_rollout": config.num_rollout,
        "max_prompt_len": config.max_prompt_len,
        "rollout_max_response_len": config.rollout_max_response_len,
        "actor_num_nodes": config.actor_num_nodes,
        "actor_num_gpus_per_node": config.actor_num_gpus_per_node,
        "n_samples_per_eval_prompt": config.n_samples_per_eval_prompt,
        "dynamic_sampling_max_rounds": config.dynamic_sampling_max_rounds,
    }
    for name, value in positive.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag(name)}: got {value!r}; it must be a positive integer")
    for name in ("rollout_num_gpus", "eval_interval", "save_interval", "local_gpus", "keep_checkpoints"):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{flag(name)}: got {value!r}; it must be a positive integer, or unset")
    if (
        isinstance(config.max_engine_restarts, bool)
        or not isinstance(config.max_engine_restarts, int)
        or (config.max_engine_restarts < 0)
    ):
        raise ValueError(
            f"--max-engine-restarts: got {config.max_engine_restarts!r}; it must be an integer >= 0 (0: never)"
        )
    if not 0 <= config.num_critic_only_steps <= config.num_rollout:
        raise ValueError(
            f"--num-critic-only-steps: got {config.num_critic_only_steps}; it must lie in "
            f"[0, --num-rollout = {config.num_rollout}]"
        )
    grace = config.sigterm_grace_s
    if grace is not None and not grace > 0:
        raise ValueError(f"--sigterm-grace-s: got {grace}; it must be a positive number of seconds, or unset")
    fraction = config.rollout_kv_cache_memory_fraction
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(
            f"--rollout-kv-cache-memory-fraction: got {fraction}; it must lie in (0, 1], or unset"
        )
    if config.dynamic_sampling and config.n_samples_per_prompt < 2:
        raise ValueError(
            "--dynamic-sampling: needs --n-samples-per-prompt of at least 2 (a prompt's samples are "
            "compared with each other)"
        )
    if not 0 < config.rollout_top_p <= 1:
        raise ValueError(f"--rollout-top-p: got {config.rollout_top_p}; it must lie in (0, 1]")
    if config.rollout_top_k == 0 or config.rollout_top_k < -1:
        raise ValueError(f"--rollout-top-k: got {config.rollout_top_k}; use a positive k, or -1 for off")
    if not config.eval_temperature >= 0:
        raise ValueError(f"--eval-temperature: got {config.eval_temperature}; it must be >= 0 (0: greedy)")
    for name in ("actor_gpu_share", "critic_gpu_share", "engine_gpu_share"):
        value = getattr(config, name)
        if not 0 < value <= 1:
            raise ValueError(f"{flag(name)}: got {value}; it must lie in (0, 1]")
    if config.rm_type not in RM_TYPES and config.custom_rm_path is None:
        raise ValueError(
            f"--rm-type: got {config.rm_type!r}; choose one of {', '.join(RM_TYPES)}, or give "
            "--custom-rm-path module:function"
        )


def _check_plan(config: RunFields) -> None:
    if config.use_critic and config.train_backend != "megatron":
        raise ValueError(
            f"--use-critic: the critic needs --train-backend megatron (got {config.train_backend!r})"
        )
    if config.use_critic and importlib.util.find_spec("megatron") is None:
        raise ValueError(
            "--use-critic: the critic trains with Megatron-core, which is not installed; "
            "pip install megatron-core (or tandem-megatron-backend), or pass --no-use-critic"
        )
    if (
        config.rollout_engine == "sglang"
        and not config.sglang_urls
        and importlib.util.find_spec("sglang") is None
    ):
        raise ValueError(
            "--rollout-engine: sglang is not installed; pip install 'tandem-ppo-driver[sglang]', "
            "give --sglang-urls of running servers, or use --rollout-engine embedded"
        )
    if config.sglang_urls and len(config.sglang_urls) != config.num_engines:
        raise ValueError(
            f"--sglang-urls: {len(config.sglang_urls)} URLs for {config.num_engines} rollout GPUs; give one "
            "URL per rollout GPU (--rollout-num-gpus)"
        )
    if config.lora_sync != "auto" and config.lora_rank is None:
        raise ValueError(
            f"--lora-sync: {config.lora_sync}, but --lora-rank is unset (the actor trains in full and sends "
            "its whole weights); set --lora-rank, or leave --lora-sync at auto"
        )
    if config.lora_sync == "adapters" and config.rollout_engine == "sglang":
        raise ValueError(
            "--lora-sync: adapters needs the embedded engine (it merges them into its base); SGLang servers "
            "get the merged weights: use --lora-sync merged or auto"
        )
    if config.rollout_kv_cache_backend == "torch_memory_saver" and (
        config.rollout_engine != "embedded" or config.device == "cpu"
    ):
        raise ValueError(
            "--rollout-kv-cache-backend: torch_memory_saver is the embedded engine's on CUDA (SGLang servers "
            f"manage their own; got --rollout-engine {config.rollout_engine}, --device {config.device}); use torch"
        )
    if config.weight_sync == "ipc" and not (config.colocate and config.num_engines == config.actor_num_gpus):
        raise ValueError(
            "--weight-sync: ipc needs each engine on an actor rank's GPU (--colocate, one engine per "
            "actor GPU); use --weight-sync auto or cpu"
        )
    if config.async_mode and config.colocate:
        raise ValueError(
            "--async: the next rollout is generated while the models train, so the engines need GPUs "
            "of their own; pass --no-colocate with --async (and --rollout-num-gpus)"
        )
    if config.colocate and config.num_engines != config.actor_num_gpus:
        raise ValueError(
            f"--rollout-num-gpus: {config.num_engines} with --colocate, but the actor has "
            f"{config.actor_num_gpus} GPUs; colocated engines sit one per training GPU, so leave "
            "--rollout-num-gpus unset (or pass --no-colocate)"
        )
    shares = config.actor_gpu_share + (config.critic_gpu_share if config.use_critic else 0.0)
    if config.colocate:
        shares += config.engine_gpu_share
    if shares > 1 + 1e-9:
        raise ValueError(
            f"--actor-gpu-share / --critic-gpu-share / --engine-gpu-share: they add up to {shares:g} of "
            "one GPU; lower them so that the roles sharing a GPU add up to at most 1"
        )


def _check_memory_plan(config: RunFields) -> None:
    for name in ("gpu_memory_gib", "memory_margin_gib"):
        value = getattr(config, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag(name)}: {value}; give a number of GiB >= 0")
    if config.gpu_memory_gib is not None and config.memory_margin_gib >= config.gpu_memory_gib:
        raise ValueError(
            f"--memory-margin-gib: {config.memory_margin_gib:g} GiB leaves nothing of --gpu-memory-gib "
            f"{config.gpu_memory_gib:g}; give a margin below the GPU's memory"
        )
    if not config.may_plan_memory:
        if config.memory_plan == "whole":
            moves = "moves whole roles one after the other already"
            wakes = "wakes each role as its turn begins already"
            fix = "use --memory-plan fit"
        else:  # auto, where it plans nothing
            where = (
                "with --no-offload-train (nothing sleeps)" if not config.offload_train else "on --device cpu"
            )
            moves = wakes = f"takes no plan {where}"
            fix = (
                "use --memory-plan fit with --gpu-memory-gib"
                if config.offload_train
                else "drop --no-offload-train"
            )
        if not config.overlap_moves:
            raise ValueError(
                f"--no-overlap-moves: set, but --memory-plan {config.memory_plan} {moves}; {fix}, or drop "
                "--no-overlap-moves"
            )
        if not config.prefetch_wakes:
            raise ValueError(
                f"--no-prefetch-wakes: set, but --memory-plan {config.memory_plan} {wakes}; {fix}, or drop "
                "--no-prefetch-wakes"
            )
    if config.memory_plan != "fit":  # auto plans where it can (`may_plan_memory`), and keeps whole elsewhere
        return
    if not config.offload_train:
        raise ValueError(
            "--memory-plan: fit chooses what the actor and the critic put to sleep, but --no-offload-train "
            "keeps them resident; drop --no-offload-train, or use --memory-plan whole"
        )
    if config.device == "cpu" and config.gpu_memory_gib is None:
        raise ValueError(
            "--memory-plan: fit on --device cpu needs the memory it may fill: give --gpu-memory-gib "
            "(there is no GPU allocator to ask)"
        )


def _check_files(config: RunFields) -> None:
    hf = Path(config.hf_checkpoint)
    if not hf.exists():
        raise missing_folder(config.hf_checkpoint, "--hf-checkpoint")
    if not (hf / "config.json").is_file():
        raise ValueError(
            f"--hf-checkpoint: {config.hf_checkpoint!r} is not a Hugging Face model folder (no "
            "config.json); point it at a folder written by save_pretrained"
        )
    for name in ("prompt_data", "eval_prompt_data"):
        path = getattr(config, name)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag(name)}: file {path!r} does not exist; fix the path")
    if config.eval_interval is not None and config.eval_prompt_data is None:
        raise ValueError("--eval-interval: set, but there is no --eval-prompt-data to evaluate on")
    if config.custom_rm_path is not None and ":" not in config.custom_rm_path:
        raise ValueError(
            f"--custom-rm-path: got {config.custom_rm_path!r}; write it as package.module:function or "
            "/path/to/file.py:function"
        )
    run_dir = Path(config.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir: {config.run_dir!r} is a file; it must be a folder (or not exist yet)")


def _check_episodes(config: RunFields) -> None:
    """The rules of a rollout of episodes (`--env-path`, `--custom-generate-function-path`)."""
    if config.env_path is not None and config.custom_generate_function_path is not None:
        raise ValueError(
            "--env-path and --custom-generate-function-path: give one; a custom generate function plays "
            "its episodes itself (with any environment it likes)"
        )
    for name in ("env_path", "custom_generate_function_path"):
        spec = getattr(config, name)
        if spec is not None and ":" not in spec:
            raise ValueError(
                f"{flag(name)}: got {spec!r}; write it as package.module:name or /path/to/file.py:name"
                + (" (or textarena:GameId)" if name == "env_path" else "")
            )
    if isinstance(config.max_turns, bool) or not isinstance(config.max_turns, int) or config.max_turns < 1:
        raise ValueError(f"--max-turns: got {config.max_turns!r}; it must be a positive integer")
    tokens = config.max_episode_tokens
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"--max-episode-tokens: got {tokens!r}; it must be a positive integer, or unset")
    for name in ("env_timeout", "tool_timeout"):
        value = getattr(config, name)
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"{flag(name)}: got {value!r}; it must be a positive number of seconds")
    failures = config.max_env_failures
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
        raise ValueError(f"--max-env-failures: got {failures!r}; it must be an integer >= 0")
    if not 0 <= config.endpoint_port <= 65535:
        raise ValueError(
            f"--endpoint-port: got {config.endpoint_port}; give a port in 0..65535 (0: a free one)"
        )
    if not config.plays_episodes:
        return
    given = [
        f
        for f, on in (
            ("--custom-rm-path", config.custom_rm_path is not None),
            ("--reward-weights", config.reward_weights is not None),
            ("--rm-type model", config.rm_type == "model"),
        )
        if on
    ]
    if given:
        which = "--env-path" if config.env_path is not None else "--custom-generate-function-path"
        raise ValueError(
            f"{' and '.join(given)}: with {which} the episodes' rewards come from the environment (or the "
            f"custom generate function); drop {' and '.join(given)}, or score inside the environment"
        )
    remote = config.custom_generate_function_path is not None and not _loopback(config.endpoint_host)
    if remote and not os.environ.get(ENDPOINT_KEY_VARIABLE):
        raise ValueError(
            f"--endpoint-host: {config.endpoint_host!r} is not the loopback, so the chat endpoint would be "
            f"reachable from elsewhere; set an API key in the environment variable {ENDPOINT_KEY_VARIABLE} "
            "(every request must carry it), or leave --endpoint-host at 127.0.0.1"
        )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_split(config: RunFields) -> None:
    samples = config.samples_per_rollout
    roles: tuple[Role, ...] = ("actor", "critic") if config.use_critic else ("actor",)
    for role in roles:
        dp = config.data_parallel_size(config.actor_num_gpus, role)
        if samples % dp:
            raise ValueError(
                f"--rollout-batch-size: a rollout's {samples} samples (rollout_batch_size * "
                f"n_samples_per_prompt) do not split evenly over the {role}'s {dp} data-parallel "
                f"ranks; make it a multiple of {dp}"
            )
