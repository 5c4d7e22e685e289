"""MATH, code and SFT warm-start datasets, from local files through datasets.load_dataset; the SFT data in
torchtune's own full_finetune_single_device recipe."""

import csv
import json
import runpy
from pathlib import Path

import pytest
import torch
import torchtune
from omegaconf import OmegaConf
from torch.utils.data import DataLoader
from torchtune import config as tt_config
from torchtune.data import padded_collate_sft
from torchtune.models.qwen2 import qwen2

from tests.conftest import write_jsonl
from torchtune_grpo.assets import asset_path
from torchtune_grpo.data import (
    code_dataset,
    collate_prompts,
    extract_boxed_answer,
    gsm8k_dataset,
    math_dataset,
    R1_SYSTEM_PROMPT,
    sft_dataset,
    WarmStartDataset,
)
from torchtune_grpo.rewards import CodeExecutionReward, MathAnswerReward, RewardBatch


def _cache(tmp_path):
    return str(tmp_path / "hf_cache")


# ---------------------------------------------------------------- MATH

MATH_ROWS = [
    {"problem": "Compute $\\frac{1}{2} + \\frac{1}{4}$.", "solution": "We get $\\boxed{\\frac{3}{4}}$.",
     "level": "Level 2", "type": "Algebra"},
    {"problem": "What is $2^{10}$?", "solution": "First \\boxed{512}? No: $2^{10} = \\boxed{1024}$.",
     "level": "Level 1", "type": "Algebra"},
    {"problem": "Simplify $\\sqrt{8}$.", "solution": "$\\sqrt{8} = \\fbox{2\\sqrt{2}}$", "level": "Level 5",
     "type": "Algebra"},
]


def test_extract_boxed_answer():
    assert extract_boxed_answer("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_boxed_answer("\\boxed{1} then \\boxed{ {2} }") == "{2}"  # the last one, stripped
    assert extract_boxed_answer("\\boxed{}") is None
    assert extract_boxed_answer("no box") is None


def test_math_dataset_from_local_json(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    ds = math_dataset(tokenizer, source="json", data_files=path, cache_dir=_cache(tmp_path))
    assert [s["answer"] for s in ds] == ["\\frac{3}{4}", "1024", "2\\sqrt{2}"]
    assert ds[0]["solution"] == MATH_ROWS[0]["solution"] and ds[0]["type"] == "Algebra"
    assert ds[0]["prompt"].endswith("User: Compute $\\frac{1}{2} + \\frac{1}{4}$.\nAssistant: <think>")
    # The gold answer is what MathAnswerReward compares against (0.75 == \frac{3}{4} exactly).
    batch = collate_prompts([ds[0], ds[1]])
    scores = MathAnswerReward(extract="boxed", backend="builtin")(
        RewardBatch(batch.prompts, ["\\boxed{0.75}", "\\boxed{1024}"], [[1], [1]], batch.fields))
    assert scores == [1.0, 1.0]


def test_math_dataset_levels_and_answer_column(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    ds = math_dataset(tokenizer, source="json", data_files=path, levels=[1, "Level 5"], cache_dir=_cache(tmp_path))
    assert [s["level"] for s in ds] == ["Level 1", "Level 5"]
    rows = [{"problem": "1+1?", "answer": " 2 "}]
    path = write_jsonl(tmp_path / "math500.jsonl", rows)
    ds = math_dataset(tokenizer, source="json", data_files=path, answer_column="answer", cache_dir=_cache(tmp_path))
    assert ds[0]["answer"] == "2"


def test_math_dataset_errors(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", MATH_ROWS + [{"problem": "p", "solution": "no box", "level": "Level 1",
                                                          "type": "x"}])
    with pytest.raises(ValueError, match="row 3 .*boxed"):
        math_dataset(tokenizer, source="json", data_files=path, cache_dir=_cache(tmp_path))
    with pytest.raises(ValueError, match="column 'question' not found"):
        math_dataset(tokenizer, source="json", data_files=path, problem_column="question", cache_dir=_cache(tmp_path))
    path = write_jsonl(tmp_path / "ok.jsonl", MATH_ROWS)
    with pytest.raises(ValueError, match="no rows .* match levels"):
        math_dataset(tokenizer, source="json", data_files=path, levels=[4], cache_dir=_cache(tmp_path))


def test_math_dataset_via_yaml(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    cfg = OmegaConf.create({"_component_": "torchtune_grpo.data.math_dataset", "source": "json", "data_files": path,
                            "prompt_style": "chat", "cache_dir": _cache(tmp_path)})
    ds = tt_config.instantiate(cfg, tokenizer)
    assert len(ds) == 3 and ds[0]["prompt"].startswith("<|im_start|>system\n")


# ---------------------------------------------------------------- code

CODE_ROWS = [
    {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"], "task_id": 1},
    {"prompt": "Write sub(a, b).", "tests": ["assert sub(3, 1) == 2"], "task_id": 2},
]


def test_code_dataset_fromwrite_jsonl(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "code.jsonl", CODE_ROWS)
    ds = code_dataset(tokenizer, source="json", data_files=path, cache_dir=_cache(tmp_path))
    assert len(ds) == 2
    assert ds[0]["tests"] == [{"kind": "assert", "source": "assert add(1, 2) == 3"},
                              {"kind": "assert", "source": "assert add(0, 0) == 0"}]
    assert ds[0]["task_id"] == 1 and ds[0]["answer"] == ""
    assert "```python" in ds[0]["prompt"]  # the code instruction asks for a fenced program
    assert ds[0]["prompt"].endswith("User: Write add(a, b).\nAssistant: <think>")
    # End to end: the collated fields feed CodeExecutionReward.
    batch = collate_prompts([ds[0], ds[0]])
    good = "</think>\n<answer>\n```python\ndef add(a, b):\n    return a + b\n```\n</answer>"
    bad = "</think>\n<answer>\n```python\ndef add(a, b):\n    return 0\n```\n</answer>"
    reward = CodeExecutionReward(time_limit=3.0, memory_limit_mb=256)
    rb = RewardBatch(batch.prompts, [good, bad], [[1], [1]], batch.fields)
    assert reward(rb) == [1.0, 0.5]


def test_code_dataset_csv_with_json_tests_and_io(tokenizer, tmp_path):
    # CSV cells are strings: a JSON list of stdin/stdout pairs is parsed; a reference solution is kept.
    rows = [
        {"question": "Double n.", "cases": json.dumps([{"input": "2", "output": "4"}]), "ref": "print(2*int(input()))"},
        {"question": "Echo.", "cases": json.dumps({"inputs": ["a", "b"], "outputs": ["a", "b"]}), "ref": "print(input())"},
    ]
    path = tmp_path / "code.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    ds = code_dataset(tokenizer, source="csv", data_files=str(path), prompt_column="question", tests_column="cases",
                      solution_column="ref", prompt_style="chat", cache_dir=_cache(tmp_path))
    assert ds[0]["tests"] == [{"kind": "io", "input": "2", "output": "4"}]
    assert len(ds[1]["tests"]) == 2 and ds[1]["answer"] == "print(input())"


def test_code_dataset_bad_tests_name_the_row(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "code.jsonl", CODE_ROWS + [{"prompt": "x", "tests": [], "task_id": 3}])
    with pytest.raises(ValueError, match="row 2 .*bad 'tests'"):
        code_dataset(tokenizer, source="json", data_files=path, cache_dir=_cache(tmp_path))
    with pytest.raises(ValueError, match="column 'test_list' not found"):
        code_dataset(tokenizer, source="json", data_files=path, tests_column="test_list", cache_dir=_cache(tmp_path))


# ---------------------------------------------------------------- SFT warm start

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many now?", "answer": "3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "What is 10 - 4?", "answer": "10 - 4 = <<10-4=6>>6\n#### 6"},
]


