"""`ppo-driver eval` and `ppo-driver export`: a saved actor on an eval set, and a checkpoint as an HF folder.

`eval` also says how far the model's weights are from its base (`--base`, or a run dir's own
`--hf-checkpoint`): `policy/changed_fraction_since_start`, the share of weight elements that differ
in the dtype the engine samples in (`weights_changed`), as the run's weight syncs count it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from tandem.megatron.group import create_train_group
from tandem.megatron.runtime.checkpoint_folder import iteration_dir, read_latest
from tandem.megatron.runtime.checkpoint_manifest import verify_checkpoint
from tandem.placement import PlacementSpec, create_placement_groups
from tandem.ppo.app.machine import adapt_to_machine, announce, eval_local_gpus
from tandem.ppo.config.file import read_run_config
from tandem.ppo.config.hub import resolve_model_path
from tandem.ppo.config.record import RUN_CONFIG_FILE
from tandem.ppo.engines import SamplingParams, create_engine_group
from tandem.ppo.loop.cluster import start_ray
from tandem.ppo.rollout.data import PromptDataset, read_prompts
from tandem.ppo.rollout.episodes.generation import generate_episodes
from tandem.ppo.rollout.model_folder import missing_folder
from tandem.ppo.rollout.preflight import episode_setup
from tandem.ppo.rollout.rewards import load_reward
from tandem.ppo.rollout.samples import generate_rollout
from tandem.ppo.run.export import export_actor


def resolve_model_dir(model: str) -> Path:
    """A Hugging Face folder, a run dir's `hf/`, or a hub id's snapshot (as `train --hf-checkpoint` resolves
    it); ValueError naming MODEL otherwise."""
    path = Path(resolve_model_path(model, flag="MODEL"))
    if not path.exists():
        raise missing_folder(model, "MODEL")
    for candidate in (path, path / "hf"):
        if (candidate / "config.json").is_file():
            return candidate
    raise ValueError(
        f"MODEL: {model!r} is neither a Hugging Face folder nor a run dir with hf/; pass a folder with "
        "config.json (a finished run writes RUN_DIR/hf; `ppo-driver export RUN_DIR` writes one from a checkpoint)"
    )


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What `ppo-driver eval` samples and scores with: the run's own settings, unless flags override them."""

    reward: str
    """The reward spec (`--custom-rm-path`, else `--rm-type`)."""
    max_response_len: int
    max_prompt_len: int
    temperature: float
    n_samples_per_prompt: int
    accuracy_threshold: float
    apply_chat_template: bool
    input_key: str = "prompt"
    label_key: str = "label"
    stop_token_ids: tuple[int, ...] = ()
    source: str = "defaults"
    """Where the settings that no flag gave come from: `RUN_DIR/config.yaml`, or the defaults."""
    episodes_of: Any = None
    """The run's config when its rollouts are episodes (`--env-path`, `--custom-generate-function-path`):
    the eval plays them as the run did, scored by the environment."""
    base: str | None = None
    """The folder the weights are compared with (`--base`, else the run's `--hf-checkpoint`); None: none."""
    dtype: str = "auto"
    """The engine's dtype (the run's `--rollout-dtype`): the weights compare in it."""


EVAL_DEFAULTS = {
    "rm_type": "exact_match",
    "max_response_len": 128,
    "max_prompt_len": 512,
    "temperature": 0.0,
    "n_samples_per_prompt": 1,
    "accuracy_threshold": 1.0,
    "apply_chat_template": True,
}
"""What `ppo-driver eval` uses for a bare Hugging Face folder (no run config to read)."""


