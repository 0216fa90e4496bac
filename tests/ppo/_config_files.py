"""The files a config's validation reads, for the config tests: a small Llama's config.json and a prompt file."""

from __future__ import annotations

import json
from pathlib import Path

LLAMA_CONFIG = {
    "model_type": "llama",
    "vocab_size": 56,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""A small Llama's config.json: validation reads the architecture (4 heads, 2 key/value heads and
2 layers, against TP 2 or PP 2)."""


def write_config_files(root: Path) -> dict[str, str]:
    """`hf_checkpoint` (LLAMA_CONFIG), `prompt_data` (one prompt) and `run_dir` under `root`."""
    hf = root / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    prompts = root / "train.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1", "label": "2"}) + "\n")
    return {"hf_checkpoint": str(hf), "prompt_data": str(prompts), "run_dir": str(root / "run")}
