"""Per-token log-probabilities, computed chunk by chunk.

With Qwen's vocabulary (V = 151,936) the logits of a GRPO batch are the largest tensor of the whole step:
64k tokens x V x 4 bytes is 39 GB in fp32. Nothing here ever builds the full ``[B, T, V]`` tensor: the
output projection, log-softmax and gather run on ``chunk_size`` tokens at a time, and when gradients are
needed each chunk is recomputed in backward, so at most one chunk of logits is alive in forward or backward.

For a plain bias-free projection (``nn.Linear`` or torchtune's ``TiedLinear``: every torchtune decoder's
output layer) a fused autograd function does this with hand-written gradients: backward recomputes a
chunk's logits, turns them into the logits' gradient in place, and accumulates the weight's gradient into
one buffer with ``addmm_``. Peak working memory is about two ``[chunk_size, V]`` fp32 buffers, and no
per-chunk ``[V, D]`` weight-gradient temporaries (docs/benchmarks/memory.md has the measurements). When all the
tokens fit in one chunk, forward keeps that chunk's logits for backward instead (one ``[tokens, V]``
buffer, held from forward to backward; it saves a quarter of the projection's work). Any other
projection takes the generic path: activation checkpointing per chunk.

The fused head's matrix products run in one of :data:`HEAD_PRECISIONS` (the config's ``logprob_head``):
``fp32`` multiplies in the weight's dtype (fp32 master weights: the fp32 rate of the device), ``bf16``
rounds the chunk's hidden states and the weight to bf16 and accumulates in fp32 with fp32 output (the
tensor-core rate); the log-sum-exp, log-softmax and gradients of the logits stay fp32 in both, chunk by
chunk. :func:`set_head_precision` sets it on a model; the generic path computes in the projection's own dtype.
"""

from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchtune_grpo.models.head_precision import (
    bf16_mm, head_matmul_kernel, HEAD_PRECISIONS, project_chunk, resolve_head_precision, set_head_precision,
)

__all__ = [
    "HEAD_PRECISIONS", "TokenLogprobs", "chunked_logprobs", "head_matmul_kernel", "replace_unembed",
    "sequence_logprobs", "set_head_precision",
]



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
    # H = lse - sum_v p_v z_v on logits shifted by their max (shift-invariant): the sum then has terms of the
    # size of log p, not of the logits (unshifted logits ~20-50 cost up to 1e-2 nats in fp32; -sum p log p
    # from log_softmax 8e-5). When only logged, keep it out of the graph: its backward would cost more
    # [C, V] passes for a gradient of zero.
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        shifted = logits - logits.detach().amax(dim=-1, keepdim=True)
        entropy = torch.logsumexp(shifted, dim=-1) - (torch.softmax(shifted, dim=-1) * shifted).sum(-1)
    return torch.stack([logp, entropy], dim=-1)  # [C, 2]


def _projection_weight(project: Callable[[torch.Tensor], torch.Tensor]) -> Optional[torch.Tensor]:
    """The ``[V, D]`` weight of a bias-free linear projection, or None when ``project`` is anything else."""
    if isinstance(project, nn.Linear) and type(project).forward is nn.Linear.forward and project.bias is None:
        weight = project.weight
    elif type(project).__name__ == "TiedLinear" and hasattr(project, "tied_module"):
        weight = project.tied_module.weight
    elif callable(getattr(project, "linear_weight", None)):
        # A head that knows whether it is a plain projection (a transformers policy's: TransformersHead).
        weight = project.linear_weight()
        if weight is None:
            return None
    else:
        return None
    # A sharded (DTensor) weight is only usable inside its FSDP module's forward: stay generic.
    if not isinstance(weight, torch.Tensor) or type(weight) not in (torch.Tensor, nn.Parameter):
        return None
    return weight


