"""Hostile data (issue 33, items 3 and 6): rows with an empty or null question or answer are dropped with a
count in the log, or refused naming the file, row and column; a data file that cannot be read (not UTF-8,
a JSONL line cut short, empty) is named with its line."""

import logging

import pytest

from tests.conftest import write_jsonl
from torchtune_grpo.assets import asset_path
from torchtune_grpo.data import (
    code_dataset,
    DataFileError,
    gsm8k_dataset,
    load_rows,
    math_dataset,
    PromptDataset,
    sft_dataset,
    tool_sft_dataset,
    verifiable_dataset,
)
from torchtune_grpo.models import hf_tokenizer
from torchtune_grpo.rewards import MathAnswerReward, RewardBatch


def _cache(tmp_path):
    return str(tmp_path / "hf_cache")


# Row 1: empty question; row 2: null answer; row 3: whitespace-only question. Rows 0 and 4 are fine.
QA_ROWS = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {"question": "", "answer": "7"},
    {"question": "What is 1 + 1?", "answer": None},
    {"question": "   \n", "answer": "4"},
    {"question": "What is 3 + 3?", "answer": "6"},
]


# ----------------------------------------------------------------------------- item 3: empty or null cells


def test_jsonl_empty_question_and_null_answer_are_dropped_and_counted(tokenizer, tmp_path, caplog):
    path = write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)
    with caplog.at_level(logging.WARNING):
        ds = verifiable_dataset(tokenizer, source="json", data_files=path, cache_dir=_cache(tmp_path))
    assert [s["answer"] for s in ds] == ["5", "6"]
    assert ds.num_invalid == 3 and ds.num_dropped == 0  # num_dropped stays the over-long count
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "dropped 3 of 5 rows" in message and path in message
    assert "'question': 2" in message and "'answer': 1" in message


def test_null_answer_never_becomes_the_gold_answer_none(tokenizer, tmp_path):
    # Before: the gold answer was str(None) == "None", and the math reward paid 1.0 for <answer>None</answer>.
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q1", "answer": None}, {"question": "q2", "answer": "2"}])
    ds = verifiable_dataset(tokenizer, source="json", data_files=path, cache_dir=_cache(tmp_path))
    fields = [{k: v for k, v in s.items() if k != "tokens"} for s in ds]
    assert [f["answer"] for f in fields] == ["2"]
    batch = RewardBatch([f["prompt"] for f in fields], ["<answer>None</answer>"], [[1]], fields)
    assert MathAnswerReward(backend="builtin")(batch) == [0.0]


def test_on_invalid_row_error_names_file_row_and_column(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)
    with pytest.raises(ValueError) as info:
        verifiable_dataset(tokenizer, source="json", data_files=path, on_invalid_row="error",
                           cache_dir=_cache(tmp_path))
    message = str(info.value)
    assert path in message and "row 1 (0-based)" in message and "'question'" in message


def test_csv_empty_cell_is_not_the_prompt_none(tokenizer, tmp_path, caplog):
    # An empty CSV cell reaches the builder as None; before, the prompt was the text "None".
    path = tmp_path / "quiz.csv"
    path.write_text("problem,solution\nWhat is 2 + 3?,5\n,9\nWhat is 4 + 4?,\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        ds = verifiable_dataset(tokenizer, source="csv", data_files=str(path), question_column="problem",
                                answer_column="solution", cache_dir=_cache(tmp_path))
    assert len(ds) == 1 and ds[0]["problem"] == "What is 2 + 3?"
    assert "dropped 2 of 3 rows" in caplog.text
    with pytest.raises(ValueError, match=r"row 1 \(0-based\) of 'csv' .*quiz\.csv.* null 'problem' \(None\)"):
        verifiable_dataset(tokenizer, source="csv", data_files=str(path), question_column="problem",
                           answer_column="solution", on_invalid_row="error", cache_dir=_cache(tmp_path))