def test_sft_gsm8k_tokens_and_labels(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    ds = sft_dataset(tokenizer, source="json", data_files=path, answer_format="gsm8k", cache_dir=_cache(tmp_path))
    assert isinstance(ds, WarmStartDataset) and len(ds) == 2
    item = ds[0]
    # The prompt part is exactly the GRPO prompt of the same question (same builder, same style).
    grpo = gsm8k_dataset(tokenizer, source="json", data_files=path, cache_dir=_cache(tmp_path))
    prompt = grpo[0]["tokens"]
    assert item["tokens"][: len(prompt)] == prompt
    assert item["labels"][: len(prompt)] == [-100] * len(prompt)
    response = item["tokens"][len(prompt):]
    assert item["labels"][len(prompt):] == response
    assert response[-1] == tokenizer.eos_id
    text = tokenizer.decode(response[:-1])
    # Calculator annotations are removed; the response is in the think/answer format after "<think>".
    assert text == "3 + 4 = 7 apples.\n</think>\n<answer>\n7\n</answer>"


def test_sft_formats(tokenizer, tmp_path):
    rows = [{"problem": "p1", "solution": "so \\boxed{5}", "final": "5", "why": "because", "full": "R </think> A"}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    kw = dict(source="json", data_files=path, question_column="problem", cache_dir=_cache(tmp_path))

    def response(ds):
        item = ds[0]
        start = item["labels"].index(next(t for t in item["labels"] if t != -100))
        return tokenizer.decode(item["tokens"][start:-1])

    assert response(sft_dataset(tokenizer, answer_format="boxed", **kw)) == \
        "so \\boxed{5}\n</think>\n<answer>\n5\n</answer>"
    assert response(sft_dataset(tokenizer, answer_column="final", reasoning_column="why", **kw)) == \
        "because\n</think>\n<answer>\n5\n</answer>"
    assert response(sft_dataset(tokenizer, response_column="full", **kw)) == "R </think> A"
    assert response(sft_dataset(tokenizer, answer_column="final", response_template="#{answer}", **kw)) == "#5"


def test_sft_chat_style_train_on_input_and_filtering(tokenizer, tmp_path, caplog):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    kw = dict(source="json", data_files=path, answer_format="gsm8k", cache_dir=_cache(tmp_path))
    chat = sft_dataset(tokenizer, prompt_style="chat", system_prompt="Be brief.", **kw)
    text = tokenizer.decode(chat[0]["tokens"], skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<answer>\n7\n</answer><|im_end|>")
    full = sft_dataset(tokenizer, train_on_input=True, **kw)
    assert full[0]["labels"] == full[0]["tokens"]
    lengths = sorted(len(x["tokens"]) for x in sft_dataset(tokenizer, **kw))
    short = sft_dataset(tokenizer, max_seq_len=lengths[0], **kw)
    assert len(short) == 1 and short.num_dropped == 1
    with pytest.raises(ValueError, match="no SFT examples left"):
        sft_dataset(tokenizer, max_seq_len=5, **kw)


def test_sft_errors(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS + [{"question": "q", "answer": "no marker"}])
    kw = dict(source="json", data_files=path, cache_dir=_cache(tmp_path))
    with pytest.raises(ValueError, match="row 2 .*####"):
        sft_dataset(tokenizer, answer_format="gsm8k", **kw)
    with pytest.raises(ValueError, match="answer_format"):
        sft_dataset(tokenizer, answer_format="latex", **kw)
    with pytest.raises(ValueError, match="packed"):
        sft_dataset(tokenizer, packed=True, **kw)
    with pytest.raises(ValueError, match="column 'solution' not found"):
        sft_dataset(tokenizer, answer_format="boxed", **kw)


def test_sft_collate_and_loss(tokenizer, tmp_path):
    # What torchtune's SFT recipes do with it: padded_collate_sft, shift labels, cross-entropy.
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    ds = sft_dataset(tokenizer, source="json", data_files=path, answer_format="gsm8k", cache_dir=_cache(tmp_path))
    loader = DataLoader(ds, batch_size=2, collate_fn=padded_collate_sft)
    batch = next(iter(loader))
    assert batch["tokens"].shape == batch["labels"].shape
    model = qwen2(
        vocab_size=512, num_layers=1, num_heads=2, num_kv_heads=2, embed_dim=32, intermediate_dim=64, max_seq_len=512)
    logits = model(batch["tokens"])
    labels = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], dim=1)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    assert torch.isfinite(loss)
    loss.backward()


@pytest.mark.slow
def test_sft_dataset_in_torchtune_full_finetune_recipe(tmp_path, one_thread):
    # torchtune's own recipe, unchanged, trains 2 steps on sft_dataset (the warm-start path of docs/datasets.md).
    # In process: the installed recipe file that `tune run full_finetune_single_device` executes, its class
    # driven as its recipe_main does (setup, train, cleanup), without the launcher's start-up.
    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a in range(4) for b in range(4)]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    tiny = asset_path("tiny_qwen2")
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "model": {"_component_": "torchtune.models.qwen2.qwen2", "vocab_size": 512, "num_layers": 2, "num_heads": 4,
                  "num_kv_heads": 4, "embed_dim": 128, "intermediate_dim": 256, "max_seq_len": 1024,
                  "norm_eps": 1e-6, "rope_base": 1000000.0, "tie_word_embeddings": True},
        "tokenizer": {"_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer", "path": f"{tiny}/vocab.json",
                      "merges_file": f"{tiny}/merges.txt", "special_tokens_path": f"{tiny}/tokenizer.json",
                      "max_seq_len": 1024},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": tiny,
                         "checkpoint_files": ["model.safetensors"], "recipe_checkpoint": None,
                         "output_dir": str(tmp_path / "out"), "model_type": "QWEN2"},
        "resume_from_checkpoint": False,
        "dataset": {"_component_": "torchtune_grpo.data.sft_dataset", "source": "json", "data_files": data,
                    "answer_format": "gsm8k", "packed": False, "cache_dir": _cache(tmp_path)},
        "seed": 0, "shuffle": True, "epochs": 1, "max_steps_per_epoch": 2, "batch_size": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
        "optimizer_in_bwd": False,
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "device": "cpu", "enable_activation_checkpointing": False, "enable_activation_offloading": False,
        "dtype": "fp32", "clip_grad_norm": None, "compile": False,
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger",
                          "log_dir": str(tmp_path / "out" / "logs")},
        "log_every_n_steps": 1, "log_peak_memory_stats": False,
    }
    recipe_file = Path(torchtune.__file__).parent.parent / "recipes" / "full_finetune_single_device.py"
    recipe_class = runpy.run_path(str(recipe_file), run_name="sft_recipe")["FullFinetuneRecipeSingleDevice"]
    cfg = OmegaConf.create(cfg)
    recipe = recipe_class(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()
    logs = "".join(p.read_text() for p in (tmp_path / "out" / "logs").glob("*.txt"))
    losses = [float(line.split("loss:")[1].split()[0]) for line in logs.splitlines() if "loss:" in line]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert list((tmp_path / "out" / "epoch_0").glob("*.safetensors"))


def test_r1_prompt_is_shared(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    ds = sft_dataset(tokenizer, source="json", data_files=path, answer_format="gsm8k", cache_dir=_cache(tmp_path))
    assert tokenizer.decode(ds[0]["tokens"]).startswith(R1_SYSTEM_PROMPT)
