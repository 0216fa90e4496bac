"""The exported folder of a LoRA actor: the merged model for transformers, and `adapter/` for PEFT.

`HfFolderWriter` is fed as the actor feeds it (`export_actor`: the merged weights, then the
adapters in PEFT's names without its prefix); the folder it publishes loads both ways and the
two give the same logits. No Ray: the writer is called in the process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tandem.megatron.models.lora_spec import (
    LoraSettings,
    adapter_config,
    adapter_name,
    merge_lora,
    resolve_targets,
)
from tandem.ppo.run.export import ADAPTER_FOLDER, HfFolderWriter


def _base(path: Path) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model: Any = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return model


def test_the_folder_loads_merged_in_transformers_and_as_an_adapter_in_peft(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = _base(tmp_path / "base")
    settings = LoraSettings(rank=2, alpha=6.0, dropout=0.0, targets=resolve_targets(["q_proj", "linear_fc1"]))
    state = base.state_dict()
    g = torch.Generator().manual_seed(1)
    adapters: list[tuple[str, torch.Tensor]] = []
    merged = dict(state)
    for layer in range(2):
        for target in settings.targets:
            weight = adapter_name(layer, target, "A").removesuffix(".lora_A.weight") + ".weight"
            rows, cols = state[weight].shape
            a = torch.randn(settings.rank, cols, generator=g) * 0.3
            b = torch.randn(rows, settings.rank, generator=g) * 0.3
            adapters += [(adapter_name(layer, target, "A"), a), (adapter_name(layer, target, "B"), b)]
            merged[weight] = merge_lora(state[weight], a, b, settings.scaling)

    writer = HfFolderWriter(str(tmp_path / "hf"), str(tmp_path / "base"))
    writer.update_weights_from_tensors(list(merged.items()))
    half = len(adapters) // 2  # in two chunks, as the actor may send them
    writer.update_adapter_from_tensors(adapters[:half], scaling=settings.scaling)
    writer.update_adapter_from_tensors(adapters[half:], scaling=settings.scaling)
    out = Path(writer.finish(adapter_config(settings, str(tmp_path / "base"))))

    tokens = torch.tensor([[1, 5, 9, 3, 7, 2], [4, 4, 8, 0, 11, 6]])
    plain: Any = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    fresh_base: Any = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with_adapter: Any = PeftModel.from_pretrained(fresh_base, str(out / ADAPTER_FOLDER)).eval()
    assert sorted(with_adapter.peft_config["default"].target_modules) == ["gate_proj", "q_proj", "up_proj"]
    with torch.no_grad():
        merged_logits, peft_logits = plain(tokens).logits, with_adapter(tokens).logits
        base_logits = base.eval()(tokens).logits
    torch.testing.assert_close(merged_logits, peft_logits, rtol=1e-4, atol=1e-5)
    assert float((peft_logits - base_logits).abs().max()) > 1e-2  # the adapters do something
