"""The package's vLLM plugin: registers the shared-memory weight-transfer engine in every vLLM process.

vLLM runs the ``vllm.general_plugins`` entry points (``pyproject.toml``) in each process it starts, the API
server and its engine and worker processes alike, so a ``vllm serve ... --weight-transfer-config
'{"backend": "torchtune_grpo_shm"}'`` started anywhere this package is installed can receive a trainer's
weights (:class:`~torchtune_grpo.generation.VLLMServerGenerator`). Importing this module imports no vLLM.
"""

__all__ = ["BACKEND", "TRANSFERS", "register"]

#: The ``--weight-transfer-config`` backend name of the shared-memory engine.
BACKEND = "torchtune_grpo_shm"

#: ``generation.weight_transfer`` values -> the server's ``--weight-transfer-config`` backend.
TRANSFERS = {"shm": BACKEND, "nccl": "nccl"}


def register() -> None:
    """Register :data:`BACKEND` with vLLM's weight-transfer factories, the server's and the trainer's (lazily:
    vLLM imports an engine on first use)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, name in (
        (WeightTransferEngineFactory, "torchtune_grpo.generation._vllm_transfer", "SharedMemoryWeightTransferEngine"),
        (WeightTransferTrainerFactory, "torchtune_grpo.generation._vllm_trainer_transfer", "SharedMemoryTrainerEngine"),
    ):
        try:
            factory.register_engine(BACKEND, module, name)
        except ValueError:
            pass  # already registered: vLLM may load plugins more than once in a process
