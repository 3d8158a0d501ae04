"""FP8 numerics: E4M3 weights with one float32 scale per output row, and `Fp8Linear`.

`Fp8Linear` replaces an `nn.Linear` at load time (inference only; `blockspec.loading.fp8` makes a
drafter's copies). Its weight is q = round_e4m3(w / s) with s = rowmax(|w|) / 448 (448 = largest
E4M3 value, so every row uses the full range and the row maximum is exact), and forward computes,
as `Linear` does, residual + norm(x) @ (q * s[:, None]).T + bias (the norm optional; a gate|up
projection can end in SwiGLU instead of the residual add), W8A8: the normed x is quantized per row
as the weight is, and the GEMM multiplies E4M3 by E4M3 on FP8 tensor cores. On CUDA (Hopper+)
`blockspec.layers.kernels.quantize_rows` quantizes x with the norm fused, then:
- up to `FP8_SKINNY_MAX_M` rows (a propose step up to batch 4), the Triton skinny kernel
  (`skinny_scaled_mm`), which streams the weight at small M;
- above, `torch._scaled_mm` with row-wise scales (bf16 x), where the GEMM nears compute-bound.
(`python -m blockspec.bench.fp8_bench` times one drafter step's linears against bf16.) x is
quantized by a launch of its own: quantizing it inside the GEMM (per group) stalls the K loop.
Elsewhere runs the reference (the CPU path and the oracle) with the same rounding: the norm, the
activations rounded to E4M3 per row and back, then the weight dequantized to x.dtype (in float32,
rounded once) and `layers.linear.dense`. `KernelConfig.fp8_kernel` off runs the reference
everywhere, FP8 weights kept.
The drafter only proposes, so its precision moves the acceptance rate, never the output.

Per-row scales make quantization commute with stacking rows, so the drafter's fused K/V weight
(every layer's k_proj and v_proj stacked) quantized as a whole is bit-identical to the stacked
quantized projections (`Fp8Linear.concat`)."""

import functools
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from blockspec.layers.activation import silu_mul
from blockspec.layers.fast_path import active_kernels, fast_path
from blockspec.layers.kernels import is_hopper_or_later, kernel_module
from blockspec.layers.linear import dense
from blockspec.layers.norm import RMSNorm

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
_CHUNK_ELEMENTS = 1 << 25  # elements per (de)quantization chunk: <= 128 MiB of float32 temporaries
FP8_SKINNY_MAX_M = 64  # rows up to which the skinny kernel beats torch._scaled_mm


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
        return dequantize_weight(self.weight, self.weight_scale, dtype, active_kernels().fp8_kernel)

    def forward_reference(
        self, x: torch.Tensor, norm: RMSNorm | None = None, swiglu: bool = False, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x if norm is None else norm(x)
        q, scale = quantize_weight(x.reshape(-1, x.shape[-1]))  # x rounded to E4M3 per row, as the GEMM reads it
        x = dequantize_weight(q, scale, x.dtype, active_kernels().fp8_kernel).view(x.shape)
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
            active_kernels().fp8_kernel
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
