"""Which module a Hugging Face model directory is trained as: torchtune's or transformers' own.

Two backends build the policy from the same directory:

- ``torchtune``: the decoder rebuilt from torchtune's modules (:mod:`torchtune_grpo.models._builder`), for the
  architectures :class:`~torchtune_grpo.models.HFModelSpec` reads (Llama 3.x / SmolLM2, Mistral without a
  window that bites, Qwen2/2.5, Qwen3 dense). The native engine's shared-prefix decode, the shared-prompt and
  packed training layouts need it.
- ``transformers``: ``AutoModelForCausalLM``'s own module for the directory
  (:mod:`torchtune_grpo.models._transformers_policy`), for every other causal LM transformers knows: Qwen3.5,
  Gemma 3/4, OLMo 3, SmolLM3, Phi-3/4, Ministral 3, Mistral with a sliding window, ..., and every
  mixture-of-experts model (Qwen3-MoE, Qwen3.5-MoE, gpt-oss, OLMoE, Mixtral): torchtune 0.6.1 has no MoE
  layers, so ``backend: torchtune`` refuses them by name.

``model.backend: auto`` (the default) picks torchtune where it builds the same model and transformers
elsewhere; ``torchtune`` or ``transformers`` forces one.
"""

from typing import Any, Mapping, NamedTuple

from torchtune_grpo.models._spec import _MOE_KEYS, HFModelSpec, SUPPORTED_MODEL_TYPES

__all__ = ["BACKENDS", "Backend", "choose_backend", "is_mixture_of_experts", "text_config"]

BACKENDS = ("auto", "torchtune", "transformers")
# Seq2seq architectures: GRPO here trains decoder-only causal LMs.
_ENCODER_DECODER = {"t5", "mt5", "umt5", "bart", "mbart", "pegasus", "marian", "led", "longt5", "switch_transformers",
                    "t5gemma", "whisper", "prophetnet", "blenderbot", "fsmt", "nllb_moe", "m2m_100", "plbart"}

_MOE_TYPES = {"mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3", "llama4", "llama4_text", "dbrx", "jamba", "minimax"}


class Backend(NamedTuple):
    """The backend chosen for a directory.

    Attributes:
        name (str): ``"torchtune"`` or ``"transformers"``.
        reason (str): why, for the log and the algorithm card.
    """

    name: str
    reason: str


def text_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a ``config.json``: its ``text_config`` for a multimodal checkpoint
    (Qwen3.5, Gemma 3 4B+, Gemma 4 on disk), else the config itself."""
    inner = hf_config.get("text_config")
    return inner if isinstance(inner, Mapping) else hf_config


def is_mixture_of_experts(hf_config: Mapping[str, Any]) -> str:
    """Why a ``config.json`` describes a mixture-of-experts model (its ``model_type`` or an expert count, as
    ``"model_type 'qwen3_moe'"`` or ``"num_experts = 8"``), or ``""`` for a dense one."""
    text = text_config(hf_config)
    model_type = str(text.get("model_type", ""))
    if "moe" in model_type or model_type in _MOE_TYPES:
        return f"model_type {model_type!r}"
    return next((f"{key} = {text[key]!r}" for key in _MOE_KEYS if text.get(key)), "")


def _window_bites(hf_config: Mapping[str, Any]) -> bool:
    # torchtune's Mistral is built for at most `sliding_window` positions (where a window changes nothing);
    # a window shorter than the model's context means longer sequences need transformers' windowed attention.
    window = hf_config.get("sliding_window")
    positions = int(hf_config.get("max_position_embeddings", 4096))
    return hf_config.get("model_type") == "mistral" and bool(window) and int(window) < positions


def choose_backend(hf_config: Mapping[str, Any], backend: str = "auto", source: str = "config.json") -> Backend:
    """The backend that trains the model of ``hf_config`` (see the module docstring).

    Args:
        hf_config (Mapping[str, Any]): the directory's parsed ``config.json``.
        backend (str): ``model.backend``: ``"auto"``, ``"torchtune"`` or ``"transformers"``. Default is ``"auto"``.
        source (str): where the config came from, for messages. Default is ``"config.json"``.

    Returns:
        Backend: the name and the reason.

    Raises:
        ValueError: for an unknown ``backend``, an encoder-decoder model, or ``backend: torchtune`` on an
            architecture torchtune's modules do not build (the message names ``model.backend`` and why).
    """
    if backend not in BACKENDS:
        raise ValueError(f"model.backend = {backend!r}; choose one of {list(BACKENDS)}")
    model_type = hf_config.get("model_type")
    if hf_config.get("is_encoder_decoder") or model_type in _ENCODER_DECODER:
        raise ValueError(
            f"{source}: model_type {model_type!r} is an encoder-decoder model; GRPO here trains decoder-only "
            "causal language models"
        )
    text = text_config(hf_config)
    moe = is_mixture_of_experts(hf_config)
    if hf_config.get("quantization_config") or text.get("quantization_config"):
        method = dict(hf_config.get("quantization_config") or text["quantization_config"]).get("quant_method", "?")
        if method == "mxfp4" and moe and backend != "torchtune":
            # gpt-oss as released: MXFP4 experts, dequantised on load (models/_transformers_experts.py).
            return Backend("transformers", f"{moe}: a mixture-of-experts model with MXFP4 experts (dequantised on "
                           "load, saved unquantised), trained as transformers' own module")
        raise ValueError(
            f"{source}: quantization_config.quant_method = {method!r} is not supported (either backend): train from "
            "unquantised bf16/fp16/fp32 weights"
        )
    try:
        HFModelSpec.from_hf_config(hf_config, source=source)
        torchtune_problem = "a window shorter than its context (sliding_window)" if _window_bites(hf_config) else None
    except ValueError as e:
        torchtune_problem = str(e)
    if backend == "torchtune":
        if moe:
            raise ValueError(
                f"{source}: {moe}: a mixture-of-experts model, and torchtune's modules have no mixture-of-experts "
                "layers: set model.backend: transformers (or auto) to train "
                "transformers' own module"
            )
        if torchtune_problem is not None and not _window_bites(hf_config):
            raise ValueError(
                f"model.backend: torchtune, but torchtune's modules do not build this model: {torchtune_problem}. "
                "Set model.backend: transformers (or auto) to train transformers' own module."
            )
        return Backend("torchtune", "model.backend: torchtune")
    if backend == "transformers":
        return Backend("transformers", "model.backend: transformers")
    if moe:
        return Backend("transformers", f"{moe}: a mixture-of-experts model, trained as transformers' own module "
                       "(torchtune's modules have none; model.backend: auto)")
    if torchtune_problem is None:
        return Backend("torchtune", f"model_type {model_type!r} is built from torchtune's modules (model.backend: auto)")
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = f"torchtune's modules build {sorted(SUPPORTED_MODEL_TYPES)} only"
    else:
        why = f"torchtune's modules do not build it: {torchtune_problem}"
    return Backend("transformers", f"model_type {model_type!r} is trained as transformers' own module ({why}; "
                   "model.backend: auto)")
