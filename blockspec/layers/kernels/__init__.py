"""Triton kernels for the CUDA path. Importing this package needs only torch; its modules need
triton, so callers reach them through `kernel_module` (see `blockspec.layers.fast_path`)."""

import functools
import importlib
from types import ModuleType

import torch


def num_sms(device: torch.device, interpreted: int) -> int:
    """The SM count of a CUDA device; on the CPU (Triton's interpreter) `interpreted`, which each
    kernel's tests choose to exercise its launch heuristics."""
    if device.type != "cuda":
        return interpreted
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def is_hopper_or_later(index: int | None) -> bool:
    """Compute capability 9.0+ (TMA, programmatic dependent launch), cached: asked at every launch."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


@functools.cache
def kernel_module(name: str) -> ModuleType | None:
    """The module `blockspec.layers.kernels.<name>`, or None where triton is missing (CPU installs)."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError:
        return None
