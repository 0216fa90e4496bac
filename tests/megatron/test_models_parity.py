"""Our Megatron actor and critic against transformers' own Llama, Qwen2, Qwen3 and Mistral (fp32, CPU, gloo).

The test builds small random HF models (grouped-query attention, a 200-token
vocabulary that Megatron pads to 256 rows, Qwen3 and Mistral with a head_dim
that is not hidden/heads, Llama with tied embeddings and Llama-3 RoPE scaling,
Qwen2 with its q/k/v biases saved as a sharded checkpoint), saves them with
`save_pretrained`, and runs `_scripts/model_checks.py` in two fresh processes
(Megatron never initialises inside pytest) for three layouts: TP=1/PP=1
(data-parallel 2), TP=2 and PP=2. The references below come from the HF models.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "_scripts"
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
PHASES = ("1x1", "2x1", "1x2")
TEMPERATURE = 0.7
FP32_ATOL = 1e-4
VOCAB = 200
"""Not a multiple of 128 * TP: Megatron's vocabulary is padded (to 256 rows at TP 1 and 2)."""


def _hf_model(family: str) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    if family == "llama":
        config = transformers.LlamaConfig(
            **common,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(
            **common, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_theta": 1e6}
        )
        model = transformers.Qwen2ForCausalLM(config)
    elif family == "mistral":
        # Mistral-Nemo style: a head_dim that is not hidden / heads, no sliding window.
        config = transformers.MistralConfig(
            **common,
            head_dim=32,
            sliding_window=None,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={"rope_theta": 1e6},
        )
        model = transformers.MistralForCausalLM(config)
    else:
        config = transformers.Qwen3Config(
            **common,
            head_dim=24,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_parameters={"rope_theta": 1e6},
        )
        model = transformers.Qwen3ForCausalLM(config)
    # HF initialises norms to 1 and biases to 0; perturb everything so that a
    # swapped norm or a dropped bias shows in the outputs.
    gen = torch.Generator().manual_seed(len(family))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.float().eval()


def _inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    lengths, response_lengths = [7, 11, 5], [3, 6, 2]
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    loss_masks = [torch.tensor([1, 0, 1]), torch.tensor([1, 1, 0, 1, 1, 1]), torch.tensor([1, 1])]
    return {
        "families": list(FAMILIES),
        "temperature": TEMPERATURE,
        "square_tokens": torch.randint(0, VOCAB, (2, 12), generator=gen),
        "tokens": tokens,
        "response_lengths": response_lengths,
        "loss_masks": [m.float() for m in loss_masks],
    }


def _prepare_and_run(work: Path, nproc: int, phases: tuple[str, ...]) -> dict[str, Any]:
    """Save the HF models, run the Megatron side once in `nproc` processes, load everything back."""
    inputs = _inputs()
    models = {}
    for family in FAMILIES:
        model = _hf_model(family)
        # Qwen2 goes through the sharded-checkpoint path (model.safetensors.index.json).
        shard = {"max_shard_size": "50KB"} if family == "qwen2" else {}
        model.save_pretrained(work / family, **shard)
        models[family] = model
    assert (work / "qwen2" / "model.safetensors.index.json").is_file()
    torch.save(inputs, work / "inputs.pt")
    command = [sys.executable, str(SCRIPTS / "launch.py"), str(nproc), str(SCRIPTS / "model_checks.py")]
    proc = subprocess.run(
        [*command, str(work), ",".join(phases)], capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    ranks = list(range(nproc))
    outputs = {
        (phase, family, rank): torch.load(
            work / "out" / phase / family / f"rank{rank}.pt", weights_only=False
        )
        for phase in phases
        for family in FAMILIES
        for rank in ranks
    }
    return {
        "work": work,
        "inputs": inputs,
        "models": models,
        "outputs": outputs,
        "ranks": ranks,
        "atol": FP32_ATOL,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _prepare_and_run(tmp_path_factory.mktemp("parity"), 2, PHASES)


def _last_stage_ranks(run: dict[str, Any], phase: str) -> list[int]:
    # PP=2 over two processes: rank 1 is the last stage; otherwise every rank is.
    return [1] if phase == "1x2" else run["ranks"]


def _response_slices(inputs: dict[str, Any]) -> list[tuple[torch.Tensor, int, int]]:
    return [
        (t, t.numel() - r, t.numel())
        for t, r in zip(inputs["tokens"], inputs["response_lengths"], strict=True)
    ]


def _reference_actor(model: Any, inputs: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sample response log-probs and entropies from transformers' logits / temperature."""
    log_probs, entropies = [], []
    for tokens, prompt, total in _response_slices(inputs):
        logits = model(tokens[None]).logits[0, prompt - 1 : total - 1] / TEMPERATURE
        logp = torch.log_softmax(logits.float(), dim=-1)
        log_probs.append(logp.gather(-1, tokens[prompt:total, None])[:, 0])
        entropies.append(-(logp.exp() * logp).sum(-1))
    return log_probs, entropies


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(run: dict[str, Any], family: str, phase: str) -> None:
    with torch.no_grad():
        expected = run["models"][family](run["inputs"]["square_tokens"]).logits
    vocab = expected.shape[-1]
    tp = int(phase.split("x")[0])
    for rank in _last_stage_ranks(run, phase):
        ours = run["outputs"][(phase, family, rank)]["logits"]
        # Megatron's vocabulary is padded to a multiple of 128 * TP (200 -> 256 rows; at TP 2 the
        # second rank's 128 rows hold 72 tokens and 56 padding rows); the tokens' logits are the
        # model's, the padding rows' are zeros that no softmax sees.
        step = 128 * tp
        assert ours.shape == (*expected.shape[:-1], -(-vocab // step) * step)
        assert (ours[..., :vocab] - expected).abs().max().item() < run["atol"]
        assert not ours[..., vocab:].any()
    if phase == "1x2":
        assert run["outputs"][(phase, family, 0)]["logits"] is None


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_only_log_probs_and_entropy_match_transformers(
    run: dict[str, Any], family: str, phase: str
) -> None:
    with torch.no_grad():
        expected_lp, expected_ent = _reference_actor(run["models"][family], run["inputs"])
    for rank in _last_stage_ranks(run, phase):
        out = run["outputs"][(phase, family, rank)]
        assert len(out["log_probs"]) == len(expected_lp)
        for ours, ref, ent, ref_ent in zip(
            out["log_probs"], expected_lp, out["entropy"], expected_ent, strict=True
        ):
            assert ours.shape == ref.shape and ent.shape == ref_ent.shape
            assert (ours - ref).abs().max().item() < run["atol"]
            assert (ent - ref_ent).abs().max().item() < run["atol"]
        # Two micro-batches of at most 2 samples: the loss_fn metrics come back one per micro-batch.
        assert [m["n"] for m in out["entropy_metrics"]] == [2, 1]
    if phase == "1x2":
        assert run["outputs"][(phase, family, 0)]["log_probs"] is None


def test_log_probs_use_the_temperature(run: dict[str, Any]) -> None:
    # Guards the reference itself: at temperature 1 the log-probs differ from ours.
    model, inputs = run["models"]["qwen2"], run["inputs"]
    tokens, prompt, total = _response_slices(inputs)[1]
    with torch.no_grad():
        plain = torch.log_softmax(model(tokens[None]).logits[0, prompt - 1 : total - 1], -1)
    plain_lp = plain.gather(-1, tokens[prompt:total, None])[:, 0]
    ours = run["outputs"][("1x1", "qwen2", 0)]["log_probs"][1]
    assert (ours - plain_lp).abs().max().item() > 100 * FP32_ATOL


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_returns_identical_tensors_on_every_rank(
    run: dict[str, Any], family: str, phase: str
) -> None:
    from safetensors.torch import load_file

    folder = run["work"] / family
    saved: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        saved.update(load_file(f))
    for rank in run["ranks"]:
        out = run["outputs"][(phase, family, rank)]
        exported = out["actor_export"]
        # A tied head is not exported: the engine ties lm_head to the embedding itself.
        expected_names = set(saved) - ({"lm_head.weight"} if family == "llama" else set())
        assert set(exported) == expected_names
        for name, tensor in exported.items():
            assert torch.equal(tensor, saved[name]), name
        sizes = out["actor_chunk_sizes"]
        assert len(sizes) > 1
        biggest = max(t.numel() * t.element_size() for t in exported.values())
        assert all(s <= max(6000, biggest) for s in sizes)
        # The critic exports the same backbone plus its own head.
        critic = out["critic_export"]
        assert set(critic) == {n for n in expected_names if n != "lm_head.weight"} | {
            "score.weight",
            "score.bias",
        }
        for name in critic:
            if not name.startswith("score."):
                assert torch.equal(critic[name], saved[name]), name


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_critic_head_and_values(run: dict[str, Any], family: str, phase: str) -> None:
    model, inputs = run["models"][family], run["inputs"]
    for rank in _last_stage_ranks(run, phase):
        out = run["outputs"][(phase, family, rank)]
        head = out["critic_head"]
        assert head["weight_shape"] == (1, 64) and head["bias_shape"] == (1,)
        assert head["weight_dtype"] == "torch.float32" and not head["is_embedding"]
        w, b = out["critic_export"]["score.weight"], out["critic_export"]["score.bias"]
        for ours, (tokens, prompt, total) in zip(out["values"], _response_slices(inputs), strict=True):
            with torch.no_grad():
                hidden = model.model(tokens[None]).last_hidden_state[0, prompt - 1 : total - 1]
            expected = hidden @ w.T[:, 0] + b
            assert ours.dtype == torch.float32 and ours.shape == expected.shape
            assert (ours - expected).abs().max().item() < run["atol"]
        # Saved from its export and loaded into a critic with another head init: same values.
        for again, ours in zip(out["reloaded_values"], out["values"], strict=True):
            assert (again - ours).abs().max().item() < run["atol"]
    # The head is equal on every rank (same seeded init), and untied from the embedding.
    heads = [run["outputs"][(phase, family, r)]["critic_export"]["score.weight"] for r in run["ranks"]]
    assert all(torch.equal(heads[0], h) for h in heads)


def _close(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> bool:
    return (ours - ref).abs().max().item() <= atol * ref.abs().max().item() + 1e-6


def _reference_grads(run: dict[str, Any], family: str) -> dict[str, dict[str, torch.Tensor]]:
    """transformers' gradients of the two test losses of model_checks.py (computed once per family)."""
    cache = run.setdefault("grad_cache", {})
    if family in cache:
        return cache[family]
    inputs, model = run["inputs"], run["models"][family]
    model.zero_grad()
    log_probs, entropies = _reference_actor(model, inputs)
    loss = sum(
        ((lp + 0.1 * e) * m).sum()
        for lp, e, m in zip(log_probs, entropies, inputs["loss_masks"], strict=True)
    )
    torch.as_tensor(loss).backward()
    actor = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # Critic: values from the HF backbone and our (seeded, equal everywhere) head,
    # loss sum((v - 0.5)^2 * mask).
    export = run["outputs"][(PHASES[0], family, 0)]["critic_export"]
    w = export["score.weight"].clone().requires_grad_()
    b = export["score.bias"].clone().requires_grad_()
    total = torch.zeros(())
    for (tokens, prompt, end), m in zip(_response_slices(inputs), inputs["loss_masks"], strict=True):
        hidden = model.model(tokens[None]).last_hidden_state[0, prompt - 1 : end - 1]
        total = total + (((hidden @ w.T)[:, 0] + b - 0.5) ** 2 * m).sum()
    total.backward()
    critic = {n: p.grad.clone() for n, p in model.model.named_parameters(prefix="model")}
    critic |= {"score.weight": w.grad, "score.bias": b.grad}
    model.zero_grad()
    cache[family] = {"actor": actor, "critic": critic}
    return cache[family]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_training_gradients_match_transformers(run: dict[str, Any], family: str, phase: str) -> None:
    """run_micro_batches(backward=True): gradients of the same losses as in transformers.

    The script sums q/k-norm grads over TP and tied-head grads over PP as
    Megatron's finalize_model_grads does (the worker's DDP set-up).
    """
    expected = _reference_grads(run, family)
    for rank in run["ranks"]:
        out = run["outputs"][(phase, family, rank)]
        # The reference used the first layout's critic head; this layout's is the same.
        reference_head = run["outputs"][(PHASES[0], family, 0)]["critic_export"]["score.weight"]
        assert torch.equal(out["critic_export"]["score.weight"], reference_head)
        for role in ("actor", "critic"):
            grads = out[f"{role}_grads"]
            for name, ref in expected[role].items():
                assert _close(grads[name], ref, run["atol"]), (role, name)


@pytest.mark.gpu
def test_everything_above_on_cuda(tmp_path: Path) -> None:
    """The same checks with the models on CUDA (NCCL): 2 GPUs give all three layouts, 1 GPU the plain one."""
    nproc = min(2, torch.cuda.device_count())
    phases = PHASES if nproc == 2 else ("1x1",)
    gpu_run = _prepare_and_run(tmp_path, nproc, phases)
    gpu_run["atol"] = 1e-3  # GPU kernels sum in other orders than the CPU reference
    for phase in phases:
        for family in FAMILIES:
            test_logits_match_transformers(gpu_run, family, phase)
            test_forward_only_log_probs_and_entropy_match_transformers(gpu_run, family, phase)
            test_export_round_trip_returns_identical_tensors_on_every_rank(gpu_run, family, phase)
            test_critic_head_and_values(gpu_run, family, phase)
            test_training_gradients_match_transformers(gpu_run, family, phase)
