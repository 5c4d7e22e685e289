"""Multi-turn token layout: the prompt, the model's sampled turns and the environment's replies, appended
without re-tokenizing, give exactly the ids transformers' chat template gives the whole conversation."""


import pytest

from tests.chat_templates import make_tokenizer_dir
from torchtune_grpo.models import hf_tokenizer
from torchtune_grpo.multiturn import Calculator
from torchtune_grpo.multiturn.turns import ChatTurns, PlainTurns

TOOLS = [Calculator().schema()]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'


def _episode(directory, style, system):
    """(our ids, transformers' ids, action mask) of a two-call episode."""
    from transformers import AutoTokenizer

    tok = hf_tokenizer(str(make_tokenizer_dir(directory, style)))
    turns = ChatTurns(tok, tools=TOOLS if style == "qwen2_5_tools" else None)
    head = [{"role": "system", "content": "Use tools."}] if system else []
    messages = head + [{"role": "user", "content": "What is 17*23, then plus 1?"}]
    model_turns = [f"Let me compute. {CALL}", CALL.replace("17*23", "391+1"), "The answer is 392."]
    replies = [[{"role": "tool", "content": "391"}], [{"role": "tool", "content": "392"}]]
    ids = turns.prompt_ids(messages)
    mask = [0] * len(ids)
    conversation = list(messages)
    for i, text in enumerate(model_turns):
        sampled = tok.encode_text(text) + [tok.eot_id]  # what the model would sample, its stop token last
        ids += sampled
        mask += [1] * len(sampled)
        conversation.append({"role": "assistant", "content": text})
        if i < len(replies):
            reply = turns.reply_ids(replies[i])
            ids += reply
            mask += [0] * len(reply)
            conversation += replies[i]
    hf = AutoTokenizer.from_pretrained(str(directory))
    kwargs = {"tools": TOOLS} if style == "qwen2_5_tools" else {}
    out = hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=False, **kwargs)
    reference = list(out["input_ids"] if hasattr(out, "keys") else out)
    return tok, ids, reference, mask


@pytest.mark.parametrize("style", ["qwen2_5_tools", "qwen2_5", "smollm2"])
@pytest.mark.parametrize("system", [True, False])
def test_episode_ids_equal_transformers_whole_conversation(style, system, tmp_path):
    tok, ids, reference, mask = _episode(tmp_path / style, style, system)
    # the rendered conversation ends with "<|im_end|>\n": ours stops at the model's last end-of-turn token
    assert reference[: len(ids)] == ids
    assert tok.decode(reference[len(ids):], skip_special_tokens=False) == "\n"


def test_action_mask_covers_exactly_the_models_tokens(tmp_path):
    tok, ids, _, mask = _episode(tmp_path / "t", "qwen2_5_tools", True)
    text_of = lambda keep: tok.decode([t for t, m in zip(ids, mask) if m == keep], skip_special_tokens=False)
    actions = text_of(1)
    assert actions.count("<tool_call>") == 2 and actions.endswith("The answer is 392.<|im_end|>")
    assert "<tool_response>" not in actions and "<|im_start|>" not in actions
    context = text_of(0)
    assert context.count("<tool_response>") == 2 and "# Tools" in context and '"name": "calculator"' in context
    assert "The answer" not in context


def test_qwen_tool_reply_text(tmp_path):
    tok = hf_tokenizer(str(make_tokenizer_dir(tmp_path, "qwen2_5_tools")))
    two = ChatTurns(tok, TOOLS).reply_ids([{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}])
    # consecutive tool results share one user turn; the next assistant header follows
    assert tok.decode(two, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_turns_need_an_end_of_turn_token(tmp_path):
    tok = hf_tokenizer(str(make_tokenizer_dir(tmp_path, "base")))
    with pytest.raises(ValueError, match="end-of-turn token"):
        ChatTurns(tok)


def test_plain_turns(tmp_path):
    tok = hf_tokenizer(str(make_tokenizer_dir(tmp_path, "base")))
    ids = PlainTurns(tok).reply_ids([{"role": "tool", "content": "391"}, {"role": "user", "content": "Go on."}])
    assert tok.decode(ids) == "\n<tool_response>\n391\n</tool_response>\nGo on.\n"


def test_tokenizer_tools_render_into_dataset_prompts(tmp_path):
    """With ``tools`` set (as the recipe does from the environment), the chat prompts datasets build list
    them, as transformers renders ``tools=``."""
    from transformers import AutoTokenizer

    from torchtune_grpo.data import PromptDataset

    directory = make_tokenizer_dir(tmp_path, "qwen2_5_tools")
    tok = hf_tokenizer(str(directory))
    tok.tools = TOOLS
    ds = PromptDataset([{"question": "6*7?", "answer": "42"}], tok, formatter="chat", system_prompt="Be brief.",
                       max_prompt_length=None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6*7?"}]
    out = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    assert ds[0]["tokens"] == list(out["input_ids"] if hasattr(out, "keys") else out)
    assert "# Tools" in tok.decode(ds[0]["tokens"], skip_special_tokens=False)
