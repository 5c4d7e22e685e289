# torchtune-grpo: GRPO with LoRA (or QLoRA) adapters on one or many processes (FSDP2).
#
#   tune run grpo_lora_finetune_distributed --config configs/tiny/lora_grpo_cpu.yaml
#   tune run --nproc_per_node 8 grpo_lora_finetune_distributed --config my.yaml
#
# This file is installed as a top-level module, so `tune run` finds it from any directory.
"""GRPO with LoRA adapters (Hu et al. 2021, arXiv:2106.09685) or QLoRA (Dettmers et al. 2023,
arXiv:2305.14314): the GRPO step of ``grpo_full_finetune_distributed``, training only low-rank adapters.

What differs from full fine-tuning, and nothing else does (data, rollout, rewards, advantages, loss and the
training loop are the full recipe's, inherited):

- The model comes from a torchtune LoRA builder (``lora_attn_modules``, ``apply_lora_to_mlp``,
  ``lora_rank``, ``lora_alpha``, ``lora_dropout``; ``quantize_base: True`` for QLoRA's NF4 base weights).
  Only adapter parameters are trainable: gradients and AdamW state exist for them alone.
- The reference policy is the base model, i.e. the same model with its adapters switched off
  (``torchtune.modules.peft.disable_adapter``): no second copy of the weights. LoRA's B matrices start at
  zero, so the initial policy *is* the base model and the KL is measured to it, as in full fine-tuning.
- Checkpoints (``${output_dir}/step_N``) hold the adapter: ``adapter_model.safetensors`` +
  ``adapter_config.json`` (PEFT: ``PeftModel.from_pretrained(base, step_N)``) and ``adapter_model.pt``
  (torchtune keys), plus ``recipe_state.pt``; ``step_N/merged/`` holds a Hugging Face model with the adapter
  merged into the base weights (skip it with ``save_adapter_weights_only: True``). A resumed run reads the
  base weights from ``checkpointer.checkpoint_dir`` again and the adapter + optimizer from ``step_N``.

FSDP2 is set up as in torchtune's ``lora_finetune_distributed`` (meta-device init, per-layer
``fully_shard``, adapters initialised after sharding), except that QLoRA's NF4 base weights are kept out of
FSDP (``ignored_params``) and held whole on every rank: with torch 2.13 FSDP2's single-process path ignores
NF4's all-gather extension, and sharding NF4 needs every weight's block count to divide by the world size.
"""

import os
from functools import partial
import sys
from itertools import chain
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torchtune import config, modules, training, utils
from torchtune.modules.peft import (
    disable_adapter,
    get_adapter_params,
    get_adapter_state_dict,
    get_merged_lora_ckpt,
    LoRALinear,
    set_trainable_params,
)

from grpo_full_finetune_distributed import GRPOFullFinetuneRecipeDistributed, checkpoint_source, run_recipe
from torchtune_grpo.checkpointer_facts import epoch_output_dir, hf_config, model_type_name
from torchtune_grpo.config import LoRARecipeConfig
from torchtune_grpo.experience import Reference
from torchtune_grpo.precision import Precision
from torchtune_grpo.lora import (
    ADAPTER_TORCHTUNE_FILE,
    load_nf4_base_weights,
    lora_hyperparams,
    nf4_parameters,
    save_adapter,
)
from torchtune_grpo.setup_checks import check_state_dict_shapes

log = utils.get_logger("INFO")

MERGED_DIR = "merged"  # step_N/merged: the Hugging Face model with the adapter merged in