def test_gsm8k_null_or_blank_final_answer_is_dropped(tokenizer, tmp_path, caplog):
    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "null answer", "answer": None},  # before: "no '####'" error for the text "None"
        {"question": "blank final answer", "answer": "2 + 2 = 4\n####  "},
    ]
    path = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        ds = gsm8k_dataset(tokenizer, source="json", data_files=path, cache_dir=_cache(tmp_path))
    assert [s["answer"] for s in ds] == ["7"]
    assert "dropped 2 of 3 rows" in caplog.text
    with pytest.raises(ValueError, match=r"row 1 \(0-based\).*gsm8k\.jsonl.*'answer'"):
        gsm8k_dataset(tokenizer, source="json", data_files=path, on_invalid_row="error", cache_dir=_cache(tmp_path))


def test_math_null_answer_column_and_null_solution_are_dropped(tokenizer, tmp_path):
    rows = [
        {"problem": "What is $1+1$?", "solution": "$\\boxed{2}$", "answer": "2"},
        {"problem": "What is $2+2$?", "solution": None, "answer": None},
        {"problem": None, "solution": "$\\boxed{3}$", "answer": "3"},
    ]
    path = write_jsonl(tmp_path / "math.jsonl", rows)
    by_answer = math_dataset(tokenizer, source="json", data_files=path, answer_column="answer",
                             cache_dir=_cache(tmp_path))
    by_solution = math_dataset(tokenizer, source="json", data_files=path, cache_dir=_cache(tmp_path))
    assert [s["answer"] for s in by_answer] == ["2"] and [s["answer"] for s in by_solution] == ["2"]
    with pytest.raises(ValueError, match=r"row 1 \(0-based\).*'solution'"):
        math_dataset(tokenizer, source="json", data_files=path, on_invalid_row="error", cache_dir=_cache(tmp_path))


def test_code_blank_task_or_solution_is_dropped_but_empty_answer_is_allowed(tokenizer, tmp_path):
    rows = [
        {"prompt": "Write f(x) returning x + 1.", "tests": ["assert f(1) == 2"], "ref": "def f(x): return x+1"},
        {"prompt": "", "tests": ["assert g() == 1"], "ref": "def g(): return 1"},
        {"prompt": "Write h() returning 0.", "tests": ["assert h() == 0"], "ref": None},
    ]
    path = write_jsonl(tmp_path / "code.jsonl", rows)
    # No reference solution: `answer` is empty by design and the row stays.
    no_ref = code_dataset(tokenizer, source="json", data_files=path, cache_dir=_cache(tmp_path))
    assert [s["prompt"].count("Write") for s in no_ref] == [1, 1] and {s["answer"] for s in no_ref} == {""}
    with_ref = code_dataset(tokenizer, source="json", data_files=path, solution_column="ref",
                            cache_dir=_cache(tmp_path))
    assert [s["answer"] for s in with_ref] == ["def f(x): return x+1"]


def test_sft_null_answer_is_not_trained_as_none(tokenizer, tmp_path, caplog):
    rows = [{"question": "What is 2 + 3?", "answer": "5"}, {"question": "What is 1 + 1?", "answer": None}]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        ds = sft_dataset(tokenizer, source="json", data_files=path, cache_dir=_cache(tmp_path))
    assert len(ds) == 1 and "dropped 1 of 2 rows" in caplog.text
    with pytest.raises(ValueError, match=r"row 1 \(0-based\) .*sft\.jsonl.*'answer'"):
        sft_dataset(tokenizer, source="json", data_files=path, on_invalid_row="error", cache_dir=_cache(tmp_path))


def test_tool_sft_blank_question_is_dropped(tmp_path):
    tok = hf_tokenizer(asset_path("tiny_qwen2"))
    trace = [{"role": "assistant", "content": "The answer is 4."}]
    path = write_jsonl(tmp_path / "traces.jsonl", [{"question": "What is 2 + 2?", "messages": trace},
                                              {"question": None, "messages": trace}])
    ds = tool_sft_dataset(tok, source="json", data_files=path, system_prompt="", cache_dir=_cache(tmp_path))
    assert len(ds) == 1


