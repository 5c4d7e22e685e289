"""The routers of a transformers mixture-of-experts model: record, force (replay) and collect their choices.

Every MoE family of transformers 5.x routes through a ``<Family>TopKRouter`` module whose forward takes the
hidden states flattened to ``[tokens, hidden]`` (``tokens = batch x sequence``, row-major) and returns
``(router_logits [tokens, E], router_scores [tokens, k], router_indices [tokens, k])``; the experts block then
mixes the ``k`` chosen experts' outputs with the scores. :class:`RouterHooks` observes those modules with forward
hooks and can

- **record** the chosen indices of every forward (the transformers engine does this while it samples:
  :mod:`torchtune_grpo.generation._transformers`);
- **force** given indices (rollout routing replay, R3: Ma et al. 2025, "Stabilizing MoE Reinforcement Learning
  by Aligning Training and Inference Routers", arXiv:2510.11370): the hook returns ``(router_logits,
  scores_at_forced, forced)``, the scores recomputed from the live logits with the family's own rule (below), so
  the router's weights still get gradients through the scores; a token whose forced entry holds -1 keeps the
  router's own choice;
- **collect** the logits, the indices used and the router's own choice of a forward, for the router metrics
  and losses (:mod:`torchtune_grpo.loss.router`).

Score rules, as each family's router computes them from its logits:

- ``softmax_then_topk`` (qwen3_moe, qwen3_5_moe, olmoe, mixtral): softmax over all experts in fp32, gather the
  chosen ``k``, renormalise them to sum 1 when the family does (``norm_topk_prob``; always for mixtral and
  qwen3_5_moe);
- ``topk_then_softmax`` (gpt_oss): softmax over the ``k`` chosen logits.

Routes are per *MoE layer* (routers in module order; a dense layer between them has none), one ``[tokens, k]``
tensor per layer and forward.
"""

import weakref
from contextlib import contextmanager
from typing import Dict, Iterator, List, NamedTuple, Optional

import torch
from torch import nn

__all__ = [
    "CollectedRouting", "RouterHooks", "find_routers", "is_moe", "moe_shape", "router_hooks", "router_scores",
    "SCORE_RULES",
]

#: The score rule of each known router class (see the module docstring).
SCORE_RULES: Dict[str, str] = {
    "Qwen3MoeTopKRouter": "softmax_then_topk",
    "Qwen3_5MoeTopKRouter": "softmax_then_topk",
    "OlmoeTopKRouter": "softmax_then_topk",
    "MixtralTopKRouter": "softmax_then_topk",
    "GptOssTopKRouter": "topk_then_softmax",
}
# Families whose router always renormalises the chosen probabilities (no ``norm_topk_prob`` attribute).
_ALWAYS_NORMALISED = {"MixtralTopKRouter", "Qwen3_5MoeTopKRouter"}


def find_routers(model: nn.Module) -> List[nn.Module]:
    """The ``*TopKRouter`` modules of ``model``, in module (layer) order; empty for a dense model."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` has transformers MoE routers."""
    return bool(find_routers(model))


def moe_shape(model: nn.Module) -> "tuple[int, int, int]":
    """``(num_moe_layers, num_experts, top_k)`` of ``model``'s routers.

    Raises:
        ValueError: when the model has no routers, or its routers differ in experts or ``k``.
    """
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts routers (*TopKRouter modules)")
    shapes = {(int(r.num_experts), int(r.top_k)) for r in routers}
    if len(shapes) != 1:
        raise ValueError(f"{type(model).__name__}: its routers differ in (num_experts, top_k): {sorted(shapes)}")
    (experts, k), = shapes
    return len(routers), experts, k


