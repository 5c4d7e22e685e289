"""Mixture-of-experts routes in the training layout, and the router terms of the update.

The engine's routes (``RolloutGroups.routed_experts``: per row ``[prompt + response, layers, k]``, position ``p``
the token at ``p``) are laid out like the training rows (:func:`layout_routes`: prompt then response from
position 0, -1 on padding), so a forward over some rows forces ``routes[rows, :width]`` exactly where those
tokens are. With ``moe.routing_replay: rollout`` the trainer's old, reference and policy forwards force them
(rollout routing replay, R3: arXiv:2510.11370); -1 entries (padding, the last sampled token, an engine that did
not report a token) keep the trainer's own routing.

:class:`RouterTerms` adds to each update micro-batch the load-balancing and z-losses of
:mod:`torchtune_grpo.loss.router` (token sums over the mini-batch's global real-token count, so micro-batch size
and process count do not change them) and, on the first pass over the rows, the metrics: the agreement of the
trainer's own top-k with the engine's, and tokens per expert.
"""

from typing import Callable, List, NamedTuple, Optional, Sequence

import torch

from torchtune_grpo.loss.router import expert_counts, load_balance_sum, z_loss_sum
from torchtune_grpo.metrics.sums import Key, Mean, StepSums, Value
from torchtune_grpo.models.moe_routing import CollectedRouting, is_moe, moe_shape

__all__ = ["LoadMaxOverMean", "RouterTerms", "expert_fractions", "layout_routes", "router_metrics"]


def layout_routes(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], routed: Sequence[torch.Tensor],
    seq_len: int,
) -> torch.Tensor:
    """Per-row routes laid out as the training rows: ``[N, seq_len, layers, k]`` int16, -1 off real tokens.

    Raises:
        ValueError: when a row's routes do not cover its ``prompt + response`` tokens or rows differ in shape
            (names the row).
    """
    shape = tuple(routed[0].shape[1:])
    out = torch.full((len(routed), seq_len, *shape), -1, dtype=torch.int16)
    for i, (p, r, route) in enumerate(zip(prompt_ids, response_ids, routed)):
        if route.dim() != 3 or tuple(route.shape) != (len(p) + len(r), *shape):
            raise ValueError(
                f"routed_experts of row {i} have shape {tuple(route.shape)}; the row has {len(p)} prompt + {len(r)} "
                f"response tokens, so [{len(p) + len(r)}, {shape[0]} layers, top_k {shape[1]}] was expected"
            )
        out[i, : route.size(0)] = route.to(torch.int16)
    return out


def expert_fractions(
    routes: torch.Tensor, lengths: Sequence[int], num_experts: int, all_reduce: Callable[[List[float]], List[float]],
) -> torch.Tensor:
    """The batch's routing-assignment fractions ``f`` per layer, over every process's real tokens.

    Args:
        routes (torch.Tensor): ``[N, L, layers, k]`` (:func:`layout_routes`).
        lengths (Sequence[int]): ``[N]`` real tokens per row.
        num_experts (int): ``E``.
        all_reduce (Callable[[List[float]], List[float]]): sums floats over processes.

    Returns:
        torch.Tensor: ``[layers, E]`` float64, each row summing to 1 (uniform where nothing was routed).
    """
    real = torch.arange(routes.size(1))[None, :] < torch.tensor(list(lengths))[:, None]  # [N, L]
    counts = torch.stack([
        expert_counts(routes[:, :, layer].reshape(-1, routes.size(3)), real.reshape(-1), num_experts)
        for layer in range(routes.size(2))
    ])  # [layers, E]
    counts = torch.tensor(all_reduce(counts.reshape(-1).tolist()), dtype=torch.float64).view_as(counts)
    total = counts.sum(-1, keepdim=True)
    return torch.where(total > 0, counts / total.clamp(min=1), torch.full_like(counts, 1.0 / num_experts))


class LoadMaxOverMean(NamedTuple):
    """A logged metric: tokens per expert, max over mean, per MoE layer, averaged over layers (1: balanced).

    Reads the reduced ``("moe", "load", layer, expert)`` counts.
    """

    num_layers: int
    num_experts: int

    def value(self, reduced) -> float:
        ratios = []
        for layer in range(self.num_layers):
            counts = [reduced[("moe", "load", layer, e)] for e in range(self.num_experts)]
            mean = sum(counts) / self.num_experts
            ratios.append(max(counts) / mean if mean else 0.0)
        return sum(ratios) / max(self.num_layers, 1)