def test_prompt_dataset_rows_every_row_invalid_and_bad_option(tokenizer):
    rows = [{"question": "q", "answer": float("nan")}, {"question": None, "answer": "1"}]
    with pytest.raises(ValueError, match="no rows left from rows: all 2 have an empty or null value"):
        PromptDataset(rows, tokenizer)
    with pytest.raises(ValueError, match="on_invalid_row must be one of"):
        PromptDataset(rows, tokenizer, on_invalid_row="skip")
    # 0 and "0" are answers, not blanks.
    ds = PromptDataset([{"question": "q", "answer": 0}, {"question": "r", "answer": "0"}], tokenizer)
    assert [s["answer"] for s in ds] == ["0", "0"]


# ----------------------------------------------------------------------------- item 6: unreadable files


def test_non_utf8_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "a", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    # Before: the load passed and the first read of row 1 raised a bare UnicodeDecodeError from pyarrow.
    # Line 1 is 33 bytes with its newline; the 0xe9 is byte 18 of line 2: offset 33 + 17 = 50.
    with pytest.raises(DataFileError, match=r"latin1\.jsonl, line 2: byte b'\\xe9' at byte offset 50 \(column 18"):
        load_rows("json", data_files=str(path), cache_dir=_cache(tmp_path))


def test_non_utf8_csv_names_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "quiz.csv"
    path.write_bytes(b"question,answer\nWhat is 1 + 1?,2\ncaf\xe9?,3\n")
    with pytest.raises(DataFileError, match=r"quiz\.csv, line 3: .*not valid UTF-8"):
        verifiable_dataset(tokenizer, source="csv", data_files=str(path), cache_dir=_cache(tmp_path))


def test_truncated_jsonl_line_names_file_and_line(tokenizer, tmp_path):
    good = tmp_path / "a.jsonl"
    write_jsonl(good, [{"question": "q", "answer": "1"}])
    cut = tmp_path / "b.jsonl"
    cut.write_text('{"question": "q", "answer": "1"}\n{"question": "r", "ans\n{"question": "s", "answer": "3"}\n',
                   encoding="utf-8")
    # Before: "ValueError: Expected object or value" / "Trailing data" without a file name.
    cut_line = r"b\.jsonl, line 2, column 19: not a valid JSON object \(Unterminated string"
    with pytest.raises(DataFileError, match=cut_line):
        gsm8k_dataset(tokenizer, source="json", data_files=[str(good), str(cut)], cache_dir=_cache(tmp_path))
    # The SFT builders read their files the same way.
    with pytest.raises(DataFileError, match=r"b\.jsonl, line 2, column 19"):
        sft_dataset(tokenizer, source="json", data_files=str(cut), cache_dir=_cache(tmp_path))


def test_broken_json_document_names_line(tmp_path):
    path = tmp_path / "doc.json"
    path.write_text('[{"question": "a", "answer": "1"},\n {"question": ]\n', encoding="utf-8")
    with pytest.raises(DataFileError, match=r"doc\.json, line 2, column 15: not valid JSON"):
        load_rows("json", data_files=str(path), cache_dir=_cache(tmp_path))


@pytest.mark.parametrize("name, builder", [("empty.jsonl", "json"), ("empty.csv", "csv")])
def test_empty_file_is_named(tmp_path, name, builder):
    path = tmp_path / name
    path.write_bytes(b"")
    # Before: a bare StopIteration (json) or "No columns to parse from file" (csv), neither naming the file.
    with pytest.raises(DataFileError, match=rf"data file .*{name} is empty"):
        load_rows(builder, data_files=str(path), cache_dir=_cache(tmp_path))


def test_blank_lines_only_file_is_named(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataFileError, match=r"blank\.jsonl holds only blank lines"):
        load_rows("json", data_files=str(path), cache_dir=_cache(tmp_path))


def test_missing_file_keeps_its_own_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_rows("json", data_files=str(tmp_path / "nowhere.jsonl"), cache_dir=_cache(tmp_path))
