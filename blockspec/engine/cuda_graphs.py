"""CUDA graphs for the fixed-shape forwards of a decoding step (propose, verify, context).

A forward is captured once per (name, batch bucket, row width) on static input buffers and
replayed with new inputs copied in. Batches are padded up to the bucket with sequences of
one padding row that write only to the trash page, so a replay never touches a real
sequence's cache outside its own rows. Attention reads its lengths from device tensors, so
one capture serves every context length up to `max_pages` pages."""

from collections.abc import Callable

import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
PAD = (0, 0, 1, 0)  # padding of (tokens/features, starts, lengths, block_tables): one row at position 0


class GraphCache:
    def __init__(self, max_batch: int, max_pages: int, warmup: int = 2) -> None:
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.max_pages = max_pages
        self.warmup = warmup
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple, object]] = {}

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def run(self, name: str, fn: Callable, inputs: tuple[torch.Tensor, ...]):
        batch = inputs[0].shape[0]
        key = (name, self.bucket(batch), *inputs[0].shape[1:])
        if key not in self.graphs:
            self.graphs[key] = self.capture(fn, key[1], inputs)
        graph, static, out = self.graphs[key]
        for buf, x, pad in zip(static, inputs, PAD):
            buf[:batch].copy_(x, non_blocking=True)
            buf[batch:].fill_(pad)
        graph.replay()
        return tuple(o if o is None else o[:batch] for o in out) if isinstance(out, tuple) else out[:batch]

    def capture(self, fn: Callable, bucket: int, inputs: tuple[torch.Tensor, ...]):
        static = tuple(
            torch.full((bucket, *x.shape[1:]), pad, dtype=x.dtype, device=x.device) for x, pad in zip(inputs, PAD)
        )
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
