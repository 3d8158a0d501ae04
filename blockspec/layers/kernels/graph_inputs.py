"""A CUDA graph's integer inputs copied into its static buffers in one launch: the CUDA
implementation of `blockspec.engine.cuda_graphs.fill_buffers` (the reference: a copy and a fill
per input). Between two replays of a step's graph those were five copies (the anchors, starts,
lengths, block tables and forced counts), each a launch and a gap on the device's critical path.
Program (r, j) writes columns [j * BLOCK, (j + 1) * BLOCK) of row r of every buffer, a row being
G groups of W columns (the block tables' cache groups; G = 1 otherwise): x's row r where r < batch
(the columns x has of each group; the rest are left as they are, unread), the padding value
where r >= batch. The sizes and strides come as floats, which Triton does not specialize on: as
integers in a tuple it would compile a variant for each pattern of ones and multiples of 16 among
them, even with do_not_specialize, and the block tables widen as contexts grow (a compile in the
middle of a run)."""

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit(do_not_specialize=["batch"])
def _fill_kernel(bufs, xs, groups, widths, x_strides, cols, pads, batch, BLOCK: tl.constexpr):
    row, col = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    real = row < batch
    for i in tl.static_range(len(bufs)):
        width, n = tl.cast(widths[i], tl.int64), tl.cast(cols[i], tl.int64)
        row_width = tl.cast(groups[i], tl.int64) * width
        group, c = col // width, col % width
        at = row * tl.cast(x_strides[3 * i], tl.int64) + group * tl.cast(x_strides[3 * i + 1], tl.int64)
        at += c * tl.cast(x_strides[3 * i + 2], tl.int64)
        ok = (col < row_width) & (c < n)
        value = tl.where(real, tl.load(xs[i] + at, mask=real & ok), tl.cast(pads[i], tl.int64))
        tl.store(bufs[i] + row * row_width + col, value, mask=tl.where(real, ok, col < row_width))


def fill_buffers_triton(bufs: list[torch.Tensor], xs: list[torch.Tensor], pads: list[int], batch: int) -> None:
    """bufs [bucket], [bucket, W] or [bucket, G, W] contiguous, xs [batch], [batch, <= W] or
    [batch, G, <= W] (any strides), all int64."""
    bufs, xs = (
        [t.view(t.shape[0], -1, t.shape[-1] if t.dim() == 3 else t[0].numel()) for t in ts] for ts in (bufs, xs)
    )
    assert all(b.is_contiguous() and b.dtype == x.dtype == torch.int64 for b, x in zip(bufs, xs, strict=True))
    assert all(
        x.shape[0] == batch and x.shape[1] == b.shape[1] and x.shape[2] <= b.shape[2] for b, x in zip(bufs, xs)
    ), "inputs past their buffers"
    groups, widths, cols = [b.shape[1] for b in bufs], [b.shape[2] for b in bufs], [x.shape[2] for x in xs]
    strides = [s for x in xs for s in x.stride()]
    assert all(0 <= n < 2**24 for n in widths + strides), "sizes past float32's exact integers"
    assert all(abs(p) < 2**24 for p in pads), "padding values past float32's exact integers"
    row_widths = [g * w for g, w in zip(groups, widths)]
    _fill_kernel[(bufs[0].shape[0], triton.cdiv(max(row_widths), BLOCK))](
        tuple(bufs), tuple(xs), *(tuple(map(float, v)) for v in (groups, widths, strides, cols, pads)), batch,
        BLOCK=BLOCK,
    )  # fmt: skip
