"""run_episodes: turns, replies and action masks with a scripted engine and environment, every way an
episode can end, and the environment's errors."""

import torch

from tests.chat_templates import make_tokenizer_dir
from torchtune_grpo.generation import GenerationEngine, Rollout
from torchtune_grpo.models import hf_tokenizer
from torchtune_grpo.multiturn import Calculator, EnvReply, ToolEnvironment
from torchtune_grpo.multiturn.episodes import run_episodes
from torchtune_grpo.multiturn.turns import ChatTurns

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


class TextScript(GenerationEngine):
    """Each row's next turn is ``script(history_text, row_in_group)`` (text; ``None``: run out of tokens),
    encoded and closed with the end-of-turn token, with logprob -0.5 per token."""

    temperature = 1.0

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, model, prompts, *, group_size, max_new_tokens, pad_id, stop_tokens, generator=None,
                 temperature=None):
        self.calls.append((len(prompts), group_size, max_new_tokens))
        rows, truncated = [], []
        for p in prompts:
            history = self.tok.decode(p, skip_special_tokens=False)
            for j in range(group_size):
                text = self.script(history, j)
                ids = self.tok.encode_text("x" * (max_new_tokens + 5)) if text is None else (
                    self.tok.encode_text(text) + [self.tok.eot_id])
                rows.append(ids[:max_new_tokens])
                truncated.append(len(ids) > max_new_tokens)
        return Rollout([list(p) for p in prompts for _ in range(group_size)], rows, torch.tensor(truncated),
                       [[-0.5] * len(r) for r in rows])


def careful(history, j):
    """Row 0 calls the calculator then answers with its result; row 1 answers at once."""
    if j == 1 or "<tool_response>" in history:
        result = history.rsplit("<tool_response>\n", 1)[-1].split("\n", 1)[0] if "<tool_response>" in history else "7"
        return f"The answer is {result}."
    return "Let me use the tool. " + CALL % "6*7"


def setup(tmp_path, script, **kwargs):
    tok = hf_tokenizer(str(make_tokenizer_dir(tmp_path / "tok", "qwen2_5_tools")))
    env = kwargs.pop("env", None) or ToolEnvironment([Calculator()])
    turns = ChatTurns(tok, tools=[Calculator().schema()])
    prompt = turns.prompt_ids([{"role": "user", "content": "6*7?"}])
    engine = TextScript(tok, script)
    fields = kwargs.pop("fields", [{"answer": "42"}])
    args = dict(env=env, turns=turns, tokenizer=tok, group_size=2, max_new_tokens=200, max_turns=4)
    args.update(kwargs)
    return tok, engine, prompt, run_episodes(engine, None, [prompt] * len(fields), fields, **args)


def test_tool_episode_and_direct_answer(tmp_path):
    tok, engine, prompt, ep = setup(tmp_path, careful)
    assert engine.calls[0][:2] == (1, 2)  # the first turn samples the group from the shared prompt
    assert engine.calls[1][:2] == (1, 1)  # then only the live episode continues, one row
    assert ep.turns == [2, 1] and ep.final_answers() == ["The answer is 42.", "The answer is 7."]
    assert ep.truncated.tolist() == [False, False] and ep.env_errors == ["", ""]
    assert ep.info == [{"tool_calls": 1.0, "tool_errors": 0.0}, {"tool_calls": 0.0, "tool_errors": 0.0}]
    assert [m["role"] for m in ep.messages[0]] == ["assistant", "tool", "assistant"]
    assert ep.messages[0][1]["content"] == "42"
    # the sampled tokens are actions, the reply is context; logprobs follow the tokens (0 on context)
    ids, mask = ep.response_ids[0], ep.action_mask[0]
    assert len(ids) == len(mask) == len(ep.logprobs[0])
    actions = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    context = tok.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=False)
    assert actions == "Let me use the tool. " + CALL % "6*7" + "<|im_end|>The answer is 42.<|im_end|>"
    assert context == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert [lp for lp, m in zip(ep.logprobs[0], mask) if not m] == [0.0] * mask.count(0)
    assert set(lp for lp, m in zip(ep.logprobs[0], mask) if m) == {-0.5}
    assert ep.action_mask[1] == [1] * len(ep.response_ids[1])


