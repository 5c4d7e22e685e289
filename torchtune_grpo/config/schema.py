"""Every recipe config key, declared once: its type, default, allowed values and a one-line doc.

:class:`RecipeConfig` (the full recipe) and :class:`LoRARecipeConfig` (the LoRA recipe's extra key) are
dataclasses whose fields are the top-level keys. A field's ``metadata`` (made by :func:`setting` or
:func:`component`) holds the doc, the range (``ge``/``gt``), the choices and whether ``null`` is allowed.
Everything else is derived from them: ``KNOWN_KEYS``, ``REQUIRED_KEYS``, ``NUMERIC_RULES``
(torchtune_grpo/config/__init__.py), the checks (torchtune_grpo/config/checks.py), the typed values the recipes read
(:meth:`RecipeConfig.from_cfg`) and the key tables in docs/recipe.md and docs/configs.md
(torchtune_grpo/config/doc_tables.py). **Adding a key is adding a field here.**

Components (``model:``, ``loss:``, ...) stay free-form: the typed config holds their ``DictConfig`` nodes,
which the recipe instantiates. A component whose arguments are range-checked (``loss.epsilon``,
``optimizer.lr``, ``generation.temperature``) names a ``checks`` dataclass listing those arguments; the
component's own signature keeps their defaults. Closed sections (``dynamic_sampling:``, ``multi_turn:``)
are dataclasses of their own: their keys are known, and absent keys take the defaults declared here.
"""

import dataclasses
from typing import Any, Optional

from torchtune_grpo.rollouts.advantages import ZERO_VARIANCE_RTOL
from torchtune_grpo.config.checks import ConfigSchema
from torchtune_grpo.config.fields import component, LIST, SECTION, setting
from torchtune_grpo.loss import KL_ESTIMATORS
from torchtune_grpo.runtime.nonfinite import NONFINITE_POLICIES
from torchtune_grpo.training.packed_rows import PACKED_ATTENTION
from torchtune_grpo.runtime.precision import PRECISIONS
from torchtune_grpo.runtime.compute import ACTIVATION_CHECKPOINTING
from torchtune_grpo.models.logprobs import HEAD_PRECISIONS
from torchtune_grpo.runtime.reference_setup import REFERENCE_PRECISIONS
from torchtune_grpo.checkpoints.resume import BROKEN_CHECKPOINT_POLICIES

__all__ = [
    "KL_PLACEMENTS", "ROUTING_REPLAY", "DynamicSamplingConfig", "MoEConfig", "GenerationWorkersConfig", "LoRARecipeConfig", "MultiTurnConfig", "RecipeConfig",
    "ReferenceConfig",
]

#: Where a KL penalty goes: GRPO's term in the loss, or RLHF-PPO's penalty of each sequence's reward.
KL_PLACEMENTS = ("loss", "reward")


class _Absent:
    """The default of a key whose value is computed from others when the key is absent (an explicit
    ``null`` means something else)."""

    def __repr__(self) -> str:
        return "<computed>"


_BUDGET_OF_MICRO_BATCH = _Absent()


