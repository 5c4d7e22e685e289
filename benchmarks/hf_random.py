"""Random Hugging Face model directories of real shapes, and a tokenizer whose words are token ids.

The GPU check (benchmarks/gpu_grpo.py, benchmarks/gpu_trl.py) needs Qwen3-0.6B- and 1.7B-shaped models with
no download: :func:`write_model_dir` writes ``config.json`` and random ``model.safetensors`` with
transformers (``Qwen3Config`` -> ``AutoModelForCausalLM.from_config`` -> ``save_pretrained``), the same kind
of directory ``tune download`` leaves, which this package reads through the one-line model config
(``checkpointer.checkpoint_dir``: :class:`~torchtune_grpo.models.HFCheckpointer` +
:func:`~torchtune_grpo.models.hf_model`) and TRL through ``from_pretrained``.

Prompts are random token ids, so the directory's tokenizer (:func:`write_id_tokenizer`) maps each id ``i``
to the word ``"i"`` and back (whitespace-separated): text and ids convert exactly both ways, for TRL's
tokenize/decode round trip, and the reward can be computed on ids alone.

Both sides of the step-time ratio also take their GRPO workload (batch, lengths, steps) from here
(:func:`add_workload_args`, :func:`use_tiny_workload`), so the ratio compares the same batch.
"""

import argparse
from pathlib import Path
from typing import Any, Dict, Union

import torch

# config.json fields of each shape (Qwen3-0.6B and Qwen3-1.7B as published: tied embeddings, GQA 16/8 heads
# of 128, q/k norms; the tiny one for the CPU rehearsal).
SHAPES: Dict[str, Dict[str, Any]] = {
    "qwen3_0_6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "qwen3_1_7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "tiny_qwen3": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # Qwen3.5-0.8B's language model (its model card: 24 layers of 3 x (Gated DeltaNet -> FFN) then
    # 1 x (gated attention -> FFN), hidden 1024, vocabulary 248,320, DeltaNet 16 QK / 16 V heads of 128,
    # attention 8 Q / 2 KV heads of 256, RoPE on 64 of the 256 dimensions (partial rotary 0.25), base 1e7,
    # tied embeddings; intermediate 3584 from the published configs derived from it). Text only
    # (qwen3_5_text): the real checkpoint is multimodal on disk, and its vision tower plays no part in a
    # text step. transformers' torch implementation of the DeltaNet layers (no flash-linear-attention here).
    "qwen3_5_0_8b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, intermediate_size=3584,
                         num_hidden_layers=24, layer_types=["linear_attention"] * 3 + ["full_attention"],
                         num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                         linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                         linear_conv_kernel_dim=4, max_position_embeddings=262144,
                         rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25)),
    # Its CPU rehearsal stand-in: the same layer kinds, tiny.
    "tiny_qwen3_5": dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_conv_kernel_dim=4,
                         rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25)),
    # Gemma 3 1B's text model (its published config.json, tests/real_hf_configs.py): 26 layers of 5 sliding
    # (window 512) then 1 global attention, hidden 1152, 4 Q / 1 KV heads of 256, vocabulary 262,144, tied.
    # benchmarks/gpu_qwen3_5.py's layouts model: transformers' own module with the packed and shared-prompt
    # training layouts and the native engine's prefill-once sampling (Qwen3.5 falls back from the layouts).
    "gemma3_1b": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                      num_hidden_layers=26, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                      query_pre_attn_scalar=256, max_position_embeddings=32768,
                      rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                                           full_attention=dict(rope_type="default", rope_theta=1000000.0))),
    # Its CPU rehearsal stand-in: both layer kinds, a window of 8 (shorter than the tiny workload's sequences).
    "tiny_gemma3": dict(model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=3, layer_types=["sliding_attention"] * 2 + ["full_attention"],
                        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
                        query_pre_attn_scalar=16,
                        rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                                             full_attention=dict(rope_type="default", rope_theta=1000000.0))),
    # Qwen3-30B-A3B's layer, 2 of its 48 layers (benchmarks/gpu_moe.py): hidden 2048, 32 Q / 4 KV heads of 128,
    # 128 experts of 768 of which 8 per token (softmax over all, top-8 renormalised), vocabulary 151,936, untied
    # head (tests/real_hf_configs.py has the published config.json): 1.87B parameters, so that full fine-tuning
    # and TRL's fp32 copy fit one 80 GB GPU with the whole layer as published (its routing, expert sizes and
    # the FSDP2 unit one layer is).
    "qwen3_30b_a3b_2l": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                             moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                             num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                             tie_word_embeddings=False, max_position_embeddings=40960),
    # Its CPU rehearsal stand-in: the same layer kinds and routing, tiny (8 experts, 2 per token).
    "tiny_qwen3_moe": dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           tie_word_embeddings=False),
}
# Fields every shape shares unless it sets its own (a shape's ``model_type`` defaults to ``qwen3``).
_COMMON = dict(tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
               rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
# Qwen's <|endoftext|> (pad) and <|im_end|> (stop) where the vocabulary has them; else its last two ids.
QWEN_PAD, QWEN_STOP = 151643, 151645


def special_ids(vocab_size: int) -> "tuple[int, int]":
    """``(pad_id, stop_id)``: Qwen's when the vocabulary holds them, else the last two ids."""
    if vocab_size > QWEN_STOP:
        return QWEN_PAD, QWEN_STOP
    return vocab_size - 2, vocab_size - 1


def random_init(model: torch.nn.Module) -> None:
    """Weights of a trained model's scale: norms 1, everything else N(0, 0.02)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)


def add_workload_args(parser: argparse.ArgumentParser, steps: int) -> None:
    """The GRPO step's workload options (prompts x group, prompt and response lengths, micro-batch, steps)."""
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--min-prompt-len", type=int, default=100)
    parser.add_argument("--max-prompt-len", type=int, default=160)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--kl-coef", type=float, default=0.04, help="TRL's beta (our side: the recipe config's kl_coef)")


