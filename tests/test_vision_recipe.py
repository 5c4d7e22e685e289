"""Two GRPO steps of the image example (docs/examples/gemma3_4B_image_grpo.yaml) on a tiny multimodal Gemma 3
(and Qwen3.5: M-RoPE; Qwen3.5-MoE: routing replay) directory with an image dataset written here (PIL-drawn shapes): the rollouts, the reference's and the policy's
logprobs and the update all see each prompt's image. The same two steps on two processes (FSDP2) equal one process,
also on Gemma 4: :func:`image_split_runs` and :func:`check_image_split`, run in tests/test_models_architectures.py's
two-process launch."""

import json

import pytest
import torch

from tests._spawn_runs import log_of, Run
from tests.conftest import REPO
from tests.hf_multimodal import LANGUAGE_PREFIX
from tests.hf_vision import make_vision_dir, shape_image
from tests.recipe_utils import read_jsonl, run_in_process, weights, write_config
from tests.tolerances import ulps

SHAPES = ("circle", "square", "triangle")
# The on-disk names of the vision tower and projector (tests/hf_multimodal.py).
TOWER = {"gemma3": ("vision_tower.", "multi_modal_projector."), "qwen3_5": ("model.visual.",),
         "qwen3_5_moe": ("model.visual.",),
         # Gemma 4: and its audio tower, which image prompts leave as it is
         "gemma4": ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")}
# What TRAINED_SPLIT trains, on disk.
TRAINED_PREFIXES = {"gemma3": ("multi_modal_projector.",), "qwen3_5": ("model.visual.",)}
EXAMPLE = REPO / "docs" / "examples" / "gemma3_4B_image_grpo.yaml"
COLORS = {"red": (220, 40, 40), "blue": (40, 40, 220)}


def _shapes_dataset(folder, colors=COLORS, numbered=False):
    """A shape of each colour per row; ``numbered``: each row's question names its row (prompts whose ids differ)."""
    (folder / "img").mkdir(parents=True)
    rows = []
    for i, (shape, color) in enumerate((s, c) for s in SHAPES for c in colors):
        shape_image(shape, color=colors[color]).save(folder / "img" / f"{i}.png")
        question = f"Shape {i}?" if numbered else "Which shape is it?"
        rows.append({"image": f"img/{i}.png", "question": question, "answer": shape})
    path = folder / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _example_config(folder, src, data, **overrides):
    """The image example (docs/examples/gemma3_4B_image_grpo.yaml) on the tiny directory ``src`` and the shapes
    file ``data``, at the tiny sizes every test here runs (CPU, fp32, 2 prompts x 2 completions of 6 tokens), with
    ``overrides``; written in ``folder``."""
    settings = dict(device="cpu", dtype="fp32", enable_activation_checkpointing=False, lr_scheduler=None, batch_size=2,
                    group_size=2, micro_batch_size=2, max_response_length=6, max_prompt_length=64)
    return write_config(folder, EXAMPLE, **{"checkpointer.checkpoint_dir": str(src), "dataset.data_files": str(data)},
                        **{**settings, **overrides})


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5", "qwen3_5_moe"])
def test_two_grpo_steps_with_images(vision_dir, tmp_path, clean_env, one_thread, monkeypatch, family):
    from torchtune_grpo.generation._hf_rollout import HFRollout
    from torchtune_grpo.models import _vision

    calls = {"prefill": 0, "forward": []}
    prefill, forward = HFRollout._prefill_with_images, _vision.forward_with_images

    def counted_prefill(self, *args, **kwargs):
        calls["prefill"] += 1
        return prefill(self, *args, **kwargs)

    def counted_forward(policy, tokens, images, input_pos, layout=None):
        calls["forward"].append((torch.is_grad_enabled(), tokens.size(0), layout is not None))
        return forward(policy, tokens, images, input_pos, layout)

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
        eval_every_n_steps=2, eval_max_prompts=2,
        # the mixture of experts: the engine's routes (recorded in the image prefill and the decode) replayed in
        # the reference's and the update's forwards with the images
        **({"moe.routing_replay": "rollout"} if family == "qwen3_5_moe" else {}))
    run_in_process(config, log=log)
    text = "\n".join(log)
    assert "Images in the prompt" in text and "training forwards carry the images" in text
    if family == "qwen3_5_moe":
        # Replay refuses rollouts without routes, so the engine recorded them with the images. The trainer's own
        # top-k on the same inputs (fp32 engine and trainer, the fixture's decisive routers) agrees on every token;
        # an engine prefill with zeroed pixels routed 11-13 % of the tokens otherwise (measured once by hand).
        rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
        assert [r["moe/router_agreement"] for r in rows] == [1.0, 1.0], rows
    assert "one row per sequence" not in text  # the default shared-prompt rows, with the images
    # Prefills with the pixels: one rollout per step, and one greedy pass per held-out evaluation (steps 0 and 2).
    # The reference's logprobs (no grad) and the update's forward (with grad) run with the images.
    assert calls["prefill"] == 4, calls["prefill"]
    assert any(g for g, *_ in calls["forward"]) and any(not g for g, *_ in calls["forward"])
    assert all(laid_out for *_, laid_out in calls["forward"])  # shared-prompt rows, the images in their slots
    step = tmp_path / "out" / "step_2"
    start, end = weights(src), weights(step)
    assert start.keys() == end.keys()
    # The tower and projector are frozen and carried byte for byte; the language model moved.
    tower = [k for k in start if k.startswith(TOWER[family])]
    assert tower and all(torch.equal(start[k], end[k]) for k in tower)
    assert max((end[k] - start[k]).abs().max().item() for k in start if k.startswith(LANGUAGE_PREFIX[family])) > 1e-5


