"""The collectives a training run needs, over the default process group, as the callables the stages take.

The stages (:class:`~torchtune_grpo.training.update.PolicyUpdate`, :class:`~torchtune_grpo.training.experience.ExperienceBuilder`,
:class:`~torchtune_grpo.rollouts.producer.RolloutProducer`, the metrics) never touch ``torch.distributed``: they take
``all_reduce_sum``-style callables, so tests run them in one process without a process group
(:func:`~torchtune_grpo.metrics.sums.one_process_sum`) and the recipes hand them these.
"""

import os
from typing import Any, List

import torch
import torch.distributed as dist
from torchtune import training

from torchtune_grpo.metrics.sums import Reduce

__all__ = ["Collectives", "init_process_group"]


def init_process_group(device_type: str) -> None:
    """The default process group for ``device_type``'s backend (gloo for ``cpu``, NCCL for ``cuda``).

    ``tune run`` without ``--nproc_per_node`` runs the recipe in-process, without torchrun's environment: it then
    gets a one-process group, so the collectives and state-dict gathering are the same on 1 process as on 64
    (FSDP2 there only with ``fsdp_single_process``). Its store is in memory: no port to pick, and so none that
    another process could take between the pick and the bind, nor one whose store another job's ranks could join.
    """
    backend = training.get_distributed_backend(device_type)
    if training.is_distributed():
        dist.init_process_group(backend)
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


class Collectives:
    """Reductions and gathers over every rank of the default process group (which must exist).

    Args:
        device (torch.device): where the reduced tensors live (the backend's device: gloo CPU, NCCL CUDA).
        world_size (int): the number of ranks.
    """

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.device = device
        self.world_size = world_size

    def all_reduce(self, values: List[float], op: Reduce = Reduce.SUM) -> List[float]:
        """``values`` reduced elementwise over ranks in float64: summed, or the maximum.

        Args:
            values (List[float]): this rank's values, the same length on every rank.
            op (Reduce): ``Reduce.SUM`` or ``Reduce.MAX``. Default is ``Reduce.SUM``.

        Returns:
            List[float]: the reduced values, the same on every rank.
        """
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op is Reduce.MAX else dist.ReduceOp.SUM)
        return t.tolist()

    def sum(self, values: List[float]) -> List[float]:
        """``values`` summed elementwise over ranks (global token and sequence counts, metric sums)."""
        return self.all_reduce(values, Reduce.SUM)

    def max(self, value: float) -> float:
        """The largest ``value`` of any rank (the weight-sync check's worst difference)."""
        return self.all_reduce([value], Reduce.MAX)[0]

    def gather_objects(self, value: Any) -> List[Any]:
        """Every rank's ``value`` in rank order (pickled: small objects only, e.g. RNG states)."""
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def gather_cat(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D CPU tensor ``[n_rank]``, concatenated in rank order ``[sum n_rank]`` (token
        selection's global entropy threshold)."""
        return torch.cat(self.gather_objects(values))
