"""The trainer's side of a weight transfer into a vLLM server, through vLLM's trainer-side API.

vLLM 0.32 pairs each worker-side weight-transfer engine with a trainer-side one, built by
``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)`` and driven by
``send_weights()``: the engine reads a ``WeightSource`` (names, dtypes, shapes, then the tensors) and talks to
the server through a *client* (four calls: ``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``). :class:`~torchtune_grpo.generation.VLLMServerGenerator` uses it
for both transfers it offers:

- ``shm``: :class:`SharedMemoryTrainerEngine` (here), the pair of the server-side
  :class:`~torchtune_grpo.generation._vllm_transfer.SharedMemoryWeightTransferEngine`: a chunk is written as a
  safetensors file that the server maps. No GPU needed; the server must see the trainer's files.
- ``nccl``: vLLM's own ``NCCLTrainerWeightTransferEngine``: the trainer's GPU broadcasts each chunk straight
  into the server's GPUs over an NCCL group of the trainer rank and the server's workers.

A weight version is sent chunk by chunk (``chunk_mib`` bounds the memory a chunk holds), so one version is
several ``send_weights`` rounds inside one ``start_weight_update`` / ``finish_weight_update`` bracket that the
generator drives itself (it names the version there). :class:`VersionBracketClient` is the client that lets it:
the engine's own ``start``/``finish`` calls are no-ops, ``update_weights`` goes to the server.
"""

import itertools
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterator, List, Optional, Tuple

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from torchtune_grpo.generation._vllm_server_process import _free_port, VLLMServer
from torchtune_grpo.generation.vllm_plugin import BACKEND, TRANSFERS

__all__ = [
    "ChunkSource",
    "SharedMemoryTrainerEngine",
    "SharedMemoryTrainerInitInfo",
    "VersionBracketClient",
    "open_trainer_transfer",
]


class ChunkSource(WeightSource):
    """A ``WeightSource`` over one chunk of already materialized, Hugging Face-named tensors.

    Args:
        tensors (Dict[str, torch.Tensor]): name -> tensor, in the order they are sent.
    """

    def __init__(self, tensors: Dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def metadata(self) -> List[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())


class VersionBracketClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over a :class:`VLLMServer`, leaving the version bracket to the caller.

    ``start_weight_update`` and ``finish_weight_update`` do nothing: the generator opens a version once, sends
    it in several chunks (each a ``send_weights`` that calls both), and closes it naming the version.

    Args:
        server (VLLMServer): the server.
        timeout (float): seconds one ``update_weights`` call may take.
    """

    def __init__(self, server: VLLMServer, timeout: float) -> None:
        self.server = server
        self.timeout = timeout

    def init_weight_transfer_engine(self, init_info: Dict[str, Any]) -> None:
        self.server.post("/init_weight_transfer_engine", {"init_info": init_info}, timeout=self.timeout)

    def start_weight_update(self) -> None:
        """A no-op: the version was opened by the generator."""

    def update_weights(self, update_info: Any) -> None:
        self.server.post("/update_weights", {"update_info": update_info}, timeout=self.timeout)

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        """A no-op: the generator closes the version, naming it."""


@dataclass
class SharedMemoryTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the shared-memory transfer.

    Attributes:
        directory (str): where chunks are written (the server checks at init that it sees it).
    """

    backend: ClassVar[str] = BACKEND

    directory: str = "/dev/shm"


class SharedMemoryTrainerEngine(TrainerWeightTransferEngine[SharedMemoryTrainerInitInfo]):
    """Writes each round's source as one safetensors file and names it in ``update_weights``.

    The file is deleted when the server has loaded it (or failed to), so nothing is left in memory.
    """

    init_info_cls = SharedMemoryTrainerInitInfo
    _files = itertools.count()

    def __init__(self, *, client: Any, source: Optional[WeightSource] = None, is_sender: bool = True,
                 directory: str = "/dev/shm") -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.directory = directory

    @classmethod
    def trainer_init(cls, init_info: SharedMemoryTrainerInitInfo, *, client: Any,
                     source: Optional[WeightSource] = None) -> "SharedMemoryTrainerEngine":
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, directory=init_info.directory)
        if engine.is_sender:
            client.init_weight_transfer_engine({"directory": init_info.directory})
        return engine

    def send_weights(self) -> None:
        from safetensors.torch import save_file

        if self.source is None:
            raise ValueError(f"{BACKEND} weight transfer: no WeightSource to send")
        # A private contiguous CPU copy of each: safetensors refuses tensors that share storage (ties, views).
        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in self.source}
        if not self.is_sender:
            return
        path = Path(self.directory) / f"torchtune_grpo_{os.getpid()}_{id(self)}_{next(self._files)}.safetensors"
        self.client.start_weight_update()
        save_file(tensors, str(path))
        try:
            self.client.update_weights({"path": str(path), "num_tensors": len(tensors)})
        finally:
            path.unlink(missing_ok=True)
        self.client.finish_weight_update()


def open_trainer_transfer(
    kind: str,
    server: VLLMServer,
    *,
    timeout: float,
    staging_dir: str,
    address: Optional[str] = None,
) -> TrainerWeightTransferEngine:
    """Build and rendezvous the trainer side of ``kind`` with ``server`` (its ``init_weight_transfer_engine``).

    Args:
        kind (str): ``shm`` or ``nccl`` (``generation.weight_transfer``).
        server (VLLMServer): this trainer rank's server, started with the matching ``--weight-transfer-config``.
        timeout (float): seconds one server call may take.
        staging_dir (str): ``shm``: where chunks are written.
        address (Optional[str]): ``nccl``: this trainer's address as the server's workers reach it (the NCCL
            rendezvous). Default is None: ``127.0.0.1`` for a server on this machine, else this host's name.

    Returns:
        TrainerWeightTransferEngine: ready for rounds of ``source = ChunkSource(...)`` and ``send_weights()``.

    Raises:
        ValueError: an unknown ``kind``, or ``nccl`` without CUDA on the trainer.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from torchtune_grpo.generation.vllm_plugin import register

    register()  # the trainer process runs no vLLM engine, so vLLM has not loaded the package's plugin here
    client = VersionBracketClient(server, timeout)
    if kind == "shm":
        info: TrainerInitInfo = SharedMemoryTrainerInitInfo(directory=staging_dir, rank=0)
    elif kind == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if not torch.cuda.is_available():
            raise ValueError("generation.weight_transfer: nccl sends from the trainer's GPU; this trainer has no CUDA "
                             "(use shm)")
        workers = int(server.get("/get_world_size")["world_size"])  # tensor x pipeline x data parallel
        host = server.url.split("//", 1)[-1].rsplit(":", 1)[0]
        if address is None:
            address = "127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.getfqdn()
        # Each trainer rank is the sender (NCCL rank 0) of its own group with its own server's workers.
        info = NCCLTrainerInitInfo(master_address=address, master_port=_free_port(), world_size=1 + workers, rank=0)
    else:
        raise ValueError(f"generation.weight_transfer must be one of {sorted(TRANSFERS)}, got {kind!r}")
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=ChunkSource({}))
