"""The ``config.json`` of the real models the shipped configs name (as published on the Hugging Face Hub),
so the configs' models can be built on the meta device without a download. Keyed by the directory name
the configs use (``tune download <repo> --output-dir /tmp/<name>``)."""

from typing import Any, Dict

_QWEN2_5 = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], attention_dropout=0.0, bos_token_id=151643,
                eos_token_id=151645, hidden_act="silu", max_position_embeddings=32768, num_key_value_heads=2,
                rms_norm_eps=1e-06, rope_theta=1000000.0, sliding_window=32768, tie_word_embeddings=True,
                torch_dtype="bfloat16", use_sliding_window=False, vocab_size=151936)
_LLAMA3_2 = dict(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False, attention_dropout=0.0,
                 bos_token_id=128000, eos_token_id=[128001, 128008, 128009], hidden_act="silu",
                 intermediate_size=8192, max_position_embeddings=131072, mlp_bias=False, num_key_value_heads=8,
                 pretraining_tp=1, rms_norm_eps=1e-05, rope_theta=500000.0, tie_word_embeddings=True,
                 rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                   original_max_position_embeddings=8192, rope_type="llama3"),
                 torch_dtype="bfloat16", vocab_size=128256)
_QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=False, attention_dropout=0.0,
              bos_token_id=151643, eos_token_id=151645, head_dim=128, hidden_act="silu",
              max_position_embeddings=40960, num_key_value_heads=8, rms_norm_eps=1e-06, rope_scaling=None,
              rope_theta=1000000, sliding_window=None, use_sliding_window=False, torch_dtype="bfloat16",
              vocab_size=151936)

HUB_CONFIGS: Dict[str, Dict[str, Any]] = {
    "Qwen2.5-0.5B-Instruct": dict(_QWEN2_5, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                                  num_hidden_layers=24, max_window_layers=21),
    "Qwen2.5-1.5B-Instruct": dict(_QWEN2_5, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                  num_hidden_layers=28, max_window_layers=21),
    "Qwen2.5-3B": dict(_QWEN2_5, hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
                       num_hidden_layers=36, max_window_layers=36),
    "Llama-3.2-1B-Instruct": dict(_LLAMA3_2, head_dim=64, hidden_size=2048, num_attention_heads=32,
                                  num_hidden_layers=16),
    "Llama-3.2-3B-Instruct": dict(_LLAMA3_2, head_dim=128, hidden_size=3072, num_attention_heads=24,
                                  num_hidden_layers=28),
    "Qwen3-0.6B": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                       num_hidden_layers=28, max_window_layers=28, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                       num_hidden_layers=28, max_window_layers=28, tie_word_embeddings=True),
    "Qwen3-4B": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                     num_hidden_layers=36, max_window_layers=36, tie_word_embeddings=True),
    "Qwen3-8B": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_hidden_layers=36, max_window_layers=36, tie_word_embeddings=False),
}

# torchtune's own builder for the models torchtune has: the directory builder must give the same model.
TORCHTUNE_BUILDERS = {
    "Qwen2.5-0.5B-Instruct": "torchtune.models.qwen2_5.qwen2_5_0_5b",
    "Qwen2.5-1.5B-Instruct": "torchtune.models.qwen2_5.qwen2_5_1_5b_instruct",
    "Qwen2.5-3B": "torchtune.models.qwen2_5.qwen2_5_3b",
    "Llama-3.2-1B-Instruct": "torchtune.models.llama3_2.llama3_2_1b",
    "Llama-3.2-3B-Instruct": "torchtune.models.llama3_2.llama3_2_3b",
}


# The 2026 families (transformers backend). Their shape fields as published (Hugging Face model cards and
# config.json copies; docs/models.md names the sources), nested as on disk for the checkpoints that are
# multimodal there (Qwen3.5, Gemma 3 4B, Gemma 4: the language model's fields in ``text_config``). The towers'
# ``vision_config`` is the published one for the models an image config names (configs/*/*_image_grpo.yaml: its
# memory estimate counts the tower), transformers' defaults elsewhere (only the language model is built from
# them). RoPE scalings that change no shape are left out (OLMo 3's YaRN on its full-attention layers,
# Phi-4-mini's LongRoPE factors).
def _layers(pattern, n):
    return [pattern[i % len(pattern)] for i in range(n)]


