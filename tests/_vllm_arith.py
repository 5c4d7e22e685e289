"""The trainer side of the vLLM engine measurements (tests/_vllm_engine_runs.py, tests/_vllm_server_scenario.py).

The shipped SFT-trained ``tiny_qwen2_arith`` (peaked distributions: greedy decoding has no near-ties) as the
trainer's torchtune model, its tokenizer and four arithmetic prompts; the largest difference between an engine's
sampled-token logprobs and the trainer's; the seeded nudge of every trainer weight that makes an engine stale.
"""

from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch


def arith_trainer(config: Path, out_dir: Path) -> SimpleNamespace:
    """The trainer's model of ``config`` (a tiny vLLM config) loaded from ``tiny_qwen2_arith``.

    Args:
        config (Path): the config naming the model and tokenizer.
        out_dir (Path): the checkpointer's output directory.

    Returns:
        SimpleNamespace: ``asset`` (the directory), ``model`` (eval mode), ``tokenizer``, ``data`` (8 arithmetic
        samples), ``prompts`` (the first 4) and ``stop`` (the tokenizer's stop ids).
    """
    from omegaconf import OmegaConf
    from torchtune import config as tt_config, training

    from torchtune_grpo.assets import asset_path, register_resolvers
    from torchtune_grpo.data import arithmetic_dataset

    register_resolvers()  # ${grpo_asset:...} in the config
    asset = str(asset_path("tiny_qwen2_arith"))
    cfg = OmegaConf.load(config)
    model = tt_config.instantiate(cfg.model)
    ckpt = training.FullModelHFCheckpointer(checkpoint_dir=asset, checkpoint_files=["model.safetensors"],
                                            model_type="QWEN2", output_dir=str(out_dir))
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    model.eval()
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    data = arithmetic_dataset(tokenizer, num_samples=8, max_value=20, seed=1)
    return SimpleNamespace(asset=asset, model=model, tokenizer=tokenizer, data=data,
                           prompts=[data[i]["tokens"] for i in range(4)], stop=list(tokenizer.stop_tokens))


def max_sampled_logprob_diff(model: torch.nn.Module, rollout, pad_id: int, temperature: float = 0.7) -> float:
    """The largest |engine - trainer| logprob over ``rollout``'s sampled tokens (trainer at ``temperature``)."""
    from torchtune_grpo.models.logprobs import sequence_logprobs
    from torchtune_grpo.training.batch import pack_sequences

    tokens, mask = pack_sequences(rollout.prompt_ids, rollout.response_ids, pad_id)
    with torch.no_grad():
        lp = sequence_logprobs(model, tokens, temperature=temperature).logprobs  # [N, L-1]
    engine_lp = torch.zeros_like(lp)
    for i, (p, row) in enumerate(zip(rollout.prompt_ids, rollout.logprobs)):
        engine_lp[i, len(p) - 1 : len(p) - 1 + len(row)] = torch.tensor(row)
    return (lp - engine_lp)[mask[:, 1:]].abs().max().item()


def nudge_weights(model: torch.nn.Module, generator: Optional[torch.Generator] = None,
                  scale: float = 1e-3) -> torch.Generator:
    """Move every trainer weight (a tied embedding too) by noise of ``scale`` drawn from ``generator`` (None: a
    fresh one seeded 0): the engine is then stale. Returns the generator, for a next nudge down the same stream."""
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return gen