def test_two_grpo_steps_with_the_transformers_engine(vision_dir, tmp_path, clean_env, one_thread, monkeypatch):
    """TransformersGenerator on image prompts (Qwen3.5: M-RoPE through generate): every rollout passes each row's
    pixels to the image-text class's ``generate``, and the run trains the language model."""
    from torchtune_grpo.generation import _transformers

    calls = []
    original = _transformers.sample_with_generate

    def recorded(hf, prompts, **kwargs):
        calls.append((type(hf).__name__, len(prompts), sorted(kwargs.get("model_inputs") or {})))
        return original(hf, prompts, **kwargs)

    monkeypatch.setattr(_transformers, "sample_with_generate", recorded)
    src = vision_dir("qwen3_5")
    data = _shapes_dataset(tmp_path / "data")
    monkeypatch.chdir(REPO)
    config = _example_config(tmp_path, src, data, max_steps=2, save_every_n_steps=2, **{"optimizer.lr": 1e-3},
                             generation={"_component_": "torchtune_grpo.generation.TransformersGenerator",
                                         "model": str(src)})
    run_in_process(config)
    assert calls == [("Qwen3_5ForConditionalGeneration", 2, ["image_grid_thw", "mm_token_type_ids", "pixel_values"])] * 2
    start, end = weights(src), weights(tmp_path / "out" / "step_2")
    assert max((end[k] - start[k]).abs().max().item() for k in start if k.startswith(LANGUAGE_PREFIX["qwen3_5"])) > 1e-5
    assert all(torch.equal(start[k], end[k]) for k in start if k.startswith(TOWER["qwen3_5"]))


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
    moves and is saved under its name; the language model moves; ``mtp.*`` is carried unchanged. Under ``dtype:
    bf16`` (FSDP2 on one process: the tower is wrapped as its own units) and with ``TransformersGenerator``, whose
    copy of the tower samples with the trainer's current (gathered) tower weights at every rollout."""
    from torchtune_grpo.generation import TransformersGenerator

    towers = []
    with_images = TransformersGenerator._with_images

    def recorded(self, *args):
        out = with_images(self, *args)
        towers.append({f"model.visual.{k}": v.clone() for k, v in out.model.visual.state_dict().items()})
        return out

    monkeypatch.setattr(TransformersGenerator, "_with_images", recorded)
    src = vision_dir("qwen3_5")
    data = _shapes_dataset(tmp_path / "data")
    monkeypatch.chdir(REPO)
    log = []
    config = _example_config(tmp_path, src, data, max_steps=2, save_every_n_steps=1, kl_coef=0.0, dtype="bf16",
                             train_vision="tower", **{"optimizer.lr": 1e-2},
                             generation={"_component_": "torchtune_grpo.generation.TransformersGenerator",
                                         "model": str(src)})
    run_in_process(config, log=log)
    assert "tower and projector trained, 45,248 parameters, sharded in 2 FSDP2 units" in "\n".join(log)
    start, end = weights(src), weights(tmp_path / "out" / "step_2")
    assert start.keys() == end.keys()
    tower = [k for k in start if k.startswith("model.visual.")]
    moved = [k for k in tower if not torch.equal(start[k], end[k])]
    assert len(moved) == len(tower), sorted(set(tower) - set(moved))[:5]
    assert all(torch.equal(start[k], end[k]) for k in start if k.startswith("mtp."))
    # The engine sampled step 1 with the source's tower and step 2 with step 1's (fp32 masters, exact).
    first = weights(tmp_path / "out" / "step_1")
    assert len(towers) == 2 and all(towers[0][k].shape == start[k].shape for k in tower)
    assert all(torch.equal(towers[0][k], start[k]) and torch.equal(towers[1][k], first[k]) for k in tower)