# Qwen3.5's vision tower of the 2B and 4B checkpoints (24 blocks of 1024; the 0.8B's has 12 of 768), its merger
# projecting to the language model's width (out_hidden_size). The 4B's is as published; the 2B's is taken to be
# the same tower: its download size (about 4.5 GB in bf16) fits 2.21B parameters with this tower (plus the
# multi-token-prediction head's 0.06B), not the 1.99B the 0.8B's tower would give.
def _qwen3_5_vision(out_hidden_size):
    return dict(model_type="qwen3_5", depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                num_position_embeddings=2304, out_hidden_size=out_hidden_size, hidden_act="gelu_pytorch_tanh",
                deepstack_visual_indexes=[])


def _qwen3_5(hidden, layers, intermediate, heads, kv_heads, linear_k_heads, linear_v_heads, tied, vision=None):
    text = dict(model_type="qwen3_5_text", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256, vocab_size=248320,
                linear_num_key_heads=linear_k_heads, linear_num_value_heads=linear_v_heads, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                layer_types=_layers(["linear_attention"] * 3 + ["full_attention"], layers),
                max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu", attn_output_gate=True,
                rope_parameters=dict(rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25))
    return dict(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"], text_config=text,
                tie_word_embeddings=tied, **({} if vision is None else {"vision_config": vision}))


_GEMMA_ROPE = dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0))
FAMILY_HUB_CONFIGS: Dict[str, Dict[str, Any]] = {
    "Qwen3.5-0.8B": _qwen3_5(1024, 24, 3584, 8, 2, 16, 16, tied=True),
    "Qwen3.5-2B": _qwen3_5(2048, 24, 6144, 8, 2, 16, 16, tied=True, vision=_qwen3_5_vision(2048)),
    "Qwen3.5-4B": _qwen3_5(2560, 32, 9216, 16, 4, 16, 32, tied=True, vision=_qwen3_5_vision(2560)),
    "Qwen3.5-9B": _qwen3_5(4096, 32, 12288, 16, 4, 16, 32, tied=False),
    "gemma-3-1b-it": dict(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=1152, num_hidden_layers=26,
        intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        sliding_window=512, layer_types=_layers(["sliding_attention"] * 5 + ["full_attention"], 26),
        max_position_embeddings=32768, query_pre_attn_scalar=256, tie_word_embeddings=True,
        rope_parameters=dict(_GEMMA_ROPE, full_attention=dict(rope_type="default", rope_theta=1000000.0))),
    "gemma-3-4b-it": dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"], text_config=dict(
        model_type="gemma3_text", hidden_size=2560, num_hidden_layers=34, intermediate_size=10240,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024,
        layer_types=_layers(["sliding_attention"] * 5 + ["full_attention"], 34), max_position_embeddings=131072,
        query_pre_attn_scalar=256,
        rope_parameters=dict(_GEMMA_ROPE, full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0))),
        # SigLIP So400m at 896 x 896 (no pooling head), pooled to 256 tokens per image.
        vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                           num_attention_heads=16, num_hidden_layers=27, image_size=896, patch_size=14,
                           vision_use_head=False),
        mm_tokens_per_image=256, tie_word_embeddings=True),
    "gemma-4-E2B-it": dict(model_type="gemma4", architectures=["Gemma4ForConditionalGeneration"], text_config=dict(
        model_type="gemma4_text", hidden_size=1536, num_hidden_layers=35, intermediate_size=6144,
        num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512, vocab_size=262144,
        vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, sliding_window=512,
        layer_types=_layers(["sliding_attention"] * 4 + ["full_attention"], 35), num_kv_shared_layers=20,
        use_double_wide_mlp=True, max_position_embeddings=131072, final_logit_softcapping=30.0,
        rope_parameters=dict(_GEMMA_ROPE, full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                                              rope_theta=1000000.0))),
        tie_word_embeddings=True),
    "Olmo-3-7B-Instruct": dict(
        model_type="olmo3", architectures=["Olmo3ForCausalLM"], hidden_size=4096, num_hidden_layers=32,
        intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32, vocab_size=100278,
        sliding_window=4096, layer_types=_layers(["sliding_attention"] * 3 + ["full_attention"], 32),
        max_position_embeddings=65536, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=500000)),
    "SmolLM3-3B": dict(
        model_type="smollm3", architectures=["SmolLM3ForCausalLM"], hidden_size=2048, num_hidden_layers=36,
        intermediate_size=11008, num_attention_heads=16, num_key_value_heads=4, vocab_size=128256,
        max_position_embeddings=65536, tie_word_embeddings=True, no_rope_layer_interval=4,
        rope_parameters=dict(rope_type="default", rope_theta=5000000.0)),
    "Phi-4-mini-instruct": dict(
        model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=3072, num_hidden_layers=32,
        intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8, vocab_size=200064,
        max_position_embeddings=131072, original_max_position_embeddings=4096, tie_word_embeddings=True,
        partial_rotary_factor=0.75, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}

