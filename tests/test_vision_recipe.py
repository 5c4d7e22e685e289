"""Two GRPO steps of the image example (docs/examples/gemma3_4B_image_grpo.yaml) on a tiny multimodal Gemma 3
(and Qwen3.5: M-RoPE) directory with an image dataset written here (PIL-drawn shapes): the rollouts, the reference's and the policy's
logprobs and the update all see each prompt's image."""

import json

import pytest
import torch

from tests.conftest import REPO
from tests.hf_multimodal import LANGUAGE_PREFIX
from tests.hf_vision import shape_image
from tests.recipe_utils import run_in_process, weights, write_config

SHAPES = ("circle", "square", "triangle")
# The on-disk names of the vision tower and projector (tests/hf_multimodal.py).
TOWER = {"gemma3": ("vision_tower.", "multi_modal_projector."), "qwen3_5": ("model.visual.",)}
EXAMPLE = REPO / "docs" / "examples" / "gemma3_4B_image_grpo.yaml"
COLORS = {"red": (220, 40, 40), "blue": (40, 40, 220)}


def _shapes_dataset(folder):
    (folder / "img").mkdir(parents=True)
    rows = []
    for i, (shape, color) in enumerate((s, c) for s in SHAPES for c in COLORS):
        shape_image(shape, color=COLORS[color]).save(folder / "img" / f"{i}.png")
        rows.append({"image": f"img/{i}.png", "question": "Which shape is it?", "answer": shape})
    path = folder / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _example_config(folder, src, data, **overrides):
    """The image example (docs/examples/gemma3_4B_image_grpo.yaml) on the tiny directory ``src`` and the shapes
    file ``data``, at the tiny sizes every test here runs (CPU, fp32, 2 prompts x 2 completions of 6 tokens), with
    ``overrides``; written in ``folder``."""
    return write_config(
        folder, EXAMPLE, **{"checkpointer.checkpoint_dir": str(src), "dataset.data_files": str(data)}, device="cpu",
        dtype="fp32", enable_activation_checkpointing=False, lr_scheduler=None, batch_size=2, group_size=2,
        micro_batch_size=2, max_response_length=6, max_prompt_length=64, **overrides)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5"])
def test_two_grpo_steps_with_images(vision_dir, tmp_path, clean_env, one_thread, monkeypatch, family):
    from torchtune_grpo.generation._hf_rollout import HFRollout
    from torchtune_grpo.models import _vision

    calls = {"prefill": 0, "forward": []}
    prefill, forward = HFRollout._prefill_with_images, _vision.forward_with_images

    def counted_prefill(self, *args, **kwargs):
        calls["prefill"] += 1
        return prefill(self, *args, **kwargs)

    def counted_forward(policy, tokens, images, input_pos):
        calls["forward"].append((torch.is_grad_enabled(), tokens.size(0)))
        return forward(policy, tokens, images, input_pos)

    monkeypatch.setattr(HFRollout, "_prefill_with_images", counted_prefill)
    monkeypatch.setattr(_vision, "forward_with_images", counted_forward)
    src = vision_dir(family)
    data = _shapes_dataset(tmp_path / "data")
    # The example's reward file is named relative to the repository; a random model never names the shape, so
    # the vowel-fraction reward (write_config's default) gives the update a signal.
    monkeypatch.chdir(REPO)
    log = []
    config = _example_config(
        tmp_path, src, data, max_steps=2, save_every_n_steps=2, **{"optimizer.lr": 1e-3},
        # held-out evaluation on image prompts too (at step 0 and step 2), through the same engine
        validation={"_component_": "torchtune_grpo.data.image_dataset", "source": "json", "data_files": str(data)},
        eval_every_n_steps=2, eval_max_prompts=2)
    run_in_process(config, log=log)
    text = "\n".join(log)
    assert "Images in the prompt" in text and "one row per sequence" in text
    # Prefills with the pixels: one rollout per step, and one greedy pass per held-out evaluation (steps 0 and 2).
    # The reference's logprobs (no grad) and the update's forward (with grad) run with the images.
    assert calls["prefill"] == 4, calls["prefill"]
    assert any(g for g, _ in calls["forward"]) and any(not g for g, _ in calls["forward"])
    step = tmp_path / "out" / "step_2"
    start, end = weights(src), weights(step)
    assert start.keys() == end.keys()
    # The tower and projector are frozen and carried byte for byte; the language model moved.
    tower = [k for k in start if k.startswith(TOWER[family])]
    assert tower and all(torch.equal(start[k], end[k]) for k in tower)
    assert max((end[k] - start[k]).abs().max().item() for k in start if k.startswith(LANGUAGE_PREFIX[family])) > 1e-5


