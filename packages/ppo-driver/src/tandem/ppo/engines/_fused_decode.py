"""The embedded engine's fused decode step for Llama-family models: a few kernels a layer instead of ~48.

transformers' eager Llama/Qwen2 code spends a one-token decode step in small
kernels (RMSNorm in fp32 pieces, rotate_half with cat/neg, cache index copies,
masks, two fp32 softmaxes over the vocabulary). `FusedDecoder.step` computes the
same step on the same weights as torch GEMMs plus five operations (`DecodeOps`):
per layer fused add+RMSNorm, the q/k/v GEMM, RoPE + KV-cache write, split-KV
grouped-query attention over the keys [start, pos] of each row, the o GEMM,
add+RMSNorm, the gate/up GEMM, SiLU*up, the down GEMM; then the final norm,
lm_head on the rows and a one-pass sampler. Every input a step varies by
(token ids, left pads, the write position, the sampler's seed and temperature) is
read from a device tensor, so one CUDA graph per batch bucket serves every step.

The weights stay transformers' parameters, the storage that weight updates copy
into and that release/resume moves: q/k/v (and gate/up) are fused by making each
layer's projections views of one buffer (`_fuse_rows`), which both act on in place.
The prefill stays transformers' own forward, writing the same `StaticKVCache`.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ._decode_ops import DecodeOps, ReferenceOps
from ._kv_cache import StaticKVCache
from ._options import EngineOptions

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
DecodeOpsKind = Literal["triton", "reference"]

_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
"""RoPE types whose frequencies depend on the sequence's length in transformers (a table per position
cannot reproduce them)."""


def unsupported_reason(model: Any, max_context_len: int) -> str | None:
    """Why the fused decode cannot run `model`, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {list(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not 'silu'"
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return "the model has sliding-window layers"
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral" and window is not None and window < max_context_len:
        return f"Mistral's sliding window ({window}) is shorter than the context ({max_context_len})"
    inner: Any = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not hasattr(model, "lm_head") or not hasattr(inner, "layers"):
        return "the model is not laid out as model.model.layers / rotary_emb / lm_head"
    if getattr(rotary, "rope_type", "default") in _POSITION_DEPENDENT_ROPE:
        return f"rope_type {rotary.rope_type!r} depends on the sequence length"
    if model.lm_head.weight.dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {model.lm_head.weight.dtype} (bfloat16 or float32 only)"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in names):
            return "a layer lacks self_attn.{q,k,v,o}_proj or mlp"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "a layer's mlp lacks gate_proj / up_proj / down_proj"
        if len({attn.q_proj.bias is None, attn.k_proj.bias is None, attn.v_proj.bias is None}) > 1:
            return "q/k/v projections with and without biases"
        if (mlp.gate_proj.bias is None) != (mlp.up_proj.bias is None):
            return "gate/up projections with and without biases"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not hasattr(norm, "variance_epsilon"):
                return "a layer norm is not an RMSNorm with variance_epsilon"
    head_dim = inner.layers[0].self_attn.head_dim
    if head_dim % 2:
        return f"head_dim {head_dim} is odd (rotate_half RoPE halves it)"
    return None


def build_fused_decoder(
    model: Any, *, options: EngineOptions, max_context_len: int, ops: DecodeOpsKind | None
) -> FusedDecoder | None:
    """The engine's fused decoder, or None where transformers' decode step runs; logs which, once.

    `ops` None: Triton on CUDA when `options.fused_decode` is on and the model is supported;
    "triton" / "reference": that kind wherever the model is supported (tests; a ValueError if not).
    """
    device = model.lm_head.weight.device
    reason = unsupported_reason(model, max_context_len)
    if ops is not None and reason is not None:
        raise ValueError(f"decode_ops={ops!r}: the fused decode cannot run this model: {reason}")
    if ops is None:
        if not options.fused_decode:
            reason = "EngineOptions.fused_decode is off"
        elif device.type != "cuda":
            reason = f"the device is {device.type}, not CUDA"
        elif reason is None and importlib.util.find_spec("triton") is None:
            reason = "triton is not installed"
        ops = "triton"
    if reason is not None:
        logger.info("embedded engine: transformers' decode step (fused decode off: %s)", reason)
        return None
    logger.info("embedded engine: fused decode step (%s operations)", ops)
    return FusedDecoder(model, ops=ops, max_context_len=max_context_len)


@dataclass
class _Layer:
    """One decoder layer's tensors as the step reads them (fused ones are views' shared storages)."""

    module: Any
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None


class FusedDecoder:
    """One decode step of a Llama-family model through `DecodeOps`; see the module docstring.

    Args:
        model: a transformers causal LM that `unsupported_reason` accepts (on its device).
        ops: "triton" (`_decode_kernels.TritonOps`, CUDA) or "reference" (`ReferenceOps`: plain
            torch, any device; the CPU tests run the decoder end to end with it).
        max_context_len: positions [0, max_context_len) get RoPE tables.
    """

    def __init__(self, model: Any, *, ops: DecodeOpsKind, max_context_len: int) -> None:
        reason = unsupported_reason(model, max_context_len)
        assert reason is None, reason
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.ops: DecodeOps
        if ops == "triton":
            from ._decode_kernels import TritonOps  # Triton: CUDA hosts only, loaded where it runs

            self.ops = TritonOps(self.device)
        else:
            self.ops = ReferenceOps()
        self.ops_kind = ops
        self._model = model
        inner = model.model
        attn = inner.layers[0].self_attn
        self.heads = int(attn.q_proj.weight.shape[0]) // int(attn.head_dim)
        self.kv_heads = int(attn.k_proj.weight.shape[0]) // int(attn.head_dim)
        self.head_dim = int(attn.head_dim)
        self.scale = float(attn.scaling)
        self._max_context_len = max_context_len
        self._layers = [
            _Layer(
                layer,
                *_fuse_rows([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                *_fuse_rows([layer.mlp.gate_proj, layer.mlp.up_proj]),
            )
            for layer in inner.layers
        ]
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def release(self) -> None:
        """Free the RoPE tables (with the weights' release; `step` recomputes them)."""
        self._cos = self._sin = None

    def rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `(max_context_len, head_dim)` in the model's dtype, from transformers' own rotary module.

        Calling `model.model.rotary_emb` gives exactly what the prefill uses, whatever the
        rope scaling (llama3, yarn, linear, ...); its inputs are buffers that weight updates
        leave alone, so the tables change only by a release (they are recomputed after it).
        """
        if self._cos is None or self._sin is None:
            positions = torch.arange(self._max_context_len, device=self.device)[None]
            probe = torch.zeros((), dtype=self.dtype, device=self.device)  # read for its device and dtype
            with torch.no_grad():
                cos, sin = self._model.model.rotary_emb(probe, positions)
            self._cos, self._sin = cos[0].contiguous(), sin[0].contiguous()
        return self._cos, self._sin

    def step(
        self,
        cache: StaticKVCache,
        *,
        ids: torch.Tensor,
        start: torch.Tensor,
        pos: torch.Tensor,
        temperature: torch.Tensor,
        seed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step of rows [:len(ids)]: writes the cache at `pos`, samples the next tokens.

        Shape: ids `(rows,)`, start `(rows,)` int64, pos `(1,)` int64, temperature `(1,)` fp32,
        seed `(1,)` int64 -> tokens `(rows,)` int64, log-probs `(rows,)` fp32 (`DecodeOps.sample`),
        logits `(rows, vocab)` in the model's dtype (for the top-k / top-p sampler).
        """
        ops = self.ops
        cos, sin = self.rope_tables()
        splits = ops.attention_splits(ids.shape[0], self.kv_heads)
        inner = self._model.model
        residual = F.embedding(ids, inner.embed_tokens.weight)
        x: torch.Tensor | None = None
        for i, layer in enumerate(self._layers):
            module = layer.module
            normed = ops.rms_norm(
                x, residual, module.input_layernorm.weight, module.input_layernorm.variance_epsilon
            )
            q = ops.rope_cache_write(
                F.linear(normed, layer.qkv_weight, layer.qkv_bias),
                heads=self.heads,
                kv_heads=self.kv_heads,
                cos=cos,
                sin=sin,
                start=start,
                pos=pos,
                keys=cache.keys[i],
                values=cache.values[i],
            )
            attended = ops.attention(
                q, cache.keys[i], cache.values[i], start=start, pos=pos, scale=self.scale, splits=splits
            )
            o_proj = module.self_attn.o_proj
            x = F.linear(attended, o_proj.weight, o_proj.bias)
            post = module.post_attention_layernorm
            normed = ops.rms_norm(x, residual, post.weight, post.variance_epsilon)
            down = module.mlp.down_proj
            gate_up = F.linear(normed, layer.gate_up_weight, layer.gate_up_bias)
            x = F.linear(ops.silu_mul(gate_up), down.weight, down.bias)
        normed = ops.rms_norm(x, residual, inner.norm.weight, inner.norm.variance_epsilon)
        lm_head = self._model.lm_head
        logits = F.linear(normed, lm_head.weight, lm_head.bias)
        tokens, log_probs = ops.sample(logits, temperature=temperature, seed=seed)
        return tokens, log_probs, logits


def _fuse_rows(modules: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding the output rows of `modules` back to back, for one GEMM.

    Each module's parameters become views of it (the same Parameter objects), so that
    in-place weight updates by name and the release backend (which moves whole storages,
    once per storage) act on the fused buffer; the old storages are freed.
    """
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in modules])
        bias = torch.cat([m.bias.detach() for m in modules]) if modules[0].bias is not None else None
        row = 0
        for m in modules:
            rows = m.weight.shape[0]
            m.weight.data = weight[row : row + rows]
            if bias is not None:
                m.bias.data = bias[row : row + rows]
            row += rows
    return weight, bias
