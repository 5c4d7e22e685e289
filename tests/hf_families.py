"""Tiny random checkpoints of every causal-LM family a 2026 user brings, made by transformers in the test.

``make_family_dir(family, directory, seed=0)`` writes a complete Hugging Face model directory
(``AutoConfig.for_model(model_type, ...)`` -> ``AutoModelForCausalLM.from_config`` -> ``save_pretrained``,
fp32 safetensors) with the family's tokenizer and chat template; the same seed gives byte-identical files.
``FAMILIES`` lists the families: ``qwen3_5_text``, ``gemma3_text``, ``gemma4_text``, ``olmo3``, ``smollm3``,
``phi3``, ``mistral``, ``ministral3``, ``qwen2`` (Qwen2.5), and ``llama``, ``qwen3`` (the architectures torchtune
also builds, for cross-backend checks). ``make_multimodal_dir`` (:mod:`tests.hf_multimodal`) makes the checkpoints
that are multimodal on disk. The mixture-of-experts families (``qwen3_moe``, ``qwen3_5_moe``, ``gpt_oss``, ``olmoe``,
``mixtral``; decisive routers, ``dtype=torch.bfloat16`` for a bf16 checkpoint) are described in :mod:`tests.hf_moe`
and made by the same ``make_family_dir``.

What every fixture has:

- every layer kind of the family (``LAYER_KINDS`` says which, and :func:`layer_kinds` reads them back from a
  loaded model): Gated DeltaNet and gated full attention (qwen3_5_text), sliding and global layers with their
  two RoPE tables (gemma3_text, gemma4_text, olmo3), Gemma 4's per-layer input embeddings, KV-sharing layers
  and double-wide MLPs, NoPE and RoPE layers (smollm3), a sliding window (mistral), a full layer then a
  windowed one (qwen2's ``max_window_layers``), YaRN with Llama-4 attention temperature past 16 positions
  (ministral3), fused qkv/gate_up with partial rotary (phi3);
- windows of ``WINDOW`` = 6 tokens and YaRN's original length 16: shorter than the >= 24-token sequences of
  the tests, so a window (or a scaling) applied wrongly changes the numbers;
- hidden 128, 4 heads of 32 (2 KV heads), intermediate 256, vocab 512 (>= the tokenizer's 480 + specials),
  2 to 4 layers; every weight random (norms and biases too, as :func:`tests.hf_models.randomize`);
- peaked attention: the query/key gains are raised (q/k norm weights where the family has them, else the
  q/k projections) so that the mean, over query positions >= 8 of a 32-token random sequence, every
  softmax-attention layer and head, of the largest attention probability is >= ``PEAKED_MIN``
  (uniform attention would give 0.03-0.11 over 9-32 keys, 0.17 in a window); measured values per family are in
  ``MEASURED_PEAKEDNESS`` (``tests/test_hf_families.py`` checks them);
- the family's chat template and special tokens (:mod:`tests.family_templates`) on the package's tiny
  byte-level BPE (480 tokens) with the specials after it; ``bos/eos/pad_token_id`` of ``config.json`` and
  ``generation_config.json`` are the tokenizer's ids.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from tests import family_templates as T

__all__ = ["FAMILIES", "LAYER_KINDS", "LAYOUT_FAMILIES", "MEASURED_PEAKEDNESS", "PEAKED_MIN", "WINDOW", "Family",
           "family_config", "family_model", "family_spec", "layer_kinds", "make_family_dir", "make_tokenizer",
           "peakedness", "probe_tokens", "qwen3_5_layers", "scale_routers", "sharpen", "write_tokenizer_files"]

WINDOW = 6


def qwen3_5_layers() -> Dict[str, Any]:
    """Qwen3.5's layer stack (dense and MoE fixtures): a Gated DeltaNet linear-attention layer, then a gated
    full-attention one. A fresh dict per call (transformers may fill in a config's nested rope parameters)."""
    return dict(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
    )


PEAKED_MIN = 0.6
# peakedness() of each fixture (seed 0) on probe_tokens(32), fp32 eager attention
# (2-core AVX-512 Xeon, transformers 5.19). Uniform attention would give 1/(t + 1) = 0.03-0.11 over the
# 9-32 visible keys of full layers and 1/6 = 0.17 in the 6-token windows.
MEASURED_PEAKEDNESS = {"qwen3_5_text": 0.859, "gemma3_text": 0.914, "gemma4_text": 0.978, "olmo3": 0.877,
                       "smollm3": 0.830, "phi3": 0.830, "mistral": 0.888, "ministral3": 0.833, "llama": 0.825,
                       "qwen3": 0.859, "qwen2": 0.828}
VOCAB = 512
# head_dim 32: the smallest vLLM's CPU attention runs (it supports 32, 64, 80, ..., 512); hidden 128 and
# intermediate 256 keep q/o and MLP weights NF4-quantisable (multiples of 64 x 256 elements).
_SIZES = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256)


