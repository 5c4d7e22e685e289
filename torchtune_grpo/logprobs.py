"""Per-token log-probabilities, computed chunk by chunk.

With Qwen's vocabulary (V = 151,936) the logits of a GRPO batch are the largest tensor of the whole step:
64k tokens x V x 4 bytes is 39 GB in fp32. Nothing here ever builds the full ``[B, T, V]`` tensor: the
output projection, log-softmax and gather run on ``chunk_size`` tokens at a time, and when gradients are
needed each chunk is recomputed in backward (activation checkpointing), so at most one chunk of logits is
alive in forward or backward.
"""

from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["TokenLogprobs", "chunked_logprobs", "replace_unembed", "sequence_logprobs"]


class TokenLogprobs(NamedTuple):
    """Per-token outputs of :func:`sequence_logprobs`.

    Attributes:
        logprobs (torch.Tensor): log p(token_t | tokens_<t), shape ``[B, T]``, float32.
        entropy (Optional[torch.Tensor]): entropy of the predictive distribution at each position,
            shape ``[B, T]``, float32; None unless requested.
    """

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]


def _chunk_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> torch.Tensor:
    # [C, V] in fp32 whatever the model dtype: log-softmax in bf16 loses ~2 digits.
    logits = project(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # [C]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [C]
    if not with_entropy:
        return logp
    # H = logsumexp(z) - sum_v softmax(z)_v * z_v. When only logged, keep it out of the graph: its
    # backward would cost two more [C, V] passes for a gradient of zero.
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return torch.stack([logp, entropy], dim=-1)  # [C, 2]


def chunked_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    *,
    temperature: float = 1.0,
    chunk_size: int = 512,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> TokenLogprobs:
    """Log-probabilities of ``targets`` under ``softmax(project(hidden) / temperature)``, chunk by chunk.

    Args:
        hidden (torch.Tensor): final (normed) hidden states, shape ``[B, T, D]``.
        targets (torch.Tensor): token ids whose log-probability is wanted, shape ``[B, T]``.
        project (Callable[[torch.Tensor], torch.Tensor]): output projection ``[C, D] -> [C, V]``.
        temperature (float): sampling temperature the logits are divided by, so the log-probabilities
            are those of the distribution actually sampled from. Default is 1.0.
        chunk_size (int): tokens per chunk; peak extra memory is about ``2 x chunk_size x V x 4`` bytes.
            Default is 512.
        with_entropy (bool): also return the per-position entropy. Default is False.
        entropy_grad (bool): let gradients flow through the entropy (for an entropy bonus); False
            computes it as a constant, for logging only. Default is True.

    Returns:
        TokenLogprobs: ``logprobs`` and optional ``entropy``, each ``[B, T]`` float32.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    b, t, d = hidden.shape
    flat_hidden = hidden.reshape(b * t, d)
    flat_targets = targets.reshape(b * t)
    # Recompute each chunk's logits in backward instead of keeping them: that is the whole point.
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    outs = []
    for start in range(0, b * t, chunk_size):
        h = flat_hidden[start : start + chunk_size]
        y = flat_targets[start : start + chunk_size]
        if recompute:
            out = checkpoint(
                _chunk_logprobs,
                h,
                y,
                project,
                temperature,
                with_entropy,
                entropy_grad,
                use_reentrant=False,
            )
        else:
            out = _chunk_logprobs(h, y, project, temperature, with_entropy, entropy_grad)
        outs.append(out)
    out = torch.cat(outs, dim=0)
    if with_entropy:
        return TokenLogprobs(out[:, 0].reshape(b, t), out[:, 1].reshape(b, t))
    return TokenLogprobs(out.reshape(b, t), None)


@contextmanager
def replace_unembed(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Temporarily replace a torchtune decoder's ``unembed`` (final norm + output projection).

    Args:
        model (nn.Module): a :class:`~torchtune.modules.TransformerDecoder`.
        fn (Callable[[torch.Tensor], torch.Tensor]): called with the last layer's hidden states
            ``[B, L, D]``; what it returns is what ``model(...)`` returns.

    Yields:
        None
    """
    # torchtune's TransformerDecoder.forward ends with ``self.unembed(h)`` (final norm + output
    # projection). Replacing it on the instance keeps the projection inside forward, which matters
    # under FSDP2: the root module's parameters (norm, output, tied embeddings) are only guaranteed to be
    # unsharded while its forward runs.
    model.unembed = fn
    try:
        yield
    finally:
        del model.unembed


def sequence_logprobs(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    start: int = 0,
    temperature: float = 1.0,
    chunk_size: int = 512,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> TokenLogprobs:
    """Log-probability of every next token of ``tokens`` under a torchtune decoder.

    Position ``j`` of the result is ``log p(tokens[:, start + j + 1] | tokens[:, : start + j + 1])``.
    Sequences must be right-padded (no left padding), so a plain causal mask is correct and rows need
    no position ids; padded positions give garbage that the caller masks out.

    Args:
        model (nn.Module): a :class:`~torchtune.modules.TransformerDecoder` (FSDP-wrapped or not).
        tokens (torch.Tensor): token ids, shape ``[B, L]``.
        start (int): skip the first ``start`` predictions (typically the shortest prompt length - 1),
            so no logits are computed for positions that are prompt in every row. Default is 0.
        temperature (float): sampling temperature. Default is 1.0.
        chunk_size (int): tokens per logits chunk. Default is 512.
        with_entropy (bool): also return entropies. Default is False.
        entropy_grad (bool): see :func:`chunked_logprobs`. Default is True.

    Returns:
        TokenLogprobs: tensors of shape ``[B, L - 1 - start]``.
    """
    targets = tokens[:, start + 1 :]

    def unembed(h: torch.Tensor) -> torch.Tensor:
        h = model.norm(h[:, start:-1])  # [B, L-1-start, D]
        out = chunked_logprobs(
            h,
            targets,
            model.output,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )
        if out.entropy is None:
            # A fresh tensor, not a view: FSDP2 warns about (and in-place ops would break) views.
            return out.logprobs.clone()
        # Return everything through forward's output so FSDP's backward hooks see it.
        return torch.stack([out.logprobs, out.entropy], dim=-1)  # [B, T, 2]

    with replace_unembed(model, unembed):
        out = model(tokens)
    if with_entropy:
        return TokenLogprobs(out[..., 0], out[..., 1])
    return TokenLogprobs(out, None)
