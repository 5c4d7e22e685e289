"""The training layouts on a Gated DeltaNet family: one update's forward and backward, three layouts.

A small random Qwen3.5 text model (transformers' ``Qwen3_5ForCausalLM``: 8 layers, 3 Gated DeltaNet then 1 gated
full attention, twice; hidden 256) trains 4 prompts of 96 tokens x 8 completions of 16-160 tokens in two
micro-batches, one row per sequence, in shared-prompt rows and in packed rows. Under a layout the Gated DeltaNet
layers run each sequence on a row of its own (a shared prompt once per completion), the other layers the layout's
rows. Prints the median (and min) of 3 timed updates per layout after one warm-up; one thread by default.

    python benchmarks/qwen3_5_layouts.py --threads 1
"""

import argparse
import random
import time

import torch


def build():
    from transformers import AutoConfig, AutoModelForCausalLM

    from torchtune_grpo.models import TransformersDecoder

    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, linear_conv_kernel_dim=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return TransformersDecoder(lm, 1024, {}).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from torchtune_grpo.training.batch import TrainingBatch

    model = build()
    rng = random.Random(0)
    prompts, responses = [], []
    for _ in range(4):
        prompt = [rng.randrange(1, 480) for _ in range(96)]
        for _ in range(8):
            prompts.append(prompt)
            responses.append([rng.randrange(1, 480) for _ in range(rng.randint(16, 160))])

    def update(kw) -> float:
        batch = TrainingBatch(prompts, responses, 0, **kw)
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for rows in (slice(0, 16), slice(16, 32)):
            batch.logprobs(model, rows, chunk_size=256).logprobs.sum().backward()
        return time.perf_counter() - start

    for name, kw in [("one row per sequence", dict(share_prompt=False)),
                     ("shared prompts", dict(share_prompt=True)), ("packed", dict(share_prompt=False, pack=True))]:
        update(kw)
        times = sorted(update(kw) for _ in range(3))
        print(f"{name}: median {times[1]:.2f} s (min {times[0]:.2f})")


if __name__ == "__main__":
    main()
