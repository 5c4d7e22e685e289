"""Tiny random Hugging Face model directories of every supported architecture, made with transformers in the
test (``*Config`` -> ``AutoModelForCausalLM.from_config`` -> ``save_pretrained``): nothing is downloaded."""

from pathlib import Path
from typing import Any, Dict

import torch

# Small but not degenerate: GQA (4 query heads, 2 kv heads), and for some a head_dim that differs from
# hidden_size / heads (Qwen3, Mistral-Nemo style).
_COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)

ARCHITECTURES: Dict[str, Dict[str, Any]] = {
    # Llama 3.2 style: llama3 rope scaling, tied embeddings. original_max_position_embeddings is small so
    # the scaling changes the low frequencies at the sequence lengths tested.
    "llama3_2": dict(model_type="llama", tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)),
    # Llama 3 / 3.1 without scaling, untied, 64-wide heads
    "llama3": dict(model_type="llama", tie_word_embeddings=False, rope_parameters=dict(rope_theta=500000.0)),
    # SmolLM2: Llama architecture, tied, MHA (kv heads = heads)
    "smollm2": dict(model_type="llama", tie_word_embeddings=True, num_key_value_heads=4,
                    rope_parameters=dict(rope_theta=100000.0)),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, head_dim=32, sliding_window=None,
                    rope_parameters=dict(rope_theta=1000000.0)),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_parameters=dict(rope_theta=1000000.0)),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=32,
                  rope_parameters=dict(rope_theta=1000000.0)),
    "qwen3_tied": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=16,
                       rope_parameters=dict(rope_theta=1000000.0)),
}


def hf_config(arch: str, **overrides):
    """The transformers config object of ``arch`` (a key of :data:`ARCHITECTURES`)."""
    from transformers import AutoConfig

    fields = {**_COMMON, **ARCHITECTURES[arch], **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight random, norms and biases included (transformers initialises norms to 1 and biases to 0,
    which would hide a norm applied in the wrong place or a bias never loaded)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.08 * noise)
    return model


def make_hf_model(directory: Path, arch: str, *, seed: int = 0, dtype=torch.float32, max_shard_size=None,
                  **overrides):
    """Save a random ``arch`` model to ``directory``; returns the transformers model (eval, fp32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **overrides), dtype=torch.float32)
    randomize(model, seed)
    model.eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.to(dtype).save_pretrained(directory, **kwargs)
    return model.float()


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, T, V]`` fp32 logits of the model saved in ``directory``, computed by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def make_model_dir(directory: Path, arch: str = "qwen3", *, seed: int = 0, **overrides) -> Path:
    """A complete tiny model directory: random ``arch`` weights and config, and a tokenizer with the matching
    chat template (Qwen3's for qwen3, ChatML for the rest) over the package's 512-id tiny BPE."""
    from tests.chat_templates import make_tokenizer_dir

    make_hf_model(directory, arch, seed=seed, vocab_size=512, **overrides)
    make_tokenizer_dir(directory, "qwen3" if arch.startswith("qwen3") else "qwen2_5")
    return directory


def hf_components(directory: Path) -> Dict[str, Any]:
    """Config overrides (for tests.recipe_utils.write_config) that point a tiny config at ``directory``
    through the directory-based components, with chat prompts."""
    return {
        "checkpointer": {"_component_": "torchtune_grpo.models.HFCheckpointer", "checkpoint_dir": str(directory),
                         "output_dir": "${output_dir}"},
        "model": {"_component_": "torchtune_grpo.models.hf_model", "path": "${checkpointer.checkpoint_dir}"},
        "tokenizer": {"_component_": "torchtune_grpo.models.hf_tokenizer", "path": "${checkpointer.checkpoint_dir}"},
        "dataset.prompt_style": "chat",
        "dataset.system_prompt": "Answer.",
    }
