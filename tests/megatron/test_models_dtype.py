"""Every parameter in one dtype: what Megatron's distributed optimizer needs (and the guard that says so)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.megatron.optimizer import check_one_param_dtype

from .conftest import SaveRandomLlama

SCRIPTS = Path(__file__).parent / "_scripts"


def test_bf16_models_store_every_parameter_in_bf16_and_the_critic_still_returns_fp32_values(
    tmp_path: Path, random_llama: SaveRandomLlama
) -> None:
    random_llama(
        tmp_path / "hf",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    out = tmp_path / "dtypes.pt"
    command = [sys.executable, str(SCRIPTS / "launch.py"), "1", str(SCRIPTS / "dtype_check.py")]
    proc = subprocess.run([*command, str(tmp_path / "hf"), str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = torch.load(out)
    for role in ("actor", "critic"):
        dtypes = result[role]
        # Norms (torch's RMSNorm) and the critic head are among them.
        assert any("layernorm" in name for name in dtypes), sorted(dtypes)
        assert {name: d for name, d in dtypes.items() if d != "torch.bfloat16"} == {}
    assert "output_layer.bias" in result["critic"]
    assert result["values_dtypes"] == ["torch.float32", "torch.float32"]


class _Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
        self.norm = torch.nn.RMSNorm(4)  # fp32


def test_the_optimizer_refuses_parameters_of_two_dtypes_naming_them_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"2 dtypes.*norm\.weight.*params_dtype"):
        check_one_param_dtype([_Mixed()])
    uniform = _Mixed().to(torch.bfloat16)
    check_one_param_dtype([uniform])
    uniform.norm.weight.requires_grad_(False)  # frozen parameters are not the optimizer's
    uniform.norm.float()
    check_one_param_dtype([uniform])
