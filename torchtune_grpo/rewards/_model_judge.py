"""A judge that is a local torchtune model, scoring completions in batches on the trainer's own device."""

import contextlib
import logging
import math
import tempfile
from pathlib import Path
from typing import Any, Iterator, List, Mapping, Optional, Sequence

import torch
from torch import nn

from torchtune_grpo.rewards._base import Reward, RewardBatch
from torchtune_grpo.rewards._judge import (
    DEFAULT_YES_NO_RUBRIC,
    check_rubric,
    format_rubric,
    parse_score,
    rubric_fields,
)

__all__ = ["JUDGE_METHODS", "ModelJudge"]

log = logging.getLogger(__name__)

#: Scoring methods of :class:`ModelJudge`.
JUDGE_METHODS = ("yes_no", "score_tokens", "generate")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _instantiate(spec: Any, what: str) -> Any:
    """Builds an object from a ``{_component_: ..., **kwargs}`` mapping; returns other objects as they are."""
    from omegaconf import DictConfig, OmegaConf
    from torchtune import config as tt_config

    if isinstance(spec, (Mapping, DictConfig)):
        cfg = spec if isinstance(spec, DictConfig) else OmegaConf.create(dict(spec))
        if "_component_" not in cfg:
            raise ValueError(f"{what} spec needs a `_component_`, got {OmegaConf.to_container(cfg)}")
        return tt_config.instantiate(cfg)
    return spec


def _load_weights(model: nn.Module, checkpointer: Any, checkpoint_dir: Optional[str],
                  checkpoint_files: Optional[Sequence[str]], model_type: Optional[str]) -> None:
    from torchtune import training

    with contextlib.ExitStack() as stack:
        if checkpointer is None and checkpoint_dir is not None:
            from torchtune.training import FullModelHFCheckpointer

            files = list(checkpoint_files or [])
            if not files:
                files = sorted(p.name for p in Path(checkpoint_dir).glob("*.safetensors"))
            if not files:
                raise ValueError(f"no checkpoint_files given and no *.safetensors in {checkpoint_dir!r}")
            if model_type is None:
                raise ValueError("model_type (e.g. QWEN2, LLAMA3) is needed with checkpoint_dir")
            # The checkpointer wants an output directory even to load; it is thrown away.
            out = stack.enter_context(tempfile.TemporaryDirectory(prefix="grpo_judge_"))
            checkpointer = FullModelHFCheckpointer(
                checkpoint_dir=str(checkpoint_dir),
                checkpoint_files=files,
                model_type=str(model_type),
                output_dir=out,
            )
        else:
            checkpointer = _instantiate(checkpointer, "checkpointer")
        if checkpointer is None:
            log.warning("ModelJudge: no checkpointer or checkpoint_dir given; using the model's weights as built")
            return
        state = checkpointer.load_checkpoint()[training.MODEL_KEY]
        model.load_state_dict(state)