def router_scores(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The gate weights of experts ``indices`` under ``logits``, by ``router``'s family rule (differentiable).

    Args:
        router (nn.Module): a ``*TopKRouter`` of :data:`SCORE_RULES`.
        logits (torch.Tensor): ``[tokens, E]`` its live logits.
        indices (torch.Tensor): ``[tokens, k]`` long, the experts to weigh.

    Returns:
        torch.Tensor: ``[tokens, k]`` float scores (the caller casts to the router's output dtype).

    Raises:
        ValueError: for a router class without a known rule (named, with the known ones).
    """
    name = type(router).__name__
    rule = SCORE_RULES.get(name)
    if rule is None:
        raise ValueError(f"routing replay does not know how {name} turns logits into gate weights; known routers: "
                         f"{sorted(SCORE_RULES)} (set moe.routing_replay: off)")
    if rule == "topk_then_softmax":
        return torch.softmax(logits.gather(-1, indices), dim=-1)
    chosen = torch.softmax(logits.float(), dim=-1).gather(-1, indices)  # [tokens, k]
    if name in _ALWAYS_NORMALISED or getattr(router, "norm_topk_prob", False):
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return chosen


class CollectedRouting(NamedTuple):
    """One router's collected forward.

    Attributes:
        logits (torch.Tensor): ``[tokens, E]`` router logits (with their graph in a training forward).
        used (torch.Tensor): ``[tokens, k]`` long, the experts the forward used (forced or the router's own).
        own (torch.Tensor): ``[tokens, k]`` long, the router's own top-k choice.
    """

    logits: torch.Tensor
    used: torch.Tensor
    own: torch.Tensor


class RouterHooks:
    """Forward hooks on every router of a model (see the module docstring); get one with :func:`router_hooks`.

    Args:
        model (nn.Module): a transformers MoE model (or a wrapper holding one, FSDP2-sharded or not).
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        self.num_layers, self.num_experts, self.top_k = moe_shape(model)
        self._layer = {id(r): i for i, r in enumerate(self.routers)}
        self._forced: Optional[List[torch.Tensor]] = None  # per layer [tokens, k] long
        self._recorded: Optional[List[List[torch.Tensor]]] = None
        self._collected: Optional[List[List[CollectedRouting]]] = None
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, module: nn.Module, args: tuple, output: tuple) -> Optional[tuple]:
        logits, scores, own = output
        layer = self._layer[id(module)]
        used, changed = own, None
        if self._forced is not None:
            forced = self._forced[layer].to(device=own.device, dtype=torch.long)
            if forced.shape != own.shape:
                raise ValueError(f"replayed routes of MoE layer {layer} have shape {tuple(forced.shape)}, the router "
                                 f"routed {tuple(own.shape)} (tokens, top_k): routes do not line up with the tokens")
            unknown = (forced < 0).any(dim=-1, keepdim=True)  # the engine reported nothing: own choice
            used = torch.where(unknown, own, forced)
            changed = (logits, router_scores(module, logits, used).to(scores.dtype), used)
        if self._recorded is not None:
            self._recorded[layer].append(used.detach().to(device="cpu", dtype=torch.int16))
        if self._collected is not None:
            self._collected[layer].append(CollectedRouting(logits, used.detach(), own.detach()))
        return changed

    @contextmanager
    def forcing(self, routes: Optional[torch.Tensor]) -> Iterator[None]:
        """Force ``routes`` in the forwards (and activation-checkpoint recomputations) inside.

        Args:
            routes (Optional[torch.Tensor]): ``[B, S, num_layers, k]`` integer routes of a ``[B, S]`` forward, -1
                where the router chooses itself; None: the routers' own choice (nothing forced).

        Raises:
            ValueError: when ``routes`` does not have ``num_layers`` layers and ``k`` entries.
        """
        previous = self._forced
        if routes is None:
            self._forced = None
        else:
            if routes.dim() != 4 or routes.size(2) != self.num_layers or routes.size(3) != self.top_k:
                raise ValueError(f"routes of shape {tuple(routes.shape)}; this model needs [batch, seq, "
                                 f"{self.num_layers} MoE layers, top_k {self.top_k}]")
            flat = routes.flatten(0, 1)  # [B*S, layers, k]: the routers see tokens row-major
            self._forced = [flat[:, i] for i in range(self.num_layers)]
        try:
            yield
        finally:
            self._forced = previous

    @contextmanager
    def recording(self) -> Iterator[List[List[torch.Tensor]]]:
        """Record the indices each router used, per layer and forward (int16, CPU), into the yielded lists."""
        self._recorded = [[] for _ in range(self.num_layers)]
        try:
            yield self._recorded
        finally:
            self._recorded = None

    @contextmanager
    def collecting(self) -> Iterator[List[List[CollectedRouting]]]:
        """Collect each router's logits, used and own indices per forward into the yielded lists.

        Leave it before ``backward``: an activation-checkpointed layer's recomputation runs the hooks again.
        """
        self._collected = [[] for _ in range(self.num_layers)]
        try:
            yield self._collected
        finally:
            self._collected = None

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, RouterHooks]" = weakref.WeakKeyDictionary()


def router_hooks(model: nn.Module) -> Optional[RouterHooks]:
    """The :class:`RouterHooks` of ``model`` (installed once, on first use), or None for a dense model."""
    hooks = _INSTALLED.get(model)
    if hooks is None:
        if not is_moe(model):
            return None
        hooks = _INSTALLED[model] = RouterHooks(model)
    return hooks
