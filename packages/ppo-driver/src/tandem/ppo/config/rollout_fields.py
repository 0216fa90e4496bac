"""The run's length and folder, and what it samples and scores: data, rollout, rewards, distillation, eval.

`RolloutFields` is a part of `RunFields` (every flag of `ppo-driver train`), kept apart so that each
module stays one concept; as a base class its fields keep their place in `RunFields`' order, after
the workers', the memory plan's and the episodes' fields and before the placement's.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

import tyro

__all__ = ["RolloutFields"]


@dataclasses.dataclass(frozen=True)
class RolloutFields:
    """The flags of the run's length and folder, its prompts, sampling, rewards, teacher and eval."""

    # --- run ------------------------------------------------------------------------------
    run_dir: str = "runs/ppo"
    """Folder of the run: config.yaml, metrics.jsonl, TensorBoard events, plots, checkpoints
    (`actor/`, `critic/` unless `--save` / `--critic-save` say otherwise) and `hf/` at the end."""

    num_rollout: int = 10
    """PPO steps (rollouts) of the whole run, counted from rollout 0 (a resumed run continues)."""

    num_critic_only_steps: int = 0
    """First steps in which only the critic trains (warm-up): no actor update, no weight sync."""

    # --- data -------------------------------------------------------------------------------
    prompt_data: str | None = None
    """Training prompts: JSONL (each line a `prompt` string or chat `messages`, a `label`, and any
    other fields, passed to the reward as metadata), Parquet (a file or a folder of them, verl's
    schema included) or a Hugging Face datasets folder (`save_to_disk`)."""

    input_key: str = "prompt"
    """Field (JSONL key, Parquet column) of the prompt: a string, or a list of chat messages (verl's
    `prompt` column); `messages` is always read as a chat."""

    label_key: str = "label"
    """Field of the label; a dotted name reaches into a nested field (`reward_model.ground_truth`).
    Where a row has no such field, verl's `reward_model.ground_truth` is the label."""

    apply_chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template (from the HF folder) when it has one."""

    max_prompt_len: int = 512
    """Prompts longer than this many tokens are dropped (and counted in the metrics)."""

    # --- rollout ------------------------------------------------------------------------------
    rollout_max_response_len: int = 128
    """Most tokens per sampled response."""

    rollout_top_p: float = 1.0
    """Nucleus sampling of the rollout; 1: off."""

    rollout_top_k: int = -1
    """Top-k sampling of the rollout; -1: off."""

    rollout_stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a response (the tokenizer's EOS always does)."""

    rollout_ignore_eos: bool = False
    """Sample exactly `rollout_max_response_len` tokens, EOS as an ordinary token (benchmarks)."""

    rollout_engine: Literal["embedded", "sglang"] = "embedded"
    """`embedded`: Tandem's engine on Hugging Face transformers (CPU and GPU); `sglang`: SGLang
    servers (extra `tandem-ppo-driver[sglang]`)."""

    rollout_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the rollout engine's weights; auto: bfloat16 on a GPU, float32 on the CPU."""

    rollout_fused_decode: bool = True
    """Embedded engine: the fused decode step (Triton kernels, one CUDA graph per batch bucket) for
    Llama, Qwen2 and Mistral models on CUDA; off: transformers' own decode step. The same
    distribution either way, but not the same random numbers (`EngineOptions.fused_decode`)."""

    rollout_kv_cache_memory_fraction: float | None = None
    """Embedded engine: at most this fraction of the GPU's memory holds the KV cache (a larger batch is
    generated in waves); None: the engine's default. Lower it when the models stay resident."""

    rollout_kv_cache_backend: Literal["torch", "torch_memory_saver"] = "torch"
    """Embedded engine on CUDA: where its KV cache lives. `torch_memory_saver`: in a region of
    torch_memory_saver, so that a release of the KV cache alone (the memory plan's, `--memory-plan fit`,
    where the engines' weights stay) keeps its addresses and the decode's CUDA graphs, which then need no
    capture again; `torch`: torch's allocator, the graphs captured again after each release
    (`EngineOptions.kv_cache_backend`)."""

    weight_sync: Literal["auto", "ipc", "cpu"] = "auto"
    """How the actor's weights reach the engines: `ipc`, CUDA IPC handles from actor rank r to the
    engine on its GPU (no copy through the host; colocated, one engine per actor rank); `cpu`, CPU
    copies from rank 0 to every engine through Ray; `auto`, `ipc` where it applies, else `cpu`."""

    lora_sync: Literal["auto", "adapters", "merged"] = "auto"
    """How a LoRA actor (`--lora-rank`) reaches the engines: `adapters`, its adapters alone, which each
    embedded engine merges into its own copy of the base, exactly, from that copy (the base itself is
    copied to the host once); `merged`, its whole weights with the adapters merged in, as a full
    fine-tune sends them; `auto`, `adapters` with the embedded engine, `merged` with SGLang (which is
    sent whole weights)."""

    sglang_urls: tuple[str, ...] = ()
    """Attach to these running SGLang servers (one per rollout GPU) instead of launching them."""

    dynamic_sampling: bool = False
    """Drop prompts whose samples all got the same reward (no signal) and draw more prompts until
    the rollout is full, within `dynamic_sampling_max_rounds` rounds."""

    dynamic_sampling_max_rounds: int = 4
    """Most rounds of drawing `rollout_batch_size` prompts per step with `dynamic_sampling`; a batch
    still short after them is filled with dropped prompts (counted in `dynamic/filled_prompts`)."""

    overlong_buffer_len: int | None = None
    """DAPO's soft overlong punishment: over the last this many tokens before
    `--rollout-max-response-len`, a response's reward loses up to `--overlong-penalty-factor`, in
    proportion to how far into them it ran (DAPO eq. 13, `tandem.megatron.algorithms.reward_shaping`;
    `reward/overlong_penalty`); None: off."""

    overlong_penalty_factor: float = 1.0
    """With `--overlong-buffer-len`: the penalty of a response that reaches `--rollout-max-response-len`."""

    filter_truncated: bool = False
    """Leave responses cut at `--rollout-max-response-len` (finish reason `length`) out of both
    models' losses (loss mask 0; DAPO's overlong filtering); they still count in their prompt's
    group baseline, and in the `reward/` metrics."""

    # --- rewards ----------------------------------------------------------------------------
    rm_type: str = "exact_match"
    """Built-in reward: `exact_match` (response equals the label), `math` (final answer
    compared symbolically with math-verify), `model` (the score of `--reward-model`), or `none`
    (every reward 0: the student learns from its teacher alone, `--teacher-hf-checkpoint`)."""

    custom_rm_path: str | None = None
    """A reward of your own, `package.module:function` or `/path/to/file.py:function`: batched,
    sync or async, given prompt, response, label and metadata per sample; overrides `rm_type`."""

    reward_model: str | None = None
    """With `--rm-type model`: a Hugging Face sequence-classification folder (num_labels=1, e.g. a
    LlamaForSequenceClassification) whose score of prompt + response is the reward. It runs
    forward only on the rollout GPUs, one worker per engine, and sleeps while the others work."""

    reward_weights: str | None = None
    """The reward as a weighted sum of terms, e.g. `model=1.0,exact_match=0.5`; terms: `model`,
    `exact_match`, `math`, `custom` (`--custom-rm-path`). None: the one reward of `--rm-type`
    (or `--custom-rm-path`), weight 1. Each term's mean is a metric, `reward/<term>`."""

    reward_model_input: Literal["tokens", "chat"] = "tokens"
    """What the reward model reads: `tokens`, the policy's ids (prompt with its chat template, then
    the response; needs the policy's vocabulary); `chat`, the reward model's own tokenizer and chat
    template over the prompt's messages and the decoded response."""

    reward_model_max_tokens_per_gpu: int = 16384
    """Token budget of one reward-model forward pass: samples are batched, longest first, so that
    rows x the longest sample stays within it."""

    reward_model_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the reward model; auto: bfloat16 on a GPU, float32 on the CPU."""

    reward_model_gpu_share: float = 0.5
    """Fraction of the engine's Ray GPU share on each rollout bundle that its reward-model worker
    takes (scheduling, not memory: in a shared step the two never hold memory at once)."""

    # --- on-policy distillation ----------------------------------------------------------------
    teacher_hf_checkpoint: str | None = None
    """The teacher of on-policy distillation (with `--opd-coef`): a Hugging Face causal-LM folder on the
    student's tokenizer (checked before the run starts), of any size (a 1.5B teacher for a 0.5B student).
    It runs forward only on the rollout GPUs, one worker per engine, gives the log-prob of every token of
    the student's samples, and sleeps while the others work."""

    teacher_max_tokens_per_gpu: int = 16384
    """Token budget of one teacher forward pass: samples are batched, longest first, so that rows x the
    longest sample stays within it."""

    teacher_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the teacher; auto: bfloat16 on a GPU, float32 on the CPU."""

    teacher_gpu_share: float = 0.25
    """Fraction of the engine's Ray GPU share on each rollout bundle that its teacher worker takes
    (scheduling, not memory: in a shared step the two never hold memory at once)."""

    accuracy_threshold: float = 1.0
    """A sample counts as correct for `reward/accuracy` when its reward is at least this."""

    # --- eval ---------------------------------------------------------------------------------
    eval_prompt_data: str | None = None
    """JSONL of eval prompts (same format as `prompt_data`)."""

    eval_interval: int | None = None
    """Evaluate every this many steps (and after the last); None: never."""

    eval_before_train: bool = True
    """With `eval_interval`: also evaluate the starting weights before the first step (verl's
    `val_before_train`), logged as step -1, so that one run holds the base model's eval figures and
    the trained one's. A resumed run does not repeat it."""

    n_samples_per_eval_prompt: int = 1
    """Responses per eval prompt."""

    eval_temperature: float = 0.0
    """Sampling temperature of the eval; 0: greedy."""

    async_mode: Annotated[bool, tyro.conf.arg(name="async")] = False
    """Generate rollout k+1 while the models train on rollout k (rollout GPUs of their own, so
    not with `--colocate`); each rollout is then one step off-policy (`async/staleness`), which
    `--use-tis` can correct. Actor and critic still train one after the other."""
