"""`log_probs.chunked_log_probs` against `response_outputs.vocab_parallel_log_probs`, its plain-autograd reference.

On the CPU in one gloo process (TP 1): the forward values of any shape, padding,
temperature, chunk size and input dtype equal the reference's on the logits cast to
fp32, and the gradients of random upstream gradients of both outputs equal
autograd's through the reference; nothing the size of the logits is saved in fp32.
Under TP 2 (two gloo processes, `_scripts/chunked_log_probs_check.py`) each rank's
values and gradient slice equal the TP-1 reference on the whole logits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.worker.log_probs import chunked_log_probs
from tandem.megatron.worker.response_outputs import vocab_parallel_log_probs

SCRIPTS = Path(__file__).parent / "_scripts"


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    """A one-process gloo world with Megatron's parallel state at TP 1, PP 1."""
    from megatron.core import parallel_state as mpu

    from tandem.megatron.models._cpu_compat import enable_cpu_compat

    assert not dist.is_initialized()
    enable_cpu_compat()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mpu.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
        yield
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


def reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    vocab_size: int | None,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return vocab_parallel_log_probs(
        logits.float() / temperature, targets, with_entropy=with_entropy, vocab_size=vocab_size
    )


def grads_of(
    outputs: tuple[torch.Tensor, torch.Tensor | None], logits: torch.Tensor, upstream: list[torch.Tensor]
) -> torch.Tensor:
    """The gradient reaching `logits` of `Σ g_lp · log_probs + Σ g_H · entropy`."""
    log_probs, entropy = outputs
    loss = (upstream[0] * log_probs).sum()
    if entropy is not None:
        loss = loss + (upstream[1] * entropy).sum()
    (grad,) = torch.autograd.grad(loss, logits)
    return grad


