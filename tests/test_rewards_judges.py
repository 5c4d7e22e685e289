"""Model judges: the OpenAI-compatible HTTP judge against a real local HTTP server started here, and the
local torchtune-model judge on the shipped tiny model (mechanics only: range, determinism, batching)."""

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torchtune import config as tt_config

from torchtune_grpo.assets import asset_path
from torchtune_grpo.rewards import (
    HTTPJudge,
    JudgeRequestError,
    ModelJudge,
    RewardBatch,
    RewardSample,
    build_reward_set,
    parse_score,
    rubric_fields,
)

# ================================================================ a real chat-completions server


class JudgeServer:
    """An OpenAI-style ``POST /v1/chat/completions`` server on 127.0.0.1 whose behaviour depends on the
    completion being judged (the rubric below puts it alone on the last line of the user message):

    ``score N`` -> replies "N";  ``slow`` -> waits 2 s first;  ``flaky`` -> HTTP 500 twice, then "7";
    ``down`` -> always HTTP 503;  ``malformed`` -> a body that is not JSON;  ``nochoices`` -> ``{}``;
    ``words`` -> "excellent!";  ``bad`` -> HTTP 400;  ``hold`` -> waits 0.2 s, then "5".
    """

    def __init__(self):
        self.requests = []
        self.attempts = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                completion = body["messages"][-1]["content"].rsplit("\n", 1)[-1]
                hold = completion == "hold"  # only these count for the concurrency test
                with server.lock:
                    server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                    server.attempts[completion] += 1
                    attempt = server.attempts[completion]
                    server.in_flight += hold
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    self.respond(completion, attempt)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

            def send(self, status, payload):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def reply(self, content):
                self.send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})

            def respond(self, completion, attempt):
                if completion.startswith("score "):
                    return self.reply(completion[len("score "):])
                if completion == "slow":
                    time.sleep(2)
                    return self.reply("9")
                if completion == "flaky":
                    return self.send(500, {"error": "overloaded"}) if attempt <= 2 else self.reply("7")
                if completion == "down":
                    return self.send(503, {"error": "down"})
                if completion == "malformed":
                    return self.send(200, b"<html>not json")
                if completion == "nochoices":
                    return self.send(200, {})
                if completion == "words":
                    return self.reply("excellent!")
                if completion == "bad":
                    return self.send(400, {"error": "bad request"})
                if completion == "hold":
                    time.sleep(0.2)
                    # Out of flight before the reply is written: the client sends its next request as soon
                    # as it reads this one, possibly before this thread would get past the reply.
                    with server.lock:
                        server.in_flight -= 1
                    return self.reply("5")
                return self.reply("0")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def reset(self):
        with self.lock:
            self.requests.clear()
            self.attempts.clear()
            self.max_in_flight = 0

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server():
    s = JudgeServer()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    # Requests to 127.0.0.1 must not go through a proxy configured in the environment.
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


RUBRIC = "Question: {question}\nReference: {answer}\nRate 0-10.\n{completion}"


def make_batch(completions, answers=None):
    n = len(completions)
    answers = answers if answers is not None else ["4"] * n
    return RewardBatch(["Q?"] * n, list(completions), [[1]] * n, [{"answer": a, "question": "2+2?"} for a in answers])


def judge(server, **kwargs):
    kwargs.setdefault("rubric", RUBRIC)
    kwargs.setdefault("backoff", 0.01)
    return HTTPJudge(base_url=server.url, model="judge-model", **kwargs)


# ---------------------------------------------------------------- HTTP judge