def test_train_vision_projector_is_trained_and_saved(vision_dir, tmp_path, clean_env, one_thread, monkeypatch):
    """``train_vision: projector`` on Gemma 3, whose on-disk projector and tower names differ from transformers'
    in-memory ones: the projector moves and is saved under the checkpoint's own names, the tower does not, and the
    step directory loads in the image-text class with the trained projector."""
    from transformers import AutoModelForImageTextToText

    src = vision_dir("gemma3")
    data = _shapes_dataset(tmp_path / "data")
    monkeypatch.chdir(REPO)
    log = []
    config = _example_config(tmp_path, src, data, max_steps=2, save_every_n_steps=2, kl_coef=0.0,
                             train_vision="projector", **{"optimizer.lr": 1e-2})
    recipe = run_in_process(config, log=log)
    assert "projector trained" in "\n".join(log)
    step = tmp_path / "out" / "step_2"
    start, end = weights(src), weights(step)
    assert start.keys() == end.keys()  # the checkpoint's own names, nothing added
    projector = [k for k in start if k.startswith("multi_modal_projector.")]
    tower = [k for k in start if k.startswith("vision_tower.")]
    assert projector and tower and all(torch.equal(start[k], end[k]) for k in tower)
    assert all(not torch.equal(start[k], end[k]) for k in projector)
    trained = recipe.model.image_model.multi_modal_projector.state_dict()
    loaded = AutoModelForImageTextToText.from_pretrained(step, dtype=torch.float32).model.multi_modal_projector
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in trained.items())


def test_train_vision_tower_on_qwen3_5(vision_dir, tmp_path, clean_env, one_thread, monkeypatch):
    """``train_vision: tower`` on Qwen3.5: every tensor of the tower (``model.visual.*``, its merger included)
    moves and is saved under its name; the language model moves; ``mtp.*`` is carried unchanged."""
    src = vision_dir("qwen3_5")
    data = _shapes_dataset(tmp_path / "data")
    monkeypatch.chdir(REPO)
    config = _example_config(tmp_path, src, data, max_steps=2, save_every_n_steps=2, kl_coef=0.0,
                             train_vision="tower", **{"optimizer.lr": 1e-2})
    run_in_process(config)
    start, end = weights(src), weights(tmp_path / "out" / "step_2")
    assert start.keys() == end.keys()
    tower = [k for k in start if k.startswith("model.visual.")]
    moved = [k for k in tower if not torch.equal(start[k], end[k])]
    assert len(moved) == len(tower), sorted(set(tower) - set(moved))[:5]
    assert all(torch.equal(start[k], end[k]) for k in start if k.startswith("mtp."))


