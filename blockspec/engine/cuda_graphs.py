"""CUDA graphs for the fixed-shape forwards of a decoding step (a whole greedy step, or a sampled
step's propose, verify and context).

A forward is captured once per (name, batch bucket, row class) on static input buffers and
replayed with new inputs copied in. Batches are padded up to the bucket with sequences of
one padding row that write only to the trash page, so a replay never touches a real
sequence's cache outside its own rows. Attention reads its lengths from device tensors, so
one capture serves every context length up to `max_pages` pages (a step's block tables are
as wide as its longest sequence's; the columns past them are never read); rows are padded up to the
next row class (the widths adaptive steps run at; padding rows, past a sequence's length,
write to the trash page too), so captures stay few whatever the widths of a step."""

from collections.abc import Callable
from itertools import compress

import torch

from blockspec.layers.fast_path import fast_kernels

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# Padding of (tokens/features, starts, lengths, block_tables[, forced accepted counts]): one row at
# position 0, accepting nothing.
PAD = (0, 0, 1, 0, 0)


def round_up(n: int, sizes) -> int:
    """The smallest of the ascending `sizes` that holds n (n itself past the largest)."""
    return next((s for s in sizes if s >= n), n)


def fill_buffers(bufs: tuple[torch.Tensor, ...], xs: tuple[torch.Tensor, ...], pads: tuple, batch: int) -> None:
    """Each input x into its buffer's first rows and columns (rows, pages past x: unread), and the
    buffer's rows past `batch` (padding sequences) set to the padding value; on CUDA the integer
    inputs in one launch (`kernels.graph_inputs`)."""
    kernels = fast_kernels(xs[0], "graph_inputs")
    fused = [kernels is not None and x.is_cuda and x.dtype == torch.int64 and x.dim() <= 2 for x in xs]
    for buf, x, pad, f in zip(bufs, xs, pads, fused):
        if not f:
            buf[tuple(slice(n) for n in x.shape)].copy_(x, non_blocking=True)
            buf[batch:].fill_(pad)
    if any(fused):
        kernels.fill_buffers_triton(*(list(compress(seq, fused)) for seq in (bufs, xs, pads)), batch)


class GraphCache:
    def __init__(self, max_batch: int, max_pages: int, row_classes: tuple[int, ...], warmup: int = 2) -> None:
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.max_pages, self.row_classes = max_pages, sorted(row_classes)
        self.warmup = warmup
        self.pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple, object]] = {}

    def run(self, name: str, fn: Callable, inputs: tuple[torch.Tensor, ...]):
        """inputs[0] is [B, S, ...] (rows per sequence); outputs come back as [B, S - k, ...]."""
        batch, rows = inputs[0].shape[:2]
        key = (name, round_up(batch, self.buckets), round_up(rows, self.row_classes))
        if key not in self.graphs:
            self.graphs[key] = self.capture(fn, *key[1:], inputs)
        graph, static, out = self.graphs[key]
        fill_buffers(static, inputs, PAD, batch)
        graph.replay()
        extra = key[2] - rows

        def trim(o: torch.Tensor | None) -> torch.Tensor | None:
            return None if o is None else o[:batch, : o.shape[1] - extra]

        return tuple(trim(o) for o in out) if isinstance(out, tuple) else trim(out)

    def static_inputs(self, bucket: int, width: int, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The capture's input buffers: `bucket` sequences of `width` rows, filled with padding."""
        shapes = [(bucket, width, *inputs[0].shape[2:]), (bucket,), (bucket,), (bucket, self.max_pages), (bucket,)]
        return tuple(torch.full(s, pad, dtype=x.dtype, device=x.device) for s, x, pad in zip(shapes, inputs, PAD))

    def capture(self, fn: Callable, bucket: int, width: int, inputs: tuple[torch.Tensor, ...]):
        static = self.static_inputs(bucket, width, inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):  # first calls allocate, autotune and compile kernels
                fn(*static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn(*static)
        return graph, static, out
