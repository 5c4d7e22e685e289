"""Adapter versions in a running ``vllm.LLM``: each optimizer step's LoRA adapter, loaded next to the base.

vLLM's public LoRA API loads an adapter from a PEFT directory (``LoRARequest(name, id, path)``;
``LLMEngine.add_lora`` reads it into memory at once). It has no public in-memory route, so each version is
written to a staging directory, in ``/dev/shm`` where it exists (RAM, not disk), loaded, and deleted right
away: between syncs nothing is left on the file system, and the staging root goes at :meth:`close`.

Versions: each load gets the next vLLM adapter id (1, 2, ...; never reused in one engine: vLLM skips
loading an id it already holds, so a reused id would silently keep serving the old adapter) and the name
``policy-v<version>-<id>``. The previous
version is removed from the engine once the new one is loaded: with colocated engines no rollout is in
flight during a sync, so no request can still use it. (Out-of-process generation workers that keep rollouts
running across a sync would keep ``max_staleness + 1`` versions instead, as TRL's async trainer does.)
"""

import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import torch
from safetensors.torch import save_file

from torchtune_grpo.models.lora import LoRAHyperparams, peft_adapter_config, peft_adapter_weights
from torchtune_grpo.models import SUPPORTED_MODEL_TYPES

__all__ = ["AdapterVersions", "vllm_lora_rank"]

# vLLM's LoRAConfig.max_lora_rank accepts these values only.
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Adapted modules vLLM's LoRA cannot carry: the output projection (lm_head) has no LoRA layer there.
_UNSUPPORTED_TARGETS = {"output": "the output projection (apply_lora_to_output)"}


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for allowed in _VLLM_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank ({_VLLM_RANKS[-1]})")


def check_adapter_targets(hparams: LoRAHyperparams) -> None:
    """Raise, naming the module, for adapters vLLM's LoRA path cannot load (use ``lora_sync: merge``)."""
    for target in hparams.target_modules:
        if target in _UNSUPPORTED_TARGETS:
            raise ValueError(
                f"generation.lora_sync: adapter: vLLM cannot load an adapter on {_UNSUPPORTED_TARGETS[target]}; "
                "set generation.lora_sync: merge (full merged weights at every sync), or "
                "model.apply_lora_to_output: False"
            )


class AdapterVersions:
    """Writes each adapter version as PEFT files, loads it into the engine and drops the previous one.

    Args:
        hf_config (Mapping[str, Any]): the base model's Hugging Face ``config.json``.
        staging_root (Optional[str]): where version directories are written. Default is None
            (``/dev/shm`` if writable, else the system temporary directory).
    """

    def __init__(self, hf_config: Mapping[str, Any], staging_root: Optional[str] = None) -> None:
        self._hf_config = dict(hf_config)
        if staging_root is None and os.access("/dev/shm", os.W_OK):
            staging_root = "/dev/shm"
        self._root = Path(tempfile.mkdtemp(prefix="grpo-lora-", dir=staging_root))
        # Also at interpreter exit, for a run that stops on an exception before close().
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._root), ignore_errors=True)
        self.current = None  # the LoRARequest rollouts use
        self._last_id = 0
        self.last_bytes = 0

    @property
    def staging_dir(self) -> Path:
        """The staging root (empty between syncs)."""
        return self._root

    def _peft_files(self, directory: Path, adapter: Dict[str, torch.Tensor], hparams: LoRAHyperparams) -> None:
        cfg = self._hf_config
        # peft_adapter_weights undoes torchtune's q/k RoPE permutation of lora_b for Llama-layout models and
        # leaves Qwen2/Qwen3 (Hugging Face layout) alone; it tells them apart by a torchtune model type.
        half = SUPPORTED_MODEL_TYPES.get(cfg.get("model_type")) == "half"
        weights = peft_adapter_weights(
            adapter,
            model_type="QWEN2" if half else "LLAMA",
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            dim=cfg["hidden_size"],
            head_dim=cfg.get("head_dim"),
        )
        directory.mkdir()
        save_file({k: v.contiguous().cpu() for k, v in weights.items()}, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps(peft_adapter_config(hparams)))

    def load(self, llm, adapter: Dict[str, torch.Tensor], hparams: LoRAHyperparams, version: int):
        """Load ``adapter`` as version ``version`` into ``llm`` and make it the one rollouts use.

        Args:
            llm: the running ``vllm.LLM`` (started with ``enable_lora``).
            adapter (Dict[str, torch.Tensor]): LoRA A ``[r, in]`` / B ``[out, r]`` under torchtune names.
            hparams (LoRAHyperparams): rank, alpha, targets.
            version (int): the publisher's version number (0 = before training).

        Returns:
            LoRARequest: the new current version.
        """
        from vllm.lora.request import LoRARequest

        directory = self._root / f"v{version}-{self._last_id + 1}"
        self._peft_files(directory, adapter, hparams)
        self._last_id += 1
        request = LoRARequest(
            lora_name=f"policy-v{version}-{self._last_id}", lora_int_id=self._last_id, lora_path=str(directory)
        )
        try:
            if not llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load adapter version {version} from {directory}")
        finally:
            shutil.rmtree(directory, ignore_errors=True)  # add_lora read it into memory
        previous, self.current = self.current, request
        if previous is not None:
            llm.llm_engine.remove_lora(previous.lora_int_id)
        self.last_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
        return request

    def forget(self) -> None:
        """After the engine unloaded every adapter (vLLM's in-place weight reload does): serve none."""
        self.current = None

    def close(self) -> None:
        """Remove the staging root."""
        self._cleanup()