def test_http_judge_scores_and_request_shape(server, monkeypatch):
    server.reset()
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-test")
    j = judge(server, api_key_env="TEST_JUDGE_KEY", system_prompt="You grade.", max_tokens=4,
              extra_body={"top_p": 1.0})
    scores = j(make_batch(["score 10", "score 0", "score 2.5"]))
    assert scores == [1.0, 0.0, 0.25]
    req = server.requests[0]
    assert req["path"] == "/v1/chat/completions"
    assert req["headers"]["Authorization"] == "Bearer sk-test"
    body = req["body"]
    assert body["model"] == "judge-model" and body["max_tokens"] == 4 and body["temperature"] == 0.0
    assert body["top_p"] == 1.0
    assert body["messages"][0] == {"role": "system", "content": "You grade."}
    user = [r["body"]["messages"][1]["content"] for r in server.requests]
    assert "Question: 2+2?\nReference: 4\nRate 0-10.\nscore 10" in user


def test_http_judge_retries_500_then_succeeds(server):
    server.reset()
    assert judge(server, retries=2).score_one(make_batch(["flaky"]).sample(0)) == 0.7
    assert server.attempts["flaky"] == 3


def test_http_judge_gives_up_after_retries(server):
    server.reset()
    with pytest.raises(JudgeRequestError, match="HTTP 503.*3 attempts"):
        judge(server, retries=2).score_one(make_batch(["down"]).sample(0))
    assert server.attempts["down"] == 3


def test_http_judge_no_retry_on_400(server):
    server.reset()
    with pytest.raises(JudgeRequestError, match="HTTP 400"):
        judge(server, retries=3).score_one(make_batch(["bad"]).sample(0))
    assert server.attempts["bad"] == 1


@pytest.mark.parametrize("completion, match", [("malformed", "malformed reply"), ("nochoices", "malformed reply")])
def test_http_judge_malformed_bodies(server, completion, match):
    server.reset()
    with pytest.raises(JudgeRequestError, match=match):
        judge(server, retries=1).score_one(make_batch([completion]).sample(0))
    assert server.attempts[completion] == 2  # a malformed body is retried once, then given up


def test_http_judge_request_timeout(server):
    server.reset()
    start = time.perf_counter()
    with pytest.raises(JudgeRequestError, match="timed out|TimeoutError|timeout"):
        judge(server, request_timeout=0.3, retries=0).score_one(make_batch(["slow"]).sample(0))
    assert time.perf_counter() - start < 1.5


def test_http_judge_in_reward_set_counts_errors(server):
    # One reward set over every failure kind: each failed sample gets the fallback and is counted.
    server.reset()
    rs = build_reward_set(
        [{"_component_": "torchtune_grpo.rewards.HTTPJudge", "base_url": server.url, "model": "m",
          "rubric": RUBRIC, "retries": 1, "backoff": 0.01, "request_timeout": 0.5, "name": "judge",
          "fallback": -1.0, "concurrency": 4}]
    )
    completions = ["score 8", "slow", "down", "malformed", "words", "score 11", "score 5"]
    out = rs(make_batch(completions))
    # "words" has no number, "score 11" is outside [0, 10]: errors too.
    # Scores parsed from text ("score 8" / 10) and stored in fp32: one rounding (3e-8 relative). Bound: approx's
    # default 1e-6 relative.
    assert out.per_component["judge"].tolist() == pytest.approx([0.8, -1, -1, -1, -1, -1, 0.5])
    assert out.errors == {"judge": 5}


def test_http_judge_sample_timeout_from_yaml(server):
    # RewardSet's per-sample timeout bounds a judge call whatever its own request timeout is.
    server.reset()
    rs = build_reward_set(
        [{"_component_": "torchtune_grpo.rewards.HTTPJudge", "base_url": server.url, "model": "m",
          "rubric": RUBRIC, "request_timeout": 10, "timeout": 0.5, "fallback": 0.0}]
    )
    start = time.perf_counter()
    out = rs(make_batch(["slow", "score 3"]))
    assert time.perf_counter() - start < 1.8
    # As above: 3 / 10 rounded once to fp32 (4e-9 relative). Bound: approx's default 1e-6 relative.
    assert out.per_component["http_judge"].tolist() == pytest.approx([0.0, 0.3])
    assert out.errors == {"http_judge": 1}


