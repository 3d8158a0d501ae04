"""FP8 for the drafter: E4M3 weights with one float32 scale per output row.

`Fp8Linear` replaces an `nn.Linear` at load time (inference only). Its weight is
q = round_e4m3(w / s) with s = rowmax(|w|) / 448 (448 = largest E4M3 value, so every row uses the
full range and the row maximum is exact), and forward computes, as `Linear` does,
residual + norm(x) @ (q * s[:, None]).T + bias (the norm optional; a gate|up projection can end
in SwiGLU instead of the residual add), W8A8: the normed x is quantized per row as the weight is,
and the GEMM multiplies E4M3 by E4M3 on FP8 tensor cores. On CUDA (Hopper+)
`blockspec.layers.kernels.quantize_rows` quantizes x with the norm fused, then:
- up to `FP8_SKINNY_MAX_M` rows (a propose step up to batch 4), the Triton skinny kernel
  (`skinny_scaled_mm`), which streams the weight at small M;
- above, `torch._scaled_mm` with row-wise scales (bf16 x), where the GEMM nears compute-bound.
H200, one drafter step's linears at M rows (`python -m blockspec.bench.fp8_bench`), bf16 cuBLAS
against FP8: M = 16: 888 against 535 µs; 64: 917 against 608; 256: 1,405 against 1,037 (_scaled_mm).
A weight-only path (bf16 x, the weight converted in registers) was slower at 16 rows (706 µs) and
is gone; quantizing x inside the GEMM per 1x128 group, with no quantize launch, stalled its K loop
(q|k|v at 16 rows 24.1 against 11.1 µs, README).
Elsewhere runs the reference (the CPU path and the oracle) with the same rounding: the norm, the
activations rounded to E4M3 per row and back, then the weight dequantized to x.dtype (in float32,
rounded once) and `layers.linear.dense`.
The drafter only proposes, so its precision moves the acceptance rate, never the output.

Per-row scales make quantization commute with stacking rows, so the drafter's fused K/V weight
(every layer's k_proj and v_proj stacked) quantized as a whole is bit-identical to the stacked
quantized projections (`Fp8Linear.concat`).

Switch: `resolve_fp8(setting, device, hidden_size)` maps an engine setting (True / False / "auto" /
None) to a bool; "auto" (the default) is on for CUDA devices of compute capability 9.0+ (Hopper)
and drafters of hidden size >= AUTO_MIN_HIDDEN, unless the environment sets BLOCKSPEC_FP8. Forced
on, it runs the reference path on the CPU, and is refused on a GPU without FP8 tensor cores.
BLOCKSPEC_FP8_KERNEL=0 keeps FP8 weights but runs the reference path everywhere."""

import fnmatch
import functools
import os
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from blockspec.layers.activation import silu_mul
from blockspec.layers.fast_path import fast_path
from blockspec.layers.kernels import is_hopper_or_later, kernel_module
from blockspec.layers.linear import dense
from blockspec.layers.norm import RMSNorm

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
_CHUNK_ELEMENTS = 1 << 25  # elements per (de)quantization chunk: <= 128 MiB of float32 temporaries
# Rows up to which the skinny kernel beats torch._scaled_mm (H200, measured at 16, 64, 128 and 256).
FP8_SKINNY_MAX_M = 64

# "auto" keeps narrower drafters in bf16. H200, batch 1, T=0, the real pair of SmolLM2-135M (hidden
# 576, its whole drafter a few tens of MB, L2-sized) and its shipped drafter, speedup over plain
# decoding with FP8 against bf16: HumanEval 1.44x against 1.42x, MT-Bench 0.95x against 1.12x (a
# quantize launch before each GEMM costs about what its bytes save there); at Qwen3-8B's 4096 FP8
# is faster at every batch.
AUTO_MIN_HIDDEN = 2048

# The drafter's projections: fc (context features -> hidden) and every decoder layer's attention
# and MLP linears. Module names as in `DFlashDrafter.named_modules()`.
DRAFTER_FP8_PATTERNS = ("fc", "layers.*.self_attn.*_proj", "layers.*.mlp.*_proj")