# Each family's projector on disk (models/_vision.py VISION_MODULES, under the checkpoint's names).
PROJECTOR = {"gemma3": "multi_modal_projector.", "qwen3_5": "model.visual.merger.", "gemma4": "model.embed_vision."}


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5", "gemma4"])
def test_resume_with_a_trained_projector_equals_the_uninterrupted_run(vision_dir, tmp_path, clean_env, one_thread,
                                                                        monkeypatch, family):
    """3 steps straight against 2 steps then a resumed run to step 3, ``train_vision: projector``: the resumed run
    takes the trained projector from step 2 and its optimizer state by name. Exact: the same operations on the
    same numbers."""
    src = vision_dir(family)
    data = _shapes_dataset(tmp_path / "data")
    monkeypatch.chdir(REPO)

    def config(folder, **overrides):
        folder.mkdir(exist_ok=True)
        length = {"max_prompt_length": SPLIT_PROMPT_LENGTH[family]} if family in SPLIT_PROMPT_LENGTH else {}
        return _example_config(folder, src, data, train_vision="projector", **{"optimizer.lr": 1e-2}, **length,
                               **overrides)

    run_in_process(config(tmp_path / "a", max_steps=3, save_every_n_steps=3))
    run_in_process(config(tmp_path / "b", max_steps=2, save_every_n_steps=2))
    run_in_process(config(tmp_path / "b", max_steps=3, save_every_n_steps=3, resume_from_checkpoint=True))
    a, b = weights(tmp_path / "a" / "out" / "step_3"), weights(tmp_path / "b" / "out" / "step_3")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    projector = [k for k in a if k.startswith(PROJECTOR[family])]
    assert projector and not all(torch.equal(a[k], weights(tmp_path / "b" / "out" / "step_2")[k]) for k in projector)