@dataclass(frozen=True)
class Family:
    """How one family's tiny checkpoint is made.

    Attributes:
        model_type (str): transformers' ``model_type``.
        config (Dict[str, Any]): config fields besides ``_SIZES`` (layer counts and kinds, windows, RoPE).
        template (str): the chat template (jinja).
        specials (List[str]): special tokens, added after the 480 BPE tokens in this order.
        bos (Optional[str]), eos (str), pad (Optional[str]): the tokenizer's special tokens.
        stops (List[str]): ``eos_token_id`` of ``generation_config.json`` (end of turn and end of text).
        added (List[str]): plain (not special) added tokens, e.g. Qwen's ``<think>``.
        bos_in_text (bool): the tokenizer prepends BOS to every text (Llama, Mistral); otherwise the template
            writes it (Gemma) or the family has none.
        qk_gain (float): the q/k norm gain, or the factor on the q/k projections without q/k norms.
        offset_norm (bool): the family's norms multiply by ``1 + weight`` (Gemma, Qwen3.5).
    """

    model_type: str
    config: Dict[str, Any]
    template: str
    specials: List[str]
    eos: str
    bos: Optional[str] = None
    pad: Optional[str] = None
    stops: List[str] = field(default_factory=list)
    added: List[str] = field(default_factory=list)
    bos_in_text: bool = False
    qk_gain: float = 3.0
    offset_norm: bool = False


