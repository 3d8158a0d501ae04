"""A CUDA graph's integer inputs copied into its static buffers in one launch: the CUDA
implementation of `blockspec.engine.cuda_graphs.fill_buffers` (the reference: a copy and a fill
per input). Between two replays of a step's graph those were five copies (the anchors, starts,
lengths, block tables and forced counts), each a launch and a gap on the device's critical path.
Program (r, j) writes columns [j * BLOCK, (j + 1) * BLOCK) of row r of every buffer: x's row r
where r < batch (the columns x has; the rest are left as they are, unread), the padding value
where r >= batch."""

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _fill_kernel(bufs, xs, widths, x_strides, cols, pads, batch, BLOCK: tl.constexpr):
    row, col = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    for i in tl.static_range(len(bufs)):
        real = row < batch
        x = tl.load(xs[i] + row * x_strides[2 * i] + col * x_strides[2 * i + 1], mask=real & (col < cols[i]))
        value = tl.where(real, x, pads[i])
        tl.store(bufs[i] + row * widths[i] + col, value, mask=col < tl.where(real, cols[i], widths[i]))


def fill_buffers_triton(bufs: list[torch.Tensor], xs: list[torch.Tensor], pads: list[int], batch: int) -> None:
    """bufs [bucket] or [bucket, W] contiguous, xs [batch] or [batch, <= W] (any strides), all int64."""
    bufs, xs = [b.view(b.shape[0], -1) for b in bufs], [x.view(x.shape[0], -1) if x.dim() == 1 else x for x in xs]
    assert all(b.is_contiguous() and b.dtype == x.dtype == torch.int64 for b, x in zip(bufs, xs, strict=True))
    assert all(x.shape[0] == batch and x.shape[1] <= b.shape[1] for b, x in zip(bufs, xs)), "inputs past their buffers"
    widths = tuple(b.shape[1] for b in bufs)
    _fill_kernel[(bufs[0].shape[0], triton.cdiv(max(widths), BLOCK))](
        tuple(bufs), tuple(xs), widths, tuple(s for x in xs for s in x.stride()), tuple(x.shape[1] for x in xs),
        tuple(pads), batch, BLOCK=BLOCK,
    )  # fmt: skip
