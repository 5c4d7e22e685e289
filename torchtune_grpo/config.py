"""The recipe config's schema: which top-level keys exist, which are required, and their validation.

Both recipes (and ``tune-grpo``, the tests and the benchmarks) read the schema from here, so a key is
declared once. The recipes read the values; nothing else in ``torchtune_grpo/`` reads a config. See
docs/configs.md for what each key does.
"""

import difflib
from typing import Optional, Set

from omegaconf import DictConfig

from torchtune_grpo.loss import KL_ESTIMATORS

__all__ = [
    "DYNAMIC_SAMPLING_KEYS",
    "KL_PLACEMENTS",
    "KNOWN_KEYS",
    "LORA_KEYS",
    "REQUIRED_KEYS",
    "validate_config",
]

#: Every top-level key the full fine-tuning recipe reads. Anything else is a typo or another trainer's key.
KNOWN_KEYS: Set[str] = {
    "output_dir", "model", "tokenizer", "checkpointer", "resume_from_checkpoint", "dataset", "seed",
    "shuffle", "group_size", "batch_size", "max_prompt_length", "max_response_length", "epochs",
    "max_steps", "ppo_epochs", "micro_batch_size", "kl_coef", "generation", "reward_functions",
    "reward_fallback", "loss", "advantage", "optimizer", "lr_scheduler", "clip_grad_norm", "device",
    "dtype", "enable_activation_checkpointing", "fsdp_cpu_offload", "fsdp_reshard_after_forward",
    "logprob_chunk_size", "save_every_n_steps", "keep_last_n_checkpoints", "metric_logger", "log_every_n_steps",
    "log_completions", "profiler", "kl_estimator", "kl_placement", "mask_truncated_completions",
    "dynamic_sampling", "share_prompt_in_training", "fsdp_single_process",
    # generation engines with their own weights (vLLM): the check after each weight sync
    "weight_sync",
    # held-out evaluation (torchtune_grpo/evaluation.py)
    "validation", "eval_every_n_steps", "eval_num_samples", "eval_pass_k", "eval_max_prompts",
    "eval_reward", "eval_threshold", "eval_batch_size",
}

#: Top-level keys the LoRA recipe reads on top of :data:`KNOWN_KEYS`.
LORA_KEYS: Set[str] = {"save_adapter_weights_only"}

#: Keys without which no run can start.
REQUIRED_KEYS: Set[str] = {
    "output_dir", "model", "tokenizer", "checkpointer", "dataset", "group_size", "batch_size",
    "max_response_length", "generation", "reward_functions", "loss", "advantage", "optimizer",
    "device", "dtype", "metric_logger",
}

#: Where a KL penalty goes: GRPO's term in the loss, or RLHF-PPO's penalty of each sequence's reward.
KL_PLACEMENTS = ("loss", "reward")

#: Keys of the ``dynamic_sampling:`` section (:class:`~torchtune_grpo.dynamic_sampling.DynamicSampling`).
DYNAMIC_SAMPLING_KEYS: Set[str] = {"enabled", "max_rounds", "rtol"}


def validate_config(cfg: DictConfig, known_keys: Optional[Set[str]] = None) -> None:
    """Fail early, naming the key, on unknown (misspelled) or missing top-level keys and bad values.

    Args:
        cfg (DictConfig): the run's config.
        known_keys (Optional[Set[str]]): the keys the recipe reads. Default is None (:data:`KNOWN_KEYS`;
            the LoRA recipe passes ``KNOWN_KEYS | LORA_KEYS``).

    Raises:
        ValueError: naming the unknown, missing or invalid key (with a close match for a typo).
    """
    known_keys = KNOWN_KEYS if known_keys is None else known_keys
    unknown = sorted(set(cfg.keys()) - known_keys)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, known_keys, n=1)
            hints.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        raise ValueError(
            f"Unknown config key(s): {', '.join(hints)}. "
            f"Known keys: {', '.join(sorted(known_keys))}."
        )
    missing = sorted(REQUIRED_KEYS - set(cfg.keys()))
    if missing:
        raise ValueError(f"Missing required config key(s): {', '.join(missing)}.")
    for key in ("group_size", "batch_size", "max_response_length"):
        if int(cfg[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    if int(cfg.group_size) < 2:
        raise ValueError("group_size must be >= 2: a group-relative advantage needs a group.")
    for key in ("kl_coef", "kl_estimator", "kl_placement"):
        if key in cfg.get("loss", {}):
            raise ValueError(f"Set {key} at the top level of the config, not under loss.")
    if cfg.get("kl_estimator", "k3") not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {list(KL_ESTIMATORS)}, got {cfg.kl_estimator!r}")
    if cfg.get("kl_placement", "loss") not in KL_PLACEMENTS:
        raise ValueError(f"kl_placement must be one of {list(KL_PLACEMENTS)}, got {cfg.kl_placement!r}")
    unknown = sorted(set(cfg.get("dynamic_sampling", None) or {}) - DYNAMIC_SAMPLING_KEYS)
    if unknown:
        raise ValueError(
            f"Unknown dynamic_sampling key(s): {unknown}. Known: {sorted(DYNAMIC_SAMPLING_KEYS)}."
        )