def eval_settings(args: Any) -> EvalSettings:
    """`args`' flags over the run's config.yaml (when MODEL is a run folder) over `EVAL_DEFAULTS`."""

    run_file = Path(args.model) / RUN_CONFIG_FILE
    base: dict[str, Any] = dict(EVAL_DEFAULTS)
    keys: dict[str, Any] = {}
    source = "defaults"
    base_model: str | None = args.base
    if base_model is not None and not (Path(base_model) / "config.json").is_file():
        raise ValueError(
            f"--base: {base_model!r} is not a Hugging Face folder (no config.json); fix the path"
        )
    if run_file.is_file():
        run = read_run_config(args.model, flag="MODEL")
        base = {
            "rm_type": run.rm_type,
            "custom_rm_path": run.custom_rm_path,
            "max_response_len": run.rollout_max_response_len,
            "max_prompt_len": run.max_prompt_len,
            "temperature": run.eval_temperature,
            "n_samples_per_prompt": run.n_samples_per_eval_prompt,
            "accuracy_threshold": run.accuracy_threshold,
            "apply_chat_template": run.apply_chat_template,
        }
        keys = {
            "input_key": run.input_key,
            "label_key": run.label_key,
            "stop_token_ids": tuple(run.rollout_stop_token_ids),
            "dtype": run.rollout_dtype,
        }
        source = str(run_file)
        if run.plays_episodes:
            keys["episodes_of"] = run
        if base_model is None and run.hf_checkpoint and (Path(run.hf_checkpoint) / "config.json").is_file():
            base_model = run.hf_checkpoint  # the run's own start, where it still is
    given = {k: getattr(args, k) for k in (*EVAL_DEFAULTS, "custom_rm_path") if getattr(args, k) is not None}
    if "rm_type" in given and "custom_rm_path" not in given:
        base["custom_rm_path"] = None  # --rm-type given: the built-in, not the run's own reward
    merged = {**base, **given}
    episodes_of = keys.get("episodes_of")
    reward = merged.get("custom_rm_path") or merged["rm_type"]
    if episodes_of is not None:
        reward = f"the environment of {episodes_of.env_path or episodes_of.custom_generate_function_path}"
    return EvalSettings(
        reward=reward,
        max_response_len=merged["max_response_len"],
        max_prompt_len=merged["max_prompt_len"],
        temperature=merged["temperature"],
        n_samples_per_prompt=merged["n_samples_per_prompt"],
        accuracy_threshold=merged["accuracy_threshold"],
        apply_chat_template=merged["apply_chat_template"],
        source=source,
        base=base_model,
        **keys,
    )


def weights_changed(model_dir: str | Path, base_dir: str | Path, dtype: str = "auto") -> tuple[int, int]:
    """(elements that differ, elements compared) between two Hugging Face folders' safetensors weights,
    each tensor present in both compared bit for bit in `dtype` (auto: bfloat16 where CUDA is, as the
    engine samples; else float32). ValueError naming `--base` when they share no tensor."""
    import torch
    from safetensors import safe_open

    if dtype == "auto":
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    as_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    as_bits = torch.int32 if as_dtype == torch.float32 else torch.int16

    def files(folder: str | Path) -> dict[str, Path]:
        return {
            name: path
            for path in sorted(Path(folder).glob("*.safetensors"))
            for name in safe_open(str(path), "pt").keys()  # noqa: SIM118 (a safetensors handle is no dict)
        }

    ours, theirs = files(model_dir), files(base_dir)
    common = sorted(ours.keys() & theirs.keys())
    if not common:
        raise ValueError(
            f"--base: {base_dir} holds none of the weights of {model_dir} (safetensors names); give the model's "
            "own base folder"
        )
    changed = elements = 0
    for name in common:
        with safe_open(str(ours[name]), "pt") as a, safe_open(str(theirs[name]), "pt") as b:
            mine, base = a.get_tensor(name), b.get_tensor(name)
        if mine.shape != base.shape or not mine.is_floating_point():
            continue
        changed += int((mine.to(as_dtype).view(as_bits) != base.to(as_dtype).view(as_bits)).sum())
        elements += mine.numel()
    return changed, elements


