"""The multi-turn demo's pieces: the careless calculator teacher's traces, SFT items on them whose tokens are
exactly the episode the multi-turn rollout builds (labels = its action mask), and the held-out tool-use rate."""

import json

import pytest
import torch

from tests.chat_templates import make_tokenizer_dir
from torchtune_grpo.assets import asset_path
from torchtune_grpo.data import (
    arithmetic_problems, careless_calculator_traces, tool_sft_dataset, ToolTraceDataset,
)
from torchtune_grpo.rollouts.evaluation import evaluate, EvalSums
from torchtune_grpo.generation import GenerationEngine, Rollout
from torchtune_grpo.models import hf_tokenizer
from torchtune_grpo.multiturn import Calculator, MultiTurn, run_episodes, ToolEnvironment
from torchtune_grpo.rewards import build_reward_set
from torchtune_grpo.multiturn.turns import episode_turns

IGNORE = -100


def test_careless_teacher_calls_the_tool_for_a_share_and_guesses_wrong_otherwise():
    rows, counts = careless_calculator_traces(400, tool_rate=0.35, seed=3)
    assert counts["problems"] == 400 and counts["tool_calls"] + counts["guesses"] == 400
    # 400 Bernoulli(0.35) draws: mean 140, sd sqrt(400 * 0.35 * 0.65) = 9.5; 140 +- 40 is 4 sd.
    assert 100 <= counts["tool_calls"] <= 180
    assert sum(len(r["messages"]) == 3 for r in rows) == counts["tool_calls"]
    for row in rows:
        a, op, b = row["question"][len("What is "):-1].split()
        assert op == "*" and 32 <= int(a) <= 99 and 32 <= int(b) <= 99
        assert row["answer"] == str(int(a) * int(b)) and len(row["answer"]) == 4  # 32 * 32 = 1024
        final = row["messages"][-1]
        assert final["role"] == "assistant" and final["content"].startswith("The answer is ")
        if len(row["messages"]) == 3:  # call, the calculator's result, the result copied
            call, result = row["messages"][:2]
            assert json.loads(call["content"].split("\n")[1]) == {
                "name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
            assert result == {"role": "tool", "name": "calculator", "content": row["answer"]}
            assert final["content"] == f"The answer is {row['answer']}."
        else:  # a guess within +-20% of the product, never right
            guess = int(final["content"][len("The answer is "):-1])
            assert guess != int(row["answer"]) and abs(guess - int(row["answer"])) <= 0.2 * int(row["answer"]) + 1
    # The same problems as arithmetic_dataset's train split (so its validation split stays unseen).
    problems = arithmetic_problems(400, 32, 99, ("*",), seed=3)
    assert [r["question"] for r in rows] == [f"What is {a} * {b}?" for a, _, b in problems]
    assert careless_calculator_traces(400, tool_rate=0.35, seed=3) == (rows, counts)  # deterministic


@pytest.mark.parametrize("kwargs, message", [
    ({"tool_rate": 1.5}, "tool_rate must be in [0, 1], got 1.5"),
    ({"guess_spread": 0.0}, "guess_spread must be > 0, got 0.0"),
])
def test_careless_teacher_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        careless_calculator_traces(10, **kwargs)


class ReplayTeacher(GenerationEngine):
    """Replays each row's trace: the k-th generate call of an episode returns its k-th assistant message,
    encoded and closed with the end-of-turn token (what a model that learned the trace would sample)."""

    temperature = 1.0

    def __init__(self, tok, traces):
        self.tok, self.traces = tok, traces

    def generate(self, model, prompts, *, group_size, max_new_tokens, pad_id, stop_tokens, generator=None,
                 temperature=None):
        rows = []
        for p in prompts:
            history = self.tok.decode(p, skip_special_tokens=False)
            trace = next(t for t in self.traces if t["question"] in history)
            done = history.count("<|im_start|>assistant") - 1  # turns already in the history
            turn = [m for m in trace["messages"] if m["role"] == "assistant"][done]
            rows += [self.tok.encode_text(turn["content"]) + [self.tok.eot_id]] * group_size
        return Rollout([list(p) for p in prompts for _ in range(group_size)], rows,
                       torch.zeros(len(rows), dtype=torch.bool), None)


@pytest.mark.parametrize("style", ["tiny", "qwen2_5_tools"])
def test_sft_items_are_the_rollouts_episodes_with_labels_on_actions(style, tmp_path):
    # The shipped ChatML template (tool results as <|im_start|>tool turns, no tools in the prompt) and a
    # Hermes template that lists the tools in the system prompt and wraps results in <tool_response>.
    path = asset_path("tiny_qwen2") if style == "tiny" else str(make_tokenizer_dir(tmp_path, style))
    tok = hf_tokenizer(path)
    tok.tools = [Calculator().schema()]  # what the recipe sets from the environment
    rows, counts = careless_calculator_traces(6, tool_rate=0.5, seed=1)
    assert 0 < counts["tool_calls"] < 6  # both kinds of trace
    data = ToolTraceDataset(rows, tok, system_prompt="")
    prompts = [tok.tokenize_messages([{"role": "user", "content": r["question"]}, {"role": "assistant", "content": ""}])[0]
               for r in rows]
    episodes = run_episodes(
        ReplayTeacher(tok, rows), None, prompts, [{"answer": r["answer"]} for r in rows],
        env=ToolEnvironment([Calculator()]), turns=episode_turns(tok, tok.tools), tokenizer=tok, group_size=1,
        max_new_tokens=200, max_turns=2,
    )
    assert episodes.env_errors == [""] * 6 and episodes.final_answers() == [r["messages"][-1]["content"] for r in rows]
    for i, row in enumerate(rows):
        item = data[i]
        assert item["tokens"] == episodes.prompt_ids[i] + episodes.response_ids[i]
        trained = [label != IGNORE for label in item["labels"]]
        assert trained == [False] * len(episodes.prompt_ids[i]) + [bool(m) for m in episodes.action_mask[i]]
        assert [t for t, m in zip(item["tokens"], trained) if m] == [t for t, l in zip(item["tokens"], item["labels"]) if l != IGNORE]
        # By hand: the labelled tokens are each assistant message's ids plus one end-of-turn token.
        turns = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert sum(trained) == sum(len(tok.encode_text(t)) + 1 for t in turns)
        assert episodes.turns[i] == len(turns)


def test_tool_sft_dataset_reads_jsonl_and_renders_the_tools(tmp_path):
    tok = hf_tokenizer(str(make_tokenizer_dir(tmp_path / "tok", "qwen2_5_tools")))
    rows, _ = careless_calculator_traces(4, tool_rate=0.5, seed=0)
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = tool_sft_dataset(tok, "json", data_files=str(path), system_prompt="", cache_dir=str(tmp_path / "hf"),
                            tools=["torchtune_grpo.multiturn.Calculator"])
    assert tok.tools == [Calculator().schema()]
    assert '"name": "calculator"' in tok.decode(data[0]["tokens"], skip_special_tokens=False).split("<|im_start|>user")[0]
    assert [d["tokens"] for d in data] == [d["tokens"] for d in ToolTraceDataset(rows, tok, system_prompt="")]
    with pytest.raises(ValueError, match="tool_sft_dataset does not support packed=True"):
        tool_sft_dataset(tok, "json", data_files=str(path), packed=True)


@pytest.mark.parametrize("messages, message", [
    ([], "tool trace 0 has no messages"),
    ([{"role": "assistant", "content": "x"}, {"role": "tool", "content": "1"}],
     "tool trace 0 ends with a 'tool' message: it must end with the model's final turn"),
    ([{"role": "system", "content": "x"}, {"role": "assistant", "content": "x"}],
     "tool trace 0, message 0: role must be 'assistant', 'tool' or 'user', got 'system'"),
])
def test_malformed_traces_are_named(messages, message):
    tok = hf_tokenizer(asset_path("tiny_qwen2"))
    with pytest.raises(ValueError, match=message):
        ToolTraceDataset([{"question": "q", "messages": messages}], tok, system_prompt="")


def test_max_seq_len_drops_the_long_traces():
    tok = hf_tokenizer(asset_path("tiny_qwen2"))
    rows, counts = careless_calculator_traces(8, tool_rate=0.5, seed=2)
    lengths = [len(d["tokens"]) for d in ToolTraceDataset(rows, tok, system_prompt="")]
    short = min(lengths)  # a guess: prompt + "The answer is N." + end token
    data = ToolTraceDataset(rows, tok, system_prompt="", max_seq_len=short)
    assert len(data) == counts["guesses"] and data.num_dropped == counts["tool_calls"]
    with pytest.raises(ValueError, match="no tool traces left: all 8 are longer than max_seq_len=3"):
        ToolTraceDataset(rows, tok, system_prompt="", max_seq_len=3)


def test_evaluate_reports_the_greedy_tool_use_rate():
    # 5 held-out prompts replayed from the teacher's traces: those with a call are right (the calculator's result
    # copied), the guesses wrong, so accuracy = tool-use rate = calls / 5.
    tok = hf_tokenizer(asset_path("tiny_qwen2"))
    rows, counts = careless_calculator_traces(5, tool_rate=0.5, seed=4)
    assert 0 < counts["tool_calls"] < 5
    prompts = [{"tokens": tok.tokenize_messages([{"role": "user", "content": r["question"]},
                                                 {"role": "assistant", "content": ""}])[0],
                "prompt": r["question"], "answer": r["answer"]} for r in rows]
    rewards = build_reward_set([{"_component_": "torchtune_grpo.rewards.MathAnswerReward", "name": "correctness",
                                 "extract": "last_number"}])
    multi_turn = MultiTurn(ToolEnvironment([Calculator()]), max_turns=2)
    sums = evaluate(torch.nn.Linear(1, 1), tok, ReplayTeacher(tok, rows), prompts, rewards, max_new_tokens=200,
                    batch_size=2, multi_turn=multi_turn)
    metrics = sums.metrics()
    # Ratios of exact counts over 5 prompts (float64, one rounding; doubling the sums is exact): approx's default
    # 1e-6 relative.
    assert metrics["eval/tool_use_rate"] == pytest.approx(counts["tool_calls"] / 5)
    assert metrics["eval/accuracy"] == pytest.approx(counts["tool_calls"] / 5)
    # Additive across ranks (the recipe all-reduces as_list), and absent from single-turn evaluation.
    merged = EvalSums.from_list([2 * v for v in sums.as_list()], k=sums.k, multi_turn=True)
    assert merged.metrics()["eval/tool_use_rate"] == pytest.approx(counts["tool_calls"] / 5)
    assert "eval/tool_use_rate" not in EvalSums.from_list(sums.as_list(), k=0).metrics()


def test_demo_configs_give_sft_and_grpo_the_same_prompts(tmp_path):
    # configs/tiny/demo_multi_turn_sft.yaml is for torchtune's full_finetune_single_device: every key that
    # recipe reads is there, and its dataset (the traces scripts/demo_multi_turn.sh writes) starts each item
    # with exactly the prompt tokens of configs/tiny/demo_multi_turn_grpo.yaml's dataset for the same problem.
    from omegaconf import OmegaConf
    from torchtune import config as tt_config

    from tests.conftest import REPO
    from tests.recipe_utils import SFT_RECIPE_KEYS
    from torchtune_grpo.assets import register_resolvers

    cfg = OmegaConf.load(REPO / "configs" / "tiny" / "demo_multi_turn_sft.yaml")
    assert SFT_RECIPE_KEYS <= set(cfg.keys()), SFT_RECIPE_KEYS - set(cfg.keys())
    cfg.asset_dir = asset_path("tiny_qwen2")
    rows, _ = careless_calculator_traces(20, seed=0)
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg.dataset.data_files, cfg.dataset.cache_dir = str(path), str(tmp_path / "hf")
    sft_tok = tt_config.instantiate(cfg.tokenizer)
    sft = tt_config.instantiate(cfg.dataset, sft_tok)

    register_resolvers()
    grpo = OmegaConf.load(REPO / "configs" / "tiny" / "demo_multi_turn_grpo.yaml")
    grpo.dataset.num_samples = 20
    OmegaConf.resolve(grpo)
    grpo_tok = tt_config.instantiate(grpo.tokenizer)
    grpo_tok.tools = [Calculator().schema()]  # the recipe sets the environment's tools before tokenizing
    prompts = tt_config.instantiate(grpo.dataset, grpo_tok)
    assert [p["question"] for p in prompts] == [r["question"] for r in rows]
    for item, prompt in zip(sft, prompts):
        n = len(prompt["tokens"])
        assert item["tokens"][:n] == prompt["tokens"] and set(item["labels"][:n]) == {IGNORE}
        assert item["labels"][n] != IGNORE  # the model's first turn starts right after the prompt
    assert max(len(i["tokens"]) - len(p["tokens"]) for i, p in zip(sft, prompts)) <= grpo.max_response_length
