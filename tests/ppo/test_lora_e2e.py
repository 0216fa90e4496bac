"""A LoRA actor and critic through the driver on CPU, in one run: the demo with `--lora-rank 8`.

The run serves several checks: the reward rises; the weight syncs send the adapters alone and the
engine samples with exactly the trainer's weights (its merge of the adapters into its base); only
the adapted weights ever change in the engine; the base sleeps without a copy to the host after its
first; the exported folder holds the merged model and the adapters in PEFT's format, which load over
the base into the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ._runs import demo_config, read_jsonl, run_driver

pytestmark = pytest.mark.slow

STEPS = 40


def test_the_demo_learns_with_lora_adapters(tmp_path: Path, ray_cluster: str) -> None:
    run_dir = tmp_path / "run"
    config = demo_config(
        run_dir,
        num_rollout=STEPS,
        eval_interval=None,
        save_interval=None,
        lora_rank=8,
        critic_lora_rank=8,
    )  # `lora_base_share` left at its default: one host copy of the two bases
    copied: dict[str, Any] = {}

    def read_worker_copies(driver: Any) -> None:
        for group in (driver.actor, driver.critic):
            to_host = group.run("bytes_copied_to_host")[0]
            group.run("wake_up")  # the state's sizes are read awake
            copied[group.role] = (to_host, group.run("state_nbytes")[0])

    summary = run_driver(config, ray_cluster, after=read_worker_copies)
    rewards = [m["reward/mean"] for m in summary.metrics]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # The full fine-tune's mark (test_driver.py's test_demo_task_learns), on the demo's LoRA model
    # (`prepare_demo`: an output layer that lets adapters answer, a larger entropy bonus).
    assert first <= 0.2, rewards
    assert last >= first + 0.3, rewards
    # The engine samples with the trainer's weights to rounding: its merge of each sync's adapters into
    # its base is the trainer's model; and only the adapted weights ever change there (the embeddings,
    # the norms and the output layer stay the base's).
    syncs = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "weight_sync"]
    assert syncs and all(e["adapters"] for e in syncs)
    adapted = _adapted_fraction(config.hf_checkpoint)
    for m in summary.metrics:
        assert 0 <= m["actor/sampler_log_prob_gap"] < 1e-4
        assert 0 < m["policy/changed_fraction_since_start"] <= adapted + 1e-9
    # The frozen bases went to the host once, at the first of some 80 sleeps, and once for both models
    # (`lora_base_share`, on by default): the model that slept first copied its base whole, the other
    # only what that copy lacks (the actor's output layer, which the critic has not), and mapped the rest.
    (first_to_host, first_nbytes), (second_to_host, second_nbytes) = sorted(
        (copied[role] for role in ("actor", "critic")), key=lambda c: c[0]["base"] < c[1]["base"]
    )
    assert first_to_host["base"] == first_nbytes["base"] > 0
    assert 0 <= second_to_host["base"] < second_nbytes["base"] / 2, (second_to_host, second_nbytes)
    _check_the_export(run_dir, config.hf_checkpoint)


def _adapted_fraction(hf_dir: str) -> float:
    """The share of the model's elements in its adapted weights (attention and MLP), as the engine
    counts them (each tensor of its state dict once)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tensors = {id(t): (name, t.numel()) for name, t in model.state_dict(keep_vars=True).items()}
    adapted = sum(n for name, n in tensors.values() if name.endswith(ADAPTED))
    return adapted / sum(n for _, n in tensors.values())


ADAPTED = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))


def _check_the_export(run_dir: Path, base: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = run_dir / "hf"
    adapter = json.loads((hf / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["peft_type"]) == (8, "LORA")
    ids = torch.tensor([[4, 42, 5], [12, 42, 5]])
    merged: Any = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    over_base: Any = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), hf / "adapter"
    )
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, over_base(ids).logits, rtol=1e-4, atol=1e-4)
        base_logits = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(ids).logits
    assert not torch.allclose(merged(ids).logits, base_logits)  # the adapters trained
