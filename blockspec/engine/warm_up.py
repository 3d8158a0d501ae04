"""Everything a GPU engine would otherwise build while it serves, built when it starts: the CUDA
graph of every step kind (greedy, sampled, filtered; with logprobs, logit rules (penalties and
min_tokens) and a grammar's masks or without) at every batch bucket and row class (and where
width-1 steps defer the drafter's context, the flush of each bucket), and the
prefill's kernels: over a grid of chunk shapes (the kernels' variants follow the rows and their
alignment), then one prefill for each attention kernel variant the grid missed
(`paged_attention.prefill_variants`: they follow the rows, the sequences and the context, as a
chunk after a cached prefix splits its keys; under row invariance, the least prefill whose tiles
fold their own key splits, `invariant_fold_prefill`, where the grid has none).
A capture or a compile in the middle of serving stalls every running request (it synchronizes the
device, and a compile takes seconds), so the first requests would run slower than the same
requests later. Warm-up sequences hold only the trash page and the trash state slot: everything
they write lands where padding rows write."""

from dataclasses import replace
from itertools import product
from typing import TYPE_CHECKING

from blockspec.engine.kv_cache_manager import BlockTable
from blockspec.engine.sequence import Sequence
from blockspec.layers.decoder import Attention
from blockspec.layers.kernels import kernel_module, num_sms
from blockspec.layers.row_invariant import row_invariant
from blockspec.sampling import SamplingParams
from blockspec.structured_output import token_bitmasks

if TYPE_CHECKING:
    from blockspec.engine.runner import ModelRunner

# one request of each step kind (`StepInputs.mode`): greedy, sampled, filtered (top-k)
KINDS = (SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2))
PREFILL_BATCHES = (1, 2, 4)
PREFILL_ROWS = (1, 7, 16, 17, 33, 64, 100)  # chunk lengths: each query tile class, off and on multiples of 16
PREFILL_STARTS = (0, 300, 3000)  # positions a chunk starts at: no split of its keys, a few, many


def step_kinds() -> list[SamplingParams]:
    """A request of every step kind: each sampling kind, with and without logprobs and logit rules."""
    return [
        replace(kind, logprobs=logprobs, repetition_penalty=penalty, max_tokens=1)
        for kind, logprobs, penalty in product(KINDS, (None, 1), (1.0, 1.1))
    ]


def trash_sequence(runner: "ModelRunner", start: int, rows: int, params: SamplingParams, columns: int) -> Sequence:
    """A sequence with `start` positions computed and `rows` more to prefill before its anchor, whose
    `columns` table columns are all the trash page."""
    seq = Sequence(None, [0] * (start + rows + 1), params, seed=0)
    seq.block_tables = [BlockTable([0] * columns) for _ in runner.layout.reaches]
    seq.num_cached = start
    seq.stop_ids = [0]
    return seq


