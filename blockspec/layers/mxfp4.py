"""MXFP4 (OCP microscaling FP4), as gpt-oss stores its experts: a weight [..., K] is kept as
`blocks` uint8 [..., K / 32, 16], two FP4 (e2m1) values a byte, the low nibble first, and
`scales` uint8 [..., K / 32], one e8m0 exponent (bias 127) per group of 32 values:
value = E2M1[nibble] * 2**(scale - 127). Every value is exact in bf16, so dequantizing to bf16 or
fp32 loses nothing. The CUDA MoE kernel reads them as they are
(`blockspec.layers.kernels.fused_moe.fused_moe_triton`); this is its reference."""

import torch

# The e2m1 value of each nibble: sign bit, 2 exponent bits, 1 mantissa bit.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values sharing a scale


def mxfp4_problems(blocks: torch.Tensor, scales: torch.Tensor) -> list[str]:
    """What makes (blocks, scales) not one MXFP4 weight."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        return [f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}"]
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        return [f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} (expected [..., 16])"]
    return []


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] and scales [..., G] (uint8, without `mxfp4_problems`) -> the weight
    [..., G * 32] in `dtype`."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    byte_values = torch.stack((table.repeat(16), table.repeat_interleave(16)), dim=-1)  # byte -> (low, high)
    values = byte_values[blocks.int()].flatten(-2)  # [..., G, 32]: one int32 index a byte, not an int64 a value
    return torch.ldexp(values, scales.to(torch.int32)[..., None] - 127).flatten(-2).to(dtype)


# Boundaries between consecutive e2m1 magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6): nearest-value rounding.
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks, scales): per group of 32 the smallest power of two
    under which the group's largest magnitude fits e2m1's 6, each value rounded to the nearest e2m1
    value there. Exact for a weight that MXFP4 holds (`dequantize_mxfp4` of its result is w): any
    scale that holds a group's largest value exactly holds the others, e2m1's values doubled stay
    e2m1's values up to 6."""
    groups = w.float().unflatten(-1, (-1, GROUP))
    mantissa, exponent = torch.frexp(groups.abs().amax(-1) / 6)
    exponent = (exponent - (mantissa == 0.5).int()).clamp(-127, 127)  # ceil(log2(amax / 6))
    scaled = torch.ldexp(groups, -exponent[..., None])
    magnitude = torch.bucketize(scaled.abs(), torch.tensor(MIDPOINTS, device=w.device))
    nibbles = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def dequantize_stored(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each MXFP4 pair `X_blocks`, `X_scales` of `weights` as the weight `X_proj` in `dtype`, one
    at a time (exact), in place."""
    for name in [n for n in weights if n.endswith("_blocks")]:
        prefix = name.removesuffix("_blocks")
        weights[f"{prefix}_proj"] = dequantize_mxfp4(weights.pop(name), weights.pop(f"{prefix}_scales"), dtype)
    return weights