class GRPOLoRAFinetuneRecipeDistributed(GRPOFullFinetuneRecipeDistributed):
    """GRPO with LoRA/QLoRA adapters and FSDP2. See the module docstring and ``docs/lora.md``.

    Args:
        cfg (DictConfig): the run's config (see ``configs/tiny/lora_grpo_cpu.yaml``).
    """

    REFERENCE_DESCRIPTION = "the base model: the policy with its adapters disabled (no second copy)"

    config_class = LoRARecipeConfig  # the full recipe's keys and save_adapter_weights_only

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        self._save_adapter_weights_only = self.config.save_adapter_weights_only
        # Every weight stays in the compute dtype (frozen base; adapters train at LoRA's larger rates), so
        # dtype: bf16 is bf16_pure here (torchtune_grpo/precision.py).
        self._precision = Precision.from_name("bf16_pure" if self.config.dtype == "bf16" else self.config.dtype)

    # ------------------------------------------------------------------------------------------ setup

    def _setup_models(self, cfg: DictConfig, base_checkpointer: Any, resume_dir: Optional[Path]) -> None:
        # Base weights always come from the original checkpoint; a resumed run adds its saved adapter.
        # Saves go through the same checkpointer, whose config.json and tokenizer files are the base's.
        self._checkpointer = base_checkpointer
        base_state = base_checkpointer.load_checkpoint()[training.MODEL_KEY]
        adapter_state = None
        if resume_dir is not None:
            adapter_state = torch.load(
                Path(resume_dir) / ADAPTER_TORCHTUNE_FILE, map_location="cpu", weights_only=True
            )
        self._model = self._setup_lora_model(cfg, base_state, adapter_state)
        del base_state, adapter_state
        self._ref_model = None  # the reference is self._model with adapters disabled
        reference = "the base model (adapters disabled), no second copy" if self.kl_coef > 0 else None
        utils.log_rank_zero(log, f"Reference model: {reference or 'none (kl_coef = 0)'}")

    def _setup_lora_model(
        self,
        cfg: DictConfig,
        base_state: Dict[str, torch.Tensor],
        adapter_state: Optional[Dict[str, torch.Tensor]],
    ) -> torch.nn.Module:
        cpu_offload = self.config.fsdp_cpu_offload
        with training.set_default_dtype(self._dtype), torch.device("meta"):
            model = config.instantiate(cfg.model)
        self._lora = lora_hyperparams(model)  # raises for a model without LoRA layers
        self._check_max_seq_len(cfg, model)
        check_state_dict_shapes(
            chain(model.named_parameters(), model.named_buffers()), base_state, checkpoint_source(cfg)
        )
        adapter_names = set(get_adapter_params(model))
        set_trainable_params(model, adapter_names)
        if self.config.enable_activation_checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
        nf4 = {p for _, p in nf4_parameters(model)}
        self._shard(model, cpu_offload=cpu_offload, ignored_params=nf4)
        # NF4 weights first: model.state_dict() (used by every load below) dequantizes them through a
        # torchtune hook, which fails while they are still on the meta device.
        base_state = dict(base_state)
        nf4_keys = set(load_nf4_base_weights(model, base_state, self._device, self._dtype))

        if adapter_state is not None:
            loaded = training.load_from_full_model_state_dict(
                model, dict(adapter_state), self._device, cpu_offload=cpu_offload
            )
            if loaded.unexpected_keys or adapter_names - set(adapter_state):
                raise ValueError(
                    f"The saved adapter does not match the model: unexpected {loaded.unexpected_keys}, "
                    f"missing {sorted(adapter_names - set(adapter_state))}"
                )
        if adapter_state is None:
            with training.set_default_dtype(self._dtype), self._device:
                for m in model.modules():
                    if isinstance(m, LoRALinear):
                        # A fresh adapter: A random, B zero, so the initial policy is the base model.
                        m.to_empty(device="cpu" if cpu_offload else self._device)
                        m.initialize_parameters()
        self._init_rope(model)

        loaded = training.load_from_full_model_state_dict(
            model, base_state, self._device, cpu_offload=cpu_offload
        )
        missing = set(loaded.missing_keys) - adapter_names - nf4_keys
        if missing or loaded.unexpected_keys:
            raise ValueError(
                f"The base checkpoint does not match the model: missing {sorted(missing)}, "
                f"unexpected {sorted(loaded.unexpected_keys)}"
            )
        training.validate_no_params_on_meta_device(model)
        set_trainable_params(model, adapter_names)  # loading assigned new parameters: freeze again

        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        utils.log_rank_zero(
            log,
            f"LoRA rank {self._lora.rank}, alpha {self._lora.alpha:g} on {self._lora.target_modules}"
            f"{' with NF4 base weights (QLoRA)' if nf4 else ''}: {trainable:,} trainable parameters of "
            f"{total:,} ({100 * trainable / total:.2f}%)",
        )
        return model

    def _shard(self, model: torch.nn.Module, *, cpu_offload: bool, ignored_params: frozenset = frozenset()) -> None:
        """FSDP2 per transformer layer, then the root, as the full recipe; NF4 weights left out."""
        if not ignored_params:
            super()._shard(model, cpu_offload=cpu_offload)
            return
        kwargs: Dict[str, Any] = {
            "reshard_after_forward": self._reshard_after_forward,
            "ignored_params": ignored_params,
        }
        if cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for name, module in reversed(list(model.named_modules())):
            if training.get_shard_conditions(name, module):
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)

    # ------------------------------------------------------------------------------- reference policy

    def _reference(self) -> Optional[Reference]:
        """The base model: the policy with its adapters switched off (no second copy); None without KL."""
        if self.kl_coef <= 0:
            return None
        return Reference(self._model, context=partial(disable_adapter, self._model))

    # ----------------------------------------------------------------------------------- checkpoints

    def _gather_model_state(self) -> Dict[str, Any]:
        """The full state (base + adapters) on rank 0's CPU, or the adapters only (``save_adapter_weights_only``)."""
        return training.gather_cpu_state_dict(
            self._model, self._is_rank_zero, device=self._device,
            adapter_weights_only=self._save_adapter_weights_only,
        )

    def _write_model_files(self, model_state: Dict[str, Any], staging: Path, step: int) -> None:
        """The adapter (PEFT + torchtune) in ``staging`` and, unless adapters only, the merged model in
        ``staging/merged`` (the base class publishes and prunes; torchtune_grpo/checkpointing.py)."""
        with_merged = not self._save_adapter_weights_only
        adapter = get_adapter_state_dict(model_state) if with_merged else model_state
        staging.mkdir(parents=True)
        if with_merged:
            for key in adapter:
                if key.endswith(".lora_a.weight"):
                    # Merging adds to the base weight in place: never into a tensor the model shares.
                    base_key = key[: -len(".lora_a.weight")] + ".weight"
                    model_state[base_key] = model_state[base_key].clone()
            merged = get_merged_lora_ckpt(model_state, rank=self._lora.rank, alpha=self._lora.alpha)
            self._checkpointer.save_checkpoint(
                {training.MODEL_KEY: merged}, epoch=step, intermediate_checkpoint=False
            )
            os.replace(epoch_output_dir(self._checkpointer, step), staging / MERGED_DIR)
        save_adapter(
            staging,
            adapter,
            self._lora,
            model_type=model_type_name(self._checkpointer),
            hf_config=hf_config(self._checkpointer),
            base_model_name_or_path=getattr(self._checkpointer, "repo_id", None),
        )


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run grpo_lora_finetune_distributed --config CONFIG [key=value ...]``."""
    run_recipe(GRPOLoRAFinetuneRecipeDistributed, cfg)


if __name__ == "__main__":
    sys.exit(recipe_main())
