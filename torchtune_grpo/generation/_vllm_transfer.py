"""A vLLM weight-transfer engine that needs no GPU: the trainer's weights through shared memory.

vLLM 0.32's RL API moves a trainer's weights into a running server in four calls (``init_weight_transfer_engine``,
then per version ``start_weight_update``, ``update_weights`` once per chunk, ``finish_weight_update``), each
served by a *weight-transfer engine* that vLLM builds inside every worker from ``--weight-transfer-config``.
The engines vLLM ships (NCCL, CUDA IPC, ...) need CUDA. This one needs a file system both sides see: the trainer
writes a chunk of weights as a safetensors file (in ``/dev/shm``, i.e. memory), ``update_weights`` names the
file, and the worker maps it and hands the tensors to the model's own ``load_weights`` inside vLLM's layerwise
reload, so kernels that repack their weights (vLLM's CPU linear layers) are rebuilt from the new values.

It runs inside vLLM's worker processes, which import this module only through the package's vLLM plugin
(:mod:`torchtune_grpo.generation.vllm_plugin`, an entry point vLLM loads in every process it starts), under
the backend name :data:`BACKEND`. The trainer's side is :class:`~torchtune_grpo.generation.VLLMServerGenerator`.
"""

import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from torchtune_grpo.generation._vllm import finish_reload
from torchtune_grpo.generation._vllm_moe import moe_layers_in
from torchtune_grpo.generation.vllm_plugin import BACKEND

__all__ = ["BACKEND", "SharedMemoryInitInfo", "SharedMemoryUpdateInfo", "SharedMemoryWeightTransferEngine"]


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """What the trainer says at ``init_weight_transfer_engine``.

    Attributes:
        directory (str): where the trainer writes its chunks; the worker checks that it sees it (a server on
            another machine, or in a container without the trainer's ``/dev/shm``, fails here, not later).
    """

    directory: str


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    """One ``update_weights`` call: a chunk of weights in one file.

    Attributes:
        path (str): the safetensors file (Hugging Face parameter names).
        num_tensors (int): how many tensors the trainer wrote (a truncated file fails the update).
    """

    path: str
    num_tensors: int


class SharedMemoryWeightTransferEngine(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
    """vLLM's side of the transfer: load each named file into the model, inside a layerwise reload."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        if not os.path.isdir(init_info.directory):
            raise ValueError(
                f"{BACKEND} weight transfer: this vLLM server does not see the trainer's staging directory "
                f"{init_info.directory!r} (the server must run on the trainer's machine and see its files)"
            )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._moe_layers = set()  # MoE layers whose experts this version reloads (prepacked again at the end)
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the next step must see the copies (the base class's sync needs an accelerator)

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        with safe_open(update_info.path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            if len(names) != update_info.num_tensors:
                raise ValueError(
                    f"{BACKEND} weight transfer: {update_info.path} holds {len(names)} tensors, the trainer wrote "
                    f"{update_info.num_tensors}"
                )
            self._moe_layers.update(moe_layers_in(names))
            self.model.load_weights((name, f.get_tensor(name)) for name in names)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        finish_reload(self.model, self._moe_layers)

    def shutdown(self) -> None:
        """Nothing is held between updates (the trainer deletes its files)."""
