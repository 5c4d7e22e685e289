"""Phase timings that mean the same on every device: the clock is read after the device's queued work ends.

CUDA runs kernels asynchronously: ``time.perf_counter()`` right after a forward measures the launches, and
the next phase that waits for the device is charged with the rest. :func:`device_clock` synchronizes the
device first, so ``time/reference``, ``time/old_logprobs`` and ``time/update`` hold their own work (a
synchronization per phase boundary, a handful per step). On the CPU it is the plain clock.
"""

import time

import torch

__all__ = ["device_clock"]


def device_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device``'s queued work has finished (seconds)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