class _FusedChunkedLogprobs(torch.autograd.Function):
    """Per-token logprob (and entropy) of a linear projection, chunk by chunk, with manual gradients.

    Forward: ``z = (h W^T) / tau`` per chunk (fp32), ``logp_t = z_t[y_t] - lse_t``,
    ``H_t = lse_t - sum_v p_tv z_tv``. Backward, with ``p = softmax(z)`` and incoming ``g_lp, g_H``:
    ``dlogp_t/dz_tv = 1[v = y_t] - p_tv`` and ``dH_t/dz_tv = -p_tv (log p_tv + H_t)``, so
    ``dz = g_lp (onehot - p) - g_H p (log p + H)``, then ``dlogits = dz / tau``,
    ``dh = dlogits W`` and ``dW += dlogits^T h``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, entropy_grad, bf16):
        m = hidden.size(0)
        # The bf16 head: one bf16 copy of the weight per call ([V, D], half the fp32 weight's bytes).
        bf16_weight = weight.to(torch.bfloat16) if bf16 else None
        # One chunk holds everything: keep its logits for backward instead of recomputing them there (the
        # [m, V] buffer exists in forward anyway; with several chunks, backward recomputes chunk by chunk).
        keep_logits = m <= chunk_size and any(ctx.needs_input_grad[:2])
        ctx.kept_logits = None
        logp = torch.empty(m, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(m, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(m, dtype=torch.float32, device=hidden.device) if with_entropy else None
        for start in range(0, m, chunk_size):
            end = min(start + chunk_size, m)
            z = project_chunk(hidden[start:end], weight, bf16_weight)  # [C, V] fp32
            if temperature != 1.0:
                z.div_(temperature)
            # logsumexp by hand, so that exp(z - max) is the only other [C, V] buffer (and becomes p). z is
            # shifted in place to z - max <= 0: the entropy's dot product then sums terms of the size of
            # log p, not of the logits (with logits ~ 20-50, fp32 rounding of sum_v p_v z_v cost up to 1e-2
            # nats of entropy).
            z_max = z.amax(dim=-1)
            z.sub_(z_max[:, None])
            p = z.exp()
            total = p.sum(dim=-1)
            shifted_lse = total.log()  # logsumexp(z) - max
            lse[start:end] = z_max + shifted_lse
            logp[start:end] = z.gather(-1, targets[start:end, None]).squeeze(-1) - shifted_lse
            if with_entropy:
                p.div_(total[:, None])  # softmax
                # H = lse - sum_v p_v z_v (shift-invariant). The product is built in p's buffer (p is not
                # needed after): no third [C, V] tensor. Not einsum("cv,cv->c"): on CPU its batched dot
                # product was off by 4e-4 nats on SmolLM2's logits, mul + sum by 5e-7 (float64 reference).
                entropy[start:end] = shifted_lse - p.mul_(z).sum(dim=-1)
            if keep_logits:
                ctx.kept_logits = (z, shifted_lse)  # shifted logits (already divided by the temperature)
            del z, p
        ctx.save_for_backward(hidden, weight, targets, lse, entropy if with_entropy else lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        ctx.entropy_grad = entropy_grad
        ctx.bf16 = bf16
        ctx.mark_non_differentiable(lse)
        if with_entropy:
            if not entropy_grad:
                ctx.mark_non_differentiable(entropy)
            return logp, entropy
        return logp, lse  # lse: a non-differentiable placeholder, dropped by the caller

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        tau = ctx.temperature
        use_entropy = ctx.with_entropy and ctx.entropy_grad and g_entropy is not None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        bf16_weight = weight.to(torch.bfloat16) if ctx.bf16 else None
        m = hidden.size(0)
        for start in range(0, m, ctx.chunk_size):
            end = min(start + ctx.chunk_size, m)
            h = hidden[start:end]
            if ctx.kept_logits is not None:
                kept, shifted_lse = ctx.kept_logits
                z = kept - shifted_lse[:, None]  # log p; a new buffer: backward may run again
            else:
                z = project_chunk(h, weight, bf16_weight)
                if tau != 1.0:
                    z.div_(tau)
                z.sub_(lse[start:end, None])  # log p
            p = torch.exp(z)
            g_lp = g_logp[start:end, None].float()
            if use_entropy:
                # dz = -g_H p (log p + H) - g_lp p, built in place in z.
                z.add_(entropy[start:end, None]).mul_(p).mul_(-g_entropy[start:end, None].float())
                z.addcmul_(p, g_lp, value=-1.0)
                del p
            else:
                z = p.mul_(-g_lp)
                del p  # the same buffer as z now; keep no second name for it past this chunk
            rows = torch.arange(end - start, device=z.device)
            z[rows, targets[start:end]] += g_lp.squeeze(-1)
            if tau != 1.0:
                z.div_(tau)
            if bf16_weight is not None:  # bf16 products, fp32 accumulation into fp32 gradients
                dz = z.to(torch.bfloat16)
                del z
                if need_h:
                    grad_h[start:end] = bf16_mm(dz, bf16_weight).to(grad_h.dtype)
                if need_w and grad_w.dtype == torch.float32:  # fp32 master weights: accumulate in place
                    bf16_mm(dz.t(), h.to(torch.bfloat16), out=grad_w)
                elif need_w:  # bf16 weights (bf16_pure): the chunk's product rounded once, as the fp32 head's
                    grad_w.add_(bf16_mm(dz.t(), h.to(torch.bfloat16)).to(grad_w.dtype))
                del dz
                continue
            dz = z.to(weight.dtype)
            del z
            if need_h:
                grad_h[start:end] = dz @ weight
            if need_w:
                grad_w.addmm_(dz.t(), h)
            del dz
        return grad_h, grad_w, None, None, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    *,
    temperature: float = 1.0,
    chunk_size: int = 512,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    fused: bool = True,
    head_precision: Optional[str] = None,
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
        fused (bool): use the fused function with manual gradients when ``project`` is a plain bias-free
            linear layer (see the module docstring); False always uses per-chunk checkpointing.
            Default is True.
        head_precision (Optional[str]): the fused head's products, one of :data:`HEAD_PRECISIONS`; None: what
            :func:`set_head_precision` set on ``project`` (``"fp32"`` when nothing). The generic path ignores it.
            Default is None.

    Returns:
        TokenLogprobs: ``logprobs`` and optional ``entropy``, each ``[B, T]`` float32.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    b, t, d = hidden.shape
    flat_hidden = hidden.reshape(b * t, d)
    flat_targets = targets.reshape(b * t)
    weight = _projection_weight(project) if fused else None
    if weight is not None:
        bf16 = resolve_head_precision(project, head_precision) == "bf16"
        logp, entropy = _FusedChunkedLogprobs.apply(
            flat_hidden, weight, flat_targets, temperature, chunk_size, with_entropy, entropy_grad, bf16
        )
        return TokenLogprobs(logp.reshape(b, t), entropy.reshape(b, t) if with_entropy else None)
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
