"""Small files shipped with the package (the tiny Qwen2 model and tokenizer used by tests and demos)."""

from pathlib import Path

_ASSETS_DIR = Path(__file__).resolve().parent


def asset_path(*parts: str) -> str:
    """Returns the absolute path of a shipped asset.

    Args:
        *parts (str): path components below ``torchtune_grpo/assets/``, e.g.
            ``asset_path("tiny_qwen2", "vocab.json")`` or ``asset_path("tiny_qwen2/vocab.json")``.

    Returns:
        str: the absolute path.

    Raises:
        FileNotFoundError: if the asset does not exist (the message names the full path).
    """
    path = _ASSETS_DIR.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"torchtune_grpo asset not found: {path}")
    return str(path)


def register_resolvers() -> None:
    """Registers the OmegaConf resolver ``grpo_asset`` so YAML can point at shipped assets.

    Example YAML::

        tokenizer:
          path: ${grpo_asset:tiny_qwen2/vocab.json}

    Safe to call more than once (``replace=True``).
    """
    import inspect

    from omegaconf import OmegaConf

    # OmegaConf 2.4 deprecates register_new_resolver in favour of register_resolver; in 2.3,
    # register_resolver is the old legacy API with other semantics, so tell them apart by signature.
    register = OmegaConf.register_new_resolver
    if "annotation_validation" in inspect.signature(OmegaConf.register_resolver).parameters:
        register = OmegaConf.register_resolver
    register("grpo_asset", asset_path, replace=True)


__all__ = ["asset_path", "register_resolvers"]
