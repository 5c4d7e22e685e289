"""Process reward models (PRMs) as step-level rewards: a Hugging Face PRM run locally, or one behind HTTP.

The PRM reads the prompt and the completion's steps, each followed by a step tag, and gives every step
the probability that it is correct, read at its tag:

- ``head="token_classification"``: a classifier over the positions, the probability of class
  ``positive_label`` at each tag. Qwen2.5-Math-PRM (Zhang et al. 2025, arXiv:2501.07301) joins the steps
  with ``<extra_0>`` after each and reads the positive class (index 1) of a two-class head there.
- ``head="causal_lm"``: a language model, the probability of ``positive_token`` against
  ``negative_token`` as the next token at each tag. Math-Shepherd (Wang et al. 2024, arXiv:2312.08935)
  tags steps with ``ки`` and compares ``+`` with ``-``.

Both follow :class:`~torchtune_grpo.rewards.StepReward`: steps from a separator (``"\\n\\n"`` by default) or
a function, a failed completion gets the fallback, ``aggregate`` gives the per-completion number.
"""

import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Mapping, Optional

import torch

from torchtune_grpo.rewards._base import RewardBatch, RewardSample, to_plain
from torchtune_grpo.rewards._execution import run_each
from torchtune_grpo.rewards._steps import StepReward

__all__ = ["HTTPStepReward", "PRM_HEADS", "PRMStepReward", "PRMRequestError"]

log = logging.getLogger(__name__)

#: The two conventions :class:`PRMStepReward` reads a step's probability with.
PRM_HEADS = ("token_classification", "causal_lm")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_RETRY_STATUS = (408, 409, 425, 429)
_MAX_BODY_BYTES = 10 * 1024 * 1024


