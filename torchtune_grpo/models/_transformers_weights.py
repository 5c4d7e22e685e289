"""A model directory's weights for the transformers backend: the language model's tensors in, every tensor out.

The policy's state dict uses the names of transformers' text-only ``...ForCausalLM`` (``model.layers.0...``,
``lm_head.weight``). On disk a text checkpoint has the same names; a multimodal one (Qwen3.5, Gemma 3 4B+,
Gemma 4) holds the language model under a ``language_model`` segment (``model.language_model.layers.0...``
for Qwen3.5 and Gemma 4, ``language_model.model.layers.0...`` for Gemma 3) next to its vision/audio towers,
projector and extra heads (Qwen3.5's ``mtp.*``). :class:`LanguageWeights` reads which on-disk tensor is
which policy tensor, and writes a checkpoint back under the on-disk names, with every tensor the policy does
not train copied from the source unchanged (byte for byte), so the saved directory loads in the original
class.
"""

from pathlib import Path
from typing import Dict, List, Tuple

import torch
from safetensors import safe_open

__all__ = ["LanguageWeights"]

_SEGMENT = "language_model."


class LanguageWeights:
    """Which on-disk tensors are the policy's, and under which names (see the module docstring).

    Args:
        directory (Path): the model directory.
        files (List[str]): its weight files.
        expected (Dict[str, Tuple[int, ...]]): the policy's state-dict names and shapes.
        tied (bool): the output projection is the input embedding (a stored ``lm_head.weight`` is dropped).
    """

    def __init__(self, directory: Path, files: List[str], expected: Dict[str, Tuple[int, ...]], tied: bool) -> None:
        self.directory = Path(directory)
        self.expected = expected
        self.tied = tied
        self.disk_name: Dict[str, str] = {}  # policy name -> on-disk name
        self.carried: Dict[str, str] = {}  # on-disk name -> file, for tensors the policy does not hold
        self.weight_map: Dict[str, str] = {}  # on-disk name -> file (all written tensors)
        self.dropped: List[str] = []
        self._files = files

    def policy_name(self, key: str) -> str:
        """The policy's name for on-disk ``key`` (its own, or without the ``language_model`` segment)."""
        if key in self.expected:
            return key
        if _SEGMENT in key:
            bare = key.replace(_SEGMENT, "", 1)
            if bare in self.expected:
                return bare
        return ""

    def load(self) -> Dict[str, torch.Tensor]:
        """The policy's tensors under its names.

        Raises:
            ValueError: a tensor of the wrong shape (naming it, the file and both shapes), or tensors the
                policy needs that no file holds.
        """
        state: Dict[str, torch.Tensor] = {}
        for file_name in self._files:
            path = self.directory / file_name
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    self.weight_map[key] = file_name
                    name = self.policy_name(key)
                    if not name:
                        if self.tied and key.endswith("lm_head.weight"):
                            self.dropped.append(key)  # the tied head is the embedding
                            del self.weight_map[key]
                        else:
                            self.carried[key] = file_name
                        continue
                    tensor = f.get_tensor(key)
                    if tuple(tensor.shape) != tuple(self.expected[name]):
                        raise ValueError(
                            f"{path}: tensor {key!r} has shape {tuple(tensor.shape)}, but config.json describes "
                            f"{tuple(self.expected[name])}: the weights do not belong to this config.json"
                        )
                    state[name] = tensor
                    self.disk_name[name] = key
        missing = sorted(set(self.expected) - set(state))
        if missing:
            raise ValueError(
                f"{self.directory}: {len(missing)} tensors of the language model are not in {self._files}, "
                f"e.g. {missing[:3]}"
            )
        return state

    def to_disk(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The tensors to write: the policy's under their on-disk names, then every carried tensor unchanged."""
        out = {self.disk_name.get(name, name): tensor for name, tensor in state.items()}
        by_file: Dict[str, List[str]] = {}
        for key, file_name in self.carried.items():
            by_file.setdefault(file_name, []).append(key)
        for file_name, keys in by_file.items():
            with safe_open(str(self.directory / file_name), framework="pt") as f:
                for key in keys:
                    out[key] = f.get_tensor(key)
        return out
