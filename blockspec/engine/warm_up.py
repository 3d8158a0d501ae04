"""Everything a GPU engine would otherwise build while it serves, built when it starts: the CUDA
graph of every step kind (greedy, sampled, filtered; with logprobs and min_tokens or without) at
every batch bucket and row class, and the prefill's kernels at chunk shapes of both alignments.
A capture or a compile in the middle of serving stalls every running request (it synchronizes the
device, and a compile takes seconds), so the first requests would run slower than the same
requests later. Warm-up sequences hold only the trash page and the trash state slot: everything
they write lands where padding rows write."""

from itertools import product
from typing import TYPE_CHECKING

from blockspec.engine.kv_cache_manager import BlockTable
from blockspec.engine.sequence import Sequence
from blockspec.sampling import SamplingParams

if TYPE_CHECKING:
    from blockspec.engine.runner import ModelRunner

# one request of each step kind (`StepInputs.mode`): greedy, sampled, filtered (top-k)
KINDS = (SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2))
PREFILL_LENGTHS = (1, 17, 64)  # chunk lengths: a decode-sized one, and rows off and on multiples of 16


def step_kinds() -> list[SamplingParams]:
    """A request of every step kind: each sampling kind, with and without logprobs and min_tokens."""
    return [
        SamplingParams(
            temperature=kind.temperature, top_k=kind.top_k, logprobs=logprobs, min_tokens=min_tokens, max_tokens=1
        )
        for kind, logprobs, min_tokens in product(KINDS, (None, 1), (0, 1))
    ]


def trash_sequence(num_tokens: int, params: SamplingParams, columns: int, num_groups: int) -> Sequence:
    """A sequence of `num_tokens` tokens whose every table column is the trash page."""
    seq = Sequence(None, [0] * num_tokens, params, seed=0)
    seq.block_tables = [BlockTable([0] * columns) for _ in range(num_groups)]
    seq.stop_ids = [0]
    return seq


def warm_up(runner: "ModelRunner", max_num_seqs: int, step_rows: int) -> None:
    """Run a prefill at each of `PREFILL_LENGTHS` (one sequence, and two), then a step of every
    kind, batch bucket and row class of the runner's graphs (captured there)."""
    groups, page = len(runner.layout.reaches), runner.page_size
    for length, batch in product(PREFILL_LENGTHS, (1, 2)):
        columns = -(-(length + step_rows) // page)
        runner.prefill([trash_sequence(length + 1, KINDS[0], columns, groups) for _ in range(min(batch, max_num_seqs))])
    graphs = runner.graphs
    columns = -(-(step_rows + 1) // page)
    for params, bucket, width in product(step_kinds(), graphs.buckets, graphs.row_classes):
        seqs = [trash_sequence(1, params, columns, groups) for _ in range(bucket)]
        runner.step(runner.step_inputs(seqs, [width] * bucket, None, None))
