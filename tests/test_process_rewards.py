"""Step-level rewards (torchtune_grpo/rewards/_steps.py, _prm.py): step boundaries as token positions, the
Python step scorer, RewardSet's steps and fallbacks, a PRM run locally (token-classification and causal-LM
conventions, tiny transformers models built here) and over HTTP (timeout, retries, fallback)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from tests.tolerances import ulps
from torchtune_grpo.rewards import (
    HTTPStepReward,
    PRMStepReward,
    PythonStepReward,
    RewardBatch,
    RewardOutputError,
    RewardSet,
    StepSplitter,
    Steps,
    token_offsets,
)

WORKED = " 8+7=15,5+6+1=12 </think> <answer> 125 </answer>"


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _batch(tokenizer, completions, prompt="What is 58 + 67?", fields=None):
    ids = [tokenizer.encode(c, add_bos=False, add_eos=False) for c in completions]
    texts = [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    offsets = [token_offsets(_decode(tokenizer), i, t) for i, t in zip(ids, texts)]
    n = len(completions)
    return RewardBatch([prompt] * n, texts, ids, [dict(fields or {"answer": "125"})] * n, offsets)


def test_separator_steps_end_at_the_token_holding_the_separator(tokenizer):
    batch = _batch(tokenizer, [WORKED])
    ids, offsets = batch.completion_ids[0], batch.token_offsets[0]
    spans = StepSplitter(",")(batch.completions[0], ids, offsets)
    assert [s.text for s in spans] == ["8+7=15", "5+6+1=12 </think> <answer> 125 </answer>"]
    first = spans[0].end
    # The first step's last token is the one that completes the ","; the last step ends at the last token.
    assert tokenizer.decode(ids[: first + 1]).endswith(",") and "," not in tokenizer.decode(ids[:first])
    assert spans[-1].end == len(ids) - 1


def test_whitespace_steps_join_and_the_last_step_takes_the_trailing_tokens(tokenizer):
    text = "\n\nfirst\n\n\n\nsecond\n\n  "
    batch = _batch(tokenizer, [text])
    spans = StepSplitter()(batch.completions[0], batch.completion_ids[0], batch.token_offsets[0])
    assert [s.text for s in spans] == ["first", "second"]
    assert spans[-1].end == len(batch.completion_ids[0]) - 1 and spans[0].end < spans[1].end
    # A function decides the boundaries instead: every third token, the last step stretched to the end.
    every3 = StepSplitter(function=lambda text, ids, offsets: list(range(2, len(ids) - 1, 3)))
    spans = every3(batch.completions[0], batch.completion_ids[0], batch.token_offsets[0])
    assert [s.end for s in spans] == list(range(2, len(batch.completion_ids[0]) - 1, 3)) + [len(batch.completion_ids[0]) - 1]
    with pytest.raises(ValueError, match="token offsets"):
        StepSplitter()("a", [1, 2], None)
    with pytest.raises(ValueError, match="unknown keys"):
        StepSplitter.build({"sep": ","})


def carry_checker(step, index, previous):
    """Scores a column step ``a+b(+c)=d``: 1 when the sum is right and the carry is the previous column's."""
    left, right = step.split()[0].split("=")
    terms = [int(x) for x in left.split("+")]
    carry_in = 0 if not previous else int(previous[-1].split("=")[1]) // 10
    if index > 0 and terms[-1] != carry_in:
        return 0.0
    return float(sum(terms) == int(right))


def test_python_step_reward_in_a_reward_set(tokenizer):
    # Sound, careless (carry dropped: step 2 wrong), and unparseable (the function raises: fallback -1, one step
    # over the whole completion, counted as an error). aggregate=min is the completion's number in the total.
    careless = " 8+7=15,5+6+0=11 </think> <answer> 115 </answer>"
    batch = _batch(tokenizer, [WORKED, careless, " no steps here"])
    steps = PythonStepReward(carry_checker, steps={"separator": ","}, aggregate="min")
    rs = RewardSet([steps], weights=[0.5], fallbacks=[-1.0])
    out = rs(batch)
    assert rs.step_component == out.step_component == "carry_checker"
    assert [s.scores for s in out.steps] == [[1.0, 1.0], [1.0, 0.0], [-1.0]]
    assert out.steps[2].ends == [len(batch.completion_ids[2]) - 1]
    assert out.per_component["carry_checker"].tolist() == [1.0, 0.0, -1.0]
    assert out.total.tolist() == [0.5, 0.0, -0.5] and out.errors == {"carry_checker": 1}
    # Per sample (timeout set): the same steps.
    per_sample = RewardSet([steps], weights=[0.5], fallbacks=[-1.0], timeouts=[10.0])(batch)
    assert per_sample.steps == out.steps


def test_step_outputs_are_checked_and_one_step_component_per_set(tokenizer):
    batch = _batch(tokenizer, [WORKED])

    class Bad:
        step_level = True
        name = "bad"

        def __call__(self, b):
            return [Steps([1.0, 0.5], [3, 3])]

    with pytest.raises(RewardOutputError, match="'bad' returned step ends \\[3, 3\\] at index 0"):
        RewardSet([Bad()], weights=[1.0])(batch)
    with pytest.raises(ValueError, match="at most one step-level reward"):
        RewardSet([PythonStepReward(carry_checker), PythonStepReward(carry_checker, name="other")], weights=[1, 1])


