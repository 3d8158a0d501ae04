"""A drafter's FP8 copies, made at load time: whether (`resolve_fp8`, the engine's policy, resolved
once when it is built) and how (`quantize_drafter`: its projections, its fused context K/V weight
and a copy of the target's LM head become `Fp8Linear`s, the numerics of
`blockspec.layers.quantization`)."""

import fnmatch
from collections.abc import Callable, Iterable

import torch
from torch import nn

from blockspec.config import auto_flag
from blockspec.layers.fast_path import env_flag
from blockspec.layers.quantization import Fp8Linear, fp8_supported
from blockspec.models.dflash import DFlashDrafter

# "auto" keeps narrower drafters in bf16: a narrow drafter's weights are small (SmolLM2-135M's, hidden
# 576: about L2's size), so the quantize launch before each GEMM costs about what its saved bytes
# gain; at Qwen3-8B's 4096 FP8 is faster at every batch.
AUTO_MIN_HIDDEN = 2048

# The drafter's projections: fc (context features -> hidden) and every decoder layer's attention
# and MLP linears. Module names as in `DFlashDrafter.named_modules()`.
DRAFTER_FP8_PATTERNS = ("fc", "layers.*.self_attn.*_proj", "layers.*.mlp.*_proj")

NamesFilter = str | Iterable[str] | Callable[[str], bool] | None


def resolve_fp8(setting: bool | str | None, device: torch.device | str, hidden_size: int) -> bool:
    """The engine's FP8 switch for a drafter of `hidden_size` (`SpeculativeConfig.fp8`): True/"on"
    and False/"off" are obeyed (on the CPU the reference path runs; on CUDA it needs
    `fp8_supported`, else ValueError: there the reference would dequantize every weight each call);
    None/"auto" means on where `fp8_supported` for drafters at least AUTO_MIN_HIDDEN wide, unless
    the environment sets BLOCKSPEC_FP8 (0/off or 1/on)."""
    setting = auto_flag(setting, "fp8 setting")
    if setting is None:
        setting = env_flag("BLOCKSPEC_FP8")
    if setting is None:
        return fp8_supported(device) and hidden_size >= AUTO_MIN_HIDDEN
    if setting and torch.device(device).type == "cuda" and not fp8_supported(device):
        raise ValueError(f"an FP8 drafter on {device} needs FP8 tensor cores (compute capability 9.0+) and triton")
    return setting


def _matcher(names_filter: NamesFilter) -> Callable[[str], bool]:
    if names_filter is None:
        return lambda name: True
    if callable(names_filter):
        return lambda name: bool(names_filter(name))
    patterns = (names_filter,) if isinstance(names_filter, str) else tuple(names_filter)
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)


@torch.no_grad()
def quantize_linears(module: nn.Module, names_filter: NamesFilter = None) -> list[str]:
    """Replace, in place, every `nn.Linear` inside `module` whose name (as in `named_modules()`)
    is selected by `names_filter` with an `Fp8Linear` on the same device. names_filter: None
    (all), a callable name -> bool, or an fnmatch pattern / iterable of patterns matched against
    the whole name (e.g. "layers.*.mlp.*_proj"). Returns the names replaced, in order."""
    match = _matcher(names_filter)
    chosen = [(name, child) for name, child in module.named_modules() if name and isinstance(child, nn.Linear)]
    chosen = [(name, child) for name, child in chosen if match(name)]
    for name, child in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, Fp8Linear.from_linear(child))
    return [name for name, _ in chosen]


@torch.no_grad()
def quantize_drafter(
    drafter: DFlashDrafter, lm_head: nn.Linear | None = None, patterns: NamesFilter = DRAFTER_FP8_PATTERNS
) -> list[str]:
    """FP8 for a loaded `DFlashDrafter` (after its `fuse_kv`, as `load_drafter` leaves it): its
    projections (`patterns`) become Fp8Linear, and its stacked context K/V weight one Fp8Linear,
    `fused_kv_fp8`, in place of the bf16 copy. With `lm_head` (the one it reads: its own or the
    target's), an FP8 copy for the drafter's logits is stored as `drafter.lm_head_fp8`. Returns the
    names replaced or added."""
    assert drafter.fused_kv_weight is not None, "quantize_drafter needs fuse_kv's stacked weight"
    names = quantize_linears(drafter, patterns)
    drafter.fused_kv_fp8 = Fp8Linear.from_weight(drafter.fused_kv_weight, drafter.fused_kv_bias)
    drafter.fused_kv_weight, drafter.fused_kv_bias = None, None
    names.append("fused_kv_fp8")
    if lm_head is not None:
        drafter.lm_head_fp8 = Fp8Linear.from_linear(lm_head)
        names.append("lm_head_fp8")
    return names