# The mixture-of-experts models the shipped MoE configs name (configs/qwen3_moe, configs/gpt_oss,
# configs/qwen3_5_moe; docs/moe.md). Qwen3-30B-A3B: every layer sparse (decoder_sparse_step 1, no mlp_only_layers),
# untied head; gpt-oss-20b as released: MXFP4 experts (quantization_config), sliding (128) and full layers
# alternating, untied; Qwen3.5-35B-A3B: multimodal on disk like the dense Qwen3.5 ones, its language model 40 layers
# of 3 x Gated DeltaNet + 1 x gated attention, 256 experts (top 8) plus a shared expert, untied.
_GPT_OSS_QUANT = dict(quant_method="mxfp4", modules_to_not_convert=[
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"])
MOE_HUB_CONFIGS: Dict[str, Dict[str, Any]] = {
    "Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], attention_bias=False, attention_dropout=0.0,
        bos_token_id=151643, eos_token_id=151645, decoder_sparse_step=1, head_dim=128, hidden_act="silu",
        hidden_size=2048, intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48,
        mlp_only_layers=[], moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4, output_router_logits=False,
        rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None,
        tie_word_embeddings=False, torch_dtype="bfloat16", use_sliding_window=False, vocab_size=151936),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"], attention_bias=True, attention_dropout=0.0,
        eos_token_id=200002, pad_token_id=199999, experts_per_token=4, num_experts_per_tok=4, head_dim=64,
        hidden_act="silu", hidden_size=2880, intermediate_size=2880, initial_context_length=4096,
        layer_types=_layers(["sliding_attention", "full_attention"], 24), max_position_embeddings=131072,
        num_attention_heads=64, num_hidden_layers=24, num_key_value_heads=8, num_local_experts=32,
        output_router_logits=False, rms_norm_eps=1e-05, rope_theta=150000, router_aux_loss_coef=0.9,
        rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0, original_max_position_embeddings=4096,
                          rope_type="yarn", truncate=False),
        sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False, vocab_size=201088,
        quantization_config=_GPT_OSS_QUANT),
    "Qwen3.5-35B-A3B": dict(
        model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"], tie_word_embeddings=False,
        text_config=dict(
            model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
            num_key_value_heads=2, head_dim=256, vocab_size=248320, linear_num_key_heads=16, linear_num_value_heads=32,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
            layer_types=_layers(["linear_attention"] * 3 + ["full_attention"], 40), num_experts=256,
            num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu", attn_output_gate=True,
            router_aux_loss_coef=0.001, tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25))),
}
FAMILY_HUB_CONFIGS.update(MOE_HUB_CONFIGS)