def prefill_shapes(runner: "ModelRunner", max_num_seqs: int, max_rows: int, step_rows: int) -> list[tuple]:
    """(sequences, start, rows, table columns) of the warm-up's prefills: the grid's that fit the
    context, then one for each attention kernel variant they miss."""
    page = runner.page_size
    shapes = [
        (batch, start, rows, -(-(start + rows + step_rows) // page))
        for batch, rows, start in product(PREFILL_BATCHES, PREFILL_ROWS, PREFILL_STARTS)
        if batch <= max_num_seqs and start + rows + step_rows <= runner.max_model_len
    ]
    kernels = kernel_module("paged_attention")
    if kernels is None:
        return shapes
    heads = attention_heads(runner, kernels)
    if row_invariant():  # two variants: a launch's tiles fold their own key splits (a long prefill), or not
        folded = any(
            kernels.invariant_folds(rows * heads.group, b * heads.kv_heads, heads.sms) for b, _, rows, _ in shapes
        )
        least = None if folded else kernels.invariant_fold_prefill(heads, max_num_seqs, max_rows)
        if least is None or least[1] + step_rows > runner.max_model_len:
            return shapes
        batch, rows = least
        return shapes + [(batch, 0, rows, -(-(rows + step_rows) // page))]
    covered = {kernels.launch_variant(b, rows, cols * page, heads) for b, _, rows, cols in shapes}
    max_pages = -(-runner.max_model_len // page)
    variants = kernels.prefill_variants(heads, page, max_num_seqs, max_rows, max_pages)
    return shapes + [(b, 0, rows, cols) for key, (b, rows, cols) in variants.items() if key not in covered]


def attention_heads(runner: "ModelRunner", kernels):
    """The target's `paged_attention.AttentionHeads`, read from its attention layers as built: the
    fused step kernel rotates whole heads (its rope tables as wide as a head) of a power-of-two
    size (`fuses_qkv`; the cache holds the model's dtype)."""
    model = runner.target
    attn = next(layer.mixer for layer in model.layers if isinstance(layer.mixer, Attention))
    d = attn.head_dim
    whole = 2 * model.rotary.inv_freq.numel() == d and d >= 16 and (d & (d - 1)) == 0
    sms = num_sms(runner.device, interpreted=132)
    return kernels.AttentionHeads(attn.num_kv_heads, attn.num_heads // attn.num_kv_heads, whole, sms)


def grammar_step(runner: "ModelRunner", seqs: list[Sequence], width: int) -> None:
    """A structured-output step as `launch_step` runs one, every token allowed: a device proposer's
    graph first, then the verify's, on a full block of drafts (and their q)."""
    widths, drafts, q = [width] * len(seqs), None, None
    if runner.proposer is not None and width > 1:
        if runner.proposer.on_device:
            _, q = runner.propose(runner.step_inputs(seqs, widths, None, None), widths)
            q = q[:, : width - 1] if q is not None else None
        drafts = [[0] * (width - 1) for _ in seqs]
    bitmask = token_bitmasks([None] * len(seqs), [[0] * width] * len(seqs), width, runner.vocab_size)
    runner.step(runner.step_inputs(seqs, widths, None, None, drafts, bitmask, q, deferring(runner, seqs, width)))


def deferring(runner: "ModelRunner", seqs: list[Sequence], width: int) -> list[int] | None:
    """A warm-up step's `StepInputs.backlog`: where the runner defers drafter context, a width-1
    step's (nothing deferred before it), else None."""
    return [0] * len(seqs) if runner.deferred is not None and width == 1 else None


def warm_up(
    runner: "ModelRunner", max_num_seqs: int, max_rows: int, step_rows: int, num_slots: int, grammar: bool
) -> None:
    """Run each prefill of `prefill_shapes` (max_rows: the most prompt rows a prefill takes), then a
    step of every kind, batch bucket and row class of the runner's graphs (captured there), and
    where requests may follow a grammar (`grammar`), a grammar's step of each kind (a batch's kind
    joins its requests' options: one with min_tokens beside one with a grammar). The penalty state
    is allocated first: the graphs of logit rules read its tensors."""
    for batch, start, rows, columns in prefill_shapes(runner, max_num_seqs, max_rows, step_rows):
        runner.prefill([trash_sequence(runner, start, rows, KINDS[0], columns) for _ in range(batch)])
    graphs = runner.graphs
    columns = -(-step_rows // runner.page_size)
    kinds = step_kinds()
    runner.reset_penalties(trash_sequence(runner, 0, 0, kinds[-1], columns), num_slots)
    for params, bucket, width in product(kinds, graphs.buckets, graphs.row_classes):
        seqs = [trash_sequence(runner, 0, 0, params, columns) for _ in range(bucket)]
        runner.step(runner.step_inputs(seqs, [width] * bucket, None, None, backlog=deferring(runner, seqs, width)))
        if grammar:
            grammar_step(runner, seqs, width)
        if runner.deferred is not None and width == 1 and params == kinds[0]:  # one flush graph a bucket
            runner.flush(runner.step_inputs(seqs, [1] * bucket, None, None, backlog=[0] * bucket))
