"""Loading a Hugging Face model directory's weights into :func:`~torchtune_grpo.models.hf_model`'s decoder,
and saving trained weights as a Hugging Face model directory again.

The same interface as torchtune's ``FullModelHFCheckpointer`` (``load_checkpoint()`` ->
``{"model": state_dict}``, ``save_checkpoint(state, epoch)`` writing ``{output_dir}/epoch_{epoch}``), which the
recipes and ``tune-grpo eval`` already drive, but configured by the directory alone: the weight files come from
``model.safetensors.index.json`` (sharded) or ``model.safetensors``, the architecture from ``config.json``.
What torchtune's checkpointer lacks and this adds: Qwen3 (q/k norm weights), every architecture of
:mod:`torchtune_grpo.models` from one name table, and a check of every tensor's shape against ``config.json``.
"""

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from torchtune_grpo.models._convert import expected_hf_shapes, hf_to_tune, ignorable, tune_to_hf
from torchtune_grpo.models._backend import choose_backend, text_config
from torchtune_grpo.models._spec import HFModelSpec, read_hf_config
from torchtune_grpo.models._transformers_policy import build_transformers_decoder, text_model_config
from torchtune_grpo.models._transformers_weights import LanguageWeights

__all__ = ["HFArchitecture", "HFCheckpointer", "MODEL_KEY", "weight_files"]

log = logging.getLogger(__name__)

MODEL_KEY = "model"  # torchtune.training.MODEL_KEY
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Not copied into a saved checkpoint: weights (written anew), run state, and weight formats this never reads.
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
_NOT_COPIED_NAMES = {INDEX_FILE, "pytorch_model.bin.index.json", "adapter_config.json"}


class HFArchitecture:
    """What the LoRA recipe reads as ``checkpointer._model_type.name`` (``"LLAMA"``, ``"QWEN3"``, ...).

    ``torchtune_grpo.models.lora`` decides by this name whether adapters need torchtune's RoPE permutation in
    the PEFT export (``QWEN2``/``QWEN3`` keep Hugging Face's layout).
    """

    def __init__(self, model_type: str) -> None:
        self.name = model_type.upper()

    def __repr__(self) -> str:
        return f"HFArchitecture({self.name})"


