"""The reference policy in less memory: its weights' precision and where they live (``reference:`` in the config).

The KL term of GRPO (Shao et al. 2024, arXiv:2402.03300, eq. 3) needs ``log pi_ref`` of every sampled token:
one forward of a frozen copy of the initial policy per step, no gradients. Today's default keeps that copy
in the run's compute dtype, FSDP2-sharded like the policy. :func:`build_reference` can instead keep it

- in **bf16** (``precision: bf16``) while the policy trains in fp32: half the bytes, every weight rounded once;
- with its linear layers' weights **int8** (``precision: int8``, torchao's ``Int8WeightOnlyConfig``: one
  int8 per weight and one scale per output row, computed as ``(x @ q^T) * scale``) or **NF4**
  (``precision: nf4``, QLoRA's 4-bit NormalFloat, Dettmers et al. 2023, arXiv:2305.14314, as torchtune's
  ``FrozenNF4Linear`` holds it: blocks of 64 weights, double-quantised scales; a forward de-quantises each
  weight to the compute dtype); embeddings, norms and a tied output projection stay in the compute dtype;
- **offloaded** (``offload: true``): every transformer layer's parameters in CPU memory (pinned on CUDA),
  copied to the device just before the layer runs, the next layer's copy started meanwhile on a side CUDA
  stream (:class:`OffloadedLayers`); only the embeddings, final norm and output projection stay on the device.

A quantised or offloaded reference is a plain module, whole on every process (FSDP2 does not shard torchao's
quantised tensors here): on N processes each rank holds the whole quantised model, where the default holds
1/N of the full one. :func:`module_bytes` counts what a model holds, by device and dtype.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torchtune import config, training

from torchtune_grpo.runtime.model_setup import (
    build_model, check_max_seq_len, check_state_dict_shapes, init_rope, Placement,
)

__all__ = ["REFERENCE_PRECISIONS", "OffloadedLayers", "ReferenceOptions", "build_reference", "module_bytes"]

#: ``reference.precision`` values: the run's compute dtype (the default), bf16, int8 or NF4 linear weights.
REFERENCE_PRECISIONS = ("compute", "bf16", "int8", "nf4")

# QLoRA's NF4 block: 64 weights share one scale; scales are quantised in blocks of up to 256 (torchao's default).
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256


@dataclass(frozen=True)
class ReferenceOptions:
    """How the reference is held (the config's ``reference:`` section).

    Attributes:
        precision (str): one of :data:`REFERENCE_PRECISIONS`. Default is ``"compute"``.
        offload (bool): transformer layers in CPU memory, streamed to the device layer by layer. Default is False.
    """

    precision: str = "compute"
    offload: bool = False

    def __post_init__(self) -> None:
        if self.precision not in REFERENCE_PRECISIONS:
            raise ValueError(f"reference.precision must be one of {list(REFERENCE_PRECISIONS)}, got {self.precision!r}")

    @property
    def is_default(self) -> bool:
        """Whether this is today's full copy in the compute dtype, on the device."""
        return self.precision == "compute" and not self.offload

    def describe(self, compute_dtype: torch.dtype) -> str:
        """What the reference is, for the algorithm card and the log."""
        dtype = _dtype_name(torch.bfloat16 if self.precision == "bf16" else compute_dtype)
        weights = {
            "compute": f"in {dtype}", "bf16": "in bfloat16",
            "int8": f"linear weights int8 (one scale per output row), the rest in {dtype}",
            "nf4": f"linear weights NF4 (4-bit blocks of {NF4_BLOCK}), the rest in {dtype}",
        }[self.precision]
        where = (
            "; transformer layers in CPU memory, copied to the device one layer at a time" if self.offload else ""
        )
        return f"loaded (frozen copy of the initial policy, {weights}{where})"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def build_reference(
    model_cfg: Any, state_dict: Dict[str, torch.Tensor], placement: Placement, options: ReferenceOptions, *,
    source: str, max_len: int,
) -> nn.Module:
    """The frozen reference model of ``model_cfg`` with ``state_dict``, held as ``options`` say.

    Args:
        model_cfg (Any): the config's ``model`` node (a torchtune model builder).
        state_dict (Dict[str, torch.Tensor]): the initial policy's full weights (torchtune names).
        placement (Placement): device, processes, precision, FSDP2 options of the run.
        options (ReferenceOptions): precision and offloading.
        source (str): where ``state_dict`` came from, for error messages.
        max_len (int): ``max_prompt_length + max_response_length``, checked against ``max_seq_len``.

    Returns:
        nn.Module: the reference in eval mode, no parameter requiring grad. The default and bf16 without
        offloading: FSDP2-sharded as the policy is (N processes); otherwise a plain module on every rank (when
        offloaded, its ``offloaded_layers`` attribute is the :class:`OffloadedLayers` streaming its layers).

    Raises:
        ValueError: as :func:`~torchtune_grpo.runtime.model_setup.build_model`, and for an NF4 weight whose
            size is not a multiple of 64 (naming the layer and its shape).
    """
    dtype = torch.bfloat16 if options.precision == "bf16" else placement.precision.compute_dtype
    if not options.offload and options.precision in ("compute", "bf16"):
        return build_model(
            model_cfg, state_dict, placement, trainable=False, source=source, max_len=max_len, frozen_dtype=dtype
        )
    device = placement.device
    storage = torch.device("cpu") if options.offload else device
    with training.set_default_dtype(dtype), torch.device("meta"):
        model = config.instantiate(model_cfg)
    check_max_seq_len(model, max_len)
    check_state_dict_shapes(chain_tensors(model), state_dict, source)
    quantized = set()
    if options.precision in ("int8", "nf4"):
        quantize = _nf4 if options.precision == "nf4" else _int8
        for name, linear in _quantizable_linears(model):
            weight = state_dict[f"{name}.weight"].to(device=device, dtype=dtype)
            linear.weight = nn.Parameter(quantize(weight, name).to(storage), requires_grad=False)
            quantized.add(f"{name}.weight")
    rest = {k: v.to(device=storage, dtype=dtype) for k, v in state_dict.items() if k not in quantized}
    loaded = model.load_state_dict(rest, strict=False, assign=True)
    if set(loaded.missing_keys) - quantized or loaded.unexpected_keys:
        raise ValueError(
            f"The checkpoint in {source} does not match the model: missing "
            f"{sorted(set(loaded.missing_keys) - quantized)}, unexpected {sorted(loaded.unexpected_keys)}"
        )
    init_rope(model, device)  # buffers (RoPE caches) on the device, also when offloading: they are small
    training.validate_no_params_on_meta_device(model)
    model.eval()
    model.requires_grad_(False)
    if options.offload:
        _outside_layers_to(model, device)
        model.offloaded_layers = OffloadedLayers(model.layers, device)
    return model


def _outside_layers_to(model: nn.Module, device: torch.device) -> None:
    """Every parameter outside ``model.layers`` (embeddings, final norm, output projection) and every buffer on
    ``device``; a parameter two modules share (tied) stays one tensor."""
    inside = {id(m) for m in model.layers.modules()}
    moved: Dict[int, nn.Parameter] = {}
    for module in model.modules():
        for leaf, b in module._buffers.items():
            if b is not None:
                module._buffers[leaf] = b.to(device)
        if id(module) in inside:
            continue
        for leaf, p in module._parameters.items():
            if p is not None:
                if id(p) not in moved:
                    moved[id(p)] = nn.Parameter(p.data.to(device), requires_grad=False)
                module._parameters[leaf] = moved[id(p)]


def chain_tensors(model: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every parameter, then every buffer."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def _quantizable_linears(model: nn.Module) -> List[Tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` of the transformer layers, and the output projection when it is its own Linear
    (a tied one is the embedding table, left as it is), by their names in the model's state dict."""
    inside = {id(m) for m in model.layers.modules()}
    output = getattr(model, "output", None)
    return [
        (name, m) for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and (id(m) in inside or m is output)
    ]


def _nf4(weight: torch.Tensor, name: str) -> torch.Tensor:
    """``weight`` as torchao's NF4Tensor (blocks of 64; scales quantised in the largest power-of-two block up to
    256 that divides the block count, so widths such as 576 fit)."""
    from torchao.dtypes.nf4tensor import to_nf4

    if weight.numel() % NF4_BLOCK:
        raise ValueError(
            f"reference.precision: nf4 needs every linear weight's size to be a multiple of {NF4_BLOCK}; "
            f"{name}.weight has shape {tuple(weight.shape)}. Use reference.precision: int8 for this model."
        )
    blocks, scaler_block = weight.numel() // NF4_BLOCK, NF4_SCALER_BLOCK
    while blocks % scaler_block:
        scaler_block //= 2
    return to_nf4(weight, NF4_BLOCK, scaler_block)


def _int8(weight: torch.Tensor, name: str) -> torch.Tensor:
    """``weight`` as torchao's int8 weight-only tensor (symmetric, one scale per output row)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    quantize_(linear, Int8WeightOnlyConfig(version=2))
    return linear.weight.detach()


class OffloadedLayers:
    """Keeps every layer's parameters in CPU memory and puts them on ``device`` only while the layer runs.

    A forward pre-hook on layer ``i`` swaps in its device copy (made now, or started earlier by layer
    ``i - 1`` on a side CUDA stream) and starts copying layer ``i + 1``; a forward hook swaps the CPU
    parameters back and drops the copy. At most two layers are on the device at a time. On CUDA the CPU
    tensors are pinned, so the copies overlap the previous layer's compute.

    Args:
        layers (nn.ModuleList): the transformer layers, parameters on the CPU.
        device (torch.device): where the layers compute.
    """

    def __init__(self, layers: nn.ModuleList, device: torch.device) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.slots: List[List[Tuple[nn.Module, str, nn.Parameter]]] = []
        for layer in layers:
            slots = []
            for module in layer.modules():
                for leaf, p in list(module._parameters.items()):
                    if p is None:
                        continue
                    if cuda and type(p.data) is torch.Tensor:
                        p = nn.Parameter(p.data.pin_memory(), requires_grad=False)
                        module._parameters[leaf] = p
                    slots.append((module, leaf, p))
            self.slots.append(slots)
        self.pending: Dict[int, Tuple[List[nn.Parameter], Optional[Any]]] = {}
        self.copies = 0  # layers copied to the device so far (tests, benchmarks)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(self._pre_hook(i))
            layer.register_forward_hook(self._post_hook(i))

    def _copy(self, i: int) -> Tuple[List[nn.Parameter], Optional[Any]]:
        self.copies += 1
        if self.stream is None:
            return [nn.Parameter(_to(p, self.device), requires_grad=False) for _, _, p in self.slots[i]], None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copies = [nn.Parameter(_to(p, self.device), requires_grad=False) for _, _, p in self.slots[i]]
            done = torch.cuda.Event()
            done.record(self.stream)
        return copies, done

    def _pre_hook(self, i: int) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            copies, done = self.pending.pop(i, None) or self._copy(i)
            if done is not None:
                torch.cuda.current_stream(self.device).wait_event(done)
                for p in copies:  # allocated on the side stream, used on this one
                    _record_stream(p, torch.cuda.current_stream(self.device))
            for (owner, leaf, _), p in zip(self.slots[i], copies):
                owner._parameters[leaf] = p
            if i + 1 < len(self.slots) and i + 1 not in self.pending:
                self.pending[i + 1] = self._copy(i + 1)

        return hook

    def _post_hook(self, i: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for owner, leaf, p in self.slots[i]:
                owner._parameters[leaf] = p

        return hook


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; plain pinned tensors asynchronously (torchao's tensors copy their parts)."""
    if type(t.data) is torch.Tensor:
        return t.data.to(device, non_blocking=True)
    return t.data.to(device)


def _record_stream(t: torch.Tensor, stream: Any) -> None:
    for inner in _plain_tensors(t):
        inner.record_stream(stream)


def _plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``t``'s data: itself, or a torchao tensor's parts (recursively)."""
    data = t.data if isinstance(t, nn.Parameter) else t
    if type(data) is torch.Tensor:
        yield data
        return
    names, _ = data.__tensor_flatten__()
    for name in names:
        yield from _plain_tensors(getattr(data, name))


def module_bytes(model: nn.Module) -> Dict[Tuple[str, str], int]:
    """Bytes of ``model``'s parameters and buffers, by ``(device type, dtype)`` of the storage holding them.

    A quantised weight counts its parts (NF4: 4-bit codes as uint8 pairs, int8 block scales, fp32 factors;
    int8: int8 values and a scale per row); a tensor shared by two modules (tied embeddings) counts once.

    Args:
        model (nn.Module): any module.

    Returns:
        Dict[Tuple[str, str], int]: e.g. ``{("cpu", "uint8"): 16384, ("cpu", "float32"): 4216}``.
    """
    seen, out = set(), {}
    for _, tensor in chain_tensors(model):
        for t in _plain_tensors(tensor):
            key = (t.untyped_storage().data_ptr(), t.device, t.storage_offset(), tuple(t.shape))
            if t.device.type != "meta" and key not in seen:
                seen.add(key)
                slot = (t.device.type, _dtype_name(t.dtype))
                out[slot] = out.get(slot, 0) + t.numel() * t.element_size()
    return out