def test_resume_with_a_trained_projector_equals_the_uninterrupted_run(vision_dir, tmp_path, clean_env, one_thread,
                                                                        monkeypatch):
    """3 steps straight against 2 steps then a resumed run to step 3, ``train_vision: projector``: the resumed run
    takes the trained projector from step 2 and its optimizer state by name. Exact: the same operations on the
    same numbers."""
    src = vision_dir("gemma3")
    data = _shapes_dataset(tmp_path / "data")
    monkeypatch.chdir(REPO)

    def config(folder, **overrides):
        folder.mkdir(exist_ok=True)
        return _example_config(folder, src, data, train_vision="projector", **{"optimizer.lr": 1e-2}, **overrides)

    run_in_process(config(tmp_path / "a", max_steps=3, save_every_n_steps=3))
    run_in_process(config(tmp_path / "b", max_steps=2, save_every_n_steps=2))
    run_in_process(config(tmp_path / "b", max_steps=3, save_every_n_steps=3, resume_from_checkpoint=True))
    a, b = weights(tmp_path / "a" / "out" / "step_3"), weights(tmp_path / "b" / "out" / "step_3")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    projector = [k for k in a if k.startswith("multi_modal_projector.")]
    assert not all(torch.equal(a[k], weights(tmp_path / "b" / "out" / "step_2")[k]) for k in projector)


def test_lora_with_images(vision_dir, tmp_path, clean_env, one_thread, monkeypatch):
    """The LoRA recipe on image prompts: the adapters sit in the language model the image-text forward runs, the
    reference is the policy with its adapters off (same images), the tower is carried into the merged model."""
    from tests.hf_models import hf_components
    from torchtune_grpo.generation._hf_rollout import HFRollout

    prefills = []
    prefill = HFRollout._prefill_with_images
    monkeypatch.setattr(HFRollout, "_prefill_with_images", lambda self, *a: prefills.append(1) or prefill(self, *a))
    src = vision_dir("gemma3")
    data = _shapes_dataset(tmp_path / "data")
    components = {k: v for k, v in hf_components(src).items() if not k.startswith("dataset.")}
    components["model"] = {"_component_": "torchtune_grpo.models.lora_hf_model", "path": "${checkpointer.checkpoint_dir}",
                           "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4, "lora_alpha": 8}
    log = []
    config = write_config(
        tmp_path, REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml", **components, max_steps=2, save_every_n_steps=2,
        lr_scheduler=None, batch_size=2, group_size=2, micro_batch_size=2, max_response_length=6,
        max_prompt_length=64, dataset={"_component_": "torchtune_grpo.data.image_dataset", "source": "json",
                                       "data_files": str(data)})
    run_in_process(config, lora=True, log=log)
    assert "Images in the prompt" in "\n".join(log) and len(prefills) == 2
    start, merged = weights(src), weights(tmp_path / "out" / "step_2" / "merged")
    assert start.keys() == merged.keys()
    assert all(torch.equal(start[k], merged[k]) for k in start if k.startswith(TOWER["gemma3"]))
    assert any(not torch.equal(start[k], merged[k]) for k in start if k.startswith(LANGUAGE_PREFIX["gemma3"]))


def test_lora_recipe_refuses_a_trained_vision_side(vision_dir, tmp_path, clean_env, one_thread):
    """``train_vision`` other than ``none`` in the LoRA recipe stops the run naming the key: neither the adapter nor
    the merged model would hold a trained tower or projector."""
    from tests.hf_models import hf_components

    src = vision_dir("gemma3")
    components = {k: v for k, v in hf_components(src).items() if not k.startswith("dataset.")}
    components["model"] = {"_component_": "torchtune_grpo.models.lora_hf_model", "path": "${checkpointer.checkpoint_dir}",
                           "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4, "lora_alpha": 8}
    config = write_config(tmp_path, REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml", **components, max_steps=1,
                          train_vision="projector")
    with pytest.raises(ValueError, match="train_vision: projector is not supported by the LoRA recipe"):
        run_in_process(config, lora=True)


def test_the_example_reward():
    import importlib.util

    spec = importlib.util.spec_from_file_location("shape_reward", REPO / "docs" / "examples" / "shape_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    completions = ["It has three corners.\nA triangle.", "A circle, or maybe a square", "I cannot tell.", ""]
    assert module.names_the_shape(completions, ["triangle", "square", "circle", "circle"]) == [1.0, 1.0, 0.0, 0.0]
