"""Optional dependencies of the ecosystem adapters: import them only when used, and say which extra to install.

Each adapter imports its library inside the function that needs it, so ``import torchtune_grpo.envs`` works
without any of them; a missing one raises :class:`MissingExtraError` naming the pip extra
(``pip install "torchtune-grpo[reasoning-gym]"``), not a bare ``ModuleNotFoundError`` from deep inside.
"""

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "require"]

#: pip extra -> (the module it provides, the distribution and version range pyproject.toml declares)
EXTRAS = {
    "reasoning-gym": ("reasoning_gym", "reasoning-gym>=0.1.25,<0.2"),
    "openenv": ("openenv.core", "openenv-core>=0.3,<0.4"),
    "verifiers": ("verifiers.v1", "verifiers>=0.4,<0.5"),
}


class MissingExtraError(ImportError):
    """An adapter was used without its optional dependency installed; the message names the pip extra."""


def require(extra: str, what: str) -> ModuleType:
    """Imports the module of ``extra`` or raises naming the extra to install.

    Args:
        extra (str): a key of :data:`EXTRAS` (``"reasoning-gym"``, ``"openenv"``, ``"verifiers"``).
        what (str): the component that needs it, for the message (``"reasoning_gym_dataset"``).

    Returns:
        ModuleType: the imported module.

    Raises:
        MissingExtraError: when the module cannot be imported; the import error is chained.
    """
    module, requirement = EXTRAS[extra]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{what} needs the optional dependency {requirement!r}, which is not installed ({e}). "
            f'Install it with: pip install "torchtune-grpo[{extra}]" (from a clone: pip install -e ".[{extra}]")'
        ) from e
