"""MXFP4 (OCP microscaling FP4), as gpt-oss stores its experts: a weight [..., N, K] is `blocks`
uint8 [..., N, K/32, 16], two e2m1 values a byte (low nibble first), and `scales` uint8
[..., N, K/32], one power of two (e8m0, bias 127) per 32 values. Every value is exact in bf16, so
dequantizing to bf16 or fp32 loses nothing."""

import torch

# e2m1: sign bit, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale


def mxfp4_problems(blocks: torch.Tensor, scales: torch.Tensor) -> list[str]:
    """What makes (blocks, scales) not one MXFP4 weight."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        return [f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}"]
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        return [f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} (expected [..., 16])"]
    return []


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., N, G, 16], scales [..., N, G] -> [..., N, G * 32] in `dtype`."""
    table = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)