# ------------------------------------------------------------------------------------------------ sections


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicSamplingConfig(ConfigSchema):
    """``dynamic_sampling:`` (DAPO; :class:`~torchtune_grpo.rollouts.group_selection.DynamicSampling`)."""

    enabled: bool = setting(False, doc="drop groups whose rewards are all equal and generate more")
    max_rounds: int = setting(4, ge=1, doc="generation rounds per step at most, each on `batch_size` new prompts",
                              why="generation rounds per step")
    rtol: float = setting(ZERO_VARIANCE_RTOL, ge=0, doc="relative tolerance of \"all rewards equal\"")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationWorkersConfig(ConfigSchema):
    """``generation_workers:`` (:class:`~torchtune_grpo.workers.client.WorkerRollouts`; docs/async.md)."""

    enabled: bool = setting(False, doc="generate on a worker process per trainer rank, overlapped with training")
    max_staleness: int = setting(1, ge=0, why="training steps a sample may lag the trainer's weights",
                                 doc="training steps a batch's weights may lag the trainer's (0: on-policy through "
                                     "the worker; 1: one-step-off, deterministic)")
    in_flight_updates: bool = setting(
        False, doc="a weights version that reaches a worker while it generates goes into its vLLM server at once "
                   "(paused, continued with the new weights: partial rollouts) instead of after the batch; needs "
                   "`VLLMServerGenerator`, single-turn; not reproducible run to run")
    threads: int = setting(1, ge=1, doc="intra-op threads of each worker")
    device: str = setting("cpu", choices=("cpu", "cuda"),
                          doc="where a native-engine worker computes: `cuda` is the first GPU its process sees (set "
                              "`CUDA_VISIBLE_DEVICES` per worker); a vLLM worker uses vLLM's own devices")
    timeout: float = setting(600.0, gt=0, doc="seconds without a reply before the worker is replaced (or the run stops)")
    restarts: int = setting(3, ge=0, doc="workers that died or went silent replaced, each given what the old one had "
                                         "not answered (the run continues unchanged); then the run stops naming it")
    addresses: Any = component(
        "`host:port` of a worker started on another node with `python -m torchtune_grpo.workers.process --listen "
        "HOST:PORT`, one per trainer rank (rank r uses entry r); the same secret in `TORCHTUNE_GRPO_WORKER_KEY` on "
        "both sides; a restart reconnects ([async.md](async.md#generation-workers-on-other-nodes)). Absent: a "
        "worker process per rank on the trainer's node", required=False, kind=LIST)
    connect_timeout: float = setting(60.0, gt=0, doc="seconds to keep trying to connect to a worker's address (at "
                                                     "start and after a fault) before the run stops naming it")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceConfig(ConfigSchema):
    """``reference:`` (the KL term's reference model; :func:`~torchtune_grpo.runtime.reference_setup.build_reference`)."""

    precision: str = setting(
        "compute", choices=REFERENCE_PRECISIONS,
        doc="the reference's weights: `compute` (a full copy in the run's compute dtype), `bf16`, `int8` (linear "
            "weights int8, one scale per row) or `nf4` (linear weights 4-bit NormalFloat, as QLoRA); measured "
            "effect on the KL term in [algorithms.md](algorithms.md#the-reference-model-in-less-memory)")
    offload: bool = setting(False, doc="keep the reference's transformer layers in CPU memory and copy each to the "
                                       "device just before it runs (the next one prefetched)")


