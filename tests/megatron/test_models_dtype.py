"""Every parameter in one dtype: what Megatron's distributed optimizer needs (and the guard that says so)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.megatron.worker.optimizer import check_one_param_dtype

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


def _bf16_export_on_pipeline_stages(tmp_path: Path, random_llama: SaveRandomLlama, nproc: int) -> None:
    """Run bf16_export_check.py with PP = nproc and compare every rank's export with the checkpoint."""
    from safetensors.torch import load_file

    random_llama(
        tmp_path / "hf",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        max_position_embeddings=64,
        dtype=torch.bfloat16,
    )
    command = [sys.executable, str(SCRIPTS / "launch.py"), str(nproc), str(SCRIPTS / "bf16_export_check.py")]
    args = [str(tmp_path / "hf"), str(nproc), str(tmp_path / "out")]
    proc = subprocess.run([*command, *args], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    checkpoint: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        checkpoint.update(load_file(f))
    assert {t.dtype for t in checkpoint.values()} == {torch.bfloat16}
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt") for r in range(nproc)]
    for exported in ranks:
        actor = exported["actor"]
        assert actor.keys() == checkpoint.keys()
        assert [n for n in checkpoint if not torch.equal(actor[n], checkpoint[n])] == []
        assert {t.dtype for t in exported["critic"].values()} == {torch.bfloat16}
        assert all(torch.equal(exported["critic"][n], ranks[0]["critic"][n]) for n in ranks[0]["critic"])


def test_a_bf16_model_on_two_pipeline_stages_exports_every_tensor_bit_for_bit(
    tmp_path: Path, random_llama: SaveRandomLlama
) -> None:
    _bf16_export_on_pipeline_stages(tmp_path, random_llama, 2)


@pytest.mark.gpu
def test_the_bf16_pipeline_export_on_two_gpus(tmp_path: Path, random_llama: SaveRandomLlama) -> None:
    """The same with NCCL: stage 1 on GPU 1 receives stage 0's tensors in bf16."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (one pipeline stage each)")
    _bf16_export_on_pipeline_stages(tmp_path, random_llama, 2)
