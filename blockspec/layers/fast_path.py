"""The CUDA fast paths and their switches. Inference on a GPU runs Triton kernels (attention, skinny
GEMMs, q/k norm + rope with the K/V write) and torch.compile fusions of small elementwise and index
functions (a decode step is hundreds of tiny kernels; each function becomes one or two). Each sits
behind the same function as its reference (eager torch, cuBLAS, gather + SDPA), which the CPU, code
with gradients on (grad mode would recompile each compiled function for every switch between the
frozen target and the drafter in training) and `reference_ops()` run instead, so all paths share
one definition.

The switches are one `KernelConfig` for the process, held here: the engine puts its own in force
when it is built (`use_kernels`), and that is the one moment the environment is read for them (see
ENV_OVERRIDES); it puts them back at each step (`restore_kernels`), so engines built side by side
each run their own. `reference_ops()`, the fast-path tests' oracle, forces every op's reference over
whatever is in force, engines built inside it included."""

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from types import ModuleType

import torch
import torch._dynamo

from blockspec.config import KernelConfig, parse_flag
from blockspec.layers.kernels import kernel_module

# KernelConfig field -> the environment variable that overrides it (0 or 1) when the engine is built.
ENV_OVERRIDES = {
    "triton_linear": "BLOCKSPEC_TRITON_LINEAR",
    "pdl": "BLOCKSPEC_PDL",
    "fp8_kernel": "BLOCKSPEC_FP8_KERNEL",
}

_kernels = KernelConfig()  # the switches in force (`use_kernels`)
_references_only = False  # inside `reference_ops`


def env_flag(name: str) -> bool | None:
    """The environment variable `name` as a switch (`parse_flag`), None where it is not set."""
    value = os.environ.get(name)
    return None if value is None else parse_flag(value, name)


def kernels_from_env(base: KernelConfig) -> KernelConfig:
    """`base` with the switches that the environment sets (ENV_OVERRIDES) replaced."""
    overrides = {field: env_flag(name) for field, name in ENV_OVERRIDES.items()}
    return dataclasses.replace(base, **{field: on for field, on in overrides.items() if on is not None})


def use_kernels(config: KernelConfig) -> KernelConfig:
    """Put `config`, with the environment's overrides (`kernels_from_env`), in force for the
    process: what an engine does once when it is built (the last engine built decides). Returns
    the switches now in force."""
    global _kernels
    _kernels = kernels_from_env(config)
    return _kernels


def restore_kernels(config: KernelConfig) -> None:
    """Put `config`, switches already in force once (`use_kernels`'s result), back in force: an
    engine does so at each step, over whatever engine was built after it."""
    global _kernels
    _kernels = config


def active_kernels() -> KernelConfig:
    """The switches in force (the defaults until an engine is built)."""
    return _kernels


def fast_path(x: torch.Tensor) -> bool:
    """Whether an op on x takes its CUDA fast path: on CUDA, without grad, outside reference_ops."""
    return x.is_cuda and not _references_only and not torch.is_grad_enabled()


def fast_kernels(x: torch.Tensor, name: str) -> ModuleType | None:
    """The Triton module `blockspec.layers.kernels.<name>` for an op on x that takes its fast path
    (and triton is installed), else None: the op then runs its reference."""
    return kernel_module(name) if fast_path(x) else None


@contextlib.contextmanager
def reference_ops() -> Iterator[None]:
    """Run every op's reference even on CUDA (the oracle of the fast-path tests)."""
    global _references_only
    _references_only, previous = True, _references_only
    try:
        yield
    finally:
        _references_only = previous


# Variants one compiled function may compile before torch runs it eagerly for good (torch's
# default, 8). A function compiles a variant per shape class it meets (torch.compile specializes
# sizes 0 and 1 and storage offsets 0 and 1, and each dtype and float argument): batch_rows alone
# meets more than 8 in an engine's warm-up (batch 1 or more, width 1 or more, one page table column
# or more, graph buffers at offset 0 or host inputs past it), and the eager fallback, silent, puts
# a dozen kernels in every step graph captured after it. The classes are few and bounded: warm-up
# compiles them all.
RECOMPILE_LIMIT = 64


def cuda_compiled(fn: Callable) -> Callable:
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled = torch.compile(fn, dynamic=True)

    def dispatch(x: torch.Tensor, *args):
        return compiled(x, *args) if fast_path(x) else fn(x, *args)

    dispatch.__doc__, dispatch.__name__ = fn.__doc__, fn.__name__
    dispatch.eager, dispatch.compiled = fn, compiled  # the fused kernel is tested against the reference
    return dispatch