def test_max_turns_and_budget_end_episodes_as_truncated(tmp_path):
    always_call = lambda history, j: CALL % "1+1"
    _, _, _, ep = setup(tmp_path, always_call, max_turns=3)
    assert ep.turns == [3, 3] and ep.truncated.tolist() == [True, True]
    # two replies between three turns; the last turn's tool call is not answered
    assert [m["role"] for m in ep.messages[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    _, engine, _, ep = setup(tmp_path, always_call, max_turns=10, max_new_tokens=60)
    assert all(len(ids) <= 60 for ids in ep.response_ids) and ep.truncated.tolist() == [True, True]
    assert all(n < 10 for n in ep.turns)
    assert all(mt <= 60 for _, _, mt in engine.calls)


def test_running_out_of_tokens_mid_turn(tmp_path):
    _, _, _, ep = setup(tmp_path, lambda h, j: None, max_new_tokens=30)
    assert ep.turns == [1, 1] and ep.truncated.tolist() == [True, True]
    assert [len(r) for r in ep.response_ids] == [30, 30] and ep.action_mask[0] == [1] * 30


class Broken:
    """The second prompt's episode never starts; the first one's raises on its first step."""

    def start(self, fields):
        if fields["id"] == 1:
            raise ConnectionError("sandbox down")
        return {}

    def step(self, state, message):
        raise RuntimeError("tool crashed")


def test_environment_errors_end_episodes(tmp_path):
    _, _, _, ep = setup(tmp_path, careful, env=Broken(), fields=[{"id": 0}, {"id": 1}], group_size=1)
    assert ep.env_errors == ["exception: RuntimeError: tool crashed", "exception: ConnectionError: sandbox down"]
    assert ep.turns == [1, 0] and ep.response_ids[1] == [] and ep.truncated.tolist() == [False, False]


def test_episode_done_by_environment(tmp_path):
    class OneShot:
        def start(self, fields):
            return {}

        def step(self, state, message):
            return EnvReply([], True, {"graded": 1})

    _, engine, _, ep = setup(tmp_path, careful, env=OneShot())
    assert ep.turns == [1, 1] and len(engine.calls) == 1 and ep.info == [{"graded": 1.0}] * 2


# ------------------------------------------------------------------------------- sample_and_score


def test_sample_and_score_episodes(tmp_path):
    """Rewards score the final answer and see the conversation; a failed episode gets the fallback; the
    action masks travel with their rows through select and concat."""
    from torchtune_grpo.data import PromptBatch
    from torchtune_grpo.multiturn import MultiTurn
    from torchtune_grpo.rewards import RewardSet
    from torchtune_grpo.rollouts.groups import RolloutGroups, sample_and_score

    tok = hf_tokenizer(str(make_tokenizer_dir(tmp_path / "tok", "qwen2_5_tools")))

    class FailsOnSeven(ToolEnvironment):
        def step(self, state, message):
            if state["fields"]["answer"] == "7" and "<tool_call>" in message["content"]:
                raise TimeoutError("tool server gone")
            return super().step(state, message)

    multi_turn = MultiTurn(FailsOnSeven([Calculator()]), max_turns=3, env_timeout=5)
    turns = multi_turn.turns_for(tok)
    assert isinstance(turns, ChatTurns) and turns.tools == [Calculator().schema()]
    prompts = [turns.prompt_ids([{"role": "user", "content": q}]) for q in ("6*7?", "3+4?")]
    batch = PromptBatch(tokens=prompts, prompts=["6*7?", "3+4?"], fields=[{"answer": "42"}, {"answer": "7"}])

    def correct(b):
        return [float(c.endswith(f["answer"] + ".")) for c, f in zip(b.completions, b.fields)]

    def used_tool(b):
        return [float(any(m["role"] == "tool" for m in f["conversation"])) for f in b.fields]

    rewards = RewardSet([correct, used_tool], weights=[1.0, 0.5], names=["correct", "used_tool"], fallback=-1.0)
    out = sample_and_score(None, tok, TextScript(tok, careful), batch, rewards, group_size=2, max_new_tokens=200,
                           multi_turn=multi_turn)
    # prompt 0: row 0 uses the tool and answers 42 (1 + 0.5); row 1 guesses 7 (0).
    # prompt 1: row 2 calls the tool and the environment fails (fallback -1); row 3 guesses 7, right (1).
    assert out.rewards.tolist() == [1.5, 0.0, -1.0, 1.0]
    # Each component scores the failed episode with its fallback too: GDPO's advantage signal and the
    # reward/<name>/mean metrics read the components, not the total.
    assert out.per_component["correct"].tolist() == [1.0, 0.0, -1.0, 1.0]
    assert out.per_component["used_tool"].tolist() == [1.0, 0.0, -1.0, 0.0]
    assert out.errors["environment"] == 1
    assert [i["turns"] for i in out.episode_info] == [2.0, 1.0, 1.0, 1.0]
    assert [i["env_error"] for i in out.episode_info] == [0.0, 0.0, 1.0, 0.0]
    assert out.episode_info[0]["tool_calls"] == 1.0 and out.episode_info[0]["injected_tokens"] > 0
    assert out.action_mask[1] == [1] * len(out.response_ids[1])
    assert "<tool_response>" in out.completions[0]  # the whole episode, for logs
    picked = RolloutGroups.concat([out.select([1]), out.select([0])])
    assert picked.action_mask == out.action_mask[2:] + out.action_mask[:2]
    assert picked.conversations == out.conversations[2:] + out.conversations[:2]
