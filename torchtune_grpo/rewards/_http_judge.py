"""A judge behind an OpenAI-compatible chat-completions endpoint (vLLM, SGLang, TGI, llama.cpp, OpenAI...).

Standard library only (``urllib``). Each completion is one request; requests run ``concurrency`` at a
time. A request that fails with a connection error, a timeout, HTTP 408/409/425/429/5xx or a malformed
body is retried up to ``retries`` times with exponential backoff; a sample whose requests all fail, or
whose reply holds no valid score, raises, so :class:`~torchtune_grpo.rewards.RewardSet` scores it with the
fallback and counts it in ``reward/<name>/errors``.
"""

import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Mapping, Optional

from torchtune_grpo.rewards._base import Reward, RewardBatch, RewardSample, to_plain
from torchtune_grpo.rewards._execution import run_each
from torchtune_grpo.rewards._judge import DEFAULT_RUBRIC, check_rubric, format_rubric, parse_score, rubric_fields

__all__ = ["HTTPJudge", "JudgeRequestError"]

log = logging.getLogger(__name__)

_RETRY_STATUS = (408, 409, 425, 429)
_MAX_BODY_BYTES = 10 * 1024 * 1024


class JudgeRequestError(RuntimeError):
    """The judge endpoint did not give a usable reply (after retries, where retrying made sense)."""


class _Retryable(Exception):
    pass


