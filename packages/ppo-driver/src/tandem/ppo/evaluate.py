"""`ppo-driver eval` and `ppo-driver export`: a saved actor on an eval set, and a checkpoint as an HF folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


def resolve_model_dir(model: str) -> Path:
    """A Hugging Face folder, or a run dir's `hf/`; ValueError naming MODEL otherwise."""
    path = Path(model)
    for candidate in (path, path / "hf"):
        if (candidate / "config.json").is_file():
            return candidate
    raise ValueError(
        f"MODEL: {model!r} is neither a Hugging Face folder nor a run dir with hf/; pass a folder with "
        "config.json (a finished run writes RUN_DIR/hf; `ppo-driver export RUN_DIR` writes one from a checkpoint)"
    )


def evaluate_model(args: Any) -> dict[str, float]:
    """Sample responses for every prompt of `args.data` with the model, score them; the eval metrics."""
    import ray
    from transformers import AutoTokenizer

    from tandem.placement import PlacementSpec, create_placement_groups
    from tandem.ppo.cluster import start_ray
    from tandem.ppo.data import PromptDataset, read_prompts
    from tandem.ppo.engines import SamplingParams, create_engine_group
    from tandem.ppo.rewards import load_reward
    from tandem.ppo.rollout import generate_rollout

    model_dir = resolve_model_dir(args.model)
    if not Path(args.data).is_file():
        raise ValueError(f"--data: file {args.data!r} does not exist; fix the path")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    reward_fn = load_reward(args.custom_rm_path or args.rm_type)
    dataset = PromptDataset(
        read_prompts(args.data), tokenizer, max_prompt_len=args.max_prompt_len, seed=args.seed
    )
    started = start_ray(None, args.local_gpus)
    try:
        spec = PlacementSpec(actor_num_gpus_per_node=1, rollout_num_gpus=1, debug_rollout_only=True)
        with create_placement_groups(spec) as placements:
            slot = placements.rollout
            engines = create_engine_group(
                str(model_dir), slot.pg, slot.bundle_indices, num_gpus_per_engine=1.0
            )
            try:
                eos = tokenizer.eos_token_id
                params = SamplingParams(
                    max_new_tokens=args.max_response_len,
                    temperature=args.temperature,
                    stop_token_ids=(eos,) if eos is not None else (),
                    seed=args.seed,
                )
                rollout = generate_rollout(
                    engines,
                    dataset.next_batch(len(dataset)),
                    n_samples_per_prompt=args.n_samples_per_prompt,
                    params=params,
                    tokenizer=tokenizer,
                    reward_fn=reward_fn,
                )
            finally:
                engines.shutdown()
        metrics = rollout.metrics(accuracy_threshold=args.accuracy_threshold, prefix="eval")
        metrics["eval/dropped_prompts"] = float(dataset.num_dropped)
        return metrics
    finally:
        if started:
            ray.shutdown()


def export_run(run_dir: str, out: str | None = None) -> str:
    """Load the run's latest actor checkpoint and write it as a Hugging Face folder; its path."""
    import ray

    from tandem.megatron.checkpoint import read_latest
    from tandem.megatron.group import create_train_group
    from tandem.placement import PlacementSpec, create_placement_groups
    from tandem.ppo.cluster import start_ray
    from tandem.ppo.config_file import read_yaml, unvalidated
    from tandem.ppo.export import export_actor

    config_file = Path(run_dir) / "config.yaml"
    if not config_file.is_file():
        raise ValueError(
            f"RUN_DIR: {run_dir!r} has no config.yaml; pass the run dir a `ppo-driver train` wrote"
        )
    config = unvalidated(read_yaml(config_file))
    if read_latest(config.actor_save) is None:
        raise ValueError(f"RUN_DIR: no complete actor checkpoint in {config.actor_save}; nothing to export")
    worker_config = dataclasses.replace(config.worker_config(), load=config.actor_save, use_kl_loss=False)
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
                worker_config, "actor", slot.pg, slot.bundle_indices, num_gpus_per_worker=1.0
            )
            try:
                return export_actor(actor, out or Path(run_dir) / "hf", config.hf_checkpoint)
            finally:
                actor.run("shutdown")
                actor.kill()
    finally:
        if started:
            ray.shutdown()
