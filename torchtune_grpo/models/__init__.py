"""Bring your own Hugging Face model: one directory gives the model, its weights and its tokenizer.

    model:        {_component_: torchtune_grpo.models.hf_model, path: DIR}
    checkpointer: {_component_: torchtune_grpo.models.HFCheckpointer, checkpoint_dir: DIR, output_dir: ...}
    tokenizer:    {_component_: torchtune_grpo.models.hf_tokenizer, path: DIR}

llama (Llama 3.x, SmolLM2, ...), mistral, qwen2 (Qwen2, Qwen2.5) and qwen3 (dense) are built from torchtune's
modules; every other causal LM transformers knows (Qwen3.5, Gemma 3/4, OLMo 3, SmolLM3, Phi-3/4, ...) is
transformers' own module (``model.backend``, :mod:`torchtune_grpo.models._backend`). See docs/models.md.
"""

from torchtune_grpo.models._backend import BACKENDS, Backend, choose_backend, is_mixture_of_experts
from torchtune_grpo.models._builder import HeadNormLinear, HeadNormLoRALinear, hf_model, lora_hf_model
from torchtune_grpo.models._chat_template import ChatTemplateError
from torchtune_grpo.models._checkpointer import HFCheckpointer, weight_files
from torchtune_grpo.models._convert import tune_to_hf_param
from torchtune_grpo.models._grouped_attention import grouped_kv_attention
from torchtune_grpo.models._padding_idx import drop_pad_input_embedding_grad
from torchtune_grpo.models._spec import HFModelSpec, SUPPORTED_MODEL_TYPES, read_hf_config
from torchtune_grpo.models._tokenizer import HFTokenizer, hf_tokenizer
from torchtune_grpo.models._transformers_weights import language_tensor_name
from torchtune_grpo.models._transformers_policy import TransformersDecoder, TransformersHead, text_model_config
from torchtune_grpo.models._vision import (
    attach_images,
    batch_image_inputs,
    image_class_names,
    image_inputs,
    image_modules_replaced,
    image_parameters,
    image_state_dict,
    text_after,
    trained_image_modules,
    trained_image_paths,
)

__all__ = [
    "attach_images",
    "batch_image_inputs",
    "image_class_names",
    "image_inputs",
    "image_modules_replaced",
    "image_parameters",
    "image_state_dict",
    "text_after",
    "trained_image_modules",
    "trained_image_paths",
    "BACKENDS",
    "Backend",
    "TransformersDecoder",
    "TransformersHead",
    "choose_backend",
    "ChatTemplateError",
    "HFCheckpointer",
    "HFModelSpec",
    "HFTokenizer",
    "HeadNormLinear",
    "HeadNormLoRALinear",
    "drop_pad_input_embedding_grad",
    "grouped_kv_attention",
    "SUPPORTED_MODEL_TYPES",
    "hf_model",
    "hf_tokenizer",
    "lora_hf_model",
    "is_mixture_of_experts",
    "language_tensor_name",
    "read_hf_config",
    "text_model_config",
    "tune_to_hf_param",
    "weight_files",
]
