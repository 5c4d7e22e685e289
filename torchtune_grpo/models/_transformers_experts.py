"""A mixture of experts' weights on disk <-> transformers' fused expert parameters.

transformers 5 holds a sparse MoE block's experts as two 3-D parameters (``mlp.experts.gate_up_proj``
``[E, 2I, H]``: each expert's gate rows then its up rows; ``mlp.experts.down_proj`` ``[E, H, I]``), but the
checkpoints of Qwen3-MoE, Qwen3.5-MoE, OLMoE and Mixtral hold them one by one
(``mlp.experts.{e}.{gate,up,down}_proj.weight``; Mixtral ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``
with its router at ``block_sparse_moe.gate.weight``), and so does what transformers' ``save_pretrained``
writes. gpt-oss checkpoints hold the fused tensors themselves (``[E, H, 2I]``, gate/up interleaved, with
biases), in bf16 or, as released, in MXFP4 (``*_blocks`` / ``*_scales``, ``quantization_config.quant_method:
mxfp4``).

:class:`ExpertTensors` gathers the per-expert tensors into the fused parameters on load and splits them back
under their on-disk names on save; :func:`dequantize_mxfp4` turns MXFP4 blocks and scales into the fused
tensor, exactly (every MXFP4 value is representable in bf16).
"""

import re
from typing import Callable, Dict, Optional, Tuple

import torch

__all__ = ["ExpertTensors", "MXFP4_VALUES", "dequantize_mxfp4", "mxfp4_name"]

# ``<stem>.(mlp|block_sparse_moe).experts.<e>.<proj>.weight``: one expert's projection.
_PER_EXPERT = re.compile(r"^(?P<stem>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# projection -> (fused parameter, which half of gate_up_proj: 0 gate, 1 up; None for down_proj)
_SLOT = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
         "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}
# The FP4 (E2M1) code points of the OCP microscaling format, indexed by the 4-bit code.
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MXFP4_SUFFIXES = ("_blocks", "_scales")


class ExpertTensors:
    """Per-expert on-disk tensors gathered into fused parameters (and split back).

    Args:
        policy_name (Callable[[str], str]): the policy's name for an on-disk name (``""`` if none), as
            :meth:`~torchtune_grpo.models._transformers_weights.LanguageWeights.policy_name`.
        expected (Dict[str, Tuple[int, ...]]): the policy's state-dict names and shapes.
    """

    def __init__(self, policy_name: Callable[[str], str], expected: Dict[str, Tuple[int, ...]]) -> None:
        self._policy_name = policy_name
        self._expected = expected
        self._parts: Dict[str, Dict[Tuple[int, int], torch.Tensor]] = {}  # fused name -> (expert, half) -> tensor
        self.disk_names: Dict[str, Dict[Tuple[int, int], str]] = {}  # fused name -> (expert, half) -> on-disk name

    def fused_name(self, key: str) -> Optional[Tuple[str, int, int]]:
        """``(fused policy name, expert, half)`` for a per-expert on-disk name, else None."""
        match = _PER_EXPERT.match(key)
        if match is None:
            return None
        param, half = _SLOT[match["proj"]]
        name = self._policy_name(f"{match['stem']}.mlp.experts.{param}")
        return (name, int(match["e"]), 0 if half is None else half) if name else None

    def take(self, key: str, tensor: torch.Tensor, source: str) -> Optional[Tuple[str, torch.Tensor]]:
        """Keep one expert's tensor; once its fused parameter is complete, return ``(name, fused tensor)``.

        Raises:
            ValueError: a tensor of the wrong shape or an expert index beyond ``config.json``'s count (naming
                the tensor and ``source``).
        """
        name, expert, half = self.fused_name(key)
        shape = self._expected[name]
        halves = 2 if name.endswith("gate_up_proj") else 1
        want = (shape[1] // halves, shape[2])
        if expert >= shape[0] or tuple(tensor.shape) != want:
            raise ValueError(
                f"{source}: tensor {key!r} (expert {expert}, shape {tuple(tensor.shape)}) does not fit "
                f"{name!r} of shape {shape} ({shape[0]} experts of {want}) that config.json describes"
            )
        self._parts.setdefault(name, {})[(expert, half)] = tensor
        self.disk_names.setdefault(name, {})[(expert, half)] = key
        parts = self._parts[name]
        if len(parts) < shape[0] * halves:
            return None
        del self._parts[name]
        fused = torch.stack([torch.cat([parts[(e, h)] for h in range(halves)]) for e in range(shape[0])])
        return name, fused  # [E, 2I, H] (gate rows, then up rows) or [E, H, I]

    def incomplete(self) -> Dict[str, int]:
        """Fused parameters some of whose experts no file held: name -> how many tensors were found."""
        return {name: len(parts) for name, parts in self._parts.items()}

    def split(self, name: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
        """A fused parameter as its on-disk per-expert tensors (copies, so each is saved on its own)."""
        names = self.disk_names[name]
        halves = 2 if name.endswith("gate_up_proj") else 1
        rows = tensor.shape[1] // halves
        return {key: tensor[e, h * rows:(h + 1) * rows].clone() for (e, h), key in names.items()}


def mxfp4_name(key: str) -> Optional[Tuple[str, str]]:
    """``(fused on-disk name, "_blocks" | "_scales")`` for an MXFP4 tensor's name, else None."""
    for suffix in _MXFP4_SUFFIXES:
        if key.endswith(suffix) and ".experts." in key:
            return key[: -len(suffix)], suffix
    return None


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """gpt-oss's MXFP4 experts as the fused tensor transformers' ``GptOssExperts`` holds.

    Each byte of ``blocks`` packs two 4-bit E2M1 codes (low nibble first); each group of 32 values shares a
    power-of-two scale stored as a biased exponent (``2 ** (scale - 127)``). The result is exact in bf16.

    Args:
        blocks (torch.Tensor): ``[E, R, G, 16]`` uint8 (``R`` output rows, ``G * 32`` inputs).
        scales (torch.Tensor): ``[E, R, G]`` uint8.
        dtype (torch.dtype): the result's dtype. Default is ``torch.bfloat16``.

    Returns:
        torch.Tensor: ``[E, G * 32, R]`` (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``).

    Raises:
        ValueError: when the shapes do not pair up.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or \
            tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype}: expected uint8 [E, R, G, 16] and uint8 [E, R, G]")
    lut = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [E, R, G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [E, R, G, 32]
    values = torch.ldexp(values, scales.long().sub(127).unsqueeze(-1).float())
    experts, rows, groups, _ = blocks.shape
    return values.reshape(experts, rows, groups * 32).transpose(1, 2).contiguous().to(dtype)