def router_metrics(reduced) -> dict:
    """The router metrics declared over the reduced quantities (none for a dense policy)."""
    metrics = {}
    loads = [k for k in reduced if k[:2] == ("moe", "load")]
    if loads:
        metrics["moe/expert_load_max_over_mean"] = LoadMaxOverMean(
            1 + max(k[2] for k in loads), 1 + max(k[3] for k in loads))
    if ("moe", "compared") in reduced:
        metrics["moe/router_agreement"] = Mean(("moe", "agree"), ("moe", "compared"))
    for name in ("moe/load_balance_loss", "moe/z_loss"):
        if ("update", name) in reduced:
            metrics[name] = Value(("update", name))
    return metrics


class RouterTerms:
    """The router losses and metrics of one update (see the module docstring).

    Args:
        num_layers (int): MoE layers.
        num_experts (int): experts per layer.
        load_balance_coef (float): ``moe.load_balance_coef``. Default is 0.
        z_loss_coef (float): ``moe.z_loss_coef``. Default is 0.
    """

    def __init__(self, num_layers: int, num_experts: int, load_balance_coef: float = 0.0, z_loss_coef: float = 0.0):
        self.num_layers, self.num_experts = int(num_layers), int(num_experts)
        self.load_balance_coef, self.z_loss_coef = float(load_balance_coef), float(z_loss_coef)

    @classmethod
    def for_model(cls, model, load_balance_coef: float = 0.0, z_loss_coef: float = 0.0) -> Optional["RouterTerms"]:
        """The router terms of ``model`` (its routers' layers and experts), or None for a dense model."""
        if not is_moe(model):
            return None
        num_layers, num_experts, _ = moe_shape(model)
        return cls(num_layers, num_experts, load_balance_coef, z_loss_coef)

    def empty_sums(self, with_agreement: bool) -> StepSums:
        """Every key this rank reduces (zeros), so all ranks reduce the same keys."""
        sums = StepSums()
        keys: List[Key] = [("moe", "load", layer, e) for layer in range(self.num_layers) for e in range(self.num_experts)]
        if with_agreement:
            keys += [("moe", "agree"), ("moe", "compared")]
        for key in keys:
            sums.add(key, 0.0)
        return sums

    def micro_batch(
        self,
        collected: List[List[CollectedRouting]],
        real: torch.Tensor,
        engine_routes: Optional[torch.Tensor],
        fractions: Optional[torch.Tensor],
        num_real: float,
        sums: Optional[StepSums],
    ) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
        """The micro-batch's router terms.

        Args:
            collected (List[List[CollectedRouting]]): per layer, the one forward's collection.
            real (torch.Tensor): ``[n, S]`` bool, real tokens of the forward's rows.
            engine_routes (Optional[torch.Tensor]): ``[n, S, layers, k]`` the engine's routes (-1 unknown), or None.
            fractions (Optional[torch.Tensor]): ``[layers, E]`` the batch's ``f`` (needed with a load-balance
                coefficient), or None.
            num_real (float): the mini-batch's real tokens over all processes.
            sums (Optional[StepSums]): where to add the metrics (first pass over the rows), or None.

        Returns:
            tuple: the weighted loss to add (0-d, differentiable), and the load-balance and z-loss values (0-d,
            detached global-sum contributions, averaged over layers).
        """
        flat = real.reshape(-1)  # [n*S]
        lb = z = None
        for layer, forwards in enumerate(collected):
            if len(forwards) != 1:
                raise RuntimeError(f"MoE layer {layer} ran {len(forwards)} times in one forward")
            got = forwards[0]
            z_l = z_loss_sum(got.logits, flat.to(got.logits.device))
            z = z_l if z is None else z + z_l
            if fractions is not None:
                lb_l = load_balance_sum(got.logits, flat.to(got.logits.device), fractions[layer])
                lb = lb_l if lb is None else lb + lb_l
            if sums is not None:
                for e, c in enumerate(expert_counts(got.used, flat, self.num_experts).tolist()):
                    sums.add(("moe", "load", layer, e), c)
                if engine_routes is not None:
                    engine = engine_routes[:, :, layer].reshape(-1, engine_routes.size(3)).to(got.own.device).long()
                    known = flat.to(got.own.device) & (engine >= 0).all(-1)
                    same = (engine.sort(-1).values == got.own.sort(-1).values).all(-1) & known
                    sums.add(("moe", "agree"), float(same.sum()))
                    sums.add(("moe", "compared"), float(known.sum()))
        scale = 1.0 / (max(num_real, 1.0) * self.num_layers)
        z = z * scale
        lb = lb * scale if lb is not None else torch.zeros_like(z)
        if not (self.z_loss_coef or self.load_balance_coef):  # metrics only: nothing to differentiate
            return torch.zeros((), device=z.device), lb.detach(), z.detach()
        loss = self.z_loss_coef * z + self.load_balance_coef * lb
        return loss, lb.detach(), z.detach()
