"""The LoRA recipe on image prompts (tiny Gemma 3 and Qwen3.5 directories, PIL-drawn shapes): the tower frozen, and
``train_vision: projector`` / ``tower`` trained fully beside the adapters, with a reference that sees the source's
vision modules (docs/multimodal.md, "LoRA with a trained projector or tower"). Its two-process runs
(:func:`lora_image_split_runs`, :func:`check_lora_image_split`) go in tests/test_models_architectures.py's launch."""

import pytest
import torch
from safetensors.torch import load_file

from tests._spawn_runs import log_of, Run
from tests.conftest import REPO
from tests.hf_multimodal import LANGUAGE_PREFIX
from tests.recipe_utils import read_jsonl, run_in_process, weights, write_config
from tests.test_vision_recipe import _check_equal_split, _shapes_dataset, TOWER, TRAINED_PREFIXES, TRAINED_SGD

def _lora_image_config(folder, src, data, **overrides):
    """The tiny LoRA config (configs/tiny/lora_grpo_cpu.yaml: AdamW, kl_coef 0.04) on the tiny image directory
    ``src`` and the shapes file ``data``, adapters on q and v, 2 prompts x 2 completions of 6 tokens; written in
    ``folder``."""
    from tests.hf_models import hf_components

    components = {k: v for k, v in hf_components(src).items() if not k.startswith("dataset.")}
    components["model"] = {"_component_": "torchtune_grpo.models.lora_hf_model", "path": "${checkpointer.checkpoint_dir}",
                           "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4, "lora_alpha": 8}
    settings = dict(lr_scheduler=None, batch_size=2, group_size=2, micro_batch_size=2, max_response_length=6,
                    max_prompt_length=64, dataset={"_component_": "torchtune_grpo.data.image_dataset", "source": "json",
                                                   "data_files": str(data)})
    return write_config(folder, REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml", **components,
                        **{**settings, **overrides})


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5", "gemma4"])
def test_lora_with_images(vision_dir, tmp_path, clean_env, one_thread, monkeypatch, family):
    """The LoRA recipe on image prompts: the adapters sit in the language model the image-text forward runs, the
    reference is the policy with its adapters off (same images), the tower is carried into the merged model."""
    from torchtune_grpo.generation._hf_rollout import HFRollout

    prefills = []
    prefill = HFRollout._prefill_with_images
    monkeypatch.setattr(HFRollout, "_prefill_with_images", lambda self, *a: prefills.append(1) or prefill(self, *a))
    src = vision_dir(family)
    data = _shapes_dataset(tmp_path / "data")
    log = []
    config = _lora_image_config(tmp_path, src, data, max_steps=2, save_every_n_steps=2)
    run_in_process(config, lora=True, log=log)
    assert "Images in the prompt" in "\n".join(log) and len(prefills) == 2
    start, merged = weights(src), weights(tmp_path / "out" / "step_2" / "merged")
    assert start.keys() == merged.keys()
    assert all(torch.equal(start[k], merged[k]) for k in start if k.startswith(TOWER[family]))
    assert any(not torch.equal(start[k], merged[k]) for k in start if k.startswith(LANGUAGE_PREFIX[family]))
    assert not (tmp_path / "out" / "step_2" / "image_side.safetensors").exists()  # nothing trained there


def test_lora_trains_the_projector_against_the_source_reference_and_resumes(vision_dir, tmp_path, clean_env,
                                                                            one_thread, monkeypatch):
    """LoRA with ``train_vision: projector`` (tiny Gemma 3, whose on-disk names differ from the in-memory ones):

    - the projector trains fully with the adapters; ``step_N/merged`` holds it under the checkpoint's names (the
      tower byte for byte) and loads in ``AutoModelForImageTextToText`` with it; ``step_N/image_side.safetensors``
      holds it under that class's names (its ``load_state_dict`` takes them);
    - the reference (adapters off) sees the SOURCE's projector: step 3's reference logprobs equal the source
      model's, computed here by transformers, and differ from those with the projector the policy then held;
    - 3 steps straight = 2 steps, then a resumed run to step 3 (adapter, projector and their AdamW state), exactly;
    - resuming with a ``train_vision`` that does not train what the file holds is refused, naming the key.
    """
    from transformers import AutoModelForImageTextToText

    from torchtune_grpo.training.experience import ExperienceBuilder

    built = []  # (rollouts, experience) of every step, in order
    build = ExperienceBuilder.__call__

    def recorded(self, policy, trained):
        out = build(self, policy, trained)
        built.append((trained, out.experience))
        return out

    monkeypatch.setattr(ExperienceBuilder, "__call__", recorded)
    src = vision_dir("gemma3")
    data = _shapes_dataset(tmp_path / "data")
    monkeypatch.chdir(REPO)

    def config(folder, **overrides):
        folder.mkdir(exist_ok=True)
        # One row per sequence (no shared prompt): the reference's rows are the plain right-padded batch that
        # tests/test_vision_policy.py compares with the image-text class, to its bound.
        return _lora_image_config(folder, src, data, train_vision="projector", share_prompt_in_training=False,
                                  **overrides)

    log = []
    run_in_process(config(tmp_path / "a", max_steps=3, save_every_n_steps=3), lora=True, log=log)
    assert "(projector trained, " in "\n".join(log) and "reference sees a frozen copy of the source's projector" in (
        "\n".join(log))
    steps = built[:]
    run_in_process(config(tmp_path / "b", max_steps=2, save_every_n_steps=2), lora=True)
    run_in_process(config(tmp_path / "b", max_steps=3, save_every_n_steps=3, resume_from_checkpoint=True), lora=True)

    # Resume = uninterrupted: the adapter, the merged model and the projector, bit for bit.
    a, b = tmp_path / "a" / "out" / "step_3", tmp_path / "b" / "out" / "step_3"
    for name in ("adapter_model.safetensors", "image_side.safetensors"):
        x, y = load_file(a / name), load_file(b / name)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
    x, y = weights(a / "merged"), weights(b / "merged")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    # Saved: the projector moved, under the checkpoint's names in merged (nothing added), the tower byte for byte.
    start, merged = weights(src), weights(a / "merged")
    assert start.keys() == merged.keys()
    projector = [k for k in start if k.startswith("multi_modal_projector.")]
    assert projector and all(not torch.equal(start[k], merged[k]) for k in projector)
    assert all(torch.equal(start[k], merged[k]) for k in start if k.startswith("vision_tower."))
    side = load_file(a / "image_side.safetensors")
    loaded = AutoModelForImageTextToText.from_pretrained(a / "merged", dtype=torch.float32)
    assert side.keys() == {f"model.multi_modal_projector.{k}" for k in loaded.model.multi_modal_projector.state_dict()}
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in side.items())  # merged loads the trained projector
    base = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    missing, unexpected = base.load_state_dict(side, strict=False)  # what an adapter user applies
    assert not unexpected and all(torch.equal(v, base.state_dict()[k]) for k, v in side.items())

    # The reference at step 3 = the source model (adapters off, source projector), by transformers.
    source = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    held = load_file(tmp_path / "b" / "out" / "step_2" / "image_side.safetensors")  # the policy's projector at step 3
    trained, experience = steps[2]
    rows = {"source": [], "held": []}
    for model_name, model in (("source", source), ("held", base)):
        if model_name == "held":
            model.load_state_dict(held, strict=False)
        for i, (prompt, response) in enumerate(zip(trained.prompt_ids, trained.response_ids)):
            images = dict(trained.fields[i // trained.group_size]["image_inputs"])
            row = list(prompt) + list(response)
            images["token_type_ids"] = torch.nn.functional.pad(images["token_type_ids"].reshape(1, -1),
                                                               (0, len(response)))
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([row]), **images).logits.float()[0]
            logprobs = torch.log_softmax(logits, -1)[len(prompt) - 1: -1].gather(-1, torch.tensor(response)[:, None])
            rows[model_name].append((logprobs.squeeze(-1).tolist(), logits.abs().max().item()))
    mask = experience.batch.response_mask
    ours = experience.ref_logprobs[mask]
    expected = experience.batch.response_values([r for r, _ in rows["source"]])[mask]
    leaked = experience.batch.response_values([r for r, _ in rows["held"]])[mask]
    # As tests/test_vision_policy.py: the same modules and weights (LoRA off adds nothing), a right-padded batch of
    # 2 rows against each row alone, at temperature 1: a few ulp of the logits' logsumexp; 10 ulp of the largest
    # logit magnitude (at least 16).
    bound = 10 * torch.finfo(torch.float32).eps * max(16.0, *(m for _, m in rows["source"]))
    assert (ours - expected).abs().max().item() <= bound, ((ours - expected).abs().max().item(), bound)
    assert (ours - leaked).abs().max().item() > 100 * bound  # the trained projector would show

    # Resuming with train_vision: none from a step that holds a trained projector: refused, naming the key.
    with pytest.raises(ValueError, match="train_vision: none does not train .*multi_modal_projector"):
        run_in_process(_lora_image_config(tmp_path / "b", src, data, max_steps=4, resume_from_checkpoint=True,
                                          share_prompt_in_training=False), lora=True)


# The LoRA recipe with train_vision on one process and on two: Qwen3.5's whole tower (2 FSDP2 units of its own beside
# the adapters' decoder layers), the same settings and SGD with momentum; 2 steps, then resumed on two processes for a
# third (the tower from step 2's image_side file, loaded before it is sharded, and its momentum by name) against 3
# steps straight on one process. LoRA's A matrices start random, drawn differently on a sharded model, so the adapters
# are scaled by lora_alpha 0 here: they add nothing and get no gradient (the adapters' own two-process runs are in
# tests/test_models_architectures.py), the language model stays the base and the tower is what trains.
LORA_SPLIT = ("qwen3_5", "tower")


def lora_image_split_runs(folder) -> list:
    """The LoRA runs of :data:`LORA_SPLIT` (:class:`tests._spawn_runs.Run`), under ``folder``: on the shapes file
    and the Qwen3.5 directory that :func:`tests.test_vision_recipe.image_split_runs` wrote there (call it first)."""
    data = folder / "data" / "shapes.jsonl"
    family, train = LORA_SPLIT
    src, base = folder / family / "model", folder / f"lora_{family}_{train}"
    straight = _lora_split_config(base / "one", src, data, 4, train_vision=train, max_steps=3, save_every_n_steps=1)
    two = _lora_split_config(base / "two", src, data, 2, train_vision=train)
    resumed = _lora_split_config(base / "two" / "resume", src, data, 2, train_vision=train, max_steps=3,
                                 resume_from_checkpoint=True, output_dir=str(base / "two" / "out"))
    return [Run(one_process=straight, two_processes=two, lora=True), Run(two_processes=resumed, lora=True)]


def _lora_split_config(folder, src, data, batch_size, **overrides):
    """:func:`tests.test_vision_recipe._split_config`'s settings in the LoRA config (:func:`_lora_image_config`; its rewards: the scripted
    letters' vowel fraction varies within a group), SGD with momentum, adapters scaled by 0 (:data:`LORA_SPLIT`)."""
    folder.mkdir(parents=True)
    settings = dict(
        max_steps=2, save_every_n_steps=2, shuffle=False, batch_size=batch_size, micro_batch_size=4,
        generation={"_component_": "tests._engines.ScriptedGenerator", "low": 64, "high": 90}, clip_grad_norm=None,
        optimizer=TRAINED_SGD, **{"model.lora_alpha": 0})
    return str(_lora_image_config(folder, src, data, **{**settings, **overrides}))


def check_lora_image_split(folder) -> None:
    """LoRA with the trained tower (:data:`LORA_SPLIT`): two processes = one process at step 2, and resumed on two
    processes = straight on one at step 3, to :func:`tests.test_vision_recipe._check_equal_split`'s bound (the same sums regrouped): the merged
    model (the tower under its names; the language model the base's, byte for byte), ``image_side.safetensors`` and
    the metrics, whose KL (from step 2 on: the policy's tower moved, the reference's copy did not) is the same."""
    family, train = LORA_SPLIT
    base = folder / f"lora_{family}_{train}"
    one, two = base / "one", base / "two"
    assert "(tower and projector trained" in log_of(one / "config.yaml")
    assert "FSDP2 unit" in log_of(two / "config.yaml") and "Resuming from" in log_of(two / "resume" / "config.yaml")
    start = weights(folder / family / "model")
    vision = [k for k in start if k.startswith(TRAINED_PREFIXES[family])]
    for step in ("step_2", "step_3"):
        expected, got = weights(one / "out" / step / "merged"), weights(two / "out" / step / "merged")
        assert got.keys() == expected.keys() == start.keys()
        assert vision and all(not torch.equal(start[k], run[k]) for k in vision for run in (expected, got))
        assert all(torch.equal(start[k], run[k]) for k in start if k not in vision for run in (expected, got))
        _check_equal_split(f"LoRA {family} train_vision: {train} {step}", vision, expected, got, one, two)
        sides = [load_file(run / "out" / step / "image_side.safetensors") for run in (one, two)]
        assert sides[0].keys() == sides[1].keys() and len(sides[0]) == len(vision)
        for key, value in sides[0].items():  # as the merged weights above
            torch.testing.assert_close(sides[1][key], value, atol=1e-5, rtol=0, msg=lambda m: f"{step} {key}: {m}")
    rows = [[r for r in read_jsonl(run / "out" / "metrics.jsonl") if "loss" in r] for run in (one, two)]
    assert [r["step"] for r in rows[1]] == [1, 2, 3] and rows[0][0]["kl"] == 0 < rows[0][1]["kl"]
