"""The actor as a Hugging Face folder: config, safetensors shards, tokenizer, loadable by `transformers`.

The actor's rank 0 sends its weights, HF-named and in chunks, exactly as it
does to a rollout engine (`TrainWorker.update_weights`); `HfFolderWriter`, a
small Ray actor on the driver's node, takes the engine's place and writes each
chunk as one safetensors shard, then the index and the base model's config.
The driver, on the same node, writes the tokenizer into the same staging
folder (it has `transformers` loaded already; the writer's process never
imports it), and the writer publishes the folder.

A LoRA actor's folder holds its weights with the adapters merged in (a plain
model), and `adapter/` its adapters in PEFT's format (`adapter_config.json`,
`adapter_model.safetensors`), which `peft.PeftModel.from_pretrained(base, "hf/adapter")`
loads over the base model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from tandem.megatron.models.lora_spec import PEFT_PREFIX, LoraSettings, adapter_config


class HfFolderWriter:
    """Receives HF-named tensors in chunks (the engine's `update_weights_from_tensors`) and writes a folder."""

    def __init__(self, out_dir: str, base_hf_dir: str) -> None:
        self.out = Path(out_dir)
        self.base = Path(base_hf_dir)
        self.staging = _staging_folder(self.out)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self.shards = 0
        self.dtypes: set[torch.dtype] = set()
        self.adapter: dict[str, torch.Tensor] = {}

    def update_weights_from_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Write one chunk as the next shard."""
        from safetensors.torch import save_file

        self.shards += 1
        name = f"model-{self.shards:05d}.safetensors"
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in named_tensors}
        save_file(tensors, str(self.staging / name), metadata={"format": "pt"})
        for key, tensor in tensors.items():
            self.weight_map[key] = name
            self.total_bytes += tensor.numel() * tensor.element_size()
            self.dtypes.add(tensor.dtype)

    def update_adapter_from_tensors(
        self, named_tensors: list[tuple[str, torch.Tensor]], scaling: float
    ) -> None:
        """Keep one chunk of LoRA adapters (`export_lora_adapters`) for `finish` to write in PEFT's format.

        `scaling` is the adapters' `alpha / rank`; `finish`'s `adapter_config` says both."""
        del scaling  # adapter_config.json holds alpha and rank
        for name, tensor in named_tensors:
            self.adapter[PEFT_PREFIX + name] = tensor.detach().to("cpu").contiguous()

    def finish(self, adapter_config: dict[str, Any] | None = None) -> str:
        """Write the index and config (and with `adapter_config`, the adapters received as PEFT's
        `adapter/` folder); publish the folder (replacing an older one). Its path."""
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": dict(sorted(self.weight_map.items())),
        }
        (self.staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = json.loads((self.base / "config.json").read_text())
        if len(self.dtypes) == 1:
            config["torch_dtype"] = str(next(iter(self.dtypes))).removeprefix("torch.")
        (self.staging / "config.json").write_text(json.dumps(config, indent=2))
        if (self.base / "generation_config.json").is_file():
            shutil.copy(self.base / "generation_config.json", self.staging / "generation_config.json")
        if adapter_config is not None:
            from safetensors.torch import save_file

            if not self.adapter:
                raise RuntimeError("HfFolderWriter.finish: an adapter_config but no adapters were received")
            folder = self.staging / ADAPTER_FOLDER
            folder.mkdir()
            save_file(self.adapter, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
            (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.staging, self.out)
        return str(self.out)


ADAPTER_FOLDER = "adapter"
"""The subfolder of a LoRA actor's exported folder that holds its adapters in PEFT's format."""


def _staging_folder(out: Path) -> Path:
    """Where the folder for `out` is written before it is published."""
    return out.with_name(out.name + ".partial")


def _save_tokenizer(base_hf_dir: str | os.PathLike[str], folder: Path) -> None:
    """The base model's tokenizer, loaded and saved into `folder`; nothing for a base without one."""
    from transformers import AutoTokenizer

    with contextlib.suppress(OSError, ValueError):  # a base without a tokenizer: weights and config only
        AutoTokenizer.from_pretrained(str(base_hf_dir)).save_pretrained(str(folder))


def export_actor(
    actor: Any, out_dir: str | os.PathLike[str], base_hf_dir: str, lora: LoraSettings | None = None
) -> str:
    """Write the actor group's current weights as a Hugging Face folder at `out_dir`; its path.

    Works asleep or awake (`update_weights` brings only the weights back, briefly). A LoRA
    actor (`lora`, its settings) is written with its adapters merged in, and its adapters
    again in PEFT's format under `adapter/`.
    """
    import ray

    writer_cls: Any = ray.remote(num_cpus=0)(HfFolderWriter)
    node = ray.get_runtime_context().get_node_id()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    out = Path(out_dir).resolve()
    writer = writer_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
        str(out), str(Path(base_hf_dir).resolve())
    )
    try:
        actor.update_weights([writer])  # returns once the writer has made the staging folder and every shard
        config = None
        if lora is not None:
            actor.update_weights([writer], adapters=True)
            config = adapter_config(lora, str(Path(base_hf_dir).resolve()))
        _save_tokenizer(base_hf_dir, _staging_folder(out))
        path: str = ray.get(writer.finish.remote(config))
        return path
    finally:
        ray.kill(writer)
