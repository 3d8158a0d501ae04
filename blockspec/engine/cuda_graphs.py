"""CUDA graphs of the decoding step, one per (step mode, batch bucket, row class).

A step is captured on static input buffers (a `StepInputs` of them) and replayed with new inputs
copied in. Batches are padded up to the bucket with sequences of one padding row that write only
to the trash page, so a replay never touches a real sequence's cache outside its own rows.
Attention reads its lengths from device tensors, so one capture serves every context length up to
`max_pages` pages (a step's block tables, one per cache group, are as wide as its longest
sequence's; the columns past them are never read); rows are padded up to the next row class (the widths adaptive steps run at;
padding rows, past a sequence's length, write to the trash page too), so captures stay few
whatever the widths of a step."""

import dataclasses
from collections.abc import Callable
from itertools import compress

import torch

from blockspec.engine.step import StepInputs
from blockspec.layers.fast_path import fast_kernels

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
StepTensors = tuple[torch.Tensor | None, torch.Tensor | None]  # a step's packed outcome, and its per-row results


def round_up(n: int, sizes) -> int:
    """The smallest of the ascending `sizes` that holds n (n itself past the largest)."""
    return next((s for s in sizes if s >= n), n)


def fill_buffers(bufs: tuple[torch.Tensor, ...], xs: tuple[torch.Tensor, ...], pads: tuple, batch: int) -> None:
    """Each input x into its buffer's first rows and columns (rows, pages past x: unread), and the
    buffer's rows past `batch` (padding sequences) set to the padding value; on CUDA the integer
    inputs in one launch (`kernels.graph_inputs`)."""
    kernels = fast_kernels(xs[0], "graph_inputs")
    fused = [kernels is not None and x.is_cuda and x.dtype == torch.int64 and x.dim() <= 3 for x in xs]
    for buf, x, pad, f in zip(bufs, xs, pads, fused):
        if not f:
            buf[tuple(slice(n) for n in x.shape)].copy_(x, non_blocking=True)
            buf[batch:].fill_(pad)
    if any(fused):
        kernels.fill_buffers_triton(*(list(compress(seq, fused)) for seq in (bufs, xs, pads)), batch)


def tensor_fields(inputs: StepInputs) -> dict[str, torch.Tensor]:
    """The inputs' tensors by field name (a greedy step has no sampling tensor)."""
    return {f.name: v for f in dataclasses.fields(inputs) if isinstance(v := getattr(inputs, f.name), torch.Tensor)}


class GraphCache:
    def __init__(self, max_batch: int, max_pages: int, row_classes: tuple[int, ...], warmup: int = 1) -> None:
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.max_pages, self.row_classes = max_pages, sorted(row_classes)
        self.warmup = warmup
        self.pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, StepInputs, StepTensors]] = {}

    def run(
        self, name: str, fn: Callable[[StepInputs], StepTensors], inputs: StepInputs, own_pool: bool = False
    ) -> StepTensors:
        """fn(inputs) -> ([B, k + blocks of w-1 columns], [B, w, ...] or None) (w: the step's width,
        rows per sequence), replayed: the packed outcome at the captured width class, whose blocks'
        columns past w-1 hold padding rows' values (each reader takes its rows' own), the per-row
        results cut to w. Graphs share one memory pool, so a graph's intermediates may lie where
        another's outputs do: a graph replayed before the previous one's outputs are read (a step
        launched from them reads them when its inputs are filled) is captured in a pool of its
        own (`own_pool`)."""
        batch, rows = inputs.tokens.shape
        key = (name, round_up(batch, self.buckets), round_up(rows, self.row_classes))
        if key not in self.graphs:
            self.graphs[key] = self.capture(fn, *key[1:], inputs, None if own_pool else self.pool)
        graph, static, out = self.graphs[key]
        xs = tensor_fields(inputs)
        bufs = tensor_fields(static)
        assert xs.keys() == bufs.keys(), f"step mode {name!r} names inputs {list(xs)}, captured with {list(bufs)}"
        fill_buffers(tuple(bufs.values()), tuple(xs.values()), tuple(StepInputs.PAD[n] for n in xs), batch)
        graph.replay()
        packed, per_row = out
        if packed is None:  # a step part that returns nothing (`step.flush_forward`)
            return out
        return packed[:batch], per_row[:batch, :rows] if per_row is not None else None

    def static_inputs(self, bucket: int, width: int, inputs: StepInputs) -> StepInputs:
        """The capture's input buffers: `bucket` sequences of `width` rows, filled with padding."""
        sizes = {"tokens": (1, width), "block_tables": (2, self.max_pages), "bitmask": (1, width), "q": (1, width - 1)}

        def buffer(name: str, x: torch.Tensor) -> torch.Tensor:
            shape = [bucket, *x.shape[1:]]
            if name in sizes:  # the dimension that varies from step to step, at its largest
                dim, size = sizes[name]
                shape[dim] = size
            return torch.full(shape, StepInputs.PAD[name], dtype=x.dtype, device=x.device)

        return dataclasses.replace(inputs, **{n: buffer(n, x) for n, x in tensor_fields(inputs).items()})

    def capture(self, fn: Callable[[StepInputs], StepTensors], bucket: int, width: int, inputs: StepInputs, pool):
        static = self.static_inputs(bucket, width, inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):  # a first call allocates, autotunes and compiles kernels
                fn(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn(static)
        return graph, static, out