def test_http_judge_concurrency_limit(server):
    # 8 requests of 0.2 s each with concurrency 3: never more than 3 in flight at the server, and more than
    # one (requests do overlap). Counted server-side from arrival until the reply is written.
    server.reset()
    j = judge(server, concurrency=3)
    rs = build_reward_set([{"_component_": "torchtune_grpo.rewards.HTTPJudge", "base_url": server.url,
                            "model": "m", "rubric": RUBRIC, "concurrency": 3}])
    out = rs(make_batch(["hold"] * 8))
    assert out.per_component["http_judge"].tolist() == [0.5] * 8
    assert 2 <= server.max_in_flight <= 3
    server.reset()
    assert j(make_batch(["hold"] * 4)) == [0.5] * 4  # the batch entry point keeps the limit too
    assert server.max_in_flight <= 3


def test_http_judge_validation():
    with pytest.raises(ValueError, match="http"):
        HTTPJudge(base_url="localhost:8000", model="m")
    with pytest.raises(ValueError, match="literal braces"):
        HTTPJudge(base_url="http://x", model="m", rubric="score {completion")
    assert HTTPJudge(base_url="http://x/v1/chat/completions/", model="m").url == "http://x/v1/chat/completions"


def test_rubric_unknown_field_fails_sample(server):
    j = judge(server, rubric="{completion} {no_such_column}")
    with pytest.raises(KeyError, match="no_such_column"):
        j.score_one(make_batch(["x"]).sample(0))


def test_parse_score():
    assert parse_score("7", 10) == 0.7
    assert parse_score("Score: 3/5", 5) == 0.6  # the first number
    assert parse_score("The answer deserves **9.5**", 10) == 0.95
    assert parse_score("rating=4 of 4", 4, pattern=r"rating=(\d+)") == 1.0
    for bad in ("", "great", "-1", "11"):
        with pytest.raises(ValueError):
            parse_score(bad, 10)


def test_rubric_fields_cuts_long_completions():
    sample = RewardSample("P", "x" * 100, [1], {"answer": "4", "level": 3})
    fields = rubric_fields(sample, max_completion_chars=10)
    assert fields["completion"] == "x" * 10 + "..."
    assert fields["question"] == "P" and fields["answer"] == "4" and fields["level"] == 3


# ================================================================ local torchtune model judge

TINY_MODEL = {
    "_component_": "torchtune.models.qwen2.qwen2",
    "vocab_size": 512,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 4,
    "embed_dim": 128,
    "intermediate_dim": 256,
    "max_seq_len": 1024,
    "norm_eps": 1e-6,
    "rope_base": 1000000.0,
    "tie_word_embeddings": True,
}
TINY_TOKENIZER = {
    "_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer",
    "path": asset_path("tiny_qwen2", "vocab.json"),
    "merges_file": asset_path("tiny_qwen2", "merges.txt"),
    "special_tokens_path": asset_path("tiny_qwen2", "tokenizer.json"),
    "max_seq_len": 1024,
}
JUDGE_BATCH = make_batch(
    ["</think><answer>4</answer>", "</think><answer>5</answer>", "", "x" * 6000, "four"]
)


@pytest.fixture(scope="module")
def yes_no_judge():
    return ModelJudge(model=TINY_MODEL, tokenizer=TINY_TOKENIZER, checkpoint_dir=asset_path("tiny_qwen2"),
                      model_type="QWEN2", batch_size=2, max_completion_chars=300)


def test_model_judge_yes_no_mechanics(yes_no_judge):
    scores = yes_no_judge(JUDGE_BATCH)
    assert len(scores) == 5 and all(0.0 <= s <= 1.0 for s in scores)
    assert yes_no_judge(JUDGE_BATCH) == scores  # deterministic
    # Batched == one at a time (right padding does not change a row's last-position logits).
    yes_no_judge.batch_size = 1
    try:
        # A score is the judge's yes-probability from the last position's logits of the tiny asset (|z| <~ 2, 1 ulp
        # 2.4e-7), batched with right padding or alone: other matmul shapes, so logits a few ulp apart, which move a
        # probability in [0, 1] by at most about as much. Bound: 1e-5 (measured: equal with AVX-512, 1.2e-7 with AVX2
        # and scalar kernels).
        assert yes_no_judge(JUDGE_BATCH) == pytest.approx(scores, abs=1e-5)
    finally:
        yes_no_judge.batch_size = 2
    assert len(set(round(s, 6) for s in scores)) > 1  # depends on the completion
    # The " Yes"/" No" spellings start with the same space token in this tokenizer: it is dropped.
    assert set(yes_no_judge.yes_ids).isdisjoint(yes_no_judge.no_ids)


