"""Three facts about a torchtune checkpointer that torchtune 0.6.1 keeps only in private attributes.

``FullModelHFCheckpointer`` (and this project's :class:`~torchtune_grpo.models.HFCheckpointer`, which mirrors
it) has no public accessor for where it writes, which architecture it converts, or the model's
``config.json``; the recipes need all three (to move a save into place, to name the architecture in a PEFT
adapter and to write its config). They are read here and only here, so a torchtune with public accessors
changes one file.
"""

from pathlib import Path
from typing import Any, Dict

__all__ = ["backend_override", "epoch_output_dir", "hf_config", "instantiate_checkpointer", "model_type_name"]


def epoch_output_dir(checkpointer: Any, epoch: int) -> Path:
    """Where ``checkpointer.save_checkpoint(..., epoch=epoch)`` writes: ``<its output_dir>/epoch_<epoch>``."""
    return Path(checkpointer._output_dir) / f"epoch_{epoch}"


def model_type_name(checkpointer: Any) -> str:
    """The architecture it converts, as torchtune's ``ModelType`` name (``"LLAMA3"``, ``"QWEN2"``, ...)."""
    return checkpointer._model_type.name


def hf_config(checkpointer: Any) -> Dict[str, Any]:
    """The checkpoint directory's ``config.json``, as the checkpointer read it."""
    return checkpointer._config


def instantiate_checkpointer(cfg: Any, **overrides: Any) -> Any:
    """The config's ``checkpointer`` component, told the policy's ``model.backend`` when it takes one.

    :class:`~torchtune_grpo.models.HFCheckpointer` converts to torchtune's names or keeps transformers' own
    depending on the backend; forcing ``model.backend`` in the config must reach it too, so the two cannot
    disagree. Other checkpointers get only ``overrides``.
    """
    from torchtune import config as tt_config

    return tt_config.instantiate(cfg.checkpointer, **{**backend_override(cfg), **overrides})


def backend_override(cfg: Any) -> Dict[str, Any]:
    """``{"backend": model.backend}`` when the config forces one and its checkpointer takes it, else ``{}``."""
    backend = cfg.get("model", {}).get("backend", None) if hasattr(cfg, "get") else None
    if backend is not None and str(cfg.checkpointer.get("_component_", "")).endswith("HFCheckpointer"):
        return {"backend": backend}
    return {}
