"""The native engine samples from image prompts on transformers' modules: one prefill per group with the pixels,
then text decode steps on that cache (generation/_hf_rollout.py). The transformers engine (generation/_transformers.py)
samples from them with the directory's image-text class's ``generate``."""

import pytest
import torch

from tests.hf_vision import VISION_FAMILIES
from tests.sampler_records import flip_chance, record_sampler, sampled_logprobs
from tests.test_vision_policy import image_rows, vision_policy
from torchtune_grpo.generation import NativeGenerator, TransformersGenerator
from torchtune_grpo.training.batch import TrainingBatch

# 40 of the 512 ids stop a row: rows stop at scattered lengths, so the decode batch shrinks.
KW = dict(group_size=3, max_new_tokens=8, pad_id=0, stop_tokens=list(range(100, 140)))


@pytest.fixture
def sampled(monkeypatch):
    """Every sampler call of the test's ``generate`` runs (tests/sampler_records.py)."""
    return record_sampler(monkeypatch)


def _run(policy, data, runs, seed, **engine):
    runs.append([])
    gen = torch.Generator().manual_seed(seed)
    return NativeGenerator(stop_check_interval=4, **engine).generate(
        policy, [s["tokens"] for s in data], generator=gen, temperature=1.0,
        images=[s["image_inputs"] for s in data], **KW)


@pytest.mark.parametrize("family", [*VISION_FAMILIES, "qwen3_5_moe"])
def test_image_rollouts(vision_dir, tmp_path, family, sampled):
    from transformers import AutoModelForImageTextToText

    directory = vision_dir(family)
    data = image_rows(directory, tmp_path / "data")
    policy = vision_policy(directory, tmp_path / "scratch")
    fast = _run(policy, data, sampled, seed=1)
    slow = _run(policy, data, sampled, seed=1, share_prefill=False, compact_decode=False)
    # One prefill per group repeated to its rows, rows leaving the batch: the tokens of every row prefilled and
    # decoded to the end under the same seed. (The two compute the same logits in other batch shapes: rounding
    # only; a seeded draw could flip only where a uniform falls between the two runs' CDF entries, bounded below.)
    assert fast.response_ids == slow.response_ids
    chance = flip_chance(*sampled)
    assert chance < 0.01, chance
    assert len({len(r) for r in fast.response_ids}) > 1
    # The first token's logits are transformers' image-text class's on each prompt alone with its images.
    reference = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    first = sampled[0][0][0]
    for i, sample in enumerate(data):
        one = {k: (v[None] if k.endswith("token_type_ids") else v) for k, v in sample["image_inputs"].items()}
        with torch.no_grad():
            want = reference(input_ids=torch.tensor([sample["tokens"]]), **one).logits[0, -1].float()
        # Same modules and weights; a left-padded batch of two prompts against one prompt alone: rounding of
        # other matmul shapes through 3-4 layers, 32 ulp of the largest logit (as the text engine's padding test).
        bound = 32 * torch.finfo(torch.float32).eps * want.abs().max().item()
        for row in range(i * 3, i * 3 + 3):
            assert (first[row] - want).abs().max().item() <= bound
    # The trainer's logprobs (one right-padded forward per row with the prompt's images) are those of the logits
    # the engine sampled from. Same bound as the text engine's test (tests/test_native_transformers_decode.py):
    # 1e-4, a logit minus a logsumexp through 2-4 layers of peaked softmaxes computed in other orders.
    engine = sampled_logprobs(fast.response_ids, sampled[0])
    trainer = _trainer_logprobs(policy, data, fast)
    torch.testing.assert_close(trainer.double(), engine, atol=1e-4, rtol=0)


