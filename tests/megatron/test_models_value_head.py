"""The critic's ValueHead on its own (no Megatron import): shape, fp32 output, deterministic init."""

from __future__ import annotations

import torch

from tandem.megatron.models import ValueHead


def test_value_head_is_hidden_to_one_with_bias_and_fp32_output_for_bf16_input() -> None:
    head = ValueHead(32, init_std=0.02, seed=3)
    assert head.weight.shape == (1, 32) and head.bias.shape == (1,)
    assert head.weight.dtype == torch.float32 and head.bias.dtype == torch.float32
    hidden = torch.randn(5, 2, 32).to(torch.bfloat16)  # [s, b, h] as GPTModel hands it over
    values, bias = head(hidden, weight=None, runtime_gather_output=None)
    assert bias is None
    assert values.shape == (5, 2, 1) and values.dtype == torch.float32
    expected = hidden.float() @ head.weight.detach().T + head.bias.detach()
    assert torch.allclose(values, expected)


def test_value_head_init_depends_on_seed_only() -> None:
    torch.manual_seed(0)
    a = ValueHead(16, init_std=0.02, seed=5)
    torch.randn(100)  # other draws from the global RNG must not matter
    b = ValueHead(16, init_std=0.02, seed=5)
    c = ValueHead(16, init_std=0.02, seed=6)
    assert torch.equal(a.weight, b.weight)
    assert not torch.equal(a.weight, c.weight)
    assert 0.005 < a.weight.std().item() < 0.05


def test_value_head_output_stays_fp32_after_a_bf16_cast_of_the_module() -> None:
    # Megatron's Float16Module casts every parameter of the model to bf16.
    head = ValueHead(8, init_std=0.02, seed=1).bfloat16()
    values, _ = head(torch.randn(3, 1, 8))
    assert values.dtype == torch.float32