def _row_chunks(rows: int, cols: int) -> Iterable[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (q [N, K] float8_e4m3fn, scale [N] float32), w ~= q * scale[:, None].
    All-zero rows get scale 1 (q = 0)."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    q = torch.empty((n, k), dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for rows in _row_chunks(n, k):
        w = weight[rows].float()
        amax = w.abs().amax(dim=1) if k else torch.zeros(w.shape[0], device=w.device)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        # w / s can exceed 448 by a rounding step; E4M3FN has no inf and casts overflow to NaN.
        q[rows] = (w / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[rows] = s
    return q, scale


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, use_kernel: bool = True
) -> torch.Tensor:
    """q * scale[:, None], computed in float32 and rounded once to `dtype` (on CUDA by a one-pass
    Triton kernel with the same result, bit for bit)."""
    kernels = kernel_module("skinny_linear") if q.is_cuda and use_kernel else None
    if kernels is not None and q.is_contiguous():
        return kernels.dequantize_fp8(q, scale, dtype)
    if dtype == torch.float32:
        return q.float() * scale[:, None]
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for rows in _row_chunks(*q.shape):
        out[rows] = (q[rows].float() * scale[rows, None]).to(dtype)
    return out


@functools.cache
def fp8_supported(device: torch.device | str) -> bool:
    """CUDA of compute capability 9.0+ (Hopper, Blackwell: FP8 tensor cores, with row-wise scales in
    `torch._scaled_mm`) and triton importable."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return is_hopper_or_later(device.index) and kernel_module("skinny_linear") is not None


def resolve_fp8(setting: bool | str | None, device: torch.device | str, hidden_size: int) -> bool:
    """The engine's FP8 switch for a drafter of `hidden_size`: True/"on" and False/"off" are obeyed
    (on the CPU the reference path runs; on CUDA it needs `fp8_supported`, else ValueError: there
    the reference would dequantize every weight each call); None/"auto" means on where
    `fp8_supported` for drafters at least AUTO_MIN_HIDDEN wide, unless the environment sets
    BLOCKSPEC_FP8 (0/off or 1/on)."""
    if isinstance(setting, str):
        words = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False, "auto": None}
        if setting.strip().lower() not in words:
            raise ValueError(f"fp8 setting must be on, off or auto, got {setting!r}")
        setting = words[setting.strip().lower()]
    if setting is None:
        env = os.environ.get("BLOCKSPEC_FP8")
        setting = env.strip().lower() not in ("0", "off", "false", "") if env is not None else None
    if setting is None:
        return fp8_supported(device) and hidden_size >= AUTO_MIN_HIDDEN
    if not isinstance(setting, bool):
        raise TypeError(f"fp8 setting must be True, False or 'auto', got {setting!r}")
    if setting and torch.device(device).type == "cuda" and not fp8_supported(device):
        raise ValueError(f"an FP8 drafter on {device} needs FP8 tensor cores (compute capability 9.0+) and triton")
    return setting


class Fp8Linear(nn.Module):
    """Drop-in for `nn.Linear` (inference) with an E4M3 weight and per-output-row float32 scales.

    Buffers `weight` [out, in] float8_e4m3fn and `weight_scale` [out] float32 keep their dtypes
    under `module.to(dtype)` / `.half()` (only device moves apply to them); `bias` is an ordinary
    parameter (requires_grad=False) that follows the model's dtype."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros((out_features, in_features), dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.use_kernel = os.environ.get("BLOCKSPEC_FP8_KERNEL", "1") != "0"

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> "Fp8Linear":
        with torch.device("meta"):
            layer = cls(q.shape[1], q.shape[0], bias=False)
        layer.weight, layer.weight_scale = q.contiguous(), scale.to(torch.float32).contiguous()
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Fp8Linear":
        """Quantize a float weight [out, in] (and keep `bias` as is, in its dtype)."""
        q, scale = quantize_weight(weight.detach())
        return cls.from_quantized(q, scale, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        return cls.from_weight(linear.weight, linear.bias)

    @classmethod
    def concat(cls, linears: Sequence[nn.Module]) -> "Fp8Linear":
        """One Fp8Linear whose output is the concatenation of `linears`' outputs (nn.Linear ones
        are quantized first). Per-row scales make this equal to quantizing the stacked weight."""
        layers = [m if isinstance(m, Fp8Linear) else cls.from_linear(m) for m in linears]
        if not layers:
            raise ValueError("nothing to concatenate")
        if len({m.in_features for m in layers}) != 1 or len({m.bias is None for m in layers}) != 1:
            raise ValueError("concatenated linears need equal in_features and all or none with bias")
        bias = None if layers[0].bias is None else torch.cat([m.bias for m in layers])
        q = torch.cat([m.weight.view(torch.uint8) for m in layers]).view(FP8_DTYPE)  # cat on bytes: any backend
        return cls.from_quantized(q, torch.cat([m.weight_scale for m in layers]), bias)

    # -- use --------------------------------------------------------------------------------------

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale, dtype, self.use_kernel)

    def forward_reference(
        self, x: torch.Tensor, norm: RMSNorm | None = None, swiglu: bool = False, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x if norm is None else norm(x)
        q, scale = quantize_weight(x.reshape(-1, x.shape[-1]))  # x rounded to E4M3 per row, as the GEMM reads it
        x = dequantize_weight(q, scale, x.dtype, self.use_kernel).view(x.shape)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return dense(x, self.dequantize(x.dtype), bias, residual, swiglu=swiglu)

    def forward(
        self, x: torch.Tensor, norm: RMSNorm | None = None, swiglu: bool = False, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As `Linear.forward`: residual + norm(x) @ W.T + bias (or SiLU(gate) * up of it), on CUDA
        (Hopper+) in W8A8 by the skinny kernel (up to FP8_SKINNY_MAX_M rows) or torch._scaled_mm
        (above, bf16)."""
        skinny = x.numel() <= FP8_SKINNY_MAX_M * x.shape[-1]
        scaled_mm = x.dtype == torch.bfloat16 and self.in_features % 16 == self.out_features % 16 == 0
        if (
            self.use_kernel
            and fast_path(x)
            and fp8_supported(x.device)
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (skinny or scaled_mm)
        ):
            return self.forward_w8a8(x, norm, swiglu, residual, skinny)
        return self.forward_reference(x, norm, swiglu, residual)

    def forward_w8a8(
        self, x: torch.Tensor, norm: RMSNorm | None, swiglu: bool, residual: torch.Tensor | None, skinny: bool
    ) -> torch.Tensor:
        """x quantized per row with the norm fused, then the skinny kernel (`skinny`, SwiGLU in its
        epilogue) or torch._scaled_mm (bf16 x, features multiples of 16; SwiGLU after)."""
        assert not (swiglu and residual is not None), "SwiGLU's output takes no residual"
        norm_args = None if norm is None else (norm.weight, norm.eps)
        qx, sx = kernel_module("quantize_rows").quantize_rows(x.reshape(-1, x.shape[-1]), norm_args)
        out_shape = (*x.shape[:-1], self.out_features // 2 if swiglu else self.out_features)
        if skinny:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            kernels = kernel_module("skinny_linear")
            res = None if residual is None else residual.reshape(-1, self.out_features)
            y = kernels.skinny_scaled_mm(qx, sx, self.weight, self.weight_scale, x.dtype, bias, res, swiglu=swiglu)
            return y.view(out_shape)
        y = torch._scaled_mm(qx, self.weight.t(), scale_a=sx, scale_b=self.weight_scale.view(1, -1), out_dtype=x.dtype)
        if self.bias is not None:
            y += self.bias
        if swiglu:
            return silu_mul(y).view(out_shape)
        y = y.view(out_shape)
        if residual is not None:
            y += residual
        return y

    def _apply(self, fn, recurse=True):
        keep = {name: self._buffers[name] for name in ("weight", "weight_scale")}
        super()._apply(fn, recurse)
        for name, old in keep.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:  # a dtype cast: move, don't convert
                self._buffers[name] = old.to(new.device)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8=e4m3"
        )


def _matcher(names_filter) -> Callable[[str, nn.Module], bool]:
    if names_filter is None:
        return lambda name, module: True
    if callable(names_filter):
        return lambda name, module: bool(names_filter(name))
    patterns = (names_filter,) if isinstance(names_filter, str) else tuple(names_filter)
    return lambda name, module: any(fnmatch.fnmatchcase(name, p) for p in patterns)


@torch.no_grad()
def quantize_linears(module: nn.Module, names_filter=None) -> list[str]:
    """Replace, in place, every `nn.Linear` inside `module` whose name (as in `named_modules()`)
    is selected by `names_filter` with an `Fp8Linear` on the same device. names_filter: None
    (all), a callable name -> bool, or an fnmatch pattern / iterable of patterns matched against
    the whole name (e.g. "layers.*.mlp.*_proj"). Returns the names replaced, in order."""
    match = _matcher(names_filter)
    chosen = [
        (name, child)
        for name, child in module.named_modules()
        if name and isinstance(child, nn.Linear) and match(name, child)
    ]
    for name, child in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, Fp8Linear.from_linear(child))
    return [name for name, _ in chosen]


@torch.no_grad()
def quantize_drafter(drafter: nn.Module, lm_head: nn.Linear | None = None, patterns=DRAFTER_FP8_PATTERNS) -> list[str]:
    """FP8 for a loaded `DFlashDrafter` (after `fuse_kv`, i.e. after `load_drafter`). Its
    projections (`patterns`) become Fp8Linear. If the drafter reads `fused_kv_fp8` (its `fuse_kv`
    sets that attribute to None, and `context_rows` uses it when set), the stacked K/V weight
    becomes one Fp8Linear there and the bf16 copy is dropped; otherwise the context K/V GEMM stays
    bf16. With `lm_head` (the target's), an FP8 copy for the drafter's logits is stored as
    `drafter.lm_head_fp8` (the target keeps its own; the runner must choose to use it). Returns the
    names replaced or added."""
    names = quantize_linears(drafter, patterns)
    fused = getattr(drafter, "fused_kv_weight", None)
    if fused is not None and hasattr(drafter, "fused_kv_fp8"):
        drafter.fused_kv_fp8 = Fp8Linear.from_weight(fused, getattr(drafter, "fused_kv_bias", None))
        drafter.fused_kv_weight, drafter.fused_kv_bias = None, None
        names.append("fused_kv_fp8")
    if lm_head is not None:
        drafter.lm_head_fp8 = Fp8Linear.from_linear(lm_head)
        names.append("lm_head_fp8")
    return names
