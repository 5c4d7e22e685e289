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

from torchtune_grpo.models._transformers_experts import dequantize_mxfp4, ExpertTensors, mxfp4_name

__all__ = ["LanguageWeights", "language_tensor_name"]

_SEGMENT = "language_model."


def language_tensor_name(key: str) -> str:
    """The text model's name of an image-text checkpoint's on-disk tensor ``key``: without its first
    ``language_model.`` segment (``model.language_model.layers.0...`` -> ``model.layers.0...``; Gemma 3's
    ``language_model.model.layers.0...`` -> ``model.layers.0...``); ``key`` itself where it has none.

    The one rule both the checkpointer (which loads the policy) and the vLLM weight sync (which sends the
    policy's tensors back under the on-disk names) apply, so that the two cannot drift apart.
    """
    return key.replace(_SEGMENT, "", 1)


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
        self.dequantized: List[str] = []  # policy names read from MXFP4 blocks and scales
        self._files = files
        self._experts = ExpertTensors(self.policy_name, expected)

    def policy_name(self, key: str) -> str:
        """The policy's name for on-disk ``key`` (its own, or without the ``language_model`` segment)."""
        if key in self.expected:
            return key
        bare = language_tensor_name(key)
        bare = bare.replace(".block_sparse_moe.", ".mlp.", 1)  # Mixtral's on-disk name of the MoE block
        return bare if bare in self.expected else ""

    def load(self) -> Dict[str, torch.Tensor]:
        """The policy's tensors under its names.

        Raises:
            ValueError: a tensor of the wrong shape (naming it, the file and both shapes), or tensors the
                policy needs that no file holds.
        """
        state: Dict[str, torch.Tensor] = {}
        packed: Dict[str, Dict[str, torch.Tensor]] = {}  # MXFP4: fused on-disk name -> {"_blocks", "_scales"}
        for file_name in self._files:
            path = self.directory / file_name
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    self.weight_map[key] = file_name
                    name = self.policy_name(key)
                    if not name and self._experts.fused_name(key):
                        done = self._experts.take(key, f.get_tensor(key), str(path))
                        if done is not None:
                            state[done[0]] = done[1]
                        continue
                    if not name and mxfp4_name(key) and self.policy_name(mxfp4_name(key)[0]):
                        fused, suffix = mxfp4_name(key)
                        packed.setdefault(fused, {})[suffix] = f.get_tensor(key)
                        self.weight_map[fused] = file_name
                        del self.weight_map[key]
                        continue
                    if not name:
                        if self.tied and key.endswith("lm_head.weight"):
                            self.dropped.append(key)  # the tied head is the embedding
                            del self.weight_map[key]
                        else:
                            self.carried[key] = file_name
                        continue
                    state[name] = self._checked(f.get_tensor(key), key, name, path)
                    self.disk_name[name] = key
        for fused, parts in packed.items():
            if len(parts) != 2:
                raise ValueError(f"{self.directory}: MXFP4 tensor {fused!r} has {sorted(parts)} but not both "
                                 "'_blocks' and '_scales'")
            name = self.policy_name(fused)
            state[name] = self._checked(dequantize_mxfp4(parts["_blocks"], parts["_scales"]), fused, name,
                                        self.directory)
            self.disk_name[name] = fused
            self.dequantized.append(name)
        incomplete = self._experts.incomplete()
        if incomplete:
            name, found = next(iter(incomplete.items()))
            raise ValueError(f"{self.directory}: {name!r} needs {self.expected[name][0]} experts' tensors, but "
                             f"{self._files} hold {found} of them (an incomplete checkpoint?)")
        missing = sorted(set(self.expected) - set(state))
        if missing:
            raise ValueError(
                f"{self.directory}: {len(missing)} tensors of the language model are not in {self._files}, "
                f"e.g. {missing[:3]}"
            )
        return state

    def _checked(self, tensor: torch.Tensor, key: str, name: str, path) -> torch.Tensor:
        if tuple(tensor.shape) != tuple(self.expected[name]):
            raise ValueError(
                f"{path}: tensor {key!r} has shape {tuple(tensor.shape)}, but config.json describes "
                f"{tuple(self.expected[name])}: the weights do not belong to this config.json"
            )
        return tensor

    def to_disk(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The tensors to write: the policy's under their on-disk names, then every carried tensor unchanged (but
        those ``state`` holds under their on-disk names: a trained vision tower's, :func:`image_state_dict`)."""
        out: Dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            if name in self._experts.disk_names:
                out.update(self._experts.split(name, tensor))
            else:
                out[self.disk_name.get(name, name)] = tensor
        by_file: Dict[str, List[str]] = {}
        for key, file_name in self.carried.items():
            by_file.setdefault(file_name, []).append(key)
        for file_name, keys in by_file.items():
            with safe_open(str(self.directory / file_name), framework="pt") as f:
                for key in keys:
                    if key not in out:  # a trained vision tensor in the state, under its on-disk name, wins
                        out[key] = f.get_tensor(key)
        return out
