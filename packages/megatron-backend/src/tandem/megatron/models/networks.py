"""The actor and critic networks: this rank's pipeline stage of a Megatron `GPTModel`.

Both roles share the backbone built from a `ModelSpec` with Megatron's local
(non-Transformer-Engine) layer spec. The actor ends in the vocabulary-parallel
output head (tied to the embedding when the checkpoint says so); the critic
ends in `ValueHead`, an untied `hidden -> 1` linear with bias whose output is
fp32. The critic head is replicated on every tensor-parallel rank: its input
(the final norm's output) is already identical on all of them, so its
gradients are identical too, like those of the final norm.

Every parameter (norms and the critic head too) is stored in one dtype,
`params_dtype`, as Megatron's mixed-precision wrapper would leave them: its
distributed optimizer pairs main weights with gradient-buffer ranges assuming
so (its param groups put fp32 parameters first), and a pipeline stage receiving
exported weights allocates that dtype.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal, cast, get_args

import torch
from torch import nn

from tandem.megatron.choices import ROLES, PackedAttention, Role
from tandem.megatron.models import rope, swiglu
from tandem.megatron.models._cpu_compat import enable_cpu_compat
from tandem.megatron.models.attention import (
    check_varlen,
    local_attention,
    resolve_packed_attention,
    sdpa_attention,
)
from tandem.megatron.models.head_rows import HeadRows
from tandem.megatron.models.hf_config import ModelSpec

Attention = Literal["sdpa", "local"]
_ATTENTIONS: tuple[str, ...] = get_args(Attention)


class ValueHead(nn.Module):
    """The critic's scalar head: `hidden -> 1` with bias, computed and output in fp32.

    It stands in for `GPTModel.output_layer`, so it takes and returns what
    that layer does (`(output, bias)`, extra keyword arguments ignored); the
    model then returns values of shape `(batch, seq, 1)`.

    Its parameters are stored in `dtype` (the model's `params_dtype`); the
    optimizer keeps fp32 main copies of them as of every other weight.
    """

    def __init__(
        self, hidden_size: int, *, init_std: float, seed: int, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype))
        # A private generator: the head starts equal on every rank whatever
        # else each rank drew from the global RNG before.
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(1, hidden_size, generator=gen) * init_std)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """Values `[s, b, 1]` in fp32 from hidden states `[s, b, h]` of any dtype."""
        # Weights stored in bf16 are upcast: the values are always computed in fp32.
        values = torch.nn.functional.linear(hidden_states.float(), self.weight.float(), self.bias.float())
        return values, None


def uses_fused_rope(fused_rope: bool | None, *, on_cuda: bool) -> bool:
    """Whether a model applies RoPE with our kernels (`rope.py`): `fused_rope`, or where None on CUDA,
    at every hidden size and micro-batch shape; never on CPU by default (there our RoPE is the
    compiled functions, ~20 s of compiling).

    On CUDA our RoPE is one Triton kernel a call (`_rope_kernels`), which costs the host a launch and
    no compiled call's guards. A/B on one H100 (docs/benchmarks.md, "The Triton RoPE kernel"): a 0.5B
    actor's `train()` 1.48 s against 1.61 s with Megatron's eager RoPE, its critic's 1.24 s against
    1.36 s; on packed rows of new lengths each call, 2.33, 1.90 and 1.86 s against 2.22, 2.10 and
    2.23 s with the compiled functions, which the hidden-size threshold of before chose there. Megatron's eager RoPE of a packed row (THD) also asks the host
    for each sample's length and loops over the samples in Python."""
    if fused_rope is not None:
        return fused_rope
    return on_cuda


def swiglu_min_elements(fused_swiglu: bool | None) -> int:
    """The smallest MLP input the SwiGLU kernels take where a model uses them (`uses_fused_swiglu`): every
    size where `fused_swiglu` is True, from `swiglu.MIN_ELEMENTS` on where None (smaller calls run eager)."""
    return 0 if fused_swiglu else swiglu.MIN_ELEMENTS


def uses_fused_swiglu(fused_swiglu: bool | None, *, on_cuda: bool) -> bool:
    """Whether a model's MLPs run the SwiGLU with our Triton kernels (`swiglu.py`): `fused_swiglu`, or
    where None on CUDA with Triton installed (it comes with PyTorch's CUDA builds); eager on CPU.

    A/B on one H100 (docs/benchmarks.md, "the trains' micro-batch and the SwiGLU kernels"): a 0.5B critic's
    `train()` at micro batch 64 took 0.95 s against 1.16 s eager; the actor's 1.20 s, where eager
    ran out of memory at that micro batch (the kernels keep the MLP's input alone for the backward,
    eager the SiLU's output beside it) and took 1.41 s at micro batch 32. Smaller calls, where the
    trains' host sets the pace, ran slower with the kernels: under None they take calls of at least
    `swiglu.MIN_ELEMENTS` (`swiglu_min_elements`)."""
    if fused_swiglu is not None:
        return fused_swiglu
    return on_cuda and importlib.util.find_spec("triton") is not None


def unwrap_model(model: Any) -> Any:
    """The `GPTModel` inside wrappers such as Megatron's DDP or Float16Module (`.module` chains)."""
    from megatron.core.models.gpt import GPTModel

    if isinstance(model, list | tuple):
        if len(model) != 1:
            raise ValueError(
                f"expected one model chunk, got {len(model)} (virtual pipelining is not supported)"
            )
        model = model[0]
    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, GPTModel):
        raise ValueError(f"expected a GPTModel (possibly wrapped), got {type(model).__name__}")
    return model


