"""The image demo (scripts/demo_images.sh): its pictures and labels, its shipped warm start ``tiny_gemma3_shapes``
and what its README claims, the SFT loop that makes it, and a short run of the script from it.

``test_short_demo_script_run`` runs the real script (data, the shipped warm start, two GRPO steps of our recipe on
image prompts with held-out evaluation at steps 0, 1 and 2, the plot) with tiny sizes; its step-0 evaluation must
equal the asset's greedy answers computed here with transformers' own image-text class, which shows the recipe
loads the asset (weights, tokenizer, processor) as it is.
"""

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests._tune_server import forked_commands_path
from tests.conftest import REPO
from tests.recipe_utils import read_jsonl, tune_env
from torchtune_grpo.assets import asset_path
from torchtune_grpo.data import (draw_shapes, image_dataset, image_sft, SHAPE_COUNT_QUESTION, shape_count_rows,
                                 tiny_gemma3_dir, write_shape_count_data)
from torchtune_grpo.data._image_sft import TOKENIZER_FILES

ASSET = Path(asset_path("tiny_gemma3_shapes"))


def _occupied_quarters(image) -> set:
    """The quarters (0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right) with any non-white pixel (inverted,
    white is black, which ``getbbox`` leaves out)."""
    from PIL import ImageOps

    half = image.width // 2
    return {q for q in range(4) if ImageOps.invert(image.crop(
        ((q % 2) * half, (q // 2) * half, (q % 2 + 1) * half, (q // 2 + 1) * half))).getbbox() is not None}


def test_pictures_are_counted_right_disjoint_and_reproducible(tmp_path):
    rows = shape_count_rows(300, seed=0, miss_rate=0.65)
    assert rows == shape_count_rows(300, seed=0, miss_rate=0.65)  # the same seed, the same pictures and slips
    assert [r["picture"] for r in rows] != [r["picture"] for r in shape_count_rows(300, seed=1)]
    # The teacher has its own random stream: asking for its answers does not change the pictures.
    assert [r["picture"] for r in rows] == [r["picture"] for r in shape_count_rows(300, seed=0)]
    held_out = {r["picture"] for s in (0, 1) for r in shape_count_rows(300, seed=s, split="validation")}
    assert not held_out & {r["picture"] for s in (0, 1) for r in shape_count_rows(300, seed=s)}
    for row in rows[:60]:  # the drawn pixels: one shape per occupied quarter, as many as the answer says
        image = draw_shapes(row["picture"])
        assert _occupied_quarters(image) == {cell for cell, *_ in row["picture"]}
        assert len(_occupied_quarters(image)) == int(row["answer"])
    assert {r["answer"] for r in rows} == {"1", "2", "3", "4"} and all(r["question"] == SHAPE_COUNT_QUESTION
                                                                       for r in rows)
    # The careless teacher: right on 1 and 2 shapes; on 3 and 4 right or exactly one short.
    assert all(r["teacher"] == r["answer"] for r in rows if r["answer"] in "12")
    big = [r for r in rows if r["answer"] in "34"]
    assert all(int(r["teacher"]) in (int(r["answer"]), int(r["answer"]) - 1) for r in big)
    # Its share of slips is a binomial draw around 0.65 over len(big) (about 150) pictures: standard deviation
    # sqrt(0.65 * 0.35 / 150) = 0.039; 4 of them either side.
    share = sum(r["teacher"] != r["answer"] for r in big) / len(big)
    assert abs(share - 0.65) < 4 * (0.65 * 0.35 / len(big)) ** 0.5, share
    # The files: image_dataset's format, and PNGs with exactly the drawn pixels (lossless).
    from PIL import Image

    path = write_shape_count_data(tmp_path, "train", 5, seed=0, miss_rate=0.65)
    written = read_jsonl(path)
    assert written == [{"image": f"train/{i}.png", "question": r["question"], "answer": r["answer"],
                        "teacher": r["teacher"]} for i, r in enumerate(rows[:5])]
    for i, row in enumerate(rows[:5]):
        with Image.open(tmp_path / "train" / f"{i}.png") as image:
            assert image.convert("RGB").tobytes() == draw_shapes(row["picture"]).tobytes()


def _greedy(model_dir, data_file):
    """The image-text class's first answer token for each picture of ``data_file`` (all prompts have the same
    length: one batch): the answers, the greedy tokens, the probabilities of "1".."4" ``[N, 4]``, and the smallest
    gap between the two largest logits relative to the largest magnitude."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    items = list(image_dataset(None, "json", data_files=str(data_file), model_dir=str(model_dir)))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([it["tokens"] for it in items]),
                       token_type_ids=torch.stack([it["image_inputs"]["token_type_ids"] for it in items]),
                       pixel_values=torch.cat([it["image_inputs"]["pixel_values"] for it in items])).logits[:, -1]
    top = logits.topk(2).values
    gap = ((top[:, 0] - top[:, 1]).min() / logits.abs().max()).item()
    digits = [tok.convert_tokens_to_ids(str(k)) for k in range(1, 5)]
    return ([it["answer"] for it in items], [tok.decode(int(t)) for t in logits.argmax(-1)],
            logits.softmax(-1)[:, digits], gap)


def test_shipped_warm_start_counts_one_short(tmp_path, one_thread):
    # The files, and the weights the README names by sha256.
    names = sorted(p.name for p in ASSET.iterdir())
    assert names == sorted(["README.md", "config.json", "model.safetensors", *TOKENIZER_FILES])
    assert sum(p.stat().st_size for p in ASSET.iterdir()) < 3 * 1024 * 1024
    digest = hashlib.sha256((ASSET / "model.safetensors").read_bytes()).hexdigest()
    assert f"`model.safetensors`: `{digest}`" in (ASSET / "README.md").read_text()
    # The claim the demo rests on, on the demo's 200 held-out pictures (seed 0): it sees the shapes but greedily
    # answers one short on 3 and 4 (README: 51 of 52 and 51 of 51), and gives the right count there often
    # enough for sampling to find it (README: mean probability 0.315 and 0.385).
    answers, greedy, probs, gap = _greedy(ASSET, write_shape_count_data(tmp_path, "held_out", 200, split="validation"))
    # No argmax here is decided by rounding: the smallest top-two gap is far above fp32 rounding (6e-8 relative)
    # and above what another CPU's kernels move a logit (~1e-5 relative, docs/precision.md).
    assert gap > 1e-3
    for count in "1234":
        rows = [i for i, a in enumerate(answers) if a == count]
        short = sum(greedy[i] == str(int(count) - 1) for i in rows) / len(rows)
        right = probs[rows, int(count) - 1].mean().item()
        if count in "12":
            assert all(greedy[i] == count for i in rows), count
        else:
            assert short >= 0.9 and 0.2 < right < 0.5, (count, short, right)
    accuracy = sum(g == a for g, a in zip(greedy, answers)) / len(answers)
    assert accuracy == 0.49  # README; 98 of 200: the 1- and 2-shape pictures and one 3-shape one


def test_sft_loop_trains_every_part_into_a_model_directory(tmp_path, one_thread):
    base = tiny_gemma3_dir(tmp_path / "a", seed=0)
    # The random init is reproducible (the asset's README remakes it from the seed).
    assert (base / "model.safetensors").read_bytes() == (
        tiny_gemma3_dir(tmp_path / "b", seed=0) / "model.safetensors").read_bytes()
    data = write_shape_count_data(tmp_path, "sft", 16, seed=0, miss_rate=0.65)
    lines = []
    out = image_sft(base, data, tmp_path / "sft", epochs=1, batch_size=8, warmup_steps=1, log=lines.append)
    assert lines == ["SFT step 2/2 (epoch 1): loss " + re.search(r"loss (\S+)$", lines[-1]).group(1)]
    for name in TOKENIZER_FILES:  # a directory the recipe starts from: the base's tokenizer and processor files
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    start, end = load_file(base / "model.safetensors"), load_file(out / "model.safetensors")
    assert start.keys() == end.keys() and all(torch.isfinite(t).all() for t in end.values())
    # Every part trained: the language model, the projector and the tower (the random tower must learn to see).
    for prefix in ("language_model.", "multi_modal_projector.", "vision_tower."):
        moved = [k for k in start if k.startswith(prefix) and not torch.equal(start[k], end[k])]
        assert moved, prefix


@pytest.mark.slow
def test_short_demo_script_run(tmp_path, one_thread):
    work = tmp_path / "demo"
    env = {**os.environ, "DEMO_DIR": str(work), "DEMO_SEED": "0", "OMP_NUM_THREADS": "1", "DEMO_PICTURES": "8",
           "DEMO_HELD_OUT": "8", "DEMO_GRPO_STEPS": "2", "DEMO_EVAL_EVERY": "1",
           "DEMO_GRPO_ARGS": "batch_size=4 group_size=4 eval_num_samples=0 optimizer.lr=1e-2"}
    # Its `tune run` and `tune-grpo plot` forked from a process that imported torch, torchtune and the recipes
    # (tests/_tune_server.py): the same commands, without ~4 s of imports each.
    env["PATH"] = forked_commands_path(tune_env()) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "demo_images.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "the shipped SFT checkpoint" in proc.stdout and "tiny_gemma3_shapes" in proc.stdout
    assert "Images in the prompt" in (work / "grpo.log").read_text()
    evals = [r for r in read_jsonl(work / "grpo" / "metrics.jsonl") if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    last = proc.stdout.strip().splitlines()[-1]
    assert last == f"held-out accuracy: {evals[0]['eval/accuracy']:.2f} -> {evals[-1]['eval/accuracy']:.2f}"
    assert (work / "training_curves.png").stat().st_size > 10_000
    # The recipe's step-0 evaluation (greedy, the native engine prefilling with the pixels) is the asset's own
    # greedy answer on each held-out picture: the same count of right answers over the same 8 pictures (argmaxes
    # not decided by rounding, see the gap).
    answers, greedy, _, gap = _greedy(ASSET, work / "held_out.jsonl")
    assert gap > 1e-3
    assert evals[0]["eval/accuracy"] == sum(g == a for g, a in zip(greedy, answers)) / len(answers)
    # GRPO trained the language model; the frozen tower and projector are carried byte for byte.
    start, end = load_file(ASSET / "model.safetensors"), load_file(work / "grpo" / "step_2" / "model.safetensors")
    assert all(torch.equal(start[k], end[k]) for k in start if not k.startswith("language_model."))
    assert any(not torch.equal(start[k], end[k]) for k in start if k.startswith("language_model."))
    assert json.loads((work / "grpo" / "step_2" / "config.json").read_text())["model_type"] == "gemma3"