@contextlib.contextmanager
def _last_positions_only(model: nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Makes a torchtune decoder project only the hidden state at ``positions[b]`` of each row, so the
    ``[B, L, V]`` logits tensor is never built (V is ~150k for Qwen)."""
    original = getattr(type(model), "unembed", None)
    if original is None:  # not a torchtune TransformerDecoder: full logits
        yield
        return
    rows = torch.arange(positions.numel(), device=positions.device)

    def unembed(h: torch.Tensor) -> torch.Tensor:
        return original(model, h[rows, positions].unsqueeze(1))

    model.unembed = unembed
    try:
        yield
    finally:
        del model.unembed


class ModelJudge(Reward):
    """Scores completions in ``[0, 1]`` with a local torchtune model reading a rubric prompt.

    The judge prompt is ``rubric`` filled with the sample's fields (see
    :func:`~torchtune_grpo.rewards.rubric_fields`), tokenized as raw text (``chat=False``) or as a user
    message of the tokenizer's chat format (``chat=True``). Methods:

    - ``"yes_no"``: the probability of a "yes" token against a "no" token at the next position,
      ``P(yes) / (P(yes) + P(no))``, where each side sums the first tokens of ``yes_words`` / ``no_words``
      (tokens shared by both sides are dropped).
    - ``"score_tokens"``: the expected score over the single tokens ``"0"`` ... ``str(max_score)``,
      divided by ``max_score`` (every score must be one token: ``max_score`` <= 9 for most tokenizers).
    - ``"generate"``: greedy decoding of up to ``max_new_tokens`` tokens, then the first number of the
      text divided by ``max_score``; a reply without a valid number fails that sample only.

    Runs under ``torch.inference_mode`` in micro-batches of ``batch_size``, right-padded (causal attention
    makes padding after a row's last token irrelevant), projecting only each row's last position.

    Example YAML (the shipped tiny model; any torchtune model works the same way)::

        - _component_: torchtune_grpo.rewards.ModelJudge
          model:
            _component_: torchtune.models.qwen2.qwen2
            vocab_size: 512
            num_layers: 2
            ...
          tokenizer:
            _component_: torchtune.models.qwen2_5.qwen2_5_tokenizer
            path: /models/judge/vocab.json
            merges_file: /models/judge/merges.txt
          checkpoint_dir: /models/judge
          model_type: QWEN2
          method: yes_no
          weight: 0.5

    Args:
        model (Any): a ``{_component_: ...}`` mapping (a torchtune model builder and its arguments) or a
            built ``nn.Module``.
        tokenizer (Any): a ``{_component_: ...}`` mapping or a torchtune tokenizer object.
        checkpointer (Any): a ``{_component_: ...}`` checkpointer mapping or object whose
            ``load_checkpoint()["model"]`` holds the weights. Default is None.
        checkpoint_dir (Optional[str]): shortcut for a ``FullModelHFCheckpointer`` over this Hugging Face
            checkpoint directory (needs ``model_type``). Default is None.
        checkpoint_files (Optional[Sequence[str]]): its files. Default is None (every ``*.safetensors``).
        model_type (Optional[str]): torchtune ``ModelType`` name (``QWEN2``, ``LLAMA3``...). Default is None.
        rubric (str): ``str.format`` template. Default is :data:`DEFAULT_YES_NO_RUBRIC`.
        method (str): one of :data:`JUDGE_METHODS`. Default is ``"yes_no"``.
        yes_words (Sequence[str]): "yes" spellings. Default is ``("Yes", " Yes", "yes", " yes")``.
        no_words (Sequence[str]): "no" spellings. Default is ``("No", " No", "no", " no")``.
        max_score (int): top of the scale for ``score_tokens`` / ``generate``. Default is 9.
        chat (bool): wrap the rubric in the tokenizer's chat format. Default is False.
        batch_size (int): completions per forward pass. Default is 8.
        max_prompt_tokens (int): longer judge prompts keep their last this-many tokens (never more than the
            model's ``max_seq_len``, less ``max_new_tokens`` for ``"generate"``). Default is 2048.
        max_completion_chars (Optional[int]): completions are cut to this length first. Default is 8000.
        max_new_tokens (int): tokens generated by ``"generate"``. Default is 8.
        device (str): where the judge runs. Default is ``"cpu"``.
        dtype (str): ``"fp32"``, ``"bf16"`` or ``"fp16"``. Default is ``"fp32"``.

    Raises:
        ValueError: on an unknown method, a rubric with bad braces, yes/no words that leave no distinct
            token, or scores that are not single tokens.
    """

    per_sample = False

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        checkpointer: Any = None,
        checkpoint_dir: Optional[str] = None,
        checkpoint_files: Optional[Sequence[str]] = None,
        model_type: Optional[str] = None,
        rubric: str = DEFAULT_YES_NO_RUBRIC,
        method: str = "yes_no",
        yes_words: Sequence[str] = ("Yes", " Yes", "yes", " yes"),
        no_words: Sequence[str] = ("No", " No", "no", " no"),
        max_score: int = 9,
        chat: bool = False,
        batch_size: int = 8,
        max_prompt_tokens: int = 2048,
        max_completion_chars: Optional[int] = 8000,
        max_new_tokens: int = 8,
        device: str = "cpu",
        dtype: str = "fp32",
    ) -> None:
        if method not in JUDGE_METHODS:
            raise ValueError(f"unknown method {method!r}; valid methods are {list(JUDGE_METHODS)}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}")
        check_rubric(rubric)
        self.tokenizer = _instantiate(tokenizer, "tokenizer")
        self.device = torch.device(device)
        module = _instantiate(model, "model")
        if not isinstance(module, nn.Module):
            raise ValueError(f"model must build an nn.Module, got {type(module).__name__}")
        _load_weights(module, checkpointer, checkpoint_dir, checkpoint_files, model_type)
        self.model = module.to(device=self.device, dtype=_DTYPES[dtype]).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.rubric = rubric
        self.method = method
        self.max_score = int(max_score)
        self.chat = chat
        self.batch_size = max(1, int(batch_size))
        self.max_new_tokens = int(max_new_tokens)
        # Never feed the model more positions than it has (generation needs room for its new tokens).
        room = getattr(self.model, "max_seq_len", None)
        limit = int(max_prompt_tokens)
        if isinstance(room, int) and room > 0:
            limit = min(limit, room - (self.max_new_tokens if method == "generate" else 0))
        if limit < 1:
            raise ValueError(f"no room for a judge prompt: max_seq_len {room}, max_new_tokens {max_new_tokens}")
        self.max_prompt_tokens = limit
        self.max_completion_chars = max_completion_chars
        self.pad_id = int(getattr(self.tokenizer, "pad_id", 0) or 0)
        self.stop_tokens = set(getattr(self.tokenizer, "stop_tokens", None) or [])

        if method == "yes_no":
            yes = {self._first_token(w) for w in yes_words}
            no = {self._first_token(w) for w in no_words}
            yes.discard(None)
            no.discard(None)
            shared = yes & no  # e.g. a bare space token starting both " Yes" and " No"
            self.yes_ids, self.no_ids = sorted(yes - shared), sorted(no - shared)
            if not self.yes_ids or not self.no_ids:
                raise ValueError(
                    f"yes_words {list(yes_words)} and no_words {list(no_words)} leave no distinct first tokens"
                )
        elif method == "score_tokens":
            if self.max_score < 1:
                raise ValueError(f"max_score must be >= 1, got {max_score}")
            ids = []
            for k in range(self.max_score + 1):
                tokens = self.tokenizer.encode(str(k), add_bos=False, add_eos=False)
                if len(tokens) != 1:
                    raise ValueError(
                        f"score {k} is {len(tokens)} tokens for this tokenizer; score_tokens needs one token "
                        f"per score: lower max_score or use method='generate'"
                    )
                ids.append(tokens[0])
            self.score_ids = ids

    def _first_token(self, word: str) -> Optional[int]:
        tokens = self.tokenizer.encode(word, add_bos=False, add_eos=False)
        return tokens[0] if tokens else None

    def _prompt_tokens(self, batch: RewardBatch, i: int) -> List[int]:
        text = format_rubric(self.rubric, rubric_fields(batch.sample(i), self.max_completion_chars))
        if self.chat:
            from torchtune.data import Message

            from torchtune_grpo.models.chat_prompts import tokenize_chat_prompt

            tokens = tokenize_chat_prompt(
                self.tokenizer,
                [Message(role="user", content=text), Message(role="assistant", content="", eot=False)],
            )
        else:
            tokens = list(self.tokenizer.encode(text, add_bos=True, add_eos=False))
        return tokens[-self.max_prompt_tokens :]

    def _next_logits(self, rows: List[List[int]]) -> torch.Tensor:
        """Next-token logits after each row, ``[B, V]`` float32."""
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        tokens = torch.full((len(rows), int(lengths.max())), self.pad_id, dtype=torch.long, device=self.device)
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        with _last_positions_only(self.model, lengths - 1):
            logits = self.model(tokens)
        if logits.shape[1] != 1:  # full logits (not a torchtune decoder): pick the last positions
            logits = logits[torch.arange(len(rows), device=self.device), lengths - 1].unsqueeze(1)
        return logits[:, 0].float()

    def _score_rows(self, rows: List[List[int]]) -> List[Any]:
        if self.method == "generate":
            return self._generate_scores(rows)
        logp = torch.log_softmax(self._next_logits(rows), dim=-1)
        if self.method == "yes_no":
            diff = torch.logsumexp(logp[:, self.yes_ids], -1) - torch.logsumexp(logp[:, self.no_ids], -1)
            return torch.sigmoid(diff).tolist()
        probs = torch.softmax(logp[:, self.score_ids], dim=-1)
        values = torch.arange(self.max_score + 1, dtype=probs.dtype, device=probs.device)
        return ((probs * values).sum(-1) / self.max_score).tolist()

    def _generate_scores(self, rows: List[List[int]]) -> List[Any]:
        generated: List[List[int]] = [[] for _ in rows]
        done = [False] * len(rows)
        current = [list(r) for r in rows]
        for _ in range(self.max_new_tokens):
            next_ids = self._next_logits(current).argmax(-1).tolist()
            for b, t in enumerate(next_ids):
                if done[b]:
                    continue
                if t in self.stop_tokens:
                    done[b] = True
                    continue
                generated[b].append(t)
                current[b].append(t)
            if all(done):
                break
        scores: List[Any] = []
        for ids in generated:
            try:
                scores.append(parse_score(self.tokenizer.decode(ids), float(self.max_score)))
            except ValueError as e:
                scores.append(e)  # this sample fails; the others keep their scores
        return scores

    def __call__(self, batch: RewardBatch) -> List[Any]:
        n = len(batch.completions)
        rows = [self._prompt_tokens(batch, i) for i in range(n)]
        scores: List[Any] = []
        with torch.inference_mode():
            for start in range(0, n, self.batch_size):
                scores.extend(self._score_rows(rows[start : start + self.batch_size]))
        return [s if isinstance(s, BaseException) or math.isfinite(s) else ValueError("judge score is NaN") for s in scores]

    def __repr__(self) -> str:
        return f"ModelJudge(method={self.method!r}, device={str(self.device)!r})"