def _trainer_logprobs(policy, data, rollout):
    """The trainer's logprobs of ``rollout``'s response tokens (one right-padded row per sequence with its prompt's
    images, as the recipe's forwards), flattened in row order."""
    from torchtune_grpo.models import batch_image_inputs, image_inputs
    from torchtune_grpo.models.logprobs import sequence_logprobs

    batch = TrainingBatch(rollout.prompt_ids, rollout.response_ids, 0, share_prompt=False)
    group = len(rollout.response_ids) // len(data)
    rows = batch_image_inputs([data[i // group]["image_inputs"] for i in range(len(rollout.response_ids))],
                              batch.tokens.size(1))
    with torch.no_grad(), image_inputs(policy, rows):
        return sequence_logprobs(policy, batch.tokens, start=batch.start).logprobs[batch.response_mask]


@pytest.mark.parametrize("family", [*VISION_FAMILIES, "qwen3_5_moe"])
def test_transformers_engine_with_images(vision_dir, tmp_path, family, sampled, monkeypatch):
    """TransformersGenerator samples image prompts with the image-text class's ``generate``: greedy, the native
    engine's tokens; sampled, its logprobs are the trainer's (with the images) of the tokens it drew."""
    from torchtune_grpo.generation import _transformers

    directory = vision_dir(family)
    data = image_rows(directory, tmp_path / "data")
    policy = vision_policy(directory, tmp_path / "scratch")
    prompts, images = [s["tokens"] for s in data], [s["image_inputs"] for s in data]
    greedy = dict(KW, temperature=0.0)
    sampled.append([])
    native = NativeGenerator(stop_check_interval=4).generate(policy, prompts, images=images, **greedy)
    engine = TransformersGenerator(model=str(directory))
    theirs = engine.generate(policy, prompts, images=images, **greedy)
    assert theirs.prompt_ids == native.prompt_ids
    assert theirs.response_ids == native.response_ids
    assert theirs.truncated.tolist() == native.truncated.tolist()
    # Why equal tokens are expected: the two compute the same logits in other batch shapes and kernels (the first
    # token's within 32 ulp of the largest logit, test_image_rollouts), so an argmax could differ only where the top
    # two logits of a step are closer than twice that; every step of the native run is far from such a tie.
    gaps = []
    for logits, drawn in sampled[0]:
        live = drawn >= 0
        top = logits[live].topk(2, dim=-1).values
        gaps.append(((top[:, 0] - top[:, 1]) / (64 * torch.finfo(torch.float32).eps * top[:, 0].abs())).min())
    assert min(gaps) > 1, min(gaps)
    # The images matter: the same prompts without their pixels (image tokens read as text) give other tokens.
    blind = engine.generate(policy, prompts, **greedy)
    assert blind.response_ids != native.response_ids
    # Sampled at temperature 1 with the logprobs of the distribution it drew from (the engine reports them only
    # when its dtype differs from the trainer's: forced here), against the trainer's forward with the images. The
    # same bound as the native engine's check above (1e-4: a logit minus a logsumexp through 2-4 layers of peaked
    # softmaxes computed in other orders).
    original = _transformers.sample_with_generate
    monkeypatch.setattr(_transformers, "sample_with_generate",
                        lambda *a, **k: original(*a, **{**k, "with_logprobs": True}))
    drawn = [engine.generate(policy, prompts, images=images, generator=torch.Generator().manual_seed(1),
                             temperature=1.0, **KW) for _ in range(2)]
    assert drawn[0].response_ids == drawn[1].response_ids  # seeded
    assert len({len(r) for r in drawn[0].response_ids}) > 1
    engine_logprobs = torch.tensor([lp for row in drawn[0].logprobs for lp in row], dtype=torch.float64)
    torch.testing.assert_close(_trainer_logprobs(policy, data, drawn[0]).double(), engine_logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", [*VISION_FAMILIES, "qwen3_5_moe"])
def test_a_sampled_image_token_is_text(vision_dir, tmp_path, family):
    """A completion may contain the image token (a random model samples it): the engine fed it to the language
    model as a token, and the trainer's forward does the same (not an image slot without a feature)."""
    from torchtune_grpo.generation._hf_rollout import HFRollout
    from torchtune_grpo.models import batch_image_inputs, image_inputs, text_after
    from torchtune_grpo.models.logprobs import sequence_logprobs

    directory = vision_dir(family)
    sample = image_rows(directory, tmp_path / "data")[0]
    policy = vision_policy(directory, tmp_path / "scratch")
    image_id = policy.image_model.config.image_token_id
    response = [5, image_id, 7, image_id, 9]
    with torch.inference_mode():
        run = HFRollout(policy.sampler(), [sample["tokens"]], 1, 0, image_model=policy.image_model,
                        images=[sample["image_inputs"]])
        logits = [run.prefill()] + [run.decode(torch.tensor([tok]), t) for t, tok in enumerate(response[:-1])]
    engine = torch.stack([torch.log_softmax(lg[0].double(), -1)[tok] for lg, tok in zip(logits, response)])
    row = sample["tokens"] + response
    with torch.no_grad(), image_inputs(policy, batch_image_inputs([sample["image_inputs"]], len(row))):
        trainer = sequence_logprobs(policy, torch.tensor([row]), start=len(sample["tokens"]) - 1).logprobs[0]
    # As the engine-vs-trainer check above: the same function computed in other orders, bound 1e-4.
    torch.testing.assert_close(trainer.double(), engine, atol=1e-4, rtol=0)
    # A later turn of a multi-turn episode re-sends that history (sampled image tokens in it) and prefills it with
    # the pixels: the logprobs of feeding the tokens one by one, same bound.
    with torch.inference_mode():
        again = HFRollout(policy.sampler(), [row[:-1]], 1, 0, image_model=policy.image_model,
                          images=[text_after(sample["image_inputs"], len(response) - 1)]).prefill()
    torch.testing.assert_close(torch.log_softmax(again[0].double(), -1), torch.log_softmax(logits[-1][0].double(), -1),
                               atol=1e-4, rtol=0)