def build_model(
    spec: ModelSpec,
    role: Role,
    *,
    params_dtype: torch.dtype = torch.float32,
    seed: int = 1234,
    attention: Attention = "sdpa",
    packed_attention: PackedAttention = "auto",
    fused_rope: bool | None = None,
    fused_swiglu: bool | None = None,
    vocab_multiple: int = 128,
    **config_overrides: Any,
) -> nn.Module:
    """This rank's pipeline stage of the actor or critic network, on this rank's device.

    Needs `parallel.init_distributed` first (the tensor- and pipeline-parallel
    sizes come from Megatron's parallel state). Weights are randomly
    initialised; load a checkpoint with `hf_weights.load_hf_checkpoint`.

    Args:
        spec: the model shape (`ModelSpec.from_hf`).
        role: "actor" (LM head, tied when `spec.tie_word_embeddings`) or "critic" (`ValueHead`).
        params_dtype: dtype of every parameter (the critic head computes in fp32 anyway).
        seed: seed of the critic head's init (equal on all ranks).
        attention: "sdpa" (torch's fused causal attention) or "local" (Megatron's
            unfused `DotProductAttention`, which keeps `[b, heads, s, s]` scores); both
            also run packed micro-batches (`attention.py`).
        packed_attention: how "sdpa" runs a packed row: "blocks" (a call per sample),
            "varlen" (one varlen flash call a layer; CUDA, bf16/fp16: `attention.check_varlen`), or
            "auto", varlen wherever it can run, else blocks (`attention.resolve_packed_attention`).
        fused_rope: apply RoPE with our kernels (`rope.py`: a cos/sin table and one kernel a
            call, Triton on CUDA, instead of Megatron's unfused chain of multiplies and copies,
            with the same results) through Megatron's `apply_rope_fusion`; None: on when the
            model is built on CUDA (`uses_fused_rope`), else off.
        fused_swiglu: the MLP's SwiGLU as one Triton kernel forward and one backward on CUDA
            (`swiglu.py`; keeps the MLP's input alone for the backward), through Megatron's
            `bias_activation_fusion`, whatever `config_overrides` says of that field; None: on
            where the model is on CUDA (`uses_fused_swiglu`).
        vocab_multiple: the embedding and the output head get `spec.padded_vocab_size(TP,
            vocab_multiple)` rows (Megatron's `make_vocab_size_divisible_by`); the model's
            `tandem_vocab_size` keeps the real size, whose logits alone are normalised.
        config_overrides: extra `TransformerConfig` fields (e.g. `recompute_granularity`);
            `calculate_per_token_loss` defaults to True (the train step's loss form).
    """
    if role not in ROLES:
        raise ValueError(f"build_model: role {role!r} is not one of {ROLES}")
    if attention not in _ATTENTIONS:
        raise ValueError(f"build_model: attention {attention!r} is not one of {_ATTENTIONS}")
    if not (fused_rope is None or isinstance(fused_rope, bool)):
        raise ValueError(f"build_model: fused_rope {fused_rope!r} must be True, False or None (auto)")
    if not (fused_swiglu is None or isinstance(fused_swiglu, bool)):
        raise ValueError(f"build_model: fused_swiglu {fused_swiglu!r} must be True, False or None (auto)")
    if packed_attention not in ("auto", "blocks", "varlen"):
        raise ValueError(
            f"build_model: packed_attention {packed_attention!r}; choose 'auto', 'blocks' or 'varlen'"
        )
    if packed_attention == "varlen" and attention != "sdpa":
        raise ValueError("build_model: packed_attention='varlen' needs attention='sdpa'")
    if "apply_rope_fusion" in config_overrides:
        raise ValueError(
            "build_model: set RoPE fusion with fused_rope=True/False, not apply_rope_fusion "
            "(Megatron's fused path needs Transformer Engine; fused_rope installs ours)"
        )
    on = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if packed_attention == "auto":
        packed_attention = (
            resolve_packed_attention("auto", on, params_dtype, spec.head_dim)
            if attention == "sdpa"
            else "blocks"
        )
    if packed_attention == "varlen":
        check_varlen(on, params_dtype, spec.head_dim)
    enable_cpu_compat()
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if not mpu.model_parallel_is_initialized():
        raise ValueError(
            "build_model: Megatron's parallel state is not initialised; call init_distributed first"
        )
    # Loss functions return (sum, count, metrics): see forward.run_micro_batches.
    config_overrides.setdefault("calculate_per_token_loss", True)
    # The model lands on CUDA whenever torch sees a GPU (the end of this function).
    if uses_fused_swiglu(fused_swiglu, on_cuda=torch.cuda.is_available()):
        # Megatron's MLP calls `bias_swiglu_impl` (ours, once installed) only with this fusion on.
        swiglu.install(min_elements=swiglu_min_elements(fused_swiglu))
        config_overrides["bias_activation_fusion"] = True
    use_fused_rope = uses_fused_rope(fused_rope, on_cuda=torch.cuda.is_available())
    if use_fused_rope:
        # Before the config: TransformerConfig checks that the fused hooks exist.
        rope.install()
        config_overrides["apply_rope_fusion"] = True
    config = spec.transformer_config(
        tensor_parallel_size=mpu.get_tensor_model_parallel_world_size(),
        pipeline_parallel_size=mpu.get_pipeline_model_parallel_world_size(),
        params_dtype=params_dtype,
        **config_overrides,
    )
    layer_spec = get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    # Both core attentions also take packed samples (THD PackedSeqParams): see attention.py.
    core_attention = sdpa_attention() if attention == "sdpa" else local_attention()
    layer_spec.submodules.self_attention.submodules.core_attention = core_attention
    # Spelled out so that the final norm is torch's RMSNorm on every host (Megatron
    # would pick Apex or Transformer Engine norms when installed).
    block_spec = TransformerBlockSubmodules(
        layer_specs=[layer_spec] * get_num_layers_to_build(config), layer_norm=WrappedTorchNorm
    )
    tie = role == "actor" and spec.tie_word_embeddings
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=spec.padded_vocab_size(mpu.get_tensor_model_parallel_world_size(), vocab_multiple),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=tie,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
    )
    # transformers' own frequencies (RoPE scaling types, non-integer bases).
    model.rotary_pos_emb.inv_freq = spec.rope_inv_freq().to(model.rotary_pos_emb.inv_freq.device)
    # Every stage knows its role (only the last one holds the head that shows it).
    model.tandem_role = role
    # The tokenizer's vocabulary: logits of the padding rows beyond it are masked out.
    model.tandem_vocab_size = spec.vocab_size
    if role == "critic" and model.post_process:
        # Replaces the vocabulary head that GPTModel always builds on the last stage.
        model.output_layer = ValueHead(
            spec.hidden_size, init_std=spec.initializer_range, seed=seed, dtype=params_dtype
        )
    if packed_attention == "varlen":
        for module in model.modules():
            if isinstance(module, core_attention):
                cast(Any, module).varlen = True
    if role == "actor" and model.post_process:
        # The vocabulary head at the positions a forward asks for (`head_rows.py`).
        model.tandem_head_rows = HeadRows(model.output_layer)
    # torch's norms are created in the default dtype whatever the config says.
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype != params_dtype:
                param.data = param.data.to(params_dtype)
    if torch.cuda.is_available():
        # Megatron's linear layers are created on the current device, torch's norms (and our
        # head) on the CPU; Megatron's own training script moves the model the same way.
        model.cuda(torch.cuda.current_device())
    return model