def test_model_judge_weights_loaded(yes_no_judge):
    # The checkpoint really was loaded: the embedding equals the shipped safetensors.
    from safetensors.torch import load_file

    state = load_file(asset_path("tiny_qwen2", "model.safetensors"))
    torch.testing.assert_close(yes_no_judge.model.tok_embeddings.weight, state["model.embed_tokens.weight"])


def test_model_judge_from_yaml_with_checkpointer(tmp_path):
    rs = build_reward_set(
        [
            {
                "_component_": "torchtune_grpo.rewards.ModelJudge",
                "model": TINY_MODEL,
                "tokenizer": TINY_TOKENIZER,
                "checkpointer": {
                    "_component_": "torchtune.training.FullModelHFCheckpointer",
                    "checkpoint_dir": asset_path("tiny_qwen2"),
                    "checkpoint_files": ["model.safetensors"],
                    "model_type": "QWEN2",
                    "output_dir": str(tmp_path / "judge_out"),
                },
                "method": "score_tokens",
                "max_score": 9,
                "chat": True,
                "weight": 0.5,
                "name": "judge",
            }
        ]
    )
    out = rs(JUDGE_BATCH.select([0, 1, 2]))
    scores = out.per_component["judge"]
    assert out.errors == {"judge": 0}
    assert ((scores >= 0) & (scores <= 1)).all()
    torch.testing.assert_close(out.total, 0.5 * scores)


def test_model_judge_generate_parses_numbers():
    tok = tt_config.instantiate(OmegaConf.create(TINY_TOKENIZER))
    seven = tok.encode("7", add_bos=False, add_eos=False)[0]

    class SaysSeven(nn.Module):
        max_seq_len = 1024

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))

        def forward(self, tokens):
            # Next token is always "7" until the row already ends in "7", then the stop token.
            logits = torch.zeros(tokens.shape[0], tokens.shape[1], 512)
            logits[..., seven] = 1.0
            logits[tokens == seven, :] = 0.0
            logits[tokens == seven, tok.eos_id] = 1.0
            return logits

    j = ModelJudge(model=SaysSeven(), tokenizer=tok, method="generate", max_score=10, max_new_tokens=4)
    assert j(make_batch(["a", "bb"])) == [0.7, 0.7]

    random_judge = ModelJudge(model=TINY_MODEL, tokenizer=tok, checkpoint_dir=asset_path("tiny_qwen2"),
                              model_type="QWEN2", method="generate", max_new_tokens=3)
    # The random tiny model writes no number: each sample is an error instance, counted by RewardSet.
    scores = random_judge(make_batch(["a"]))
    assert isinstance(scores[0], ValueError) and "no score" in str(scores[0])


def test_model_judge_validation():
    tok = tt_config.instantiate(OmegaConf.create(TINY_TOKENIZER))
    model = nn.Linear(1, 1)
    with pytest.raises(ValueError, match="unknown method"):
        ModelJudge(model=model, tokenizer=tok, method="vibes")
    with pytest.raises(ValueError, match="one token per score"):
        ModelJudge(model=model, tokenizer=tok, method="score_tokens", max_score=10)  # "10" is two tokens
    with pytest.raises(ValueError, match="no distinct first tokens"):
        ModelJudge(model=model, tokenizer=tok, yes_words=[" Yes"], no_words=[" No"])  # both start with " "
    with pytest.raises(ValueError, match="_component_"):
        ModelJudge(model={"vocab_size": 3}, tokenizer=tok)