# ---- a PRM built in code: the tiny BPE plus the Qwen2.5-Math-PRM step tag, a 2-layer Qwen2 with peaked attention


@pytest.fixture(scope="module")
def prm_dirs(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    from tests.chat_templates import make_tokenizer_dir
    from tests.hf_models import randomize

    root = tmp_path_factory.mktemp("prm")
    dirs = {}
    for head, cls in (("token_classification", AutoModelForTokenClassification), ("causal_lm", AutoModelForCausalLM)):
        d = make_tokenizer_dir(root / head, "qwen2_5")
        tok = AutoTokenizer.from_pretrained(d)
        tok.add_special_tokens({"additional_special_tokens": ["<extra_0>"]})
        tok.save_pretrained(d)
        config = AutoConfig.for_model("qwen2", vocab_size=512, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      num_labels=2, pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        model = randomize(cls.from_config(config), seed=1)
        with torch.no_grad():  # peaked attention: random small weights attend almost uniformly
            for name, p in model.named_parameters():
                if "q_proj.weight" in name or "k_proj.weight" in name:
                    p.mul_(12.0)
        model.save_pretrained(d)
        dirs[head] = d
    return dirs


def _by_hand(directory, head, text, class_ids=None):
    """The PRM's step probabilities for one input, alone (no padding), read at the tag tokens."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    cls = AutoModelForTokenClassification if head == "token_classification" else AutoModelForCausalLM
    model = cls.from_pretrained(directory).eval()
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    at = logits[ids[0] == tok.convert_tokens_to_ids("<extra_0>")]
    probs = torch.softmax(at[:, class_ids], -1)[:, 0] if class_ids else torch.softmax(at, -1)[:, 1]
    return probs, logits


@pytest.mark.parametrize("head", ["token_classification", "causal_lm"])
def test_local_prm_reads_each_step_at_its_tag(head, prm_dirs, tokenizer):
    # Three completions of 2, 3 and 1 steps scored in one right-padded batch, against each input run alone
    # (the Qwen2.5-Math-PRM convention: positive class at <extra_0>; Math-Shepherd's: P(+) against P(-)).
    completions = ["a step\n\nanother one", "x\n\ny\n\nz z z", "only one step"]
    batch = _batch(tokenizer, completions, prompt="Q?")
    prm = PRMStepReward(str(prm_dirs[head]), head=head, batch_size=3)
    out = prm(batch)
    for i, text in enumerate(completions):
        steps = [s.strip() for s in text.split("\n\n")]
        class_ids = [10, 12] if head == "causal_lm" else None  # "+" and "-" in the tiny BPE
        expected, logits = _by_hand(prm_dirs[head], head, "Q?\n" + "".join(s + "<extra_0>" for s in steps), class_ids)
        assert len(out[i].scores) == len(steps) == len(out[i].ends)
        # Padded batch vs alone: other matmul shapes, logits a few ulp apart (2 layers, ~10 ops each); a
        # probability of a 2-way softmax moves by at most 1/4 of the logit difference's change, so 16 ulp of
        # the largest logit bounds it with room.
        torch.testing.assert_close(torch.tensor(out[i].scores), expected, atol=ulps(logits, 16), rtol=0)
    assert len({round(s, 4) for o in out for s in o.scores}) > 3  # the scores differ: a real read-out
    # A step that contains the tag text fails alone; the others keep their scores.
    bad = _batch(tokenizer, ["fine", "sneaky <extra_0> step"], prompt="Q?")
    scores = RewardSet([prm], weights=[1.0], fallbacks=[0.0])(bad)
    assert scores.errors == {prm.name: 1} and scores.steps[1].scores == [0.0] and scores.steps[0].scores[0] > 0


class _PRMHandler(BaseHTTPRequestHandler):
    calls = []

    def do_POST(self):  # noqa: N802 - the http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append(body)
        if body["prompt"] == "slow":
            time.sleep(3)
        if body["prompt"] == "flaky" and sum(c["prompt"] == "flaky" for c in type(self).calls) == 1:
            self.send_response(503)
            self.end_headers()
            return
        reply = json.dumps({"scores": [len(s) / 10 for s in body["steps"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_http_prm_with_retries_timeout_and_fallback(tokenizer):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PRMHandler)  # a port the OS picks as it binds
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prm = HTTPStepReward(f"http://127.0.0.1:{server.server_address[1]}/score", model="prm", backoff=0.01,
                             steps=",")
        rs = RewardSet([prm], weights=[1.0], fallbacks=[-1.0], timeouts=[1.5])
        batch = _batch(tokenizer, ["ab,cde", "abcd,e", "x,yz"])
        batch = batch._replace(prompts=["ok", "flaky", "slow"])
        out = rs(batch)
        # "ok": steps "ab" and "cde" -> 0.2, 0.3. "flaky": HTTP 503 once, then answered (retried). "slow": past the
        # 1.5 s limit per completion -> the fallback, one step over its tokens, counted.
        assert out.steps[0].scores == [0.2, 0.3] and out.steps[1].scores == [0.4, 0.1]
        assert out.steps[2] == Steps([-1.0], [len(batch.completion_ids[2]) - 1])
        assert out.errors == {prm.name: 1}
        flaky = [c for c in _PRMHandler.calls if c["prompt"] == "flaky"]
        assert len(flaky) == 2 and flaky[0] == {"prompt": "flaky", "steps": ["abcd", "e"], "model": "prm"}
    finally:
        server.shutdown()