def evaluate_model(args: Any) -> dict[str, float]:
    """Sample responses for every prompt of `args.data` with the model, score them; the eval metrics."""
    import ray
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(args.model)
    if not Path(args.data).is_file():
        raise ValueError(f"--data: file {args.data!r} does not exist; fix the path")
    settings = eval_settings(args)
    # The name its lines show on the terminal, kept from before the layers.
    logging.getLogger("tandem.ppo.evaluate").info(
        "eval of %s: reward %s, %d tokens per response, temperature %g (settings from %s, flags over them)",
        model_dir,
        settings.reward,
        settings.max_response_len,
        settings.temperature,
        settings.source,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    episodes = None if settings.episodes_of is None else episode_setup(settings.episodes_of, tokenizer)
    reward_fn = load_reward(settings.reward) if episodes is None else None
    dataset = PromptDataset(
        read_prompts(args.data, prompt_key=settings.input_key, label_key=settings.label_key),
        tokenizer,
        max_prompt_len=settings.max_prompt_len,
        seed=args.seed,
        apply_chat_template=settings.apply_chat_template,
    )
    started = start_ray(None, eval_local_gpus(args.local_gpus))
    try:
        spec = PlacementSpec(actor_num_gpus_per_node=1, rollout_num_gpus=1, debug_rollout_only=True)
        with create_placement_groups(spec) as placements:
            slot = placements.rollout
            engines = create_engine_group(
                str(model_dir), slot.pg, slot.bundle_indices, num_gpus_per_engine=1.0
            )
            try:
                eos = tokenizer.eos_token_id
                stops = tuple(dict.fromkeys((*settings.stop_token_ids, *(() if eos is None else (eos,)))))
                params = SamplingParams(
                    max_new_tokens=settings.max_response_len,
                    temperature=settings.temperature,
                    stop_token_ids=stops,
                    seed=args.seed,
                )
                prompts = dataset.next_batch(len(dataset))
                if episodes is not None:  # played as the run played them, scored by the environment
                    limits = dataclasses.replace(episodes.limits, max_context=engines.max_context_len)
                    rollout = generate_episodes(
                        engines,
                        prompts,
                        n_samples_per_prompt=settings.n_samples_per_prompt,
                        params=params,
                        tokenizer=tokenizer,
                        setup=dataclasses.replace(episodes, limits=limits),
                        label="eval",
                    )
                else:
                    assert reward_fn is not None
                    rollout = generate_rollout(
                        engines,
                        prompts,
                        n_samples_per_prompt=settings.n_samples_per_prompt,
                        params=params,
                        tokenizer=tokenizer,
                        reward_fn=reward_fn,
                    )
            finally:
                engines.shutdown()
        metrics = rollout.metrics(
            accuracy_threshold=settings.accuracy_threshold,
            prefix="eval",
            n_samples_per_prompt=settings.n_samples_per_prompt,
        )
        metrics["eval/dropped_prompts"] = float(dataset.num_dropped)
        if settings.base is not None:
            changed, elements = weights_changed(model_dir, settings.base, settings.dtype)
            metrics["policy/changed_fraction_since_start"] = changed / elements
        return metrics
    finally:
        if started:
            ray.shutdown()


def export_folder(run_dir: str, out: str | None, rollout_id: int) -> Path:
    """Where `ppo-driver export` writes the actor of `rollout_id`, said in a log line where it is not RUN_DIR/hf.

    `out` None: RUN_DIR/hf, unless that exists (the run's own export, never overwritten): then
    RUN_DIR/hf-rollout-K beside it. A folder that exists and is replaced (`out`, or that same
    rollout's folder again) is named.
    """
    log = logging.getLogger("tandem.ppo.evaluate")  # the name its lines show, as for eval's
    folder = Path(out) if out is not None else Path(run_dir) / "hf"
    if out is None and folder.exists():
        beside = folder.with_name(f"hf-rollout-{rollout_id}")
        log.warning(
            "%s holds the run's own export: the actor of rollout %d goes beside it, to %s",
            folder,
            rollout_id,
            beside,
        )
        folder = beside
    if folder.exists():
        log.warning("replacing %s (a folder that exists)", folder)
    return folder


def export_run(run_dir: str, out: str | None = None) -> str:
    """Load the run's latest actor checkpoint and write it as a Hugging Face folder (`export_folder`); its path."""
    import ray

    config, changes = adapt_to_machine(read_run_config(run_dir))
    announce(changes)
    latest = read_latest(config.actor_save)
    if latest is None:
        raise ValueError(f"RUN_DIR: no complete actor checkpoint in {config.actor_save}; nothing to export")
    problem = verify_checkpoint(
        iteration_dir(config.actor_save, latest), checksums=config.verify_checkpoint_checksums
    )
    if problem is not None:
        raise ValueError(
            f"RUN_DIR: the actor's latest checkpoint (rollout {latest}) does not read: {problem}; a start of the "
            "run sets it aside and resumes from the one before"
        )
    folder = export_folder(run_dir, out, latest)
    actor_config = dataclasses.replace(config.actor_config(), load=config.actor_save, use_kl_loss=False)
    started = start_ray(None, config.local_gpus)
    try:
        spec = PlacementSpec(
            actor_num_nodes=config.actor_num_nodes,
            actor_num_gpus_per_node=config.actor_num_gpus_per_node,
            debug_train_only=True,
        )
        with create_placement_groups(spec) as placements:
            slot = placements.actor
            actor = create_train_group(
                actor_config, "actor", slot.pg, slot.bundle_indices, num_gpus_per_worker=1.0
            )
            try:
                lora = actor_config.lora_of("actor")
                return export_actor(actor, folder, config.hf_checkpoint, lora)
            finally:
                actor.shutdown()
                actor.kill()
    finally:
        if started:
            ray.shutdown()