def test_the_example_reward():
    import importlib.util

    spec = importlib.util.spec_from_file_location("shape_reward", REPO / "docs" / "examples" / "shape_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    completions = ["It has three corners.\nA triangle.", "A circle, or maybe a square", "I cannot tell.", ""]
    assert module.names_the_shape(completions, ["triangle", "square", "circle", "circle"]) == [1.0, 1.0, 0.0, 0.0]


# ------------------------------------------------------------------------------- 1 vs 2 processes

# Image prompts on one process (batch_size 4) and on two (FSDP2, gloo, batch_size 2 each) see the same global batch,
# as the text runs of tests/test_models_architectures.py (_split_config there): shuffle off, so rank r of W takes
# prompts r, r + W, ..., each with its own images; the scripted engine (tests/_engines.py) gives a prompt the same
# completions on any rank; SGD without clipping or schedule (the update is the raw global gradient; lr 0.005, as
# for the MoE families there: these gradients' norm is ~30, and lr 0.05 moved weights by 0.3); micro-batches
# of 4 rows: two on one process, one on each of two. 8 prompts (of 12: the two steps' worth). The scripted
# completions are the tiny tokenizer's letters (ids 64-89), so the vowel reward varies within a group.
IMAGE_SPLIT_FAMILIES = ("gemma3", "qwen3_5", "gemma4")
# Gemma 4's prompts here are 113 or 114 tokens: its image processor gives each picture ~70 soft tokens.
SPLIT_PROMPT_LENGTH = {"gemma4": 120}
SPLIT_COLORS = {**COLORS, "green": (40, 160, 40), "black": (0, 0, 0)}
# train_vision on one process and on two (FSDP2 units of their own): Gemma 3's projector (its on-disk names differ
# from the in-memory ones; the tower stays frozen and replicated), Qwen3.5's whole tower. SGD with momentum 0.9, so
# the optimizer holds state for the vision parameters: Gemma 3's two-process run is then resumed from its step 2 for
# a third step, which must equal the third step of one process straight (the momentum restored from the checkpoint).
TRAINED_SPLIT = {"gemma3": "projector", "qwen3_5": "tower"}
TRAINED_SGD = {"_component_": "torch.optim.SGD", "lr": 0.005, "momentum": 0.9}


def _split_config(folder, src, data, batch_size, **overrides):
    folder.mkdir(parents=True)
    settings = dict(
        max_steps=2, save_every_n_steps=2, shuffle=False, batch_size=batch_size, micro_batch_size=4,
        generation={"_component_": "tests._engines.ScriptedGenerator", "low": 64, "high": 90}, clip_grad_norm=None,
        optimizer={"_component_": "torch.optim.SGD", "lr": 0.005},
        # the example's reward file, named from the repository (the spawned processes' directory may differ)
        **{"reward_functions.0.function": f"{EXAMPLE.parent / 'shape_reward.py'}:names_the_shape"})
    return str(_example_config(folder, src, data, **{**settings, **overrides}))


def image_split_runs(folder) -> list:
    """The one- and two-process runs of both families (:class:`tests._spawn_runs.Run`), written under ``folder``:
    the tower frozen, then trained (:data:`TRAINED_SPLIT`)."""
    # Numbered questions: every prompt's ids differ (an image's tokens are the same for every picture of one size),
    # so the scripted completions differ from group to group.
    data = _shapes_dataset(folder / "data", colors=SPLIT_COLORS, numbered=True)
    runs = []
    for family in IMAGE_SPLIT_FAMILIES:
        # Plain random attention, as the text families' split runs (peaked attention amplifies the regrouping's
        # rounding near softmax transitions past the bound derived below).
        src = make_vision_dir(family, folder / family / "model", peaked=False)
        length = {"max_prompt_length": SPLIT_PROMPT_LENGTH[family]} if family in SPLIT_PROMPT_LENGTH else {}
        one, two = (_split_config(folder / family / name, src, data, size, **length)
                    for name, size in (("one", 4), ("two", 2)))
        runs.append(Run(two_processes=two, one_process=one))
    for family, train in TRAINED_SPLIT.items():
        src, base = folder / family / "model", folder / f"{family}_{train}"
        trained = dict(train_vision=train, optimizer=TRAINED_SGD)
        # One process: 3 steps for Gemma 3 (12 prompts: three steps' worth), saving step 2 on the way.
        one = _split_config(base / "one", src, data, 4, **trained, max_steps=3 if family == "gemma3" else 2)
        runs.append(Run(two_processes=_split_config(base / "two", src, data, 2, **trained), one_process=one))
        if family == "gemma3":  # two processes: resumed from step 2 for the third, in the same output directory
            runs.append(Run(two_processes=_split_config(base / "two" / "resume", src, data, 2, **trained, max_steps=3,
                                                        resume_from_checkpoint=True, output_dir=str(base / "two" / "out"))))
    return runs


def check_image_split(folder) -> None:
    """Two processes equal one on the runs of :func:`image_split_runs`, after they ran."""
    for family in IMAGE_SPLIT_FAMILIES:
        src, one, two = (folder / family / name for name in ("model", "one", "two"))
        for run in (one, two):  # both trained on image prompts: the policy and the reference got the tower
            assert "Images in the prompt" in log_of(run / "config.yaml"), (family, run.name)
        start, expected, got = weights(src), weights(one / "out" / "step_2"), weights(two / "out" / "step_2")
        assert got.keys() == expected.keys() == start.keys(), family
        tower = [k for k in start if k.startswith(TOWER[family])]
        assert tower and all(torch.equal(start[k], got[k]) and torch.equal(start[k], expected[k]) for k in tower)
        language = [k for k in start if k.startswith(LANGUAGE_PREFIX[family])]
        assert max((expected[k] - start[k]).abs().max().item() for k in language) > 1e-3, family
        # Gemma 4's per-layer layer_scalar is a buffer, a constant of the checkpoint: byte for byte on both (loaded
        # as a parameter, it was trained on two processes from each one's own gradient: 8e-4 from one process).
        scalars = [k for k in language if k.endswith(".layer_scalar")]
        assert bool(scalars) == (family == "gemma4")
        assert all(torch.equal(start[k], got[k]) and torch.equal(start[k], expected[k]) for k in scalars), family
        _check_equal_split(family, language, expected, got, one, two)
    for family, train in TRAINED_SPLIT.items():
        src, base = folder / family / "model", folder / f"{family}_{train}"
        one, two = base / "one", base / "two"
        said = {"projector": "(projector trained", "tower": "(tower and projector trained"}[train]
        assert said in log_of(one / "config.yaml") and "FSDP2 unit" in log_of(two / "config.yaml"), family
        start, expected, got = weights(src), weights(one / "out" / "step_2"), weights(two / "out" / "step_2")
        assert got.keys() == expected.keys() == start.keys(), family  # the checkpoint's own names, nothing added
        vision = [k for k in start if k.startswith(TRAINED_PREFIXES[family])]
        frozen = [k for k in start if k.startswith(TOWER[family]) and k not in vision]  # Gemma 3's tower
        assert vision and all(torch.equal(start[k], got[k]) and torch.equal(start[k], expected[k]) for k in frozen)
        # Every trained vision tensor moved on both (each process's shard of it was updated, and rank 0 saved all).
        assert all(not torch.equal(start[k], run[k]) for k in vision for run in (expected, got)), family
        language = [k for k in start if k.startswith(LANGUAGE_PREFIX[family])]
        assert max((expected[k] - start[k]).abs().max().item() for k in language) > 1e-3, family
        # The vision gradients are sums over the images' feature rows regrouped by micro-batch and rank, as the
        # language model's are over tokens: the bound of _check_equal_split holds for them too (momentum 0.9 sums
        # at most 1.9 such updates per step here).
        _check_equal_split(f"{family} train_vision: {train}", language + vision, expected, got, one, two)
    # Two processes, 2 steps then resumed to the third = 3 steps straight on one process, to the bound above (a third
    # step's regrouped sums): the trained projector from step 2's files and its momentum from the optimizer state.
    # Zeroing the projector's momentum at the resume moved the third step's projector by 9.5e-4, 95x the bound.
    base = folder / "gemma3_projector"
    assert f"Resuming from {base / 'two' / 'out' / 'step_2'}" in log_of(base / "two" / "resume" / "config.yaml")
    expected, resumed = weights(base / "one" / "out" / "step_3"), weights(base / "two" / "out" / "step_3")
    assert resumed.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(resumed[key], value, atol=1e-5, rtol=0, msg=lambda m: f"step 3 {key}: {m}")


def _check_equal_split(what, keys, expected, got, one, two) -> None:
    """The weights ``keys`` and the logged metrics of runs ``one`` and ``two`` agree to the regrouping's bound."""
    # As tests/test_models_architectures.py derives it for the text families: each step's gradient is the same sum of
    # per-token terms grouped by micro-batch and rank (~sqrt(n) ulp of each sum, ~1e-7 relative); SGD at lr 0.005
    # moves a weight by lr x that per step (updates of ~0.03 here), plus one rounding of each weight (ulp 7.5e-9 at
    # 0.1; 1.2e-7 at 1, where Gemma 4 keeps its norm weights), over 2 steps, the second step's gradient taken at
    # weights that differ by the first's rounding: a few 1e-7 at most (measured 6e-8 to 2.6e-7, Gemma 4's embedding
    # table the largest; its first step: 1.5e-8); bound 1e-5 (> 30x that).
    for key in keys:
        torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=0, msg=lambda m: f"{what} {key}: {m}")
    rows = [[r for r in read_jsonl(run / "out" / "metrics.jsonl") if "loss" in r] for run in (one, two)]
    assert [r["step"] for r in rows[0]][:2] == [r["step"] for r in rows[1]][:2] == [1, 2], what
    for m1, m2 in zip(*rows):
        # Rewards and lengths are exact (the same completions); loss and kl are the same regrouped fp32 sums: 1e-5
        # at O(1), or 64 ulp of the value where the KL's e^d amplifies d's rounding (as the text families there).
        for key in ("loss", "kl", "reward/mean", "response_length/mean"):
            bound = max(1e-5, ulps(torch.tensor(m1[key]), 64))
            assert m2[key] == pytest.approx(m1[key], abs=bound), (what, m1["step"], key, m1[key], m2[key])


