"""Prompt dataset builders: formats, answers, passthrough columns, filtering, splits, collate."""

import base64
import csv
import json
import logging

import pytest
from omegaconf import OmegaConf
from torch.utils.data import DataLoader
from torchtune import config as tt_config

from torchtune_grpo.data import (
    addition_sft_rows,
    addition_worked_solution,
    arithmetic_dataset,
    arithmetic_problems,
    collate_prompts,
    extract_gsm8k_answer,
    gsm8k_dataset,
    PromptBatch,
    PromptDataset,
    R1_SYSTEM_PROMPT,
    verifiable_dataset,
)

QUESTION = "What is 2 + 3?"
R1_TEXT = f"{R1_SYSTEM_PROMPT}\nUser: {QUESTION}\nAssistant: <think>"


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _write_csv(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


# ----------------------------------------------------------------------------- prompt formats


def test_r1_prompt_text_and_tokens(tokenizer):
    ds = PromptDataset([{"question": QUESTION, "answer": "5"}], tokenizer, formatter="r1")
    sample = ds[0]
    assert sample["prompt"] == R1_TEXT
    assert sample["prompt"].endswith("Assistant: <think>")
    # Qwen has no BOS, and add_eos=False: the ids are exactly the text's ids.
    assert sample["tokens"] == tokenizer.encode(R1_TEXT, add_bos=False, add_eos=False)
    assert tokenizer.eos_id not in sample["tokens"]
    assert sample["answer"] == "5"


def test_chat_prompt_text_qwen(tokenizer):
    sample = PromptDataset([{"question": QUESTION, "answer": "5"}], tokenizer, formatter="chat")[0]
    assert sample["prompt"] == (
        f"<|im_start|>system\n{R1_SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Ends with the assistant header, no <|im_end|>: generation continues the assistant turn.
    im_start = tokenizer.special_tokens["<|im_start|>"]
    tail = [im_start] + tokenizer.encode("assistant\n", add_bos=False, add_eos=False)
    assert sample["tokens"][-len(tail):] == tail


def test_chat_prompt_without_system(tokenizer):
    ds = PromptDataset(
        [{"question": QUESTION, "answer": "5"}], tokenizer, formatter="chat", system_prompt=""
    )
    assert ds[0]["prompt"] == f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def test_custom_system_prompt_r1(tokenizer):
    ds = PromptDataset(
        [{"question": QUESTION, "answer": "5"}], tokenizer, formatter="r1", system_prompt="Be brief."
    )
    assert ds[0]["prompt"] == f"Be brief.\nUser: {QUESTION}\nAssistant: <think>"


def test_chat_prompt_llama3(tmp_path):
    # A byte-only tiktoken file is enough for torchtune's Llama3 tokenizer (its special tokens have
    # fixed ids 128000+), which lets us check the Llama3 chat prompt without model files.
    from torchtune.models.llama3 import llama3_tokenizer

    bpe = tmp_path / "tokenizer.model"
    bpe.write_text(
        "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)), encoding="utf-8"
    )
    tok = llama3_tokenizer(str(bpe))
    chat = PromptDataset(
        [{"question": QUESTION, "answer": "5"}], tok, formatter="chat", system_prompt="Be brief.",
        max_prompt_length=None,  # byte-level ids: the prompt is long
    )[0]
    assert chat["prompt"] == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{QUESTION}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert chat["tokens"][-1] != tok.eot_id
    r1 = PromptDataset(
        [{"question": QUESTION, "answer": "5"}], tok, formatter="r1", max_prompt_length=None
    )[0]
    assert r1["tokens"][0] == tok.bos_id and r1["tokens"][-1] != tok.eos_id
    assert r1["prompt"] == R1_TEXT


def test_unknown_prompt_style(tokenizer):
    with pytest.raises(ValueError, match="prompt_style"):
        PromptDataset([{"question": QUESTION, "answer": "5"}], tokenizer, formatter="alpaca")


# ----------------------------------------------------------------------------- gsm8k


GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many now?", "answer": "3 + 4 = 7\n#### 7", "id": 0},
    {"question": "A farm sells 1000 eggs. How many?", "answer": "It sold 1,000.\n####  1,000 \n", "id": 1},
]


def test_gsm8k_from_local_json(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    ds = gsm8k_dataset(tokenizer, source="json", data_files=path, cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 2 and ds.num_dropped == 0
    assert [s["answer"] for s in ds] == ["7", "1,000"]  # stripped, raw (no comma removal)
    assert ds[0]["solution"] == "3 + 4 = 7\n#### 7"
    assert ds[1]["id"] == 1  # extra columns pass through
    assert ds[0]["question"] == GSM8K_ROWS[0]["question"]
    assert ds[0]["prompt"].endswith(f"User: {GSM8K_ROWS[0]['question']}\nAssistant: <think>")


def test_gsm8k_row_without_marker(tokenizer, tmp_path):
    rows = GSM8K_ROWS + [{"question": "q?", "answer": "no marker here", "id": 2}]
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match="row 2 .*####"):
        gsm8k_dataset(tokenizer, source="json", data_files=path, cache_dir=str(tmp_path / "cache"))


def test_extract_gsm8k_answer():
    assert extract_gsm8k_answer("a #### b #### 42 ") == "42"  # the last marker wins
    assert extract_gsm8k_answer("no marker") is None


def test_gsm8k_via_yaml_instantiate(tokenizer, tmp_path):
    # How the recipe builds it: config.instantiate(cfg.dataset, tokenizer).
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    cfg = OmegaConf.create(
        {
            "_component_": "torchtune_grpo.data.gsm8k_dataset",
            "source": "json",
            "data_files": path,
            "prompt_style": "chat",
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    ds = tt_config.instantiate(cfg, tokenizer)
    assert len(ds) == 2 and ds[0]["prompt"].startswith("<|im_start|>system\n")


# ----------------------------------------------------------------------------- verifiable


CSV_ROWS = [
    {"problem": "What is 6 * 7?", "solution": 42, "difficulty": "easy"},
    {"problem": "What is 10 - 4?", "solution": 6, "difficulty": "easy"},
    {"problem": "What is 12 * 12?", "solution": 144, "difficulty": "hard"},
]


def test_verifiable_csv_custom_columns(tokenizer, tmp_path):
    path = _write_csv(tmp_path / "qa.csv", CSV_ROWS)
    ds = verifiable_dataset(
        tokenizer,
        source="csv",
        data_files=path,
        question_column="problem",
        answer_column="solution",
        cache_dir=str(tmp_path / "cache"),
    )
    assert [s["answer"] for s in ds] == ["42", "6", "144"]  # csv ints become strings
    assert [s["difficulty"] for s in ds] == ["easy", "easy", "hard"]
    assert ds[0]["problem"] == "What is 6 * 7?"
    assert "User: What is 6 * 7?\n" in ds[0]["prompt"]


def test_verifiable_missing_column_message(tokenizer, tmp_path):
    path = _write_csv(tmp_path / "qa.csv", CSV_ROWS)
    with pytest.raises(ValueError) as info:
        verifiable_dataset(
            tokenizer,
            source="csv",
            data_files=path,
            question_column="problem",
            answer_column="final_answer",
            cache_dir=str(tmp_path / "cache"),
        )
    message = str(info.value)
    assert "'final_answer'" in message and "'csv'" in message
    for column in ("problem", "solution", "difficulty"):
        assert column in message


def test_length_filter_drops_and_logs(tokenizer, tmp_path, caplog):
    short = "What is 1 + 1?"
    long = "What is " + " + ".join(["1"] * 40) + "?"
    rows = [
        {"question": q, "answer": "x"} for q in [short, long, short, long, long]
    ]
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    limit = len(PromptDataset([rows[0]], tokenizer)[0]["tokens"])  # the short prompt fits exactly
    with caplog.at_level(logging.WARNING, logger="torchtune_grpo.data._prompt"):
        ds = verifiable_dataset(
            tokenizer, source="json", data_files=path, max_prompt_length=limit,
            cache_dir=str(tmp_path / "cache"),
        )
    assert len(ds) == 2 and ds.num_dropped == 3
    assert all(len(s["tokens"]) <= limit for s in ds)
    assert f"dropped 3 of 5 prompts longer than max_prompt_length={limit} tokens" in caplog.text

    with pytest.raises(ValueError, match="max_prompt_length=5"):
        verifiable_dataset(
            tokenizer, source="json", data_files=path, max_prompt_length=5,
            cache_dir=str(tmp_path / "cache"),
        )


# ----------------------------------------------------------------------------- arithmetic


def _keys(ds):
    return {(s["a"], s["op"], s["b"]) for s in ds}


def test_arithmetic_answers_and_questions(tokenizer):
    ds = arithmetic_dataset(tokenizer, num_samples=200, seed=3)
    assert len(ds) == 200 and ds.num_dropped == 0
    for s in ds:
        assert s["question"] == f"What is {s['a']} {s['op']} {s['b']}?"
        expected = s["a"] + s["b"] if s["op"] == "+" else s["a"] - s["b"]
        assert s["answer"] == str(expected) and expected >= 0
        assert 0 <= s["a"] <= 99 and 0 <= s["b"] <= 99
    assert len(_keys(ds)) == 200  # distinct problems


def test_arithmetic_deterministic(tokenizer):
    a = arithmetic_dataset(tokenizer, num_samples=50, seed=7)
    b = arithmetic_dataset(tokenizer, num_samples=50, seed=7)
    c = arithmetic_dataset(tokenizer, num_samples=50, seed=8)
    assert [s["tokens"] for s in a] == [s["tokens"] for s in b]
    assert [s["question"] for s in a] != [s["question"] for s in c]


def test_arithmetic_train_validation_disjoint():
    # Use the problem generator directly (no tokenizing) so large samples stay fast.
    train = set(arithmetic_problems(8000, seed=0, split="train"))
    validation = set(arithmetic_problems(1000, seed=0, split="validation"))
    other_seed_train = set(arithmetic_problems(8000, seed=1, split="train"))
    assert len(train) == 8000 and len(validation) == 1000
    assert not train & validation
    assert not other_seed_train & validation
    # Huge spaces use rejection sampling: still disjoint and deterministic.
    big_train = arithmetic_problems(3000, max_value=10**6, operations=("*",), split="train")
    big_val = arithmetic_problems(3000, max_value=10**6, operations=("*",), split="validation")
    assert not set(big_train) & set(big_val)
    assert big_val == arithmetic_problems(3000, max_value=10**6, operations=("*",), split="validation")


def test_arithmetic_errors(tokenizer):
    with pytest.raises(ValueError, match="distinct problems"):
        arithmetic_problems(10**6, max_value=9, split="validation")
    with pytest.raises(ValueError, match="operations"):
        arithmetic_problems(10, operations=("/",))
    with pytest.raises(ValueError, match="split"):
        arithmetic_problems(10, split="test")


def test_addition_worked_solution_by_hand():
    # 58 + 67: units 8+7=15 (write 5, carry 1), tens 5+6+1=12 -> 125
    assert addition_worked_solution(58, 67) == ("8+7=15,5+6+1=12", "125")
    # the careless teacher writes the carry as 0 and concludes 115
    assert addition_worked_solution(58, 67, drop_carry=True) == ("8+7=15,5+6+0=11", "115")
    assert addition_worked_solution(12, 3) == ("2+3=5,1+0+0=1", "15")  # shorter operand padded with 0
    assert addition_worked_solution(999, 1) == ("9+1=10,9+0+1=10,9+0+1=10", "1000")
    assert addition_worked_solution(999, 1, drop_carry=True) == ("9+1=10,9+0+0=9,9+0+0=9", "990")
    assert addition_worked_solution(41, 52, drop_carry=True) == addition_worked_solution(41, 52)  # no carry
    with pytest.raises(ValueError, match="-3"):
        addition_worked_solution(-3, 4)


def test_addition_sft_rows_match_the_grpo_problems_and_drop_rate(tokenizer):
    rows, counts = addition_sft_rows(2000, carry_drop_rate=0.65, seed=5)
    prompts = arithmetic_dataset(tokenizer, num_samples=2000, min_value=10, max_value=99, operations=["+"], seed=5)
    assert [r["question"] for r in rows] == [p["question"] for p in prompts]
    truth = {p["question"]: p["answer"] for p in prompts}
    wrong = [r for r in rows if r["answer"] != truth[r["question"]]]
    # every wrong row is a dropped carry, and only those are wrong
    assert counts["carry_dropped"] == len(wrong) and all("+0=" in r["reasoning"] for r in wrong)
    # about 45% of two-digit additions carry from the units; 65% of those are dropped (binomial sd ~0.016)
    assert abs(counts["need_carry"] / counts["problems"] - 0.45) < 0.05
    assert abs(counts["carry_dropped"] / counts["need_carry"] - 0.65) < 0.06
    assert addition_sft_rows(2000, carry_drop_rate=0.0, seed=5)[1]["carry_dropped"] == 0
    assert addition_sft_rows(200, carry_drop_rate=0.65, seed=5) == addition_sft_rows(200, carry_drop_rate=0.65, seed=5)
    with pytest.raises(ValueError, match="carry_drop_rate"):
        addition_sft_rows(10, carry_drop_rate=1.5)


# ----------------------------------------------------------------------------- collate


def test_collate_prompts(tokenizer):
    ds = arithmetic_dataset(tokenizer, num_samples=4, seed=0)
    batch = collate_prompts([ds[0], ds[1]])
    assert isinstance(batch, PromptBatch)
    assert batch.tokens == [ds[0]["tokens"], ds[1]["tokens"]]
    assert batch.prompts == [ds[0]["prompt"], ds[1]["prompt"]]
    assert batch.fields[1]["answer"] == ds[1]["answer"]
    assert set(batch.fields[0]) == set(ds[0]) - {"tokens"}

    loader = DataLoader(ds, batch_size=3, shuffle=False, collate_fn=collate_prompts)
    sizes = [len(b.tokens) for b in loader]
    assert sizes == [3, 1]


def test_items_are_copies(tokenizer):
    ds = PromptDataset([{"question": QUESTION, "answer": "5"}], tokenizer)
    item = ds[0]
    item["tokens"].append(-1)
    item["answer"] = "changed"
    assert ds[0]["tokens"][-1] != -1 and ds[0]["answer"] == "5"