#: ``moe.routing_replay``: ``off`` (the trainer routes every token itself) or ``rollout`` (R3: the engine's routes
#: forced in the trainer's forwards).
ROUTING_REPLAY = ("off", "rollout")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(ConfigSchema):
    """``moe:`` (mixture-of-experts policies: routing replay and router losses; docs/moe_replay.md)."""

    routing_replay: str = setting(
        "off", choices=ROUTING_REPLAY,
        doc="`rollout`: force the experts the engine chose for every token (prompt and response, every MoE layer) "
            "in the trainer's old, reference and policy forwards, gate weights recomputed from the live router "
            "(rollout routing replay, R3); `off`: the trainer routes itself")
    load_balance_coef: float = setting(
        0.0, ge=0, why="weight of the load-balancing loss (0: none)",
        doc="weight of the Switch Transformer load-balancing loss (token mean, expert fractions from the engine's "
            "routes over the whole batch); 0: logged only")
    z_loss_coef: float = setting(0.0, ge=0, why="weight of the router z-loss (0: none)",
                                 doc="weight of the ST-MoE router z-loss (token mean); 0: logged only")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiTurnConfig(ConfigSchema):
    """``multi_turn:`` (:class:`~torchtune_grpo.multiturn.MultiTurn`; needs ``environment``)."""

    max_turns: int = setting(4, ge=1, doc="model turns per episode at most", why="model turns per episode")
    env_timeout: Optional[float] = setting(30.0, gt=0, null=True, doc="seconds per environment call (null: none)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _LossChecks:
    """The ``loss:`` arguments that are range-checked (defaults: the loss component's)."""

    epsilon: float = setting(None, gt=0, null=False, doc="the PPO clip range (0 clips every ratio to 1)")
    epsilon_low: Optional[float] = setting(None, gt=0, doc="the lower clip range (null: epsilon)")
    epsilon_high: Optional[float] = setting(None, gt=0, doc="the upper clip range (null: epsilon)")
    dual_clip: Optional[float] = setting(None, gt=1, doc="dual-clip bound on negative advantages")
    tis_cap: Optional[float] = setting(None, gt=0, doc="truncated importance sampling cap")
    entropy_coef: float = setting(None, ge=0, null=False, doc="entropy bonus weight")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _GenerationChecks:
    """The ``generation:`` arguments that are range-checked."""

    temperature: float = setting(None, gt=0, null=False, doc="the training sampling temperature: 0 is greedy, so a "
                                 "group's completions are all the same and there is nothing to compare")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OptimizerChecks:
    """The ``optimizer:`` arguments that are range-checked."""

    lr: float = setting(None, gt=0, null=False, doc="the learning rate")



# ---------------------------------------------------------------------------------------------- the recipes


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeConfig(ConfigSchema):
    """The full fine-tuning recipe's config: one field per top-level key (docs/recipe.md, "Config keys")."""

    # ---- what is trained, on what, where it goes
    output_dir: str = setting(doc="checkpoints (`step_N/`), `metrics.jsonl`, `completions.jsonl`; where resuming looks")
    model: Any = component("torchtune model builder (`_component_` + arguments)")
    tokenizer: Any = component("torchtune tokenizer; its `pad_id` and `stop_tokens` are used by generation")
    checkpointer: Any = component("torchtune checkpointer; loads the initial weights and writes each `step_N`")
    resume_from_checkpoint: bool = setting(
        False, doc="continue from the latest readable `output_dir/step_N` (see `on_broken_checkpoint`)")
    dataset: Any = component(
        "called as `dataset(tokenizer, **args)`; returns prompt samples ([architecture.md](architecture.md))")
    seed: Optional[int] = setting(
        None, ge=0, why="the random seed (null: drawn)",
        doc="`null` draws a random seed (the same on every rank); sets torch/numpy/random (`seed + rank`), "
            "sampling (`seed + rank`) and the shuffling order; `tune-grpo eval` and `rejection-sample` use it too")
    shuffle: bool = setting(True, doc="shuffle prompts each epoch")
    # ---- batch shape and length
    group_size: int = setting(ge=2, doc="`G`, completions per prompt",
                              why="completions per prompt: a group-relative advantage needs at least 2 to compare")
    batch_size: int = setting(ge=1, doc="prompts per rank per step", why="prompts per rank per step")
    max_prompt_length: Optional[int] = setting(
        None, ge=1, why="longest prompt kept, in tokens",
        doc="checked with `max_response_length` against the model's `max_seq_len`; prompts are filtered by the "
            "*dataset's* `max_prompt_length` argument, which the shipped configs set to `${max_prompt_length}`")
    max_response_length: int = setting(ge=1, doc="tokens sampled per completion at most; also passed to the loss",
                                       why="tokens sampled per completion")
    epochs: int = setting(1, ge=1, doc="passes over the data when `max_steps` is null", why="passes over the prompts")
    max_steps: Optional[int] = setting(None, ge=1, doc="steps to run; wins over `epochs`",
                                       why="training steps (null: epochs decide)")
    # ---- the update
    ppo_epochs: int = setting(1, ge=1, doc="passes over each batch of rollouts",
                              why="passes over each batch of rollouts")
    ppo_mini_batches: int = setting(
        1, ge=1, why="optimizer steps per pass, on disjoint mini-batches of whole groups",
        doc="optimizer steps per pass, each on a disjoint mini-batch of whole groups; must divide `batch_size`")
    ppo_mini_batch_shuffle: bool = setting(True, doc="reshuffle the groups into mini-batches before every pass")
    micro_batch_size: Optional[int] = setting(
        None, ge=1, null=False, shown="`batch_size x group_size`", why="sequences per forward/backward",
        doc="sequences per forward/backward (training and log-probability passes); memory only")
    max_tokens_per_micro_batch: Optional[int] = setting(
        _BUDGET_OF_MICRO_BATCH, ge=1, null=True,
        shown="`micro_batch_size x (max_prompt_length + max_response_length)`",
        why="tokens per forward/backward, padding included (null: `micro_batch_size` rows each)",
        doc="micro-batches by tokens, not rows: sequences sorted by length and packed up to this many tokens per "
            "forward, padding included (a group's shared prompt kept together); `micro_batch_size` caps the "
            "rows of one. The default holds no more slots than a full micro-batch of the longest sequences (rows "
            "without `max_prompt_length`); null: `micro_batch_size` rows in rollout order "
            "([configs.md](configs.md#token-budget-micro-batches-max_tokens_per_micro_batch)); same numbers")
    kl_coef: float = setting(0.0, ge=0, why="weight of the KL penalty (0: none)",
                             doc="weight of the KL penalty to the initial model; 0 loads no reference model. "
                                 "Top level only")
    kl_estimator: str = setting("k3", choices=KL_ESTIMATORS,
                                doc="estimator of the KL term ([algorithms.md](algorithms.md))")
    kl_placement: str = setting("loss", choices=KL_PLACEMENTS,
                                doc="`loss`: GRPO's per-token term; `reward`: RLHF-PPO's penalty of each "
                                    "sequence's reward")
    reference: ReferenceConfig = setting(
        factory=ReferenceConfig, null=True,
        doc="how the reference model is held (precision, CPU offload); used only when `kl_coef > 0`; not in the "
            "LoRA recipe, whose reference is the policy with its adapters off")
    moe: MoEConfig = setting(
        factory=MoEConfig, null=True,
        doc="mixture-of-experts policies: routing replay and router losses ([moe_replay.md](moe_replay.md)); "
            "ignored for a dense policy")
    generation: Any = component("generation engine, e.g. `torchtune_grpo.generation.NativeGenerator`",
                                checks=_GenerationChecks)
    reward_functions: Any = component(
        "list of reward specs: `_component_`, optional `name` (metric key; default the reward's own name) and "
        "`weight` (default 1.0), plus "
        "constructor arguments", kind=LIST)
    reward_fallback: float = setting(0.0, doc="score of every sample of a reward component that raised")
    loss: Any = component("e.g. `torchtune_grpo.loss.GRPOLoss`; receives `kl_coef`, `kl_estimator` and "
                          "`max_response_length`", checks=_LossChecks)
    advantage: Any = component("e.g. `torchtune_grpo.rollouts.advantages.GroupRelativeAdvantage`")
    optimizer: Any = component("any torch optimizer; receives the policy's parameters", checks=_OptimizerChecks)
    lr_scheduler: Any = component("torchtune scheduler builder; receives the optimizer, `num_training_steps` "
                                  "and `last_epoch=-1`", required=False)
    clip_grad_norm: Optional[float] = setting(
        None, gt=0, why="gradient-norm clip (null: no clipping)",
        doc="max total gradient norm; null: no clipping (the norm is still measured and logged as `grad_norm`)")
    # ---- masks, sampling and variants (docs/algorithms.md)
    mask_truncated_completions: bool = setting(False, doc="completions that hit `max_response_length` leave the loss "
                                               "(DAPO's overlong filtering)")
    dynamic_sampling: DynamicSamplingConfig = setting(
        factory=DynamicSamplingConfig, null=True,
        doc="DAPO's dynamic sampling: train only on groups whose rewards differ")
    rollout_correction: Any = component("off-policy weights and masks (`torchtune_grpo.loss.rollout_correction.RolloutCorrection` "
                                        "arguments); exclusive with `loss.tis_cap`", required=False, kind=SECTION)
    token_selection: Any = component("train on high-entropy tokens only (`torchtune_grpo.loss.token_selection."
                                     "HighEntropyTokens` arguments)", required=False, kind=SECTION)
    share_prompt_in_training: bool = setting(
        True, doc="training and logprob forwards compute each prompt once for its group's completions "
                  "([configs.md](configs.md#training-layout-share_prompt_in_training)); same numbers as `false`")
    packed_attention: str = setting(
        "sdpa", choices=PACKED_ATTENTION,
        doc="attention of packed rows: `sdpa` (a dense block-diagonal mask) or `flex` (FlexAttention block masks "
            "on CUDA, skipping the masked blocks; the dense mask on CPU; not yet run on a GPU) "
            "([configs.md](configs.md#packed-rows-pack_sequences_in_training))")
    pack_sequences_in_training: bool = setting(
        False, doc="with one row per sequence (`share_prompt_in_training: false`, or a model that cannot share): "
                   "several sequences per training row, none attending to another "
                   "([configs.md](configs.md#packed-rows-pack_sequences_in_training)); same numbers")
    train_vision: str = setting(
        "none", choices=("none", "projector", "tower"),
        doc="with a dataset of image prompts ([multimodal.md](multimodal.md)): `none` keeps the vision tower and "
            "projector frozen; `projector` or `tower` (tower and projector) trains them with the language model, "
            "fully also in the LoRA recipe (no adapters on them; its reference keeps a frozen copy of them)")
    drop_pad_embedding_grad: bool = setting(False, doc="no gradient to the pad token's input embedding "
                                            "(transformers' `padding_idx`, TRL's behaviour)")
    weight_sync: Any = component("for engines holding their own weights (vLLM): `WeightSyncCheck` interval and "
                                 "tolerance ([vllm.md](vllm.md))", required=False, shown="`WeightSyncCheck()`")
    environment: Any = component("multi-turn episodes' environment ([multi_turn.md](multi_turn.md))", required=False)
    multi_turn: MultiTurnConfig = setting(factory=MultiTurnConfig, null=True,
                                          doc="multi-turn episode limits (needs `environment`)")
    step_diagnostics: bool = setting(False, doc="log closed-loop diagnostics every step: KL before -> after on the step's "
                                     "samples, sampled vs greedy accuracy (`eval_reward`, `eval_threshold`); "
                                     "2 extra forwards and a greedy round per step")
    generation_workers: GenerationWorkersConfig = setting(
        factory=GenerationWorkersConfig, null=True,
        doc="asynchronous rollouts: generation on worker processes at a bounded staleness ([async.md](async.md))")
    # ---- faults (docs/recipe.md, "What survives what")
    on_nonfinite: str = setting("stop", choices=NONFINITE_POLICIES,
                                doc="a NaN/inf gradient norm or loss: `stop` the run naming the step, or `skip` the "
                                    "optimizer step ([What survives what](#what-survives-what)); non-finite "
                                    "weights always stop it")
    on_broken_checkpoint: str = setting("use_previous", choices=BROKEN_CHECKPOINT_POLICIES,
                                        doc="on resume, a newest checkpoint that cannot be read: use the newest "
                                            "readable one (said in the log), or `error`")
    save_on_sigterm: bool = setting(True, doc="on SIGTERM, finish the step, save a checkpoint and exit with 143; "
                                    "`false`: SIGTERM kills at once")
    # ---- hardware and parallelism
    device: str = setting(doc="`cpu`, `cuda`, ...")
    dtype: str = setting(choices=tuple(sorted(PRECISIONS)), doc="`fp32`, `bf16` (fp32 master weights, bf16 compute) "
                         "or `bf16_pure` (torchtune_grpo/runtime/precision.py)")
    enable_activation_checkpointing: bool = setting(False, doc="recompute each transformer layer's activations in "
                                                    "backward (policy only); `activation_checkpointing`, when set, "
                                                    "wins")
    activation_checkpointing: Optional[str] = setting(
        None, choices=ACTIVATION_CHECKPOINTING, shown="`enable_activation_checkpointing`",
        doc="`on`: every layer recomputed in backward (least memory, a second forward); `off`: none (most memory); "
            "`selective`: every `activation_checkpointing_every`-th layer; `auto`: `off` when the estimated peak "
            "fits 80% of the device's memory, else `on` ([gpu.md](gpu.md#the-update-switches)); same numbers")
    activation_checkpointing_every: int = setting(2, ge=1, why="with `selective`: every n-th layer is checkpointed",
                                                  doc="with `activation_checkpointing: selective`, checkpoint every "
                                                      "n-th decoder layer (1: all)")
    logprob_head: str = setting(
        "fp32", choices=HEAD_PRECISIONS,
        doc="the output projection's products in the logprob head: `fp32` (the weights' dtype), or `bf16` (bf16 "
            "inputs, fp32 accumulation, fp32 log-sum-exp; tensor-core speed, logprobs differ by the bf16 rounding "
            "of the hidden states and weights: [gpu.md](gpu.md#the-update-switches))")
    tf32: bool = setting(False, doc="fp32 matrix products on CUDA in TF32 (tensor cores, 10-bit mantissa inputs); "
                                    "process-wide; no effect on CPU")
    compile_training: Optional[str] = setting(
        None, why="a torch.compile backend for the training forwards (null: eager)",
        doc="compile each decoder layer for the training, reference and old-logprob forwards with this "
            "`torch.compile` backend (`inductor` on a GPU; `aot_eager` checks on CPU), dynamic shapes across "
            "micro-batches; compile seconds logged as `time/compile`; null: eager")
    fsdp_cpu_offload: bool = setting(False, doc="keep parameter shards on CPU (passed to torchtune's "
                                    "`shard_model`; tested on CPU for one step with unpinned memory only)")
    fsdp_reshard_after_forward: bool = setting(True, doc="free gathered parameters after each layer's forward")
    fsdp_single_process: bool = setting(
        False, doc="on one process, train the plain model (no FSDP2: faster and less memory, see [configs.md]"
                   "(configs.md#one-process-without-fsdp2-fsdp_single_process)); `true` wraps it in FSDP2 there too "
                   "(the same code path as N processes); ignored with more processes (always FSDP2), with "
                   "`fsdp_cpu_offload: true` (FSDP2) and in the LoRA recipe")
    logprob_chunk_size: int = setting(512, ge=1, why="positions per log-softmax chunk",
                                      doc="tokens per slice of the output projection; peak extra memory about "
                                          "`2 x chunk x vocab x 4` bytes")
    # ---- checkpoints and logs
    save_every_n_steps: Optional[int] = setting(None, ge=1, doc="checkpoint period; null: only the final checkpoint",
                                                why="steps between checkpoints (null: only the final one)")
    keep_last_n_checkpoints: Optional[int] = setting(None, ge=1, why="complete checkpoints kept (null: all)",
                                                     doc="keep only the newest n `step_N` (an older one is removed "
                                                         "once a newer one is complete); null keeps all")
    metric_logger: Any = component("any torchtune metric logger (`DiskLogger`, `WandBLogger`, ...)")
    log_every_n_steps: int = setting(1, ge=1, doc="period of the metric logger (`metrics.jsonl` gets every step)",
                                     why="steps between metric-logger writes")
    log_completions: int = setting(2, ge=0, doc="completions per step written to `completions.jsonl`",
                                   why="completions written per step")
    profiler: Any = component("torchtune's `setup_torch_profiler` config", required=False, shown="disabled")
    # ---- held-out evaluation (docs/recipe.md, "Held-out evaluation"; also `tune-grpo eval`)
    validation: Any = component("held-out prompt dataset component (e.g. `arithmetic_dataset` with `split: "
                                "validation`); when set, the run is evaluated at step 0, every `eval_every_n_steps` "
                                "and at the end (see \"Held-out evaluation\")", required=False)
    eval_every_n_steps: Optional[int] = setting(None, ge=1, why="steps between held-out evaluations",
                                                doc="evaluation period in steps; null: only at step 0 and at the end")
    eval_num_samples: int = setting(0, ge=0, why="samples per held-out prompt for pass@k",
                                    doc="completions sampled per held-out prompt for pass@k (n); 0: no pass@k")
    eval_pass_k: Optional[int] = setting(None, ge=1, shown="`eval_num_samples`", why="the k of pass@k",
                                         doc="the k of pass@k (`1 <= k <= n`)")
    eval_max_prompts: Optional[int] = setting(None, ge=1, shown="all", why="held-out prompts evaluated",
                                              doc="evaluate only the first K validation prompts")
    eval_reward: Optional[str] = setting(None, shown="`correctness`", why="the name of a reward component",
                                         doc="the reward component (by `name`) that decides whether a completion is "
                                             "correct; the run fails at setup when no component has that name")
    eval_threshold: float = setting(1.0, doc="a completion is correct when that component scores `>= eval_threshold`")
    eval_batch_size: int = setting(32, ge=1, doc="held-out prompts per generation call",
                                   why="held-out prompts per generation call")

    def __post_init__(self) -> None:
        if self.micro_batch_size is None:  # absent: one micro-batch per step (frozen, hence object.__setattr__)
            object.__setattr__(self, "micro_batch_size", self.batch_size * self.group_size)
        if self.max_tokens_per_micro_batch is _BUDGET_OF_MICRO_BATCH:
            # Absent: the slots of a full micro-batch of the longest sequences, so no forward holds more than
            # the row-count layout's worst case (without max_prompt_length that size is unknown: rows).
            budget = None
            if self.max_prompt_length is not None:
                budget = self.micro_batch_size * (self.max_prompt_length + self.max_response_length)
            object.__setattr__(self, "max_tokens_per_micro_batch", budget)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRARecipeConfig(RecipeConfig):
    """The LoRA recipe's config: the full recipe's keys and its own (docs/lora.md)."""

    save_adapter_weights_only: bool = setting(False, doc="checkpoints hold only the adapter weights (LoRA recipe)")