@pytest.mark.parametrize("setting, key", [
    ({"generation": {"_component_": "tests._engines.ToolScriptGenerator", "tokenizer_dir": "SRC"}},
     "generation._component_ is ToolScriptGenerator"),
    # vLLM with the image-text directory: its start check names the family and what the vLLM build lacks
    # (tests/test_vision_vllm.py checks the reasons).
    ({"generation": {"_component_": "torchtune_grpo.generation.VLLMGenerator", "model": "SRC"}},
     "VLLMGenerator with .*model_type 'gemma3'.*is not supported: .*NativeGenerator"),
], ids=["engine", "vllm"])
def test_what_does_not_take_images_is_refused_naming_the_key(vision_dir, tmp_path, clean_env, one_thread, setting,
                                                            key):
    """An engine without images (vLLM, a custom one; the same engine runs in generation workers and in multi-turn
    episodes) stops the run when it starts, naming the key to change."""
    src = vision_dir("gemma3")
    data = _shapes_dataset(tmp_path / "data")
    setting = {k: ({name: str(src) if value == "SRC" else value for name, value in v.items()} if isinstance(v, dict)
                   else v) for k, v in setting.items()}
    config = _example_config(tmp_path, src, data, max_steps=1, **setting,
                             **{"reward_functions.0.function": f"{EXAMPLE.parent / 'shape_reward.py'}:names_the_shape"})
    with pytest.raises(ValueError, match=key):
        run_in_process(config)