FAMILIES: Dict[str, Family] = {
    "qwen3_5_text": Family(
        "qwen3_5_text", dict(**qwen3_5_layers(), tie_word_embeddings=True),
        T.QWEN3_5, T.CHATML + T.QWEN_VISION, eos="<|im_end|>", pad="<|endoftext|>",
        stops=["<|im_end|>", "<|endoftext|>"], added=["<think>", "</think>"], offset_norm=True),
    "gemma3_text": Family(
        "gemma3_text",
        dict(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             sliding_window=WINDOW, query_pre_attn_scalar=16, final_logit_softcapping=None,
             rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                                  full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6))),
        T.GEMMA3, T.GEMMA + T.GEMMA3_VISION, bos="<bos>", eos="<eos>", pad="<pad>",
        stops=["<eos>", "<end_of_turn>"], offset_norm=True),
    "gemma4_text": Family(
        "gemma4_text",
        dict(num_hidden_layers=4, sliding_window=WINDOW, final_logit_softcapping=30.0,
             layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
             global_head_dim=64, num_kv_shared_layers=2, use_double_wide_mlp=True,
             vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
             rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                                  full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                                      rope_theta=1e6))),
        T.GEMMA4, T.GEMMA4_SPECIALS + T.GEMMA4_MEDIA, bos="<bos>", eos="<eos>", pad="<pad>",
        stops=["<eos>", "<turn|>"]),
    "olmo3": Family(
        "olmo3",
        dict(num_hidden_layers=4, sliding_window=WINDOW,
             layer_types=["sliding_attention"] * 3 + ["full_attention"],
             rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
        T.OLMO3, T.CHATML + ["<|pad|>"], eos="<|endoftext|>", pad="<|pad|>",
        stops=["<|im_end|>", "<|endoftext|>"]),
    "smollm3": Family(
        "smollm3",
        dict(num_hidden_layers=4, no_rope_layer_interval=4, no_rope_layers=[1, 1, 1, 0],
             tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=2e6)),
        T.SMOLLM3, ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>",
                    "<|finetune_right_pad_id|>"],
        bos="<|begin_of_text|>", eos="<|im_end|>", pad="<|finetune_right_pad_id|>",
        stops=["<|im_end|>", "<|end_of_text|>"], added=["<think>", "</think>"]),
    "phi3": Family(  # Phi-4-mini: tied, partial rotary
        "phi3",
        dict(num_hidden_layers=2, tie_word_embeddings=True, original_max_position_embeddings=256,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
        T.PHI3, ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], eos="<|endoftext|>",
        pad="<|endoftext|>", stops=["<|end|>", "<|endoftext|>"]),
    "mistral": Family(
        "mistral",
        dict(num_hidden_layers=2, sliding_window=WINDOW, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        T.MISTRAL, T.MISTRAL_SPECIALS, bos="<s>", eos="</s>", stops=["</s>"], bos_in_text=True),
    "ministral3": Family(
        "ministral3",
        dict(num_hidden_layers=2, rope_parameters=dict(
            rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.1)),
        T.MINISTRAL3, T.MISTRAL_SPECIALS + ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<pad>"], bos="<s>", eos="</s>",
        pad="<pad>", stops=["</s>"], bos_in_text=True),
    "llama": Family(  # Llama 3.2: llama3 RoPE scaling (original length 16, so it bites), tied
        "llama",
        dict(num_hidden_layers=2, tie_word_embeddings=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=16)),
        T.LLAMA3_2, T.LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>",
        stops=["<|end_of_text|>", "<|eot_id|>"], bos_in_text=True),
    "qwen3": Family(
        "qwen3",
        dict(num_hidden_layers=2, tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        T.QWEN3, T.CHATML, eos="<|im_end|>", pad="<|endoftext|>", stops=["<|im_end|>", "<|endoftext|>"],
        added=["<think>", "</think>"]),
    "qwen2": Family(  # Qwen2.5: q/k/v biases, tied; a full layer, then a windowed one (max_window_layers=1)
        "qwen2",
        dict(num_hidden_layers=2, tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
             max_window_layers=1, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        T.QWEN2_5, T.CHATML, eos="<|im_end|>", pad="<|endoftext|>", stops=["<|im_end|>", "<|endoftext|>"]),
}

# Model types checked for the training layouts only (tests/test_transformers_layouts.py feeds them token ids):
# families users bring whose base model takes the masks as one of the checked ones does, with what sets each
# apart. Their tokenizers and templates are the nearest fixture's (only ``family_config``'s special-token ids
# are read); the full fixture treatment (templates, engines, recipe runs) is for :data:`FAMILIES`.
LAYOUT_FAMILIES: Dict[str, Family] = {
    "gemma2": Family(  # Gemma 2: alternating 6-token windows, attention and final logit soft-capping
        "gemma2",
        dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
             query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
        T.GEMMA3, T.GEMMA, bos="<bos>", eos="<eos>", pad="<pad>", stops=["<eos>", "<end_of_turn>"],
        offset_norm=True),
    "olmo2": Family(  # OLMo 2: q/k norms over the whole projection, norms after attention and MLP
        "olmo2", dict(num_hidden_layers=2, rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
        T.OLMOE, T.OLMOE_SPECIALS, eos="<|endoftext|>", pad="<|padding|>", stops=["<|endoftext|>"]),
    # Granite 3: embedding, attention (1 / head_dim, not 1 / sqrt(head_dim): a larger q/k gain keeps the
    # attention peaked), residual and logit multipliers.
    "granite": Family(
        "granite",
        dict(num_hidden_layers=2, tie_word_embeddings=True, embedding_multiplier=12.0, attention_multiplier=1 / 32,
             residual_multiplier=0.2, logits_scaling=8.0, rope_parameters=dict(rope_type="default",
                                                                                rope_theta=10000.0)),
        T.OLMOE, T.OLMOE_SPECIALS, eos="<|endoftext|>", pad="<|padding|>", stops=["<|endoftext|>"], qk_gain=6.0),
    "cohere2": Family(  # Command R7B: windowed and global layers, parallel attention and MLP, logit scale
        "cohere2",
        dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
             logit_scale=0.25, rope_parameters=dict(rope_type="default", rope_theta=50000.0)),
        T.QWEN2_5, T.CHATML, eos="<|im_end|>", pad="<|endoftext|>", stops=["<|im_end|>"]),
}

# The layer kinds each fixture has (what :func:`layer_kinds` reports for it).
LAYER_KINDS: Dict[str, set] = {
    "qwen3_5_text": {"linear_attention", "full_attention"},
    "gemma3_text": {"sliding_attention", "full_attention"},
    "gemma4_text": {"sliding_attention", "full_attention", "kv_shared", "own_kv", "per_layer_input",
                    "double_wide_mlp"},
    "olmo3": {"sliding_attention", "full_attention"},
    "smollm3": {"rope", "nope"},
    "phi3": {"full_attention"},
    "mistral": {"sliding_attention"},
    "ministral3": {"full_attention"},
    "llama": {"full_attention"},
    "qwen3": {"full_attention"},
    "qwen2": {"full_attention", "sliding_attention"},
}


def family_spec(family: str) -> Family:
    """The :class:`Family` of a dense (:data:`FAMILIES`), mixture-of-experts (:data:`tests.hf_moe.MOE_FAMILIES`) or
    layouts-only (:data:`LAYOUT_FAMILIES`) fixture."""
    from tests.hf_moe import MOE_FAMILIES

    if family in FAMILIES:
        return FAMILIES[family]
    if family in MOE_FAMILIES:
        return MOE_FAMILIES[family]
    if family in LAYOUT_FAMILIES:
        return LAYOUT_FAMILIES[family]
    raise ValueError(f"unknown family {family!r}; known: {', '.join([*FAMILIES, *MOE_FAMILIES, *LAYOUT_FAMILIES])}")


def make_tokenizer(family: str):
    """The family's tokenizer: the package's tiny byte-level BPE (480 tokens, ids 0-479) with the family's
    special tokens (ids 480, 481, ... in ``Family.specials`` order) and plain added tokens after them.

    Returns:
        tokenizers.Tokenizer: the tokenizer (BOS prepended by its post-processor where ``bos_in_text``).
    """
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    from torchtune_grpo.assets import asset_path

    spec = family_spec(family)
    data = json.loads(Path(asset_path("tiny_qwen2", "tokenizer.json")).read_text(encoding="utf-8"))
    data["added_tokens"] = []  # Qwen2's specials go: each family brings its own
    tok = Tokenizer.from_str(json.dumps(data))
    tok.add_special_tokens(spec.specials)
    tok.add_tokens(spec.added)
    if spec.bos_in_text:
        bos = tok.token_to_id(spec.bos)
        tok.post_processor = TemplateProcessing(single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B",
                                                special_tokens=[(spec.bos, bos)])
    return tok


def family_config(family: str, **overrides):
    """The transformers config of ``family``'s tiny checkpoint (special-token ids from its tokenizer)."""
    from transformers import AutoConfig

    spec = family_spec(family)
    tok = make_tokenizer(family)
    ids = dict(bos_token_id=tok.token_to_id(spec.bos) if spec.bos else None,
               eos_token_id=tok.token_to_id(spec.eos),
               pad_token_id=tok.token_to_id(spec.pad) if spec.pad else None)
    fields = {**_SIZES, **ids, **spec.config, **overrides}
    return AutoConfig.for_model(spec.model_type, **fields)


def _qk_rows(name: str, p: torch.Tensor, config) -> Optional[slice]:
    """Rows of a weight that compute queries or keys of a softmax attention (None for other weights)."""
    if name.endswith(("q_proj.weight", "k_proj.weight")) and "linear_attn" not in name:
        return slice(None)
    if name.endswith("qkv_proj.weight"):  # Phi-3: [q; k; v] rows
        d = config.hidden_size // config.num_attention_heads
        return slice(0, (config.num_attention_heads + config.num_key_value_heads) * d)
    return None


def sharpen(model: torch.nn.Module, family: str, seed: int = 0) -> torch.nn.Module:
    """Make ``model``'s attention peaked: q/k norm weights set to the family's gain (as ``1 + w`` where the
    norms are offset), each with 10% noise; without q/k norms the q/k projection rows scaled by the gain."""
    spec = family_spec(family)
    gen = torch.Generator().manual_seed(seed + 1)
    has_qk_norm = any(n.endswith("q_norm.weight") for n, _ in model.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if has_qk_norm and name.endswith(("q_norm.weight", "k_norm.weight")):
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(spec.qk_gain * (1 + 0.1 * noise) - (1.0 if spec.offset_norm else 0.0))
            elif not has_qk_norm and (rows := _qk_rows(name, p, model.config)) is not None:
                p[rows] *= spec.qk_gain
    return model


def scale_routers(model: torch.nn.Module, gain: float) -> torch.nn.Module:
    """Scale a mixture of experts' router weights (``mlp.gate.weight``, gpt-oss's ``mlp.router.weight``) by
    ``gain``: larger gaps between the router logits, so the top-k choice is decisive (:mod:`tests.hf_moe`)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p *= gain
    return model


def make_family_dir(family: str, directory, *, seed: int = 0, peaked: bool = True,
                    router_gain: Optional[float] = None, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Write ``family``'s tiny random checkpoint (config, fp32 safetensors, tokenizer, chat template) to
    ``directory`` (created if needed). The same ``seed`` gives byte-identical files.

    Args:
        family (str): a key of :data:`FAMILIES` or of :data:`tests.hf_moe.MOE_FAMILIES`, or ``qwen3_5_moe``
            (multimodal on disk, :func:`tests.hf_multimodal.make_multimodal_dir`).
        directory: where to write.
        seed (int): the weights' seed. Default is 0.
        peaked (bool): sharpen the attention (:func:`sharpen`). False: plain random weights, for tests that compare
            a model with itself computed in another grouping, where peaked softmaxes only amplify rounding.
            Default is True.
        router_gain (Optional[float]): the factor on a mixture of experts' router weights (:func:`scale_routers`);
            None: :data:`tests.hf_moe.ROUTER_GAIN` when ``peaked``, else 1. Default is None.
        dtype (torch.dtype): the weights' dtype on disk (made in fp32, then cast). Default is ``torch.float32``.
        **overrides: config fields to change (e.g. ``num_key_value_heads=4`` for NF4-quantisable k/v).

    Returns:
        Path: ``directory``.
    """
    from transformers import AutoModelForCausalLM

    from tests.hf_models import randomize
    from tests.hf_moe import ROUTER_GAIN

    gain = router_gain if router_gain is not None else (ROUTER_GAIN if peaked else 1.0)
    if family == "qwen3_5_moe":
        from tests.hf_multimodal import make_multimodal_dir

        return make_multimodal_dir(family, directory, seed=seed, peaked=peaked, router_gain=gain, dtype=dtype,
                                   **overrides)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **overrides), dtype=torch.float32)
    randomize(model, seed)
    if peaked:
        sharpen(model, family, seed)
    scale_routers(model, gain)
    model.to(dtype).save_pretrained(directory)
    write_tokenizer_files(family, directory)
    return directory


