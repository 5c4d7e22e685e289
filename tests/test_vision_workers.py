"""Generation workers on image prompts (torchtune_grpo/workers/): the prompts' image inputs travel with them, the
worker's copy of the policy gets the directory's image side (``attach_images``), and with ``train_vision`` the
trained projector or tower comes with the language weights in every weight sync."""

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import REPO
from tests.recipe_utils import read_jsonl, run_in_process, weights
from tests.test_vision_policy import vision_policy
from tests.test_vision_recipe import _example_config, _shapes_dataset, EXAMPLE

# The example's reward, named from the repository (a spawned worker's directory may differ).
REWARD = {"reward_functions.0.function": f"{EXAMPLE.parent / 'shape_reward.py'}:names_the_shape"}


@pytest.mark.parametrize("family, train", [("qwen3_5", "none"), ("gemma3", "projector")])
def test_a_worker_samples_image_prompts_as_the_trainer(vision_dir, tmp_path, one_thread, family, train):
    """The worker's side (built here, in this process, from the run's config as a spawned worker builds it) samples
    a batch of image prompts with the tokens the trainer's own engine draws from the same seed, and scores them
    with the trainer's logprobs. Qwen3.5 with its M-RoPE positions; Gemma 3 with a trained projector whose values
    only the weight sync brings (they differ from the directory's)."""
    from torchtune import config as tt_config

    from torchtune_grpo.data import collate_prompts
    from torchtune_grpo.models import image_parameters
    from torchtune_grpo.rollouts.groups import sample_and_score
    from torchtune_grpo.training.experience import row_images
    from torchtune_grpo.workers.process import _Worker, behaviour_logprobs, WorkerSpec

    src = vision_dir(family)
    path = _example_config(tmp_path, src, _shapes_dataset(tmp_path / "data"), train_vision=train, **REWARD)
    record = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    worker = _Worker(WorkerSpec(config=record, rank=0, threads=1, dtype="float32", seed=0, image_source=str(src)))
    policy = vision_policy(src, tmp_path / "scratch", train=train).eval()
    trained = image_parameters(policy)
    assert bool(trained) == (train != "none")
    with torch.no_grad():  # a projector as training leaves it: not the directory's
        for p in trained:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    state = policy.state_dict()
    assert any(k.startswith("trained_vision.") for k in state) == (train != "none")
    worker.load(0, state)
    dataset = tt_config.instantiate(OmegaConf.create(record).dataset, worker.tokenizer)
    batch = collate_prompts([dataset[0], dataset[1]])
    assert all(f["image_inputs"] is not None for f in batch.fields)
    groups = worker.generate(batch, 0)
    # The trainer's engine on its own policy, seeded as the worker's stream starts (seed + rank).
    engine = tt_config.instantiate(OmegaConf.create(record).generation)
    mine = sample_and_score(policy, worker.tokenizer, engine, batch, worker.rewards, group_size=2, max_new_tokens=6,
                            generator=torch.Generator().manual_seed(0))
    assert groups.response_ids == mine.response_ids
    assert groups.rewards.tolist() == mine.rewards.tolist()
    # The images reached the worker's sampling: without them the same seed draws other tokens.
    blind = engine.generate(policy, batch.tokens, group_size=2, max_new_tokens=6, pad_id=0,
                            stop_tokens=worker.tokenizer.stop_tokens, generator=torch.Generator().manual_seed(0))
    assert blind.response_ids != groups.response_ids
    # The behaviour logprobs are the trainer's forward with the images, to the bit (same layout, same weights).
    theirs = behaviour_logprobs(policy, groups.prompt_ids, groups.response_ids, pad_id=worker.tokenizer.pad_id,
                                micro_batch_size=2, temperature=1.0, chunk_size=512, share_prompt=True,
                                images=row_images(groups))
    assert groups.engine_logprobs == theirs
    if trained:  # the worker's projector is the trainer's, from the sync
        ours = dict(policy.image_model.named_parameters())
        projector = {n: p for n, p in worker.model.image_model.named_parameters()
                     if n.startswith("multi_modal_projector.")}
        assert projector and all(torch.equal(p, ours[n]) for n, p in projector.items())


def test_two_grpo_steps_with_images_through_a_worker_equal_the_synchronous_run(vision_dir, tmp_path, clean_env,
                                                                               one_thread):
    """Two steps of the image example (tiny Gemma 3, ``train_vision: projector``) with a spawned generation worker at
    ``max_staleness: 0``: the synchronous run number for number. Step 2's batch is sampled by the worker with the
    projector step 1 trained, so a worker that missed it would score its tokens differently from the trainer
    (``generation/logprob_mismatch``, 0 here) and could draw others."""
    src = vision_dir("gemma3")
    data = _shapes_dataset(tmp_path / "data")
    runs = {}
    for name, extra in (("sync", {}), ("worker", {"generation_workers": {"enabled": True, "max_staleness": 0}})):
        (tmp_path / name).mkdir()
        run_in_process(_example_config(tmp_path / name, src, data, max_steps=2, save_every_n_steps=2, kl_coef=0.0,
                                       train_vision="projector", **{"optimizer.lr": 1e-2}, **REWARD, **extra))
        out = tmp_path / name / "out"
        runs[name] = ([m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m], weights(out / "step_2"))
    (sync, sync_w), (worker, worker_w) = runs["sync"], runs["worker"]
    keys = ("reward/mean", "loss", "grad_norm", "response_length/mean")
    assert [{k: m[k] for k in keys} for m in worker] == [{k: m[k] for k in keys} for m in sync]
    assert all(m["staleness/max"] == 0 and m["generation/logprob_mismatch"] == 0.0 for m in worker)
    assert sync_w.keys() == worker_w.keys() and all(torch.equal(sync_w[k], worker_w[k]) for k in sync_w)
    start = weights(src)
    assert any(not torch.equal(start[k], sync_w[k]) for k in start if k.startswith("multi_modal_projector."))