def weight_files(directory: Union[str, Path]) -> List[str]:
    """The safetensors files holding a model directory's weights, in order.

    ``model.safetensors.index.json``'s files when it exists, else ``model.safetensors``, else every
    ``*.safetensors`` but adapters.

    Raises:
        FileNotFoundError: when no weight file is found, or a file the index names is missing.
    """
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [name for name in files if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index} names weight files that are missing: {missing} (an interrupted download?)"
            )
        return files
    if (directory / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    files = sorted(p.name for p in directory.glob("*.safetensors") if not p.name.startswith("adapter"))
    if not files:
        raise FileNotFoundError(
            f"no weights in {directory}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards "
            "(only safetensors checkpoints are read)"
        )
    return files


class HFCheckpointer:
    """Reads and writes Hugging Face model directories for :func:`~torchtune_grpo.models.hf_model`.

    Args:
        checkpoint_dir (str): the model directory (``config.json``, safetensors weights, tokenizer files).
        output_dir (str): where ``save_checkpoint`` writes ``epoch_{n}/``.
        checkpoint_files (Optional[List[str]]): weight files to read, relative to ``checkpoint_dir``.
            Default is None (found from the index or ``model.safetensors``: see :func:`weight_files`).
        max_shard_size_gib (Optional[float]): split saved weights into shards of about this size with an
            index. Default is None (keep the source directory's sharding).
        backend (str): the policy's backend, as ``model.backend`` (the recipe passes it): ``"auto"``,
            ``"torchtune"`` (torchtune names, converted) or ``"transformers"`` (transformers' own names; a
            multimodal directory's towers carried unchanged into every save). Default is ``"auto"``.

    Raises:
        FileNotFoundError: without ``config.json`` or with a missing weight file.
        ValueError: for an unsupported architecture (see :class:`~torchtune_grpo.models.HFModelSpec`).
    """

    def __init__(
        self,
        checkpoint_dir: str,
        output_dir: str,
        checkpoint_files: Optional[List[str]] = None,
        max_shard_size_gib: Optional[float] = None,
        backend: str = "auto",
    ) -> None:
        self._checkpoint_dir = Path(checkpoint_dir)
        self._config: Dict[str, Any] = read_hf_config(self._checkpoint_dir)
        source = str(self._checkpoint_dir / "config.json")
        self.backend = choose_backend(self._config, backend, source=source).name
        self._spec: Optional[HFModelSpec] = None
        self._language: Optional[LanguageWeights] = None
        if self.backend == "torchtune":
            self._spec = HFModelSpec.from_hf_config(self._config, source=source)
        self._model_type = HFArchitecture(text_config(self._config)["model_type"])
        files = list(checkpoint_files) if checkpoint_files else weight_files(self._checkpoint_dir)
        for name in files:
            if not (self._checkpoint_dir / name).is_file():
                raise FileNotFoundError(f"checkpoint_files: {self._checkpoint_dir / name} does not exist")
        self._files = files
        self._output_dir = Path(output_dir)
        if self._output_dir.resolve() == self._checkpoint_dir.resolve():
            raise ValueError(f"output_dir must differ from checkpoint_dir ({checkpoint_dir}): saving would overwrite it")
        self._output_dir.mkdir(parents=True, exist_ok=True)
        self._max_shard_bytes = None if max_shard_size_gib is None else int(max_shard_size_gib * 2**30)
        self._weight_map: Dict[str, str] = {}  # Hugging Face name -> file, filled by load_checkpoint
        repo_id_file = self._checkpoint_dir / "repo_id.json"  # written by `tune download`
        self.repo_id = json.loads(repo_id_file.read_text()).get("repo_id") if repo_id_file.is_file() else None

    @property
    def spec(self) -> Optional[HFModelSpec]:
        """The architecture read from ``config.json`` (None for the transformers backend)."""
        return self._spec

    def load_checkpoint(self) -> Dict[str, Any]:
        """Read every weight file into one torchtune state dict.

        Returns:
            Dict[str, Any]: ``{"model": state_dict}`` under :func:`hf_model`'s parameter names.

        Raises:
            ValueError: when a tensor is missing, unexpected, or shaped differently from what ``config.json``
                describes (the message names the tensor, the file and both shapes).
        """
        if self.backend == "transformers":
            return {MODEL_KEY: self._load_language_weights()}
        expected = expected_hf_shapes(self._spec)
        state: Dict[str, torch.Tensor] = {}
        self._weight_map = {}
        for name in self._files:
            path = self._checkpoint_dir / name
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_tensor(key)
                    want = expected.get(key)
                    if want is None and not ignorable(key, self._spec):
                        raise ValueError(
                            f"{path}: tensor {key!r} does not belong to a {self._spec.model_type} model as "
                            "config.json describes it (see docs/models.md for the supported architectures)"
                        )
                    if want is not None and tuple(tensor.shape) != want:
                        raise ValueError(
                            f"{path}: tensor {key!r} has shape {tuple(tensor.shape)}, but config.json describes "
                            f"{want}: the weights do not belong to this config.json"
                        )
                    state[key] = tensor
                    self._weight_map[key] = name
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ValueError(
                f"{self._checkpoint_dir}: {len(missing)} tensors that config.json implies are not in "
                f"{self._files}, e.g. {missing[:3]}"
            )
        return {MODEL_KEY: hf_to_tune(state, self._spec, source=str(self._checkpoint_dir))}

    def save_checkpoint(self, state_dict: Dict[str, Any], epoch: int, intermediate_checkpoint: bool = False,
                        adapter_only: bool = False) -> Path:
        """Write ``{output_dir}/epoch_{epoch}``: a Hugging Face model directory.

        Weights in their dtype as given, under Hugging Face names, sharded like the source (or by
        ``max_shard_size_gib``) with ``model.safetensors.index.json`` when there is more than one file; every
        other file of the source directory (``config.json``, tokenizer and generation files, ...) copied.

        Args:
            state_dict (Dict[str, Any]): ``{"model": torchtune state dict}`` (full, on CPU).
            epoch (int): names the directory (the recipe renames it to ``step_N``).
            intermediate_checkpoint (bool): unused; the recipe writes its own state. Default is False.
            adapter_only (bool): not supported here (the LoRA recipe writes adapters itself). Default is False.

        Returns:
            Path: the directory written.
        """
        del intermediate_checkpoint
        if adapter_only:
            raise ValueError("HFCheckpointer.save_checkpoint writes full models; adapters are the recipe's job")
        target = self._output_dir / f"epoch_{epoch}"
        target.mkdir(parents=True, exist_ok=True)
        if self.backend == "transformers":
            if self._language is None:
                self._load_language_weights()
            hf_state = self._language.to_disk(state_dict[MODEL_KEY])
            self._weight_map = self._language.weight_map
        else:
            hf_state = tune_to_hf(state_dict[MODEL_KEY], self._spec)
        shards = self._shards(hf_state)
        for file_name, tensors in shards.items():
            tensors = {k: v.contiguous() for k, v in tensors.items()}
            save_file(tensors, str(target / file_name), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(t.numel() * t.element_size() for t in hf_state.values())},
                "weight_map": {k: f for f, tensors in shards.items() for k in tensors},
            }
            with open(target / INDEX_FILE, "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
        for item in self._checkpoint_dir.iterdir():
            if item.is_file() and not item.name.endswith(_NOT_COPIED) and item.name not in _NOT_COPIED_NAMES:
                shutil.copy2(item, target / item.name)
        if self._language is not None and self._language.dequantized:
            # MXFP4 experts were dequantised on load and are saved unquantised: the config says so.
            config = {k: v for k, v in self._config.items() if k != "quantization_config"}
            (target / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        log.info("Saved a Hugging Face model directory to %s (%d weight files)", target, len(shards))
        return target

    def _load_language_weights(self) -> Dict[str, torch.Tensor]:
        """The transformers policy's tensors (names and shapes from its meta-device module)."""
        with torch.device("meta"):  # names and shapes only
            policy = build_transformers_decoder(text_model_config(str(self._checkpoint_dir)))
        expected = {k: tuple(v.shape) for k, v in policy.state_dict().items()}
        tied = not any(k.endswith("lm_head.weight") for k in expected)
        self._language = LanguageWeights(self._checkpoint_dir, self._files, expected, tied)
        state = self._language.load()
        self._weight_map = dict(self._language.weight_map)
        if self._language.carried:
            log.info("%s: %d tensors besides the language model's (vision/audio towers, projector, extra heads) "
                     "are carried unchanged into every save", self._checkpoint_dir, len(self._language.carried))
        return state

    def _shards(self, hf_state: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, torch.Tensor]]:
        """File name -> tensors: the source's sharding, or new shards of at most ``max_shard_size_gib``."""
        if self._max_shard_bytes is None and len(set(self._weight_map.values())) <= 1:
            return {SINGLE_FILE: hf_state}
        if self._max_shard_bytes is None:
            groups: Dict[str, Dict[str, torch.Tensor]] = {}
            for key, tensor in hf_state.items():
                groups.setdefault(self._weight_map.get(key, ""), {})[key] = tensor
            ordered = [groups[k] for k in sorted(groups)]
        else:
            ordered, size = [{}], 0
            for key, tensor in hf_state.items():
                nbytes = tensor.numel() * tensor.element_size()
                if ordered[-1] and size + nbytes > self._max_shard_bytes:
                    ordered.append({})
                    size = 0
                ordered[-1][key] = tensor
                size += nbytes
        n = len(ordered)
        if n == 1:
            return {SINGLE_FILE: ordered[0]}
        return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": tensors for i, tensors in enumerate(ordered)}