def use_tiny_workload(args: argparse.Namespace) -> None:
    """The CPU rehearsal's workload (``--tiny``), the same on both sides."""
    args.prompts, args.group, args.min_prompt_len, args.max_prompt_len = 4, 4, 8, 16
    args.response_len, args.micro_batch = 12, 8


def hf_config(shape: str):
    """The transformers config of ``shape`` (a key of :data:`SHAPES`): ``Qwen3Config`` unless the shape
    names another ``model_type``. The layer pattern of a ``layer_types`` shape repeats over its layers."""
    from transformers import AutoConfig

    fields = {**_COMMON, **SHAPES[shape]}
    model_type = fields.pop("model_type", "qwen3")
    if "layer_types" in fields:
        pattern = fields["layer_types"]
        fields["layer_types"] = [pattern[i % len(pattern)] for i in range(fields["num_hidden_layers"])]
    return AutoConfig.for_model(model_type, **fields)


def model_type_available(shape: str) -> "tuple[bool, str]":
    """Whether this transformers knows ``shape``'s ``model_type``, and if not, the reason to report."""
    import transformers
    from transformers import CONFIG_MAPPING

    model_type = SHAPES[shape].get("model_type", "qwen3")
    if model_type in CONFIG_MAPPING:
        return True, ""
    return False, f"transformers {transformers.__version__} has no model_type {model_type!r}"


def write_model_dir(shape: str, directory: Union[str, Path], device: str = "cpu", seed: int = 0) -> Path:
    """Write a random ``shape`` model (bf16 safetensors, std 0.02, norms at 1) and its id tokenizer.

    Args:
        shape (str): a key of :data:`SHAPES`.
        directory (Union[str, Path]): created if missing; an existing ``config.json`` there is kept as is
            (the directory is reused).
        device (str): where the random weights are drawn (``cuda``: seconds for 1.7B parameters).
        seed (int): RNG seed. Default is 0.

    Returns:
        Path: ``directory``.
    """
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16)
    random_init(model)
    model.save_pretrained(directory)
    del model
    write_id_tokenizer(directory, SHAPES[shape]["vocab_size"])
    return directory


def write_id_tokenizer(directory: Union[str, Path], vocab_size: int) -> None:
    """A word-level tokenizer over the words ``"0" .. str(vocab_size - 1)``: ``encode("5 7") == [5, 7]``.

    The pad and end-of-sequence tokens are the words of :func:`special_ids` (special: dropped by
    ``decode(..., skip_special_tokens=True)``).
    """
    from tokenizers import models, pre_tokenizers, Tokenizer
    from transformers import PreTrainedTokenizerFast

    pad, stop = special_ids(vocab_size)
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token=str(pad)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=str(pad), eos_token=str(stop))
    fast.save_pretrained(str(directory))
