"""HFTokenizer: chat prompts with the same token ids as transformers' apply_chat_template, for several real
template styles, and the torchtune-tokenizer interface the datasets and engines use."""

import pytest
from torchtune.data import Message

from tests.chat_templates import make_tokenizer_dir
from torchtune_grpo.data import ChatPrompt, PromptDataset, R1_SYSTEM_PROMPT
from torchtune_grpo.models import ChatTemplateError, HFTokenizer, hf_tokenizer

STYLES = ["qwen2_5", "smollm2", "qwen3", "llama3_2", "zephyr"]
QUESTION = "  Natalia sold 48 clips in April, and half as many in May. How many altogether? Ünïcode ✓ \n"


def _hf(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _hf_ids(hf, messages, **kwargs):
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


CONVERSATIONS = {
    "user only": [{"role": "user", "content": QUESTION}],
    "system + user": [{"role": "system", "content": " Think step by step. "}, {"role": "user", "content": QUESTION}],
    "multi-turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n2"},
        {"role": "user", "content": QUESTION},
    ],
}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_chat_ids_equal_transformers(style, conversation, tmp_path):
    directory = make_tokenizer_dir(tmp_path / style, style)
    messages = CONVERSATIONS[conversation]
    ours = hf_tokenizer(str(directory)).apply_chat_template(messages)
    assert ours == _hf_ids(_hf(directory), messages)
    assert len(ours) > 20


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_qwen3_thinking_switch_equals_transformers(enable_thinking, tmp_path):
    directory = make_tokenizer_dir(tmp_path / "qwen3", "qwen3")
    messages = CONVERSATIONS["system + user"]
    tok = hf_tokenizer(str(directory), enable_thinking=enable_thinking)
    ids = tok.apply_chat_template(messages)
    assert ids == _hf_ids(_hf(directory), messages, enable_thinking=enable_thinking)
    # Off: the prompt already holds an empty reasoning block; on (the template's default): it does not.
    assert tok.decode(ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n" if not enable_thinking else "<|im_start|>assistant\n"
    )
    assert ids == (hf_tokenizer(str(directory)).apply_chat_template(messages) if enable_thinking else ids)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("system_prompt", [None, ""])
def test_chat_prompt_dataset_path(style, system_prompt, tmp_path):
    # prompt_style: chat through the dataset code (ChatPrompt -> tokenize_messages), with the default R1
    # system message and with none.
    directory = make_tokenizer_dir(tmp_path / style, style)
    tok = hf_tokenizer(str(directory))
    tokens, text = ChatPrompt(system_prompt=system_prompt)(tok, QUESTION)
    messages = ([{"role": "system", "content": R1_SYSTEM_PROMPT}] if system_prompt is None else [])
    messages.append({"role": "user", "content": QUESTION})
    hf = _hf(directory)
    assert tokens == _hf_ids(hf, messages)
    assert text == hf.decode(tokens, skip_special_tokens=False)

    rows = [{"question": QUESTION, "answer": "72"}]
    dataset = PromptDataset(rows, tok, formatter="chat", max_prompt_length=None, system_prompt=system_prompt)
    assert dataset[0]["tokens"] == tokens


def test_stop_tokens_pad_and_eot(tmp_path):
    qwen = hf_tokenizer(str(make_tokenizer_dir(tmp_path / "q", "qwen3")))
    # tiny_qwen2 ids: <|endoftext|> 480, <|im_start|> 481, <|im_end|> 482
    assert (qwen.eos_id, qwen.eot_id, qwen.pad_id, qwen.bos_id) == (482, 482, 480, None)
    assert qwen.stop_tokens == [480, 482]  # generation_config's list: <|im_end|>, <|endoftext|>

    llama = hf_tokenizer(str(make_tokenizer_dir(tmp_path / "l", "llama3_2")))
    ids = {t: llama._tok.token_to_id(t) for t in ("<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>")}
    assert llama.bos_id == ids["<|begin_of_text|>"]
    assert llama.eot_id == llama.eos_id == ids["<|eot_id|>"]
    assert llama.pad_id == llama.eos_id  # no pad_token: eos fills padding (always masked)
    assert llama.stop_tokens == sorted({480, ids["<|eom_id|>"], ids["<|eot_id|>"]})

    base = hf_tokenizer(str(make_tokenizer_dir(tmp_path / "b", "base")))
    assert base.eot_id is None and base.stop_tokens == [480] and base.eos_id == 480


@pytest.mark.parametrize("style", ["llama3_2", "qwen2_5", "smollm2"])
def test_encode_decode_match_transformers(style, tmp_path):
    # add_bos adds BOS exactly when the model's own tokenizer does (Llama 3 yes; Qwen and SmolLM2 no).
    directory = make_tokenizer_dir(tmp_path / style, style)
    tok, hf = hf_tokenizer(str(directory)), _hf(directory)
    text = "User: what is 3 + 4?\nAssistant: <think>"
    assert tok.encode(text, add_bos=True, add_eos=False) == hf(text)["input_ids"]
    assert tok.encode(text, add_bos=False, add_eos=False) == hf(text, add_special_tokens=False)["input_ids"]
    assert tok.encode(text, add_bos=False, add_eos=True)[-1] == tok.eos_id
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_no_chat_template_is_a_clear_error(tmp_path):
    tok = hf_tokenizer(str(make_tokenizer_dir(tmp_path / "b", "base")))
    with pytest.raises(ChatTemplateError, match="no chat template .*prompt_style: chat"):
        PromptDataset([{"question": "q", "answer": "a"}], tok, formatter="chat")
    # raw prompts still work
    assert PromptDataset([{"question": "q", "answer": "a"}], tok, formatter="r1")[0]["tokens"]


def test_template_exception_and_bad_conversation(tmp_path):
    tok = hf_tokenizer(str(make_tokenizer_dir(tmp_path / "l", "llama3_2")))
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles .* got tool"):
        tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])
    with pytest.raises(ValueError, match="empty assistant message"):
        tok.tokenize_messages([Message(role="user", content="x")])


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTokenizer(str(tmp_path))