def assert_grads_close(
    got: torch.Tensor,
    want: torch.Tensor,
    logits: torch.Tensor,
    upstream: list[torch.Tensor],
    temperature: float,
) -> None:
    """Entry by entry: 1e-5 relative (fp32; bf16: one bf16 rounding), plus 2e-6 of the row's natural scale.

    An entry `-p_j (g_lp + g_H (s_j − E[s])) / T` is a sum of terms up to
    `(|g_lp| + |g_H| (1 + |s|)) / T` in size, which may cancel to far less; fp32 rounds
    the terms, so that (with `|s| ≤ 2 max |x|`) is the scale of any fp32 computation's
    error, the reference's as much as ours (against float64 both stay below 4e-7 of it).
    """
    assert got.dtype == want.dtype
    x = logits.detach().float().abs() / temperature
    natural = (upstream[0].abs() + upstream[1].abs() * (1 + 2 * x.amax(dim=-1))) / temperature
    rtol = 1e-5 if got.dtype == torch.float32 else 2**-7
    error = (got.float() - want.float()).abs()
    allowed = rtol * want.float().abs() + 2e-6 * natural.unsqueeze(-1)
    assert (error <= allowed).all(), (
        f"gradients differ by up to {float(error.max()):.3g}, "
        f"{float((error / allowed).max()):.3g} times what is allowed"
    )


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 40))
    vocab_local = draw(st.integers(2, 300))
    vocab_size = draw(st.one_of(st.none(), st.integers(1, vocab_local)))
    return {
        "n": n,
        "vocab_local": vocab_local,
        "vocab_size": vocab_size,
        "temperature": draw(st.sampled_from([1.0, 0.7, 0.3, 1.5, 3.0])),
        "chunk": draw(st.integers(1, n + 3)),
        "with_entropy": draw(st.booleans()),
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "scale": draw(st.sampled_from([0.1, 1.0, 5.0, 30.0])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def inputs(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Logits (a leaf in the case's dtype), targets below the vocabulary, and two upstream gradients."""
    generator = torch.Generator().manual_seed(case["seed"])
    n, vocab_local = case["n"], case["vocab_local"]
    logits = (torch.randn(n, vocab_local, generator=generator) * case["scale"]).to(case["dtype"])
    real = case["vocab_size"] or vocab_local
    targets = torch.randint(0, real, (n,), generator=generator)
    upstream = [torch.randn(n, generator=generator), torch.randn(n, generator=generator)]
    return logits.requires_grad_(), targets, upstream


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_forward_and_gradients_equal_the_reference(case: dict[str, Any]) -> None:
    logits, targets, upstream = inputs(case)
    args = (case["temperature"], case["vocab_size"], case["with_entropy"])
    want = reference(logits, targets, *args)
    got = chunked_log_probs(
        logits,
        targets,
        temperature=case["temperature"],
        vocab_size=case["vocab_size"],
        with_entropy=case["with_entropy"],
        chunk_tokens=case["chunk"],
    )
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    if case["with_entropy"]:
        assert got[1] is not None and want[1] is not None
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    else:
        assert got[1] is None
    want_grad = grads_of(want, logits, upstream)
    got_grad = grads_of(got, logits, upstream)
    assert_grads_close(got_grad, want_grad, logits, upstream, case["temperature"])
    # A real gradient, not two zeros (one real token is a certainty: nothing to move, and so is a row
    # whose softmax saturates in float32, every probability exactly 0 or 1); none reaches the padding
    # columns.
    real = case["vocab_size"] or case["vocab_local"]
    probs = torch.softmax(logits.detach().float()[:, :real] / case["temperature"], dim=-1)
    certain = bool(((probs == 0) | (probs == 1)).all())
    if not certain:
        assert float(want_grad.abs().max()) > 0
    if case["vocab_size"] is not None:
        assert not got_grad[:, case["vocab_size"] :].any()


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_either_output_alone_gets_its_own_gradient(case: dict[str, Any]) -> None:
    """A loss of the entropy alone (the log-probs' gradient never materialised), or of the log-probs alone."""
    logits, targets, upstream = inputs(case)
    args = (case["temperature"], case["vocab_size"], True)
    kwargs = {"temperature": case["temperature"], "vocab_size": case["vocab_size"], "with_entropy": True}
    for which in (0, 1):
        want = reference(logits, targets, *args)[which]
        got = chunked_log_probs(logits, targets, chunk_tokens=case["chunk"], **kwargs)[which]
        assert want is not None and got is not None
        (want_grad,) = torch.autograd.grad((upstream[which] * want).sum(), logits)
        (got_grad,) = torch.autograd.grad((upstream[which] * got).sum(), logits)
        alone = [g if i == which else torch.zeros_like(g) for i, g in enumerate(upstream)]
        assert_grads_close(got_grad, want_grad, logits, alone, case["temperature"])


def test_the_forward_is_the_reference_bit_for_bit() -> None:
    """The same fp32 operations in the same order on each row: equal values, not merely close ones."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 257, generator=generator).mul(8).bfloat16()
    targets = torch.randint(0, 250, (37,), generator=generator)
    want = reference(logits, targets, 0.7, 250, True)
    for chunk in (1, 5, 37, 100):
        got = chunked_log_probs(
            logits, targets, temperature=0.7, vocab_size=250, with_entropy=True, chunk_tokens=chunk
        )
        assert torch.equal(got[0], want[0]), chunk
        assert got[1] is not None and want[1] is not None and torch.equal(got[1], want[1]), chunk


def test_only_the_logits_and_per_row_figures_are_saved() -> None:
    """The graph keeps the bf16 logits and `(n,)` tensors; the reference keeps fp32 copies of the logits."""
    n, vocab = 24, 300

    def saved_by(run: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
        seen: list[tuple[tuple[int, ...], torch.dtype]] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            seen.append((tuple(tensor.shape), tensor.dtype))
            return tensor

        logits = torch.randn(n, vocab).bfloat16().requires_grad_()
        targets = torch.randint(0, vocab - 10, (n,))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(logits, targets)
        return seen

    chunked = saved_by(
        lambda z, t: chunked_log_probs(z, t, vocab_size=vocab - 10, with_entropy=True, chunk_tokens=5)
    )
    assert chunked and all(shape in ((n,), (n, vocab)) for shape, _ in chunked)
    assert all(dtype == torch.bfloat16 for shape, dtype in chunked if shape == (n, vocab))
    full = saved_by(lambda z, t: reference(z, t, 1.0, vocab - 10, True))
    assert any(shape == (n, vocab) and dtype == torch.float32 for shape, dtype in full)


def test_bad_arguments_are_refused() -> None:
    logits, targets = torch.zeros(3, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_log_probs(logits, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_log_probs(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="targets"):
        chunked_log_probs(logits, targets[:2])


def test_response_outputs_take_the_chunked_path_and_0_the_previous_one() -> None:
    """`response_outputs` with a chunk size and with 0 (the plain-autograd path): the same tensors, gradients."""
    from tandem.megatron.batch import RolloutBatch
    from tandem.megatron.worker.response_outputs import response_outputs

    generator = torch.Generator().manual_seed(7)
    lengths, responses, vocab = [9, 6, 12], [4, 1, 7], 40
    mb = RolloutBatch(
        tokens=[torch.randint(0, 33, (n,), generator=generator) for n in lengths],
        response_lengths=responses,
        loss_masks=[torch.ones(r) for r in responses],
        rewards=torch.zeros(len(lengths)),
    )
    tokens = torch.nn.utils.rnn.pad_sequence(mb.tokens, batch_first=True)
    output = torch.randn(len(lengths), max(lengths), vocab, generator=generator).mul(4).bfloat16()
    upstream = torch.randn(len(lengths), max(responses), generator=generator)
    results = []
    saved_fp32_logits = []
    for chunk in (0, 3):
        leaf = output.clone().requires_grad_()
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, s=saved: s.append(t) or t, lambda t: t):
            outputs = response_outputs(
                mb,
                tokens,
                leaf,
                role="actor",
                temperature=0.8,
                with_entropy=True,
                vocab_size=33,
                log_probs_chunk_tokens=chunk,
            )
        saved_fp32_logits.append(any(t.dtype == torch.float32 and t.shape[-1:] == (vocab,) for t in saved))
        assert outputs.log_probs is not None and outputs.entropy is not None
        (grad,) = torch.autograd.grad((upstream * (outputs.log_probs + outputs.entropy)).sum(), leaf)
        results.append((outputs.log_probs.detach(), outputs.entropy.detach(), grad))
    (lp0, h0, g0), (lp, h, g) = results
    assert saved_fp32_logits == [True, False]
    assert torch.equal(lp, lp0) and torch.equal(h, h0)
    assert (lp[0, 4:] == 0).all() and (lp[1, 1:] == 0).all()
    torch.testing.assert_close(g.float(), g0.float(), rtol=2**-7, atol=1e-5)
    assert g.abs().max() > 0


def test_run_micro_batches_refuses_a_negative_chunk() -> None:
    from tandem.megatron.worker.forward import run_micro_batches

    with pytest.raises(ValueError, match="log_probs_chunk_tokens"):
        run_micro_batches(torch.nn.Linear(1, 1), [], role="actor", log_probs_chunk_tokens=-1)


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["chunked", "fused"])
def test_two_tensor_parallel_ranks_equal_the_whole_vocabulary(tmp_path: Path, fused: bool) -> None:
    """Each TP-2 rank's outputs and gradient slice against the TP-1 reference on the gathered logits.

    `fused`: the Triton kernels of `fused_log_probs` (under Triton's CPU interpreter) instead of the
    chunked kernel; their online softmax sums in another order, so values agree to 1e-5.
    """
    command = [sys.executable, str(SCRIPTS / "launch.py"), "2", str(SCRIPTS / "chunked_log_probs_check.py")]
    env = dict(os.environ, TRITON_INTERPRET="1") if fused else None
    extra = ["--fused"] if fused else []
    proc = subprocess.run(
        [*command, str(tmp_path), *extra], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    inputs_ = torch.load(tmp_path / "inputs.pt")
    assert inputs_, "the script wrote no cases"
    for name, case in inputs_.items():
        logits = case["logits"].clone().requires_grad_()
        args = (case["temperature"], case["vocab_size"], case["with_entropy"])
        want = reference(logits, case["targets"], *args)
        want_grad = grads_of(want, logits, case["upstream"])
        halves = want_grad.chunk(2, dim=-1)
        for rank in (0, 1):
            got = torch.load(tmp_path / f"{name}-rank{rank}.pt")
            tol = 1e-5 if fused else 1e-6
            torch.testing.assert_close(got["log_probs"], want[0], rtol=tol, atol=tol, msg=name)
            if case["with_entropy"]:
                assert want[1] is not None
                torch.testing.assert_close(got["entropy"], want[1], rtol=tol, atol=tol, msg=name)
            # The natural scale is of the whole row, whose max shifts both halves.
            scale_args = (case["logits"], case["upstream"], case["temperature"])
            assert_grads_close(got["grad"], halves[rank], *scale_args)
            # The TP-2 reference on the same slices agrees with the chunked kernel there too.
            torch.testing.assert_close(got["log_probs"], got["ref_log_probs"], rtol=tol, atol=tol, msg=name)
            assert_grads_close(got["grad"], got["ref_grad"], *scale_args)
