"""The ``reference`` part of benchmarks/gpu_grpo.py: the KL reference model's device memory per ``reference:``
mode on a model shape (the GPU check runs it on the Qwen3-1.7B shape; docs/algorithms.md has the CPU numbers).

For each mode (``compute``: today's full copy in the run's compute dtype; ``int8``; ``nf4``; ``compute+offload``
and ``nf4+offload``: transformer layers in CPU memory, streamed one at a time), in that order, from the same
initial weights (the shape's random Hugging Face directory, loaded once into CPU memory):

- the reference's own bytes by device and dtype (parameters + buffers,
  :func:`~torchtune_grpo.runtime.reference_setup.module_bytes`);
- the device memory it holds once built (``torch.cuda.memory_allocated`` after minus before) and the peak
  while building it and computing one batch of logprobs (``max_memory_allocated`` minus before), in GiB;
- the seconds of that logprob pass (``--reference-rows`` rows of ``--reference-len`` random tokens, chunked as
  the recipe computes them), the second of two passes;
- the logprobs' mean and max absolute difference from the ``compute`` mode's on the same tokens.

On CPU (the rehearsal, ``--tiny``) the device numbers are the process's RSS instead and offloading saves nothing.
"""

import gc
import tempfile
import time
from typing import Any, Dict

import torch

MODES = ("compute", "int8", "nf4", "compute+offload", "nf4+offload")


def _allocated(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    import psutil

    return psutil.Process().memory_info().rss


def measure_reference(model_dir: str, device: torch.device, dtype: torch.dtype, rows: int, length: int,
                      chunk_size: int) -> Dict[str, Any]:
    """Every mode of :data:`MODES` on the Hugging Face directory ``model_dir`` (see the module docstring)."""
    from omegaconf import OmegaConf

    from torchtune_grpo.models import HFCheckpointer
    from torchtune_grpo.runtime.model_setup import Placement
    from torchtune_grpo.runtime.precision import Precision
    from torchtune_grpo.runtime.reference_setup import build_reference, module_bytes, ReferenceOptions
    from torchtune_grpo.training.batch import batch_logprobs, TrainingBatch

    cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model", "path": str(model_dir)})
    state = HFCheckpointer(str(model_dir), tempfile.mkdtemp(prefix="gpu_reference_")).load_checkpoint()["model"]
    placement = Placement(device, 1, Precision.from_name("bf16_pure" if dtype == torch.bfloat16 else "fp32"))
    vocab = state["tok_embeddings.weight"].shape[0]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab - 2, (rows, length), generator=gen).tolist()
    half = length // 2
    layout = TrainingBatch([t[:half] for t in tokens], [t[half:] for t in tokens], vocab - 1, share_prompt=False,
                           device=device)
    out: Dict[str, Any] = {"rows": rows, "length": length, "dtype": str(dtype).replace("torch.", ""), "modes": {}}
    baseline = None
    for mode in MODES:
        precision, _, offload = mode.partition("+")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        before = _allocated(device)
        t0 = time.perf_counter()
        reference = build_reference(cfg, state, placement, ReferenceOptions(precision, offload == "offload"),
                                    source=str(model_dir), max_len=length)
        built = time.perf_counter() - t0
        held = _allocated(device) - before
        seconds = []
        for _ in range(2):
            t0 = time.perf_counter()
            logprobs = batch_logprobs(reference, layout, micro_batch_size=rows, chunk_size=chunk_size)
            _allocated(device)  # synchronise
            seconds.append(time.perf_counter() - t0)
        peak = (torch.cuda.max_memory_allocated(device) - before) if device.type == "cuda" else None
        mask = layout.response_mask
        row: Dict[str, Any] = {
            "bytes": {f"{d}/{t}": n for (d, t), n in sorted(module_bytes(reference).items())},
            "held_gib": held / 2**30, "peak_gib": None if peak is None else peak / 2**30,
            "build_s": built, "logprob_s": seconds[1],
        }
        logprobs = logprobs.float().cpu()
        if baseline is None:
            baseline = logprobs
        diff = (logprobs - baseline).abs()[mask.cpu()]
        row["logprob_abs_diff_mean"], row["logprob_abs_diff_max"] = float(diff.mean()), float(diff.max())
        out["modes"][mode] = row
        del reference, logprobs
    return out
