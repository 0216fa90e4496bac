"""The run's one typed config: every flag of `ppo-driver train`, read from YAML plus command-line overrides.

`PPOConfig` extends the train worker's `WorkerConfig` (tandem-megatron-backend)
with what the driver owns: data, rollout, rewards, placement, the offload plan,
checkpoint cadence and logging. Flags use slime/miles names where they exist
(`--use-critic`, `--colocate`, `--offload-train`, `--rollout-batch-size`, ...).

Construction never validates (so that a YAML file and flags can be merged
first); `validate()` checks the whole config before Ray starts and raises a
`ValueError` that names the flag and the fix. Derived sizes are properties,
computed in one place.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from tandem.megatron.config import WorkerConfig
from tandem.ppo.estimator_plan import check_estimator_plan
from tandem.ppo.reward_model import RM_TYPES, check_reward_config

BUILTIN_REWARDS = ("exact_match", "math")


FLAG_NAMES = {"async_mode": "async"}
"""Fields whose flag is not their name (`async` is a Python keyword)."""


def flag(name: str) -> str:
    """The command-line flag of config field `name` (`global_batch_size` -> `--global-batch-size`)."""
    return "--" + FLAG_NAMES.get(name, name).replace("_", "-")


@dataclasses.dataclass(frozen=True)
class PPOConfig(WorkerConfig):
    """Everything one PPO run needs: the train workers' fields plus the driver's."""

    hf_checkpoint: str = ""
    """Hugging Face folder (config.json, safetensors, tokenizer): the model's architecture, the
    actor's, critic's and reference's initial weights, the rollout engine's start and the tokenizer."""

    rollout_batch_size: int = 32
    """Prompts per rollout (each sampled `n_samples_per_prompt` times)."""

    global_batch_size: int = 32
    """Samples per optimizer step (over all data-parallel ranks); must divide a rollout's samples."""

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
    """JSONL of training prompts: each line a `prompt` string or chat `messages`, a `label`, and
    any other fields (passed to the reward as metadata)."""

    input_key: str = "prompt"
    """Key of the prompt string in each JSONL line (`messages` is always read as a chat)."""

    label_key: str = "label"
    """Key of the label in each JSONL line."""

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

    rollout_kv_cache_memory_fraction: float | None = None
    """Embedded engine: at most this fraction of the GPU's memory holds the KV cache (a larger batch is
    generated in waves); None: the engine's default. Lower it when the models stay resident."""

    weight_sync: Literal["auto", "ipc", "cpu"] = "auto"
    """How the actor's weights reach the engines: `ipc`, CUDA IPC handles from actor rank r to the
    engine on its GPU (no copy through the host; colocated, one engine per actor rank); `cpu`, CPU
    copies from rank 0 to every engine through Ray; `auto`, `ipc` where it applies, else `cpu`."""

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
    compared symbolically with math-verify), or `model` (the score of `--reward-model`)."""

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

    # --- placement and the offload plan ----------------------------------------------------------
    use_critic: bool = True
    """Train a critic (GAE's baseline); it shares the actor's GPUs and never adds any. Left unset, a
    critic-free `--advantage-estimator` implies `--no-use-critic` (no critic starts, sleeps or
    trains); asked for with one, or turned off with `gae`, it is refused."""

    colocate: bool = True
    """The rollout engine sits on the training GPUs (released during training)."""

    offload_train: bool = True
    """Actor and critic sleep after training and wake before it (they time-share the GPUs);
    `--no-offload-train` keeps both resident, for comparison."""

    actor_num_nodes: int = 1
    """Nodes of the actor (and critic)."""

    actor_num_gpus_per_node: int = 1
    """GPUs per node of the actor (and critic)."""

    rollout_num_gpus: int | None = None
    """GPUs of the rollout engines, one engine per GPU; None: the actor's GPUs when colocated."""

    train_backend: Literal["megatron"] = "megatron"
    """Training backend; the critic and the sleep/wake mechanism need Megatron."""

    actor_gpu_share: float = 0.4
    """Fraction of each shared GPU that Ray gives each actor rank (scheduling, not memory)."""

    critic_gpu_share: float = 0.4
    """Fraction of each shared GPU that Ray gives each critic rank."""

    engine_gpu_share: float = 0.2
    """Fraction of each shared GPU that Ray gives each rollout engine."""

    max_engine_restarts: int = 3
    """Times each rollout engine that dies (out of memory, killed) is started again on its bundle, with
    the current weights and the prompts it lost; one more death ends the run naming its rank. 0: never."""

    # --- checkpoints ---------------------------------------------------------------------------
    save_interval: int | None = None
    """Save a checkpoint every this many steps (and always at the end); None: only at the end."""

    save_on_interrupt: bool = True
    """On Ctrl-C, finish the step under way and save before exiting (130); a second Ctrl-C
    exits at once, leaving the last complete checkpoint."""

    export_hf: bool = True
    """Write the actor as a Hugging Face folder to `RUN_DIR/hf` at the end of the run."""

    # --- cluster and logging ----------------------------------------------------------------
    ray_address: str | None = None
    """Ray cluster to join; None: `RAY_ADDRESS`, else a local cluster."""

    local_gpus: int | None = None
    """Logical GPUs of a local Ray cluster on a machine without GPUs (CPU runs); None: what Ray
    detects."""

    tensorboard: bool = True
    """Write TensorBoard event files under RUN_DIR/tensorboard."""

    gpu_memory_metrics: bool = True
    """On GPUs, record each phase's device memory in use (`memory/<phase>_gib`, from nvidia-smi)."""

    progress: bool = True
    """Show a progress bar with the key figures."""

    # --- experiment trackers (extras tandem-ppo-driver[wandb] and [mlflow]) --------------------
    use_wandb: bool = False
    """Log every step's metrics (as metrics.jsonl has them) and the resolved config to Weights & Biases."""

    wandb_project: str = "tandem"
    """The wandb project of the run."""

    wandb_team: str | None = None
    """The wandb entity (team or user) of the run; None: your default entity."""

    wandb_group: str | None = None
    """The wandb group of the run (runs to compare side by side, e.g. shared vs resident)."""

    wandb_run_name: str | None = None
    """The wandb run's name; None: the name of RUN_DIR."""

    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """`offline`: write the run locally (`wandb sync` uploads it later); `disabled`: log nothing."""

    wandb_dir: str | None = None
    """Folder of wandb's own files; None: RUN_DIR (they go to RUN_DIR/wandb)."""

    use_mlflow: bool = False
    """Log every step's metrics (as metrics.jsonl has them) and the resolved config (as run
    parameters) to MLflow."""

    mlflow_tracking_uri: str | None = None
    """The MLflow tracking server or store; None: a local `file:` store at RUN_DIR/mlruns."""

    mlflow_experiment_name: str = "tandem"
    """The MLflow experiment the run is logged under (created when missing)."""

    def __post_init__(self) -> None:
        """Nothing: `validate()` checks the merged config (YAML + flags) before Ray starts."""

    # --- derived sizes -------------------------------------------------------------------
    @property
    def actor_num_gpus(self) -> int:
        """GPUs (ranks) of the actor, and of the critic that shares them."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_engines(self) -> int:
        """Rollout engines, one per rollout GPU."""
        if self.rollout_num_gpus is not None:
            return self.rollout_num_gpus
        return self.actor_num_gpus

    @property
    def actor_data_parallel_size(self) -> int:
        """Data-parallel size of the actor."""
        tp, pp = self.topology("actor")
        return self.actor_num_gpus // (tp * pp)

    @property
    def reward_spec(self) -> str:
        """What `load_reward` is given: the custom reward if set, else the built-in."""
        return self.custom_rm_path or self.rm_type

    @property
    def actor_save(self) -> str:
        """The actor's checkpoint folder: `--save`, else RUN_DIR/actor."""
        return self.save or str(Path(self.run_dir) / "actor")

    @property
    def critic_save_dir(self) -> str:
        """The critic's checkpoint folder: `--critic-save`, else RUN_DIR/critic."""
        return self.critic_save or str(Path(self.run_dir) / "critic")

    def worker_config(self) -> WorkerConfig:
        """The train workers' config: this config's WorkerConfig fields, checkpoints resumable by default.

        Each model resumes from its `--load` / `--critic-load`, or else from its own save folder
        (a run started again in the same RUN_DIR continues where it stopped).
        """
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(WorkerConfig)}
        values["save"] = self.actor_save
        values["critic_save"] = self.critic_save_dir if self.use_critic else None
        values["load"] = self.load or self.actor_save
        values["critic_load"] = (self.critic_load or self.critic_save_dir) if self.use_critic else None
        if self.async_mode and self.reuse_old_log_probs is None:
            # A rollout one step stale: the old log-probs stay a forward of their own (auto only).
            values["reuse_old_log_probs"] = False
        return WorkerConfig(**values)

    def placement_spec(self) -> Any:
        """The tandem.placement spec of this run."""
        from tandem.placement import PlacementSpec

        return PlacementSpec(
            actor_num_nodes=self.actor_num_nodes,
            actor_num_gpus_per_node=self.actor_num_gpus_per_node,
            rollout_num_gpus=self.num_engines,
            colocate=self.colocate,
            use_critic=self.use_critic,
        )

    # --- validation ------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the whole config; a ValueError naming the flag and the fix otherwise."""
        self._check_required()
        self._check_driver_numbers()
        self._check_plan()
        check_estimator_plan(self)
        self._check_files()
        from tandem.ppo.trackers import check_trackers

        check_trackers(self)
        check_reward_config(self)
        try:
            worker = self.worker_config()
            worker.check_world(self.actor_num_gpus, role=None if self.use_critic else "actor")
            worker.check_role("actor")
            worker.check_model("actor")
            if self.use_critic:
                worker.check_role("critic")
                worker.check_model("critic")
        except ValueError as exc:
            raise ValueError(_flagged(str(exc))) from None
        self._check_split()

    def _check_required(self) -> None:
        if not self.hf_checkpoint:
            raise ValueError(
                "--hf-checkpoint: not set; point it at a Hugging Face model folder (config.json, "
                "safetensors, tokenizer)"
            )
        if not self.prompt_data:
            raise ValueError("--prompt-data: not set; point it at a JSONL file of prompts and labels")

    def _check_driver_numbers(self) -> None:
        positive = {
            "num_rollout": self.num_rollout,
            "max_prompt_len": self.max_prompt_len,
            "rollout_max_response_len": self.rollout_max_response_len,
            "actor_num_nodes": self.actor_num_nodes,
            "actor_num_gpus_per_node": self.actor_num_gpus_per_node,
            "n_samples_per_eval_prompt": self.n_samples_per_eval_prompt,
            "dynamic_sampling_max_rounds": self.dynamic_sampling_max_rounds,
        }
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag(name)}: got {value!r}; it must be a positive integer")
        for name in ("rollout_num_gpus", "eval_interval", "save_interval", "local_gpus"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{flag(name)}: got {value!r}; it must be a positive integer, or unset")
        if (
            isinstance(self.max_engine_restarts, bool)
            or not isinstance(self.max_engine_restarts, int)
            or (self.max_engine_restarts < 0)
        ):
            raise ValueError(
                f"--max-engine-restarts: got {self.max_engine_restarts!r}; it must be an integer >= 0 (0: never)"
            )
        if not 0 <= self.num_critic_only_steps <= self.num_rollout:
            raise ValueError(
                f"--num-critic-only-steps: got {self.num_critic_only_steps}; it must lie in "
                f"[0, --num-rollout = {self.num_rollout}]"
            )
        fraction = self.rollout_kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(
                f"--rollout-kv-cache-memory-fraction: got {fraction}; it must lie in (0, 1], or unset"
            )
        if self.dynamic_sampling and self.n_samples_per_prompt < 2:
            raise ValueError(
                "--dynamic-sampling: needs --n-samples-per-prompt of at least 2 (a prompt's samples are "
                "compared with each other)"
            )
        if not 0 < self.rollout_top_p <= 1:
            raise ValueError(f"--rollout-top-p: got {self.rollout_top_p}; it must lie in (0, 1]")
        if self.rollout_top_k == 0 or self.rollout_top_k < -1:
            raise ValueError(f"--rollout-top-k: got {self.rollout_top_k}; use a positive k, or -1 for off")
        if not self.eval_temperature >= 0:
            raise ValueError(f"--eval-temperature: got {self.eval_temperature}; it must be >= 0 (0: greedy)")
        for name in ("actor_gpu_share", "critic_gpu_share", "engine_gpu_share"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{flag(name)}: got {value}; it must lie in (0, 1]")
        if self.rm_type not in RM_TYPES and self.custom_rm_path is None:
            raise ValueError(
                f"--rm-type: got {self.rm_type!r}; choose one of {', '.join(RM_TYPES)}, or give "
                "--custom-rm-path module:function"
            )

    def _check_plan(self) -> None:
        if self.use_critic and self.train_backend != "megatron":
            raise ValueError(
                f"--use-critic: the critic needs --train-backend megatron (got {self.train_backend!r})"
            )
        if self.use_critic and importlib.util.find_spec("megatron") is None:
            raise ValueError(
                "--use-critic: the critic trains with Megatron-core, which is not installed; "
                "pip install megatron-core (or tandem-megatron-backend), or pass --no-use-critic"
            )
        if (
            self.rollout_engine == "sglang"
            and not self.sglang_urls
            and importlib.util.find_spec("sglang") is None
        ):
            raise ValueError(
                "--rollout-engine: sglang is not installed; pip install 'tandem-ppo-driver[sglang]', "
                "give --sglang-urls of running servers, or use --rollout-engine embedded"
            )
        if self.sglang_urls and len(self.sglang_urls) != self.num_engines:
            raise ValueError(
                f"--sglang-urls: {len(self.sglang_urls)} URLs for {self.num_engines} rollout GPUs; give one "
                "URL per rollout GPU (--rollout-num-gpus)"
            )
        if self.weight_sync == "ipc" and not (self.colocate and self.num_engines == self.actor_num_gpus):
            raise ValueError(
                "--weight-sync: ipc needs each engine on an actor rank's GPU (--colocate, one engine per "
                "actor GPU); use --weight-sync auto or cpu"
            )
        if self.async_mode and self.colocate:
            raise ValueError(
                "--async: the next rollout is generated while the models train, so the engines need GPUs "
                "of their own; pass --no-colocate with --async (and --rollout-num-gpus)"
            )
        if self.colocate and self.num_engines != self.actor_num_gpus:
            raise ValueError(
                f"--rollout-num-gpus: {self.num_engines} with --colocate, but the actor has "
                f"{self.actor_num_gpus} GPUs; colocated engines sit one per training GPU, so leave "
                "--rollout-num-gpus unset (or pass --no-colocate)"
            )
        shares = self.actor_gpu_share + (self.critic_gpu_share if self.use_critic else 0.0)
        if self.colocate:
            shares += self.engine_gpu_share
        if shares > 1 + 1e-9:
            raise ValueError(
                f"--actor-gpu-share / --critic-gpu-share / --engine-gpu-share: they add up to {shares:g} of "
                "one GPU; lower them so that the roles sharing a GPU add up to at most 1"
            )

    def _check_files(self) -> None:
        hf = Path(self.hf_checkpoint)
        if not (hf / "config.json").is_file():
            raise ValueError(
                f"--hf-checkpoint: {self.hf_checkpoint!r} is not a Hugging Face model folder (no "
                "config.json); point it at a folder written by save_pretrained"
            )
        for name in ("prompt_data", "eval_prompt_data"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag(name)}: file {path!r} does not exist; fix the path")
        if self.eval_interval is not None and self.eval_prompt_data is None:
            raise ValueError("--eval-interval: set, but there is no --eval-prompt-data to evaluate on")
        if self.custom_rm_path is not None and ":" not in self.custom_rm_path:
            raise ValueError(
                f"--custom-rm-path: got {self.custom_rm_path!r}; write it as package.module:function or "
                "/path/to/file.py:function"
            )
        run_dir = Path(self.run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            raise ValueError(f"--run-dir: {self.run_dir!r} is a file; it must be a folder (or not exist yet)")

    def _check_split(self) -> None:
        samples = self.samples_per_rollout
        roles: tuple[Any, ...] = ("actor", "critic") if self.use_critic else ("actor",)
        for role in roles:
            dp = self.data_parallel_size(self.actor_num_gpus, role)
            if samples % dp:
                raise ValueError(
                    f"--rollout-batch-size: a rollout's {samples} samples (rollout_batch_size * "
                    f"n_samples_per_prompt) do not split evenly over the {role}'s {dp} data-parallel "
                    f"ranks; make it a multiple of {dp}"
                )


def _flagged(message: str) -> str:
    """A WorkerConfig message (`field_name: ...`) with its leading field, and each field it names in
    backticks, turned into the flag."""
    fields = {f.name for f in dataclasses.fields(PPOConfig)}
    message = re.sub(
        r"`([a-z_]+)`", lambda m: flag(m.group(1)) if m.group(1) in fields else m.group(0), message
    )
    match = re.match(r"^([a-z_]+)([ :/])", message)
    if match is None:
        return message
    return flag(match.group(1)) + message[len(match.group(1)) :]