class HTTPJudge(Reward):
    """Scores each completion in ``[0, 1]`` by asking a judge model behind an OpenAI-compatible
    ``POST {base_url}/chat/completions`` endpoint.

    The judge prompt is ``rubric`` filled with the sample's fields (``{question}``, ``{answer}``,
    ``{completion}``, ``{prompt}`` and any dataset column; see :func:`~torchtune_grpo.rewards.rubric_fields`).
    The score is the first number of the reply (or the first group of ``score_pattern``) divided by
    ``max_score``; a number outside ``[0, max_score]`` or no number is an error for that sample.

    Example YAML::

        - _component_: torchtune_grpo.rewards.HTTPJudge
          base_url: http://localhost:8000/v1
          model: Qwen/Qwen2.5-7B-Instruct
          rubric: "Question: {question}\\nResponse: {completion}\\nScore the response from 0 to 10. Reply with the number only."
          request_timeout: 30
          retries: 2
          concurrency: 16
          weight: 0.5
          fallback: 0.0

    Args:
        base_url (str): the API root, e.g. ``http://localhost:8000/v1`` (``/chat/completions`` is appended
            unless the URL already ends with it).
        model (str): the ``model`` field of the request.
        rubric (str): ``str.format`` template of the user message. Default is :data:`DEFAULT_RUBRIC`.
        system_prompt (Optional[str]): a system message. Default is None.
        max_score (float): the top of the rubric's scale. Default is 10.0.
        score_pattern (Optional[str]): regex whose first group is the score. Default is None (first number).
        request_timeout (float): seconds per HTTP request (connect and read). Default is 30.0.
        retries (int): extra attempts after a retryable failure. Default is 2.
        backoff (float): seconds before the first retry, doubled each time (at most 30 s). Default is 0.5.
        concurrency (int): requests in flight at once. Default is 8.
        max_tokens (int): ``max_tokens`` of the request. Default is 16.
        temperature (float): ``temperature`` of the request. Default is 0.0.
        api_key_env (Optional[str]): environment variable holding a bearer token (sent as
            ``Authorization: Bearer ...``). Default is None (no header). Keys never go in the YAML.
        headers (Optional[Mapping[str, str]]): extra HTTP headers. Default is None.
        extra_body (Optional[Mapping[str, Any]]): extra JSON fields of the request. Default is None.
        max_completion_chars (Optional[int]): longer completions are cut before judging. Default is 8000.

    Raises:
        ValueError: on an invalid URL, rubric or numeric setting.
    """

    per_sample = True

    def __init__(
        self,
        base_url: str,
        model: str,
        rubric: str = DEFAULT_RUBRIC,
        system_prompt: Optional[str] = None,
        max_score: float = 10.0,
        score_pattern: Optional[str] = None,
        request_timeout: float = 30.0,
        retries: int = 2,
        backoff: float = 0.5,
        concurrency: int = 8,
        max_tokens: int = 16,
        temperature: float = 0.0,
        api_key_env: Optional[str] = None,
        headers: Optional[Mapping[str, str]] = None,
        extra_body: Optional[Mapping[str, Any]] = None,
        max_completion_chars: Optional[int] = 8000,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        check_rubric(rubric)
        if not max_score > 0:
            raise ValueError(f"max_score must be > 0, got {max_score}")
        if not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {request_timeout}")
        if retries < 0 or concurrency < 1:
            raise ValueError(f"need retries >= 0 and concurrency >= 1, got {retries} and {concurrency}")
        url = base_url.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else url + "/chat/completions"
        self.model = model
        self.rubric = rubric
        self.system_prompt = system_prompt
        self.max_score = float(max_score)
        self.score_pattern = score_pattern
        self.request_timeout = float(request_timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.concurrency = int(concurrency)
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.api_key_env = api_key_env
        self.headers = dict(to_plain(headers) or {})
        self.extra_body = dict(to_plain(extra_body) or {})
        self.max_completion_chars = max_completion_chars
        # Honours the usual *_proxy / no_proxy environment variables.
        self._opener = urllib.request.build_opener()

    def _request_body(self, sample: RewardSample) -> bytes:
        messages: List[Dict[str, str]] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        content = format_rubric(self.rubric, rubric_fields(sample, self.max_completion_chars))
        messages.append({"role": "user", "content": content})
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            **self.extra_body,
        }
        return json.dumps(body).encode("utf-8")

    def _post(self, data: bytes) -> str:
        """One attempt: returns the reply text, raises _Retryable or JudgeRequestError."""
        headers = {"Content-Type": "application/json", "Accept": "application/json", **self.headers}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if key:
                headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.request_timeout) as response:
                raw = response.read(_MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as e:
            detail = e.read(500).decode("utf-8", "replace") if e.fp is not None else ""
            msg = f"HTTP {e.code} from {self.url}: {detail[:200]!r}"
            if e.code in _RETRY_STATUS or e.code >= 500:
                raise _Retryable(msg) from None
            raise JudgeRequestError(msg) from None
        except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError, OSError) as e:
            raise _Retryable(f"request to {self.url} failed: {type(e).__name__}: {e}") from None
        if len(raw) > _MAX_BODY_BYTES:
            raise _Retryable(f"reply from {self.url} is larger than {_MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw.decode("utf-8"))
            content = body["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise _Retryable(f"malformed reply from {self.url} ({type(e).__name__}: {e}): {raw[:200]!r}") from None
        if not isinstance(content, str):
            raise _Retryable(f"malformed reply from {self.url}: message content is {type(content).__name__}")
        return content

    def ask(self, sample: RewardSample) -> str:
        """Sends the judge prompt for ``sample`` (with retries) and returns the judge's reply text.

        Raises:
            JudgeRequestError: when every attempt failed, or on a non-retryable HTTP error.
        """
        data = self._request_body(sample)
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), 30.0))
            try:
                return self._post(data)
            except _Retryable as e:
                last = e
                log.debug("judge attempt %d/%d failed: %s", attempt + 1, self.retries + 1, e)
        raise JudgeRequestError(f"{last} (gave up after {self.retries + 1} attempts)")

    def score_one(self, sample: RewardSample) -> float:
        return parse_score(self.ask(sample), self.max_score, self.score_pattern)

    def __call__(self, batch: RewardBatch) -> List[Any]:
        # Used when the component runs on the whole batch: same concurrency, per-sample failures marked.
        outcomes = run_each(
            lambda i: self.score_one(batch.sample(i)), len(batch.completions), concurrency=self.concurrency
        )
        return [o.value for o in outcomes]

    def __repr__(self) -> str:
        return f"HTTPJudge(url={self.url!r}, model={self.model!r})"
