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
- Image prompts with ``train_vision: projector`` or ``tower``: those modules train fully (no adapters on them).
  The reference sees a frozen copy of them as the source has them (``initial_image_side``). ``step_N/merged``
  holds them under the checkpoint's names, ``step_N/image_side.safetensors`` under the image-text class's, and
  a resumed run loads them from there (docs/multimodal.md).

FSDP2 is set up as in torchtune's ``lora_finetune_distributed`` (meta-device init, per-layer
``fully_shard``, adapters initialised after sharding), except that QLoRA's NF4 base weights are kept out of
FSDP (``ignored_params``) and held whole on every rank: with torch 2.13 FSDP2's single-process path ignores
NF4's all-gather extension, and sharding NF4 needs every weight's block count to divide by the world size.
"""

import os
import sys
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Dict, Optional

# First: drops torchao's import-time line before torchtune imports it (torchtune_grpo/runtime/quiet.py).
import torchtune_grpo.runtime.quiet  # noqa: F401, I001

import torch
from omegaconf import DictConfig
from torchtune import config, training
from torchtune.modules.peft import disable_adapter, get_adapter_state_dict, get_merged_lora_ckpt
from safetensors.torch import save_file

from grpo_full_finetune_distributed import checkpoint_source, GRPOFullFinetuneRecipeDistributed, Models, run_recipe
from torchtune_grpo.checkpoints.checkpointer_facts import epoch_output_dir, hf_config, model_type_name
from torchtune_grpo.config import LoRARecipeConfig
from torchtune_grpo.training.experience import Reference
from torchtune_grpo.models import image_class_names, image_state_dict
from torchtune_grpo.models.lora import ADAPTER_TORCHTUNE_FILE, save_adapter
from torchtune_grpo.runtime.image_setup import IMAGE_SIDE_FILE, image_side_state, initial_image_side
from torchtune_grpo.runtime.lora_setup import build_lora_model
from torchtune_grpo.runtime.precision import Precision
from torchtune_grpo.runtime.sharding import gather_full_state_dict

MERGED_DIR = "merged"  # step_N/merged: the Hugging Face model with the adapter merged in


class GRPOLoRAFinetuneRecipeDistributed(GRPOFullFinetuneRecipeDistributed):
    """GRPO with LoRA/QLoRA adapters and FSDP2. See the module docstring and ``docs/lora.md``.

    Overrides only the full recipe's hooks: :meth:`precision`, :meth:`build_models`,
    :meth:`gather_model_state` and :meth:`write_model_files`.

    Args:
        cfg (DictConfig): the run's config (see ``configs/tiny/lora_grpo_cpu.yaml``).
    """

    config_class = LoRARecipeConfig  # the full recipe's keys and save_adapter_weights_only

    @staticmethod
    def precision(config: Any) -> Precision:
        # Every weight stays in the compute dtype (frozen base; adapters train at LoRA's larger rates), so
        # dtype: bf16 is bf16_pure here (torchtune_grpo/runtime/precision.py).
        return Precision.from_name("bf16_pure" if config.dtype == "bf16" else config.dtype)

    def build_models(self, cfg: DictConfig, base_checkpointer: Any, resume_dir: Optional[Path]) -> Models:
        reference = self.config.reference
        if reference.precision != "compute" or reference.offload:
            raise ValueError(
                f"reference.precision: {reference.precision} / reference.offload: {reference.offload} apply to the "
                "full recipe only: the LoRA recipe's reference is the policy with its adapters off (no second copy; "
                "QLoRA's base is NF4 already). Remove the reference: section."
            )
        # Base weights always come from the original checkpoint; a resumed run adds its saved adapter (and trained
        # vision tensors). Saves go through the same checkpointer, whose config.json and tokenizer files are the base's.
        base_state = base_checkpointer.load_checkpoint()[training.MODEL_KEY]
        adapter_state, image_file = None, None
        if resume_dir is not None:
            adapter_state = torch.load(Path(resume_dir) / ADAPTER_TORCHTUNE_FILE, map_location="cpu", weights_only=True)
            image_file = Path(resume_dir) / IMAGE_SIDE_FILE if (Path(resume_dir) / IMAGE_SIDE_FILE).is_file() else None
        max_len = (self.config.max_prompt_length or 0) + self.config.max_response_length
        model, self._lora = build_lora_model(
            cfg.model, base_state, adapter_state, self._placement, source=checkpoint_source(cfg), max_len=max_len
        )
        # The reference is the base model: the policy with its adapters switched off (no second copy), seeing the
        # source's vision modules where train_vision trains them.
        reference = Reference(model, context=partial(_base_model, model))
        what = "the base model: the policy with its adapters disabled (no second copy)"
        if self.config.train_vision != "none":
            trained = "projector" if self.config.train_vision == "projector" else "tower and projector"
            what += f", seeing a frozen copy of the source's {trained} (train_vision)"
        return Models(model, reference, base_checkpointer, what, image_source=checkpoint_source(cfg), image_file=image_file)

    def gather_model_state(self) -> Dict[str, Any]:
        """The full state (base + adapters) on rank 0's CPU, or the adapters only (``save_adapter_weights_only``);
        with the trained vision tensors (``train_vision``) in both."""
        if not self.config.save_adapter_weights_only:
            return gather_full_state_dict(self.model, self._is_rank_zero, self._device)
        # Only what is saved is gathered (not the base weights): torchtune's adapter keys (its filter, as its
        # ``adapter_weights_only`` gather used) and the trained vision tensors.
        keys = set(get_adapter_state_dict(self.model.state_dict(), device=None))  # device None: nothing moves
        if self.config.train_vision != "none":
            keys |= set(image_class_names(self.model))
        return gather_full_state_dict(self.model, self._is_rank_zero, self._device, keys=keys)

    def write_model_files(self, model_state: Dict[str, Any], staging: Path, step: int) -> None:
        """The adapter (PEFT + torchtune) and the trained vision tensors (:data:`IMAGE_SIDE_FILE`) in ``staging``
        and, unless adapters only, the merged model in ``staging/merged`` (the base class publishes and prunes;
        torchtune_grpo/checkpoints/manager.py)."""
        with_merged = not self.config.save_adapter_weights_only
        adapter, image_side = get_adapter_state_dict(model_state), image_side_state(self.model, model_state)
        staging.mkdir(parents=True)
        if with_merged:
            for key in adapter:
                if key.endswith(".lora_a.weight"):
                    # Merging adds to the base weight in place: never into a tensor the model shares.
                    base_key = key[: -len(".lora_a.weight")] + ".weight"
                    model_state[base_key] = model_state[base_key].clone()
            merged = get_merged_lora_ckpt(model_state, rank=self._lora.rank, alpha=self._lora.alpha)
            merged = image_state_dict(self.model, merged)  # trained vision tensors under the checkpoint's names
            self._checkpointer.save_checkpoint({training.MODEL_KEY: merged}, epoch=step, intermediate_checkpoint=False)
            os.replace(epoch_output_dir(self._checkpointer, step), staging / MERGED_DIR)
        if image_side:  # for adapter users: AutoModelForImageTextToText's load_state_dict(..., strict=False)
            save_file({k: v.contiguous() for k, v in image_side.items()}, str(staging / IMAGE_SIDE_FILE))
        save_adapter(
            staging,
            adapter,
            self._lora,
            model_type=model_type_name(self._checkpointer),
            hf_config=hf_config(self._checkpointer),
            base_model_name_or_path=getattr(self._checkpointer, "repo_id", None),
        )


@contextmanager
def _base_model(model: torch.nn.Module):
    """The reference's forwards: the adapters off, and the source's vision modules in place of trained ones."""
    with disable_adapter(model), initial_image_side(model):
        yield


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run grpo_lora_finetune_distributed --config CONFIG [key=value ...]``."""
    run_recipe(GRPOLoRAFinetuneRecipeDistributed, cfg)


if __name__ == "__main__":
    sys.exit(recipe_main())