def _one_token(tokenizer: Any, text: str, what: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{what} {text!r} is {len(ids)} tokens ({ids}) for this PRM's tokenizer; it must be one token")
    return int(ids[0])


class PRMStepReward(StepReward):
    """Scores each step with a local Hugging Face process reward model (see the module docstring).

    The PRM input is ``template`` with ``{prompt}`` (the prompt text, or ``fields[question_field]`` when
    that column exists) and ``{steps}`` (every step followed by ``step_tag``); with ``chat=True`` it is
    the tokenizer's chat template over ``[system_prompt], user: question, assistant: steps`` instead
    (Qwen2.5-Math-PRM's format). A completion whose input holds another number of tags than it has steps
    (a step containing the tag text) or is longer than ``max_length`` fails alone (fallback).

    Example YAML (Qwen2.5-Math-PRM-7B after ``tune download``)::

        - _component_: torchtune_grpo.rewards.PRMStepReward
          model: /models/Qwen2.5-Math-PRM-7B
          head: token_classification
          auto_class: AutoModel          # its custom class: trust_remote_code
          trust_remote_code: true
          step_tag: "<extra_0>"
          chat: true
          system_prompt: "Please reason step by step, and put your final answer within \\\\boxed{}."
          steps: {separator: "\\n\\n"}
          device: cuda
          dtype: bf16
          weight: 0.0

    Args:
        model (Any): a Hugging Face model directory, or a loaded ``transformers`` model.
        tokenizer (Any): a tokenizer directory or object. Default is None (``model``'s directory).
        head (str): one of :data:`PRM_HEADS`. Default is ``"token_classification"``.
        step_tag (str): the text after each step, one token. Default is ``"<extra_0>"``.
        positive_label (int): the positive class (``token_classification``). Default is 1.
        positive_token (str): the "correct" token (``causal_lm``). Default is ``"+"``.
        negative_token (str): the "wrong" token (``causal_lm``). Default is ``"-"``.
        template (str): the input text without ``chat``. Default is ``"{prompt}\\n{steps}"``.
        chat (bool): build the input with the tokenizer's chat template. Default is False.
        system_prompt (Optional[str]): the system message with ``chat``. Default is None.
        question_field (str): the dataset column used as ``{prompt}`` when present. Default is ``"question"``.
        auto_class (Optional[str]): the ``transformers`` auto class to load ``model`` with. Default is None
            (``AutoModelForTokenClassification`` or ``AutoModelForCausalLM`` by ``head``).
        trust_remote_code (bool): passed to ``from_pretrained``. Default is False.
        max_length (int): longest PRM input in tokens. Default is 4096.
        batch_size (int): completions per forward. Default is 8.
        device (str): where the PRM runs. Default is ``"cpu"``.
        dtype (str): ``"fp32"``, ``"bf16"`` or ``"fp16"``. Default is ``"fp32"``.
        steps (Any): see :class:`~torchtune_grpo.rewards.StepReward`. Default is None (``"\\n\\n"``).
        aggregate (str): see :class:`~torchtune_grpo.rewards.StepReward`. Default is ``"min"``.

    Raises:
        ValueError: on an unknown head or dtype, a tag or class token that is not one token, or a
            template without ``{steps}``.
    """

    per_sample = False

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        head: str = "token_classification",
        step_tag: str = "<extra_0>",
        positive_label: int = 1,
        positive_token: str = "+",
        negative_token: str = "-",
        template: str = "{prompt}\n{steps}",
        chat: bool = False,
        system_prompt: Optional[str] = None,
        question_field: str = "question",
        auto_class: Optional[str] = None,
        trust_remote_code: bool = False,
        max_length: int = 4096,
        batch_size: int = 8,
        device: str = "cpu",
        dtype: str = "fp32",
        steps: Any = None,
        aggregate: str = "min",
    ) -> None:
        super().__init__(steps=steps, aggregate=aggregate)
        import transformers

        if head not in PRM_HEADS:
            raise ValueError(f"unknown head {head!r}; valid heads are {list(PRM_HEADS)}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}")
        if not chat and "{steps}" not in template:
            raise ValueError(f"template must contain {{steps}}, got {template!r}")
        self.device = torch.device(device)
        if isinstance(model, (str, os.PathLike)):
            cls_name = auto_class or (
                "AutoModelForTokenClassification" if head == "token_classification" else "AutoModelForCausalLM"
            )
            loader = getattr(transformers, cls_name, None)
            if loader is None:
                raise ValueError(f"auto_class {cls_name!r} is not a transformers class")
            model_dir = str(model)
            model = loader.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
            tokenizer = model_dir if tokenizer is None else tokenizer
        if tokenizer is None:
            raise ValueError("tokenizer is needed when model is a loaded model")
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=trust_remote_code)
        self.model = model.to(device=self.device, dtype=_DTYPES[dtype]).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.head = head
        self.step_tag = step_tag
        self.tag_id = _one_token(tokenizer, step_tag, "step_tag")
        self.positive_label = int(positive_label)
        if head == "causal_lm":
            self.class_ids = [_one_token(tokenizer, positive_token, "positive_token"),
                              _one_token(tokenizer, negative_token, "negative_token")]
        self.template = template
        self.chat = bool(chat)
        self.system_prompt = system_prompt
        self.question_field = question_field
        self.max_length = int(max_length)
        self.batch_size = max(1, int(batch_size))
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else 0)

    def prm_text(self, sample: RewardSample, steps: List[str]) -> str:
        """The PRM's input text for one completion's steps."""
        question = sample.fields.get(self.question_field, sample.prompt)
        tagged = "".join(step + self.step_tag for step in steps)
        if not self.chat:
            return self.template.format(prompt=question, steps=tagged)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages += [{"role": "user", "content": str(question)}, {"role": "assistant", "content": tagged}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

    def _rows(self, batch: RewardBatch, steps: List[List[str]]) -> List[Any]:
        rows: List[Any] = []
        for i, texts in enumerate(steps):
            ids = self.tokenizer.encode(self.prm_text(batch.sample(i), texts), add_special_tokens=False)
            tags = sum(1 for t in ids if t == self.tag_id)
            if len(ids) > self.max_length:
                rows.append(ValueError(f"PRM input of {len(ids)} tokens is longer than max_length={self.max_length}"))
            elif tags != len(texts):
                rows.append(ValueError(
                    f"PRM input holds {tags} step tags {self.step_tag!r} for {len(texts)} steps (does a step "
                    "contain the tag text?)"
                ))
            else:
                rows.append(ids)
        return rows

    @torch.inference_mode()
    def _probabilities(self, rows: List[List[int]]) -> List[List[float]]:
        """Each row's step probabilities, read at its tags (right-padded forward, attention mask)."""
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = torch.tensor(r, dtype=torch.long)
            attention[b, : len(r)] = 1
        out = self.model(input_ids=tokens.to(self.device), attention_mask=attention.to(self.device))
        logits = (out.logits if hasattr(out, "logits") else out[0]).float()  # [B, L, C] or [B, L, V]
        tags = (tokens == self.tag_id) & attention.bool()  # [B, L]
        result = []
        for b in range(len(rows)):
            at = logits[b, tags[b].to(logits.device)]  # [steps, C]
            if self.head == "causal_lm":
                p = torch.softmax(at[:, self.class_ids], dim=-1)[:, 0]  # P(+) against P(-)
            else:
                p = torch.softmax(at, dim=-1)[:, self.positive_label]
            result.append(p.tolist())
        return result

    def score_step_batch(self, batch: RewardBatch, steps: List[List[str]]) -> List[Any]:
        rows = self._rows(batch, steps)
        out: List[Any] = list(rows)
        ok = [i for i, r in enumerate(rows) if not isinstance(r, BaseException)]
        for start in range(0, len(ok), self.batch_size):
            chunk = ok[start : start + self.batch_size]
            for i, p in zip(chunk, self._probabilities([rows[i] for i in chunk])):
                out[i] = p
        return out

    def score_steps(self, sample: RewardSample, steps: List[str]) -> List[float]:
        batch = RewardBatch([sample.prompt], [sample.completion], [sample.completion_ids], [sample.fields])
        result = self.score_step_batch(batch, [steps])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def __repr__(self) -> str:
        return f"PRMStepReward(head={self.head!r}, step_tag={self.step_tag!r}, {self.splitter!r})"


class PRMRequestError(RuntimeError):
    """The PRM endpoint did not give a usable reply (after retries, where retrying made sense)."""


class _Retryable(Exception):
    pass


class HTTPStepReward(StepReward):
    """Scores each step with a process reward model behind HTTP, one request per completion.

    ``POST {url}`` with the JSON ``{"model": model, "prompt": ..., "steps": [step texts], **extra_body}``;
    the reply is ``{"scores": [one number per step]}``. A connection error, a timeout, HTTP
    408/409/425/429/5xx or a malformed body is retried up to ``retries`` times with exponential backoff;
    a completion whose requests all fail, or whose reply has the wrong number of scores, fails alone
    (the fallback, counted in ``reward/<name>/errors``), like :class:`~torchtune_grpo.rewards.HTTPJudge`.
    ``timeout`` in the reward's entry bounds each completion as a whole (retries included).

    Example YAML::

        - _component_: torchtune_grpo.rewards.HTTPStepReward
          url: http://prm-host:8080/score_steps
          model: Qwen2.5-Math-PRM-7B
          steps: {separator: "\\n\\n"}
          request_timeout: 30
          retries: 2
          concurrency: 16
          timeout: 90
          fallback: 0.0
          weight: 0.0

    Args:
        url (str): the endpoint.
        model (Optional[str]): sent as ``model``. Default is None (not sent).
        request_timeout (float): seconds per request. Default is 30.0.
        retries (int): extra attempts after a retryable failure. Default is 2.
        backoff (float): seconds before the first retry, doubled each time (at most 30). Default is 0.5.
        concurrency (int): requests in flight at once. Default is 8.
        api_key_env (Optional[str]): environment variable holding a bearer token. Default is None.
        headers (Optional[Mapping[str, str]]): extra HTTP headers. Default is None.
        extra_body (Optional[Mapping[str, Any]]): extra JSON fields. Default is None.
        steps (Any): see :class:`~torchtune_grpo.rewards.StepReward`. Default is None (``"\\n\\n"``).
        aggregate (str): see :class:`~torchtune_grpo.rewards.StepReward`. Default is ``"min"``.

    Raises:
        ValueError: on a URL that is not http(s), or a bad numeric setting.
    """

    per_sample = True

    def __init__(
        self,
        url: str,
        model: Optional[str] = None,
        request_timeout: float = 30.0,
        retries: int = 2,
        backoff: float = 0.5,
        concurrency: int = 8,
        api_key_env: Optional[str] = None,
        headers: Optional[Mapping[str, str]] = None,
        extra_body: Optional[Mapping[str, Any]] = None,
        steps: Any = None,
        aggregate: str = "min",
    ) -> None:
        super().__init__(steps=steps, aggregate=aggregate)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {request_timeout}")
        if retries < 0 or concurrency < 1:
            raise ValueError(f"need retries >= 0 and concurrency >= 1, got {retries} and {concurrency}")
        self.url = url
        self.model = model
        self.request_timeout = float(request_timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.concurrency = int(concurrency)
        self.api_key_env = api_key_env
        self.headers = dict(to_plain(headers) or {})
        self.extra_body = dict(to_plain(extra_body) or {})
        self._opener = urllib.request.build_opener()

    def _post(self, data: bytes, n_steps: int) -> List[float]:
        headers = {"Content-Type": "application/json", "Accept": "application/json", **self.headers}
        if self.api_key_env and os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[self.api_key_env]}"
        request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.request_timeout) as response:
                raw = response.read(_MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as e:
            msg = f"HTTP {e.code} from {self.url}"
            if e.code in _RETRY_STATUS or e.code >= 500:
                raise _Retryable(msg) from None
            raise PRMRequestError(msg) from None
        except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError, OSError) as e:
            raise _Retryable(f"request to {self.url} failed: {type(e).__name__}: {e}") from None
        try:
            scores = json.loads(raw.decode("utf-8"))["scores"]
            scores = [float(s) for s in scores]
        except (ValueError, KeyError, TypeError) as e:
            raise _Retryable(f"malformed reply from {self.url} ({type(e).__name__}: {e}): {raw[:200]!r}") from None
        if len(scores) != n_steps:
            raise PRMRequestError(f"{self.url} returned {len(scores)} scores for {n_steps} steps")
        return scores

    def score_steps(self, sample: RewardSample, steps: List[str]) -> List[float]:
        body: Dict[str, Any] = {"prompt": sample.prompt, "steps": list(steps), **self.extra_body}
        if self.model is not None:
            body["model"] = self.model
        data = json.dumps(body).encode("utf-8")
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), 30.0))
            try:
                return self._post(data, len(steps))
            except _Retryable as e:
                last = e
                log.debug("PRM attempt %d/%d failed: %s", attempt + 1, self.retries + 1, e)
        raise PRMRequestError(f"{last} (gave up after {self.retries + 1} attempts)")

    def score_step_batch(self, batch: RewardBatch, steps: List[List[str]]) -> List[Any]:
        # Used when the component runs on the whole batch: the same concurrency, per-completion failures.
        outcomes = run_each(lambda i: self.score_steps(batch.sample(i), steps[i]), len(steps), concurrency=self.concurrency)
        return [o.value for o in outcomes]

    def __repr__(self) -> str:
        return f"HTTPStepReward(url={self.url!r}, {self.splitter!r})"
