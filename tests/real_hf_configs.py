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