def family_model(family: str, seed: int = 0) -> torch.nn.Module:
    """``family``'s tiny model in memory (fp32, eval), with the weights :func:`make_family_dir` writes for ``seed``
    (peaked attention, decisive routers); ``qwen3_5_moe`` gives its language model (``qwen3_5_moe_text``)."""
    from transformers import AutoModelForCausalLM

    from tests.hf_models import randomize
    from tests.hf_moe import MOE_FAMILIES, ROUTER_GAIN

    name = "qwen3_5_moe_text" if family == "qwen3_5_moe" else family
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name), dtype=torch.float32)
    randomize(model, seed)
    sharpen(model, name, seed)
    scale_routers(model, ROUTER_GAIN if name in MOE_FAMILIES else 1.0)
    return model.eval()


def write_tokenizer_files(family: str, directory: Path) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` (specials, chat template) and ``generation_config.json``."""
    spec = family_spec(family)
    tok = make_tokenizer(family)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": spec.bos, "eos_token": spec.eos,
              "pad_token": spec.pad, "chat_template": spec.template}
    (directory / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None}, indent=1), encoding="utf-8")
    generation = {"eos_token_id": [tok.token_to_id(t) for t in spec.stops]}
    if spec.bos:
        generation["bos_token_id"] = tok.token_to_id(spec.bos)
    if spec.pad:
        generation["pad_token_id"] = tok.token_to_id(spec.pad)
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=1), encoding="utf-8")


def layer_kinds(model: torch.nn.Module) -> set:
    """The layer kinds a loaded transformers model really has, read off its modules (Mistral's window, which
    its attention modules do not hold, off its config)."""
    config = model.config.get_text_config()
    kinds = set()
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        if hasattr(layer, "linear_attn"):
            kinds.add("linear_attention")
        elif getattr(attn, "sliding_window", None) or (config.model_type == "mistral" and config.sliding_window):
            kinds.add("sliding_attention")
        elif not hasattr(attn, "use_rope"):
            kinds.add("full_attention")
        if hasattr(attn, "use_rope"):  # SmolLM3: RoPE or NoPE per layer
            kinds.add("rope" if attn.use_rope else "nope")
        if hasattr(attn, "is_kv_shared_layer"):
            kinds.add("kv_shared" if attn.is_kv_shared_layer else "own_kv")
        if hasattr(layer, "per_layer_input_gate"):
            kinds.add("per_layer_input")
        if getattr(layer.mlp, "intermediate_size", config.intermediate_size) > config.intermediate_size:
            kinds.add("double_wide_mlp")
    return kinds


def probe_tokens(length: int = 32) -> torch.Tensor:
    """``[1, length]`` random ids of plain BPE tokens (no specials), seed 0: the sequence the measured values
    of this module are taken on."""
    return torch.randint(0, 470, (1, length), generator=torch.Generator().manual_seed(0))


def peakedness(model: torch.nn.Module, tokens: torch.Tensor, start: int = 8) -> float:
    """Mean, over softmax-attention layers, heads and query positions >= ``start``, of the largest attention
    probability (1.0: every query attends to one key; uniform over the ``t + 1`` visible keys: ``1 / (t + 1)``).

    Args:
        model (torch.nn.Module): loaded with ``attn_implementation="eager"`` (the only one returning weights).
        tokens (torch.Tensor): ``[B, T]`` ids, ``T > start``.
        start (int): the first query position counted (early positions see few keys). Default is 8.

    Returns:
        float: the mean largest probability.
    """
    with torch.no_grad():
        attentions = model(tokens, output_attentions=True).attentions
    maxima = [a[:, :, start:, :].amax(-1).mean() for a in attentions if a is not None]  # [B, H, T-start] each
    return float(torch.stack(maxima).mean())
