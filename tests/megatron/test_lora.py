"""LoRA on the Megatron models and in the train worker (CPU, gloo): `_scripts/lora_checks.py` in 2 processes.

One launch serves every assertion: TP 2 gives TP 1's loss, logits and gradients; gradients reach
only the adapters (and the critic's value head); the adapters switched off give the base model
exactly, and so does the worker's reference; the merged export equals PEFT's model with the
exported adapter, in logits; a resumed worker trains on exactly as the straight one does, and a
sleep and a wake change nothing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.megatron.models.lora_spec import (
    HF_LINEARS,
    LoraSettings,
    adapter_config,
    merge_lora,
    split_adapter_name,
)

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "_scripts"
VOCAB = 64
TOKENS = torch.stack([torch.arange(3, 11), torch.arange(20, 28)])  # as lora_checks.model_phase


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, random_llama: Callable[..., None]) -> Path:
    work = tmp_path_factory.mktemp("lora")
    random_llama(
        work / "hf",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    command = [sys.executable, str(SCRIPTS / "launch.py"), "2", str(SCRIPTS / "lora_checks.py")]
    proc = subprocess.run(
        [*command, str(work / "hf"), str(work / "out")], capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return work


def load(run: Path, phase: str, rank: int = 0) -> dict[str, Any]:
    saved: dict[str, Any] = torch.load(run / "out" / f"{phase}-rank{rank}.pt", weights_only=False)
    return saved


def logits(saved: dict[str, Any], key: str) -> torch.Tensor:
    return saved[key][..., :VOCAB]  # Megatron's padded vocabulary rows cut off


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_gives_tp1s_loss_logits_and_gradients(run: Path, rank: int) -> None:
    tp2, tp1 = load(run, "model-2x1", rank), load(run, "model-1x1", rank)
    for key in ("loss", "critic_loss"):
        assert len(tp2[key]) == len(tp1[key]) == 2  # two micro-batches
        torch.testing.assert_close(torch.stack(tp2[key]), torch.stack(tp1[key]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits(tp2, "logits"), logits(tp1, "logits"), rtol=1e-5, atol=1e-6)
    for key in ("grads", "critic_grads"):
        assert tp2[key].keys() == tp1[key].keys() and tp2[key]
        for name in tp1[key]:
            torch.testing.assert_close(tp2[key][name], tp1[key][name], rtol=1e-4, atol=1e-6, msg=name)
    # Real gradients: every B has one, and the layers' A get theirs through a nonzero B.
    assert all(float(g.abs().max()) > 0 for g in tp1["grads"].values())
    for name in tp1["merged"]:
        torch.testing.assert_close(tp2["merged"][name], tp1["merged"][name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("phase", ["model-2x1", "model-1x1"])
def test_gradients_reach_only_the_adapters_and_the_value_head(run: Path, phase: str) -> None:
    saved = load(run, phase)
    assert saved["frozen_grads"] == []
    assert saved["trainable"] and all(".lora." in name for name in saved["trainable"])
    # 2 layers x (qkv, proj, fc1, fc2) adapters: A and one B a part (3 + 1 + 2 + 1 parts).
    assert len(saved["trainable"]) == 2 * (4 + 7)
    heads = [n for n in saved["critic_trainable_with_grads"] if ".lora." not in n]
    assert heads == ["output_layer.bias", "output_layer.weight"]


@pytest.mark.parametrize("phase", ["model-2x1", "model-1x1"])
def test_adapters_start_at_the_base_and_switched_off_give_it_exactly(run: Path, phase: str) -> None:
    saved = load(run, phase)
    assert torch.equal(logits(saved, "initial_logits"), logits(saved, "base_logits"))  # B starts at 0
    assert torch.equal(logits(saved, "off_logits"), logits(saved, "base_logits"))
    assert float((logits(saved, "logits") - logits(saved, "base_logits")).abs().max()) > 1e-2


def test_the_merged_export_equals_peft_with_the_exported_adapter(run: Path) -> None:
    """The adapters in PEFT's names and format load with `PeftModel.from_pretrained` over the base, and give the
    logits of the merged export loaded as a plain model, and of our Megatron model."""
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    saved = load(run, "model-2x1")
    settings = LoraSettings(rank=4, alpha=8.0, dropout=0.0, targets=HF_LINEARS)  # as lora_checks.SETTINGS
    adapter_dir, merged_dir = run / "peft-adapter", run / "merged"
    adapter_dir.mkdir(exist_ok=True)
    (adapter_dir / "adapter_config.json").write_text(json.dumps(adapter_config(settings, str(run / "hf"))))
    peft_named = {f"base_model.model.{n}": t.contiguous() for n, t in saved["adapters"].items()}
    save_file(peft_named, str(adapter_dir / "adapter_model.safetensors"))
    merged_dir.mkdir(exist_ok=True)
    shutil.copy(run / "hf" / "config.json", merged_dir / "config.json")
    save_file({n: t.contiguous() for n, t in saved["merged"].items()}, str(merged_dir / "model.safetensors"))

    base: Any = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32)
    with_adapter: Any = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    merged: Any = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        peft_logits = with_adapter(TOKENS).logits
        merged_logits = merged(TOKENS).logits
    torch.testing.assert_close(merged_logits, peft_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits(saved, "logits"), peft_logits, rtol=1e-4, atol=1e-4)
    # And each merged weight is the base plus scaling * B @ A (`merge_lora`).
    from safetensors.torch import load_file

    base_tensors = load_file(str(run / "hf" / "model.safetensors"))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in saved["adapters"].items():
        weight, matrix = split_adapter_name(name)
        pairs.setdefault(weight, {})[matrix] = tensor
    assert len(pairs) == 2 * len(HF_LINEARS)
    for weight, ab in pairs.items():
        expected = merge_lora(base_tensors[weight], ab["A"], ab["B"], settings.scaling)
        torch.testing.assert_close(saved["merged"][weight], expected, rtol=1e-6, atol=1e-7, msg=weight)


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_resumed_worker_trains_on_exactly_and_sleep_changes_nothing(
    run: Path, role: str, rank: int
) -> None:
    straight, resumed = load(run, f"{role}-straight", rank), load(run, f"{role}-resumed", rank)
    assert (straight["start"], resumed["start"]) == (0, 1)
    assert resumed["metrics1"] == straight["metrics1"]
    assert straight["state"].keys() == resumed["state"].keys()
    for name, tensor in straight["state"].items():
        assert torch.equal(resumed["state"][name], tensor), name
        assert torch.equal(straight["state_after_wake"][name], tensor), name
    # The optimizer keeps state for the adapters (and the value head) only: far less than the base.
    # On the CPU its main weights are the model's own (the weights tag's), so main_params is empty.
    nbytes = straight["nbytes"]
    assert straight["memory_tags"] == ["base", "weights", "grads", "main_params", "optimizer_moments"]
    assert nbytes.keys() >= set(straight["memory_tags"]) and nbytes["main_params"] == 0
    assert 0 < nbytes["weights"] < nbytes["base"] and 0 < nbytes["optimizer_moments"] <= 2 * nbytes["weights"]
    if role == "actor":  # a LoRA model's base is a weight tag: the log-probs need it awake
        assert "['base']" in straight["refused_with_base_asleep"]
    # Two sleeps: the trained state went to the host at each, the frozen base at the first only.
    copied = straight["copied_to_host"]
    assert copied["base"] == nbytes["base"] and copied["weights"] == 2 * nbytes["weights"]


def test_the_reference_is_the_base_with_the_adapters_off(run: Path) -> None:
    saved = load(run, "actor-straight")
    before, after = saved["log_probs_before"], saved["log_probs_after"]
    # Before any step the adapters' B is 0: the policy is the base, and so is the reference.
    for old, ref in zip(before["old"], before["reference"], strict=True):
        assert torch.equal(old, ref)
    # After two steps the reference is still exactly the base, while the policy has moved.
    moved = 0.0
    for base, ref, old in zip(before["old"], after["reference"], after["old"], strict=True):
        assert torch.equal(ref, base)
        moved = max(moved, float((old - base).abs().max()))
    assert moved > 1e-3
