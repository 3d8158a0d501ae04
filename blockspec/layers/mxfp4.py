"""MXFP4 (OCP microscaling FP4), as gpt-oss stores its experts: a weight [..., K] is kept as
`blocks` uint8 [..., K / 32, 16], two FP4 (e2m1) values a byte, the low nibble first, and
`scales` uint8 [..., K / 32], one e8m0 exponent (bias 127) per group of 32 values:
value = E2M1[nibble] * 2**(scale - 127). Every value is exact in bf16, so dequantizing to bf16 or
fp32 loses nothing. The CUDA MoE kernel can read them as they are
(`blockspec.layers.kernels.fused_moe.fused_moe_mxfp4`); this is its reference."""

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
    nibbles = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32], low first
    values = torch.ldexp(table[nibbles], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)
