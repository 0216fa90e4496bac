"""LoRA adapters into the embedded engine (`EngineOptions.adapter_sync`): merged into the base exactly.

Each sync sets every adapted weight to `merge_lora(base, A, B, scaling)` from the base itself, however
many syncs, releases and resumes came before (no drift); the base goes to the host once; the engine
generates what a plain engine of the merged model generates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.megatron.models.lora_spec import adapter_name, merge_lora
from tandem.ppo.engines import EmbeddedEngine, EngineOptions, SamplingParams, ipc_payload

from .conftest import random_prompts, save_model

TARGETS = ("q_proj", "v_proj", "gate_proj", "down_proj")  # q and v, gate and up: views of fused buffers
SCALING = 1.5


def _adapters(
    engine: EmbeddedEngine, seed: int, rank: int = 2
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random A and B for each targeted weight of the engine's model (A and B, by weight name)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for target in TARGETS:
            weight = adapter_name(layer, target, "A").removesuffix(".lora_A.weight") + ".weight"
            rows, cols = engine._params_by_name[weight].shape
            out[weight] = (torch.randn(rank, cols, generator=g), torch.randn(rows, rank, generator=g) * 0.1)
    return out


def _named(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    named = []
    for weight, (a, b) in adapters.items():
        module = weight.removesuffix(".weight")
        named += [(f"{module}.lora_A.weight", a), (f"{module}.lora_B.weight", b)]
    return named


def _weights(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine._params_by_name.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of their bits (the change counter compares bits, not values)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("fused", [False, True], ids=["transformers", "fused-views"])
def test_repeated_syncs_merge_into_the_base_exactly(tiny_llama_dir: str, fused: bool) -> None:
    engine = EmbeddedEngine(
        tiny_llama_dir,
        EngineOptions(device="cpu", adapter_sync=True),
        decode_ops="reference" if fused else None,
    )
    base = _weights(engine)
    nbytes = sum(t.numel() * t.element_size() for t in [*engine.model.parameters(), *engine.model.buffers()])
    ever = {name: torch.zeros_like(t, dtype=torch.bool) for name, t in base.items()}
    now = base  # what the engine samples with
    for sync in range(12):
        # Every other sync sends the adapters again (changing nothing), one after a release of each kind.
        adapters = _adapters(engine, seed=(sync + 1) // 2)
        if sync % 3 == 1:  # in chunks of one weight each, as the actor may cut them
            for chunk in _named(adapters)[::2]:
                a_name = chunk[0]
                b_name = a_name.replace("lora_A", "lora_B")
                pairs = dict(_named(adapters))
                engine.update_adapter_from_tensors(
                    [(a_name, pairs[a_name]), (b_name, pairs[b_name])], SCALING
                )
        else:
            engine.update_adapter_from_tensors(_named(adapters), scaling=SCALING)
        sampled_with, now = now, _weights(engine)
        # The sync's changes are counted against what the engine sampled with before it, a release
        # before it or not (then the older merge is made again from the base to compare with); the
        # bitmask of changes since the start survives the releases (a tag of its own: the base is frozen).
        changed = {name: _bits(now[name]) != _bits(sampled_with[name]) for name in now}
        for name, mask in changed.items():
            ever[name] |= mask
        counted = engine.weight_changes()
        assert counted["changed"] == sum(int(m.sum()) for m in changed.values()), sync
        assert counted["changed_since_start"] == sum(int(m.sum()) for m in ever.values()), sync
        if sync % 2:  # a release and a resume between syncs, as a shared step does
            engine.release_memory()
            engine.resume_memory()
            if sync % 4 == 1:  # else the next sync finds the base alone, as a shared step's sync does
                engine.weights_digest()  # reading the weights merges the kept adapters back
                assert engine.weight_changes()["changed"] == 0  # merging back changes nothing sampled with
        if sync % 4 != 3:
            now = _weights(engine)
        for name, tensor in now.items():
            if name in adapters:
                a, b = adapters[name]
                assert torch.equal(tensor, merge_lora(base[name], a, b, SCALING)), (sync, name)
            else:
                assert torch.equal(tensor, base[name]), (sync, name)
    # The base went to the host once, before the first merge; releases never copied it again.
    assert engine._base_copy is not None and engine._base_copy.copied_to_host("weights") == nbytes


def test_the_engine_generates_what_the_merged_model_generates(tiny_llama_dir: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu", adapter_sync=True))
    adapters = _adapters(engine, seed=7, rank=4)
    engine.update_adapter_from_tensors(ipc_payload(_named(adapters)), scaling=SCALING)
    merged: Any = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    state = merged.state_dict()
    for name, (a, b) in adapters.items():
        state[name].copy_(merge_lora(state[name], a, b, SCALING))
    plain = EmbeddedEngine(save_model(merged, tmp_path / "merged"), EngineOptions(device="cpu"))
    prompts = random_prompts(6, seed=3)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
    engine.release_memory()
    engine.resume_memory()  # the adapters come back with the weights
    got, expected = engine.generate(prompts, params), plain.generate(prompts, params)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    base = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu")).generate(prompts, params)
    assert [g.token_ids for g in got] != [b.token_ids for b in base]  # the adapters change the samples


def test_whole_weights_become_the_new_base(tiny_llama_dir: str) -> None:
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu", adapter_sync=True))
    engine.update_adapter_from_tensors(_named(_adapters(engine, seed=1)), scaling=SCALING)
    new_base = {n: t + 0.25 for n, t in _weights(engine).items()}
    engine.update_weights_from_tensors(list(new_base.items()))
    adapters = _adapters(engine, seed=2)
    engine.update_adapter_from_tensors(_named(adapters), scaling=SCALING)
    engine.release_memory()
    engine.resume_memory()
    engine.weights_digest()
    for name, tensor in _weights(engine).items():
        expected = (
            merge_lora(new_base[name], *adapters[name], SCALING) if name in adapters else new_base[name]
        )
        assert torch.equal(tensor, expected), name


def test_adapter_updates_refuse_what_they_cannot_merge(tiny_llama_dir: str) -> None:
    plain = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu"))
    named = _named(_adapters(plain, seed=0))
    with pytest.raises(ValueError, match="not started for adapters"):
        plain.update_adapter_from_tensors(named, scaling=1.0)
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu", adapter_sync=True))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight got only lora_A"):
        engine.update_adapter_from_tensors(named[:1], scaling=1.0)
    with pytest.raises(
        ValueError, match=r"model.layers.9.self_attn.q_proj.weight is not a weight of the model"
    ):
        engine.update_adapter_from_tensors(
            [(n.replace("layers.0", "layers.9"), t) for n, t in named[:2]], 1.0
        )
    with pytest.raises(ValueError, match=r"cannot take A \(2, 32\) and B"):
        engine.update_adapter_from_tensors([named[0], (named[1][0], named[1][1][:3])], scaling=1.0)
    engine.release_memory(["weights"])
    with pytest.raises(Exception, match="weights are released"):
        engine.update_adapter_from_tensors(named, scaling=1.0)
