"""`ppo-driver demo`: real PPO on a fresh CPU machine, on a tiny model built locally (no downloads).

The task is verifiable and small enough to learn from a random start in a few
minutes on two cores: the prompt is `"d+1"` for a digit `d` in 0..8 and the
correct response is the single digit `d+1`. `digit_reward` scores it: 1 for
the right digit, 0.1 for another digit (a format reward: without it a
context whose samples are all wrong gives the critic nothing to learn from,
and a random model answers right only once in ~56 tokens), 0 otherwise.
`reward/accuracy` counts exact answers only. PPO with its critic lifts the
mean reward from about 0.04 towards 1.

The actor, the critic and the embedded rollout engine share logical GPUs
(a local Ray cluster with `--local-gpus`) and sleep and wake between phases,
exactly as on real GPUs. Every `ppo-driver train` flag works here too, so a
demo can be made shorter (`--num-rollout 10`) or longer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.ppo._tiny import build_tiny_tokenizer

DEMO_DEFAULTS: dict[str, Any] = {
    "run_dir": "runs/demo",
    "num_rollout": 80,
    "rollout_batch_size": 16,
    "n_samples_per_prompt": 8,
    "global_batch_size": 32,
    "micro_batch_size": 32,
    "rollout_max_response_len": 1,
    "max_prompt_len": 32,
    "lr": 3e-3,
    "critic_lr": 5e-3,
    "entropy_coef": 0.003,
    "normalize_advantages": True,
    "clip_grad": 1.0,
    "eps_clip": 0.2,
    "value_clip": None,
    "device": "cpu",
    "params_dtype": "float32",
    "offload_backend": "pinned_host",
    "local_gpus": 1,
    "custom_rm_path": "tandem.ppo._demo:digit_reward",
    "eval_interval": 10,
    "save_interval": 20,
    "seed": 1,
}
"""The demo's settings; any flag given to `ppo-driver demo` overrides them."""

MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
"""The tiny Llama-like model of the demo (random weights, seeded)."""

LORA_HEAD_SCALE = 8.0
"""The output layer of the demo's model when its actor trains LoRA adapters (`--lora-rank`): its random
init times this. A LoRA policy trains neither the output layer nor the final norm, and they cap its
logits: the norm's output has length √hidden_size (8) and each head row, of the init's scale (std 0.02),
length 0.02·√hidden_size, so no logit exceeds 0.02·hidden_size = 1.3 (the right digit at most 7 % of
the samples among 56 tokens); eight times the scale lifts the cap to 10."""


def build_base_model(out_dir: str | Path, *, seed: int = 0, head_scale: float = 1.0) -> Path:
    """A tiny random Llama (`MODEL_SHAPE`; its output layer's init times `head_scale`) and its
    character-level tokenizer, saved as a Hugging Face folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    tokenizer = build_tiny_tokenizer(out)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **MODEL_SHAPE,
    )
    model: Any = LlamaForCausalLM(config)
    if head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    progress_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a few kB of weights: no bar on the user's terminal
    try:
        model.save_pretrained(out)
    finally:
        if progress_was_on:
            hf_logging.enable_progress_bar()
    return out


def digit_reward(samples: list[Any]) -> list[float]:
    """The demo's reward: 1 for the right digit, 0.1 for another single digit, 0 otherwise."""
    scores = []
    for sample in samples:
        answer = sample.response.strip()
        scores.append(
            1.0 if answer == str(sample.label) else 0.1 if len(answer) == 1 and answer.isdigit() else 0.0
        )
    return scores


def task_files(out_dir: str | Path) -> tuple[Path, Path]:
    """Where `write_task` writes the train and the eval JSONL."""
    return Path(out_dir) / "train.jsonl", Path(out_dir) / "eval.jsonl"


def write_task(out_dir: str | Path) -> tuple[Path, Path]:
    """The demo's train and eval JSONL: `"d+1"` -> `"d+1"`'s digit, for d in 0..8."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"{d}+1", "label": str(d + 1)} for d in range(9)]
    train, evaluation = task_files(out)
    for path in (train, evaluation):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return train, evaluation


LORA_DEMO_DEFAULTS: dict[str, Any] = {"entropy_coef": 0.01}
"""What the demo's settings become when its actor trains LoRA adapters (`--lora-rank`), unless given: a
larger entropy bonus, since a LoRA policy on a random model otherwise settles on one digit a prompt
within 20 steps (the reward flat at 0.21) before it has found the right ones."""


def prepare_demo(
    values: dict[str, Any], *, write: bool = True, root: str | Path | None = None
) -> dict[str, Any]:
    """Fill in the model and data the demo builds under RUN_DIR, unless the flags name others.

    `write`: build them (False: only name where they go, as `--dry-run` shows them); `root`: build them
    there instead of RUN_DIR (the dry run's scratch folder).
    """
    base = Path(root if root is not None else values.get("run_dir", DEMO_DEFAULTS["run_dir"]))
    filled = dict(values)
    lora = filled.get("lora_rank") is not None
    if lora:
        for name, value in LORA_DEMO_DEFAULTS.items():
            if filled.get(name, DEMO_DEFAULTS[name]) == DEMO_DEFAULTS[name]:
                filled[name] = value
    if not filled.get("hf_checkpoint"):
        # A folder of its own with LoRA: a full fine-tune's demo in the same RUN_DIR built the other.
        model = base / ("base-lora" if lora else "base")
        head_scale = LORA_HEAD_SCALE if lora else 1.0
        filled["hf_checkpoint"] = str(build_base_model(model, head_scale=head_scale) if write else model)
    if not filled.get("prompt_data"):
        train, evaluation = write_task(base / "data") if write else task_files(base / "data")
        filled["prompt_data"] = str(train)
        if filled.get("eval_prompt_data") is None:
            filled["eval_prompt_data"] = str(evaluation)
    return filled
