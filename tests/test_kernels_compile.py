"""Every Triton kernel compiled for Hopper (sm_90: Triton's front end, LLVM and ptxas) on a
machine without a GPU, over the flag combinations their launchers produce. The interpreter runs a
kernel as Python, so it accepts what the compiler refuses (tensors of mismatched shapes in a
branch the flags select, a failing static assert, an op with no lowering); this catches that in
CI, before a GPU ever runs the kernel. Where occupancy decides speed, a kernel's registers a
thread (ptxas's report) are held to a budget too."""

import itertools
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.errors import CompilationError

from blockspec.layers.kernels import (
    argmax,
    graph_inputs,
    markov_chain,
    paged_attention,
    qk_norm_rope,
    quantize_rows,
    rms_norm,
    sample,
    speculative_sample,
    swiglu,
)
from blockspec.layers.kernels import skinny_linear as kernel

HOPPER = GPUTarget("cuda", 90, 32)
FLOATS = ("eps", "qk_scale")


def compile_for_hopper(
    fn, constants: dict, aligned: tuple[str, ...] | None = None, options: dict | None = None, **pointers: str
):
    """Compile `fn` with `constants` for its constexpr parameters; the arguments `pointers` names
    take the type given there (x_ptr="*fp8e4nv", x_src="tensordesc<bf16[16,128]>"), other pointer
    arguments bf16, the rest int32 or fp32 scalars. `aligned`: compile as the JIT specializes a
    launch, every pointer 16-byte aligned and the integers named there multiples of 16 (the code,
    and its registers, as on the GPU); `options`: the launch's num_warps and num_stages (default 4
    warps)."""

    def kind(name: str) -> str:
        if name in constants:
            return "constexpr"
        if name in pointers:
            return pointers[name]
        if name.endswith("_ptr"):
            return "*bf16"
        return "fp32" if name in FLOATS else "i32"

    signature = {name: kind(name) for name in fn.arg_names}
    paths = {(fn.arg_names.index(name),): value for name, value in constants.items()}
    multiples = [] if aligned is None else [n for n in fn.arg_names if n.endswith("_ptr") or n in aligned]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in multiples}
    try:
        source = ASTSource(fn, signature, constexprs=paths, attrs=attrs)
        return triton.compile(source, target=HOPPER, options=options or {"num_warps": 4})
    except RuntimeError as e:  # no CUDA backend or ptxas in this triton build
        if "ptxas" in str(e) or "backend" in str(e):
            pytest.skip(f"triton cannot compile for sm_90 here: {e}")
        raise


def tile_sources(fp8: bool, tma: bool, tile: dict) -> dict:
    """The MMA kernel's x_src and w_src: pointers, or tensor descriptors of its tiles."""
    dtype = "fp8e4nv" if fp8 else "bf16"
    if not tma:
        return {"x_src": f"*{dtype}", "w_src": f"*{dtype}"}
    rows = {"x_src": tile["BLOCK_M"], "w_src": tile["BLOCK_N"]}
    return {name: f"tensordesc<{dtype}[{n},{tile['BLOCK_K']}]>" for name, n in rows.items()}


SCALES = {name: "*fp32" for name in ("x_scale_ptr", "w_scale_ptr", "ws_ptr", "sq_ptr")}


def flags_for(norm: str | None, swiglu: bool, **more) -> dict:
    """A launch's flags: the norm prologue ("norm": with its weight, "rms": folded), the SwiGLU
    epilogue or else the residual add; `more`: the kernel's own."""
    return {"HAS_BIAS": True, "NORM": norm is not None, "NORM_WEIGHT": norm == "norm", "SWIGLU": swiglu,
            "RESIDUAL": not swiglu, "K_ITERS": 4, "EVEN_K": False, **more}  # fmt: skip


@pytest.mark.parametrize("norm,swiglu", [(None, False), ("norm", False), ("rms", False), ("rms", True), (None, True)])
def test_gemv_compiles(norm, swiglu):
    flags = flags_for(norm, swiglu, PDL=True, BLOCK_N=32, BLOCK_K=128)
    compile_for_hopper(kernel._gemv_kernel, flags)


MMA_TILE = {"IEEE": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "PDL": True}


@pytest.mark.parametrize("fp8,norm,swiglu,split_k,tma", [
    (fp8, norm, swiglu, split_k, tma)
    for fp8, norm, swiglu, split_k, tma in itertools.product(
        (False, True), (None, "norm", "rms"), (False, True), (1, 2), (False, True)
    )
    if not (fp8 and norm) and not (swiglu and (split_k > 1 or tma))  # SwiGLU's rows: no split, no box
])  # fmt: skip
def test_mma_kernel_compiles(fp8, norm, swiglu, split_k, tma):
    flags = flags_for(norm, swiglu, FP8=fp8, SPLIT_K=split_k, TMA=tma, **MMA_TILE)
    compiled = compile_for_hopper(kernel._skinny_kernel, flags, **SCALES, **tile_sources(fp8, tma, MMA_TILE))
    assert ("cp.async.bulk.tensor" in compiled.asm["ptx"]) is tma  # TMA copies, or none


def test_swiglu_with_split_k_is_refused_when_compiled():
    flags = flags_for("rms", True, FP8=False, SPLIT_K=2, TMA=False, **MMA_TILE)
    with pytest.raises(CompilationError, match="no split-K"):
        compile_for_hopper(kernel._skinny_kernel, flags, **SCALES, **tile_sources(False, False, MMA_TILE))


@pytest.mark.parametrize("fp8,norm,residual", [(False, True, True), (True, False, False)])
def test_splitk_reduce_compiles(fp8, norm, residual):
    flags = {
        "HAS_BIAS": True,
        "NORM": norm,
        "RESIDUAL": residual,
        "FP8": fp8,
        "SPLIT_K": 4,
        "BLOCK": kernel.REDUCE_BLOCK,
        "PDL": True,
    }
    compile_for_hopper(kernel._splitk_reduce_kernel, flags, **SCALES)


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_argmax_compiles(dtype):
    flags = {"CHUNK_ITERS": 5, "CHUNKS_PAD": 16, "BLOCK": argmax.BLOCK}
    compile_for_hopper(argmax._chunk_argmax_kernel, flags, x_ptr=dtype, val_ptr="*fp32", idx_ptr="*i32")
    compile_for_hopper(argmax._row_argmax_kernel, {"CHUNKS": 15, "CHUNKS_PAD": 16}, val_ptr="*fp32", idx_ptr="*i32",
                       out_ptr="*i64")  # fmt: skip


MARKOV_POINTERS = {
    "base_ptr": "*fp32", "w1_ptr": "*fp32", "w2_ptr": "*fp32", "d2t_ptr": "*i64", "anchor_ptr": "*i64",
    "val_ptr": "*fp32", "idx_ptr": "*i32", "sum_ptr": "*fp32", "x_ptr": "*fp32", "temp_ptr": "*fp32",
    "u_ptr": "*fp32", "drafts_ptr": "*i64", "emb_ptr": "*fp32",
}  # fmt: skip


@pytest.mark.parametrize("vocab,seqs", [(128, 16), (128, 1), (151936, 16)])
def test_markov_chain_compiles_for_any_draft_vocabulary(vocab, seqs):
    """The chain's sampled rows at the chunk counts `markov_chain` launches: one chunk too (a small
    vocabulary), as the JIT specializes it (aligned sizes)."""
    tiles = markov_chain.chain_tiles(seqs, torch.empty(vocab, 32))
    layout = markov_chain.chunk_layout(1, vocab, 132, tiles)
    flags = {"R": 32, "CHUNKS": layout.chunks, "CHUNKS_PAD": layout.pad, "CHUNK_ITERS": layout.iters,
             "FIRST": False, "ROW": True, "HAS_D2T": False, "SAMPLED": True, "SEQS": tiles.seqs,
             "BLOCK": tiles.block, "RB": 32, "DOT": tiles.seqs >= 16, "MMA": tiles.mma}  # fmt: skip
    aligned = ("stride_b", "stride_j", "n", "B", "Vd")
    compile_for_hopper(markov_chain._markov_row_kernel, flags, aligned, **MARKOV_POINTERS)


SAMPLE_POINTERS = {"temp_ptr": "*fp32", "u_ptr": "*fp64", "val_ptr": "*fp32", "sum_ptr": "*fp32", "out_ptr": "*i64"}


@pytest.mark.parametrize("logits", ["*bf16", "*fp32"])
@pytest.mark.parametrize("aligned", [("V", "stride_row"), ()])
@pytest.mark.parametrize("vocab", [2048, 49152, 151936])
def test_sample_compiles_at_the_chunks_it_cuts_a_row_into(vocab, aligned, logits):
    """The draw of a plain step's token at `chunk_layout`'s chunks: two of a small vocabulary too,
    whose scan needs MIN_PAD where the JIT specializes the rows as aligned."""
    layout = sample.chunk_layout(vocab)
    pointers = SAMPLE_POINTERS | {"x_ptr": logits}
    flags = {"CHUNK_ITERS": layout.iters, "CHUNKS_PAD": layout.pad, "BLOCK": sample.BLOCK}
    compile_for_hopper(sample._chunk_mass_kernel, flags, aligned, **pointers)
    compile_for_hopper(sample._row_draw_kernel, flags | {"CHUNKS": layout.chunks}, aligned, **pointers)


SPECULATIVE_POINTERS = {
    "drafts_ptr": "*i64", "num_ptr": "*i64", "temp_ptr": "*fp32", "u_ptr": "*fp64", "accepted_ptr": "*i64",
    "token_ptr": "*i64", "r_ptr": "*fp32", "rsum_ptr": "*fp32", "part_ptr": "*fp32",
} | {f"{row}_{stat}_ptr": "*fp32" for row in "pq" for stat in ("val", "sum")}  # fmt: skip


@pytest.mark.parametrize("logits", ["*bf16", "*fp32"])
@pytest.mark.parametrize("aligned", [("V", "S"), ()])
@pytest.mark.parametrize("vocab", [2048, 49152, 151936])
def test_speculative_sample_compiles(vocab, aligned, logits):
    """Speculative sampling's acceptance test, residual draw and drafts' chances at `chunk_layout`'s
    chunks, at the narrowest and widest blocks (a width of 16 is a multiple of 16, which the JIT
    specializes)."""
    layout = sample.chunk_layout(vocab)
    pointers = SPECULATIVE_POINTERS | {"x_ptr": logits, "y_ptr": logits}
    shape = {"CHUNKS": layout.chunks, "CHUNKS_PAD": layout.pad}
    for block in (2, 16):
        compile_for_hopper(speculative_sample._accept_kernel, shape | {"S_PAD": block}, aligned, **pointers)
    steps = shape | {"CHUNK_ITERS": layout.iters, "BLOCK": sample.BLOCK}
    compile_for_hopper(speculative_sample._residual_mass_kernel, steps, aligned, **pointers)
    compile_for_hopper(speculative_sample._residual_draw_kernel, steps, aligned, **pointers)
    compile_for_hopper(speculative_sample._chance_kernel, steps, aligned, **pointers)


def test_dequantize_compiles():
    flags = {"BLOCK": kernel.DEQUANT_BLOCK}
    compile_for_hopper(kernel._dequant_kernel, flags, q_ptr="*fp8e4nv", scale_ptr="*fp32")


SPLIT_POINTERS = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "arrivals_ptr": "*i32"}


INVARIANT_KEYS = paged_attention.INVARIANT_SPLIT_KEYS


@pytest.mark.parametrize("split,arrive,fp32,sinks,split_keys,fold", [
    (True, True, False, False, 0, False), (True, False, False, False, 0, False), (False, False, False, True, 0, False),
    (True, True, True, True, 0, False), (True, False, False, True, INVARIANT_KEYS, False),
    (False, False, False, True, INVARIANT_KEYS, True), (False, False, True, False, INVARIANT_KEYS, True),
])  # fmt: skip
def test_paged_attention_compiles(split, arrive, fp32, sinks, split_keys, fold):
    flags = {"G": 4, "D": 128, "D_PAD": 128, "PAGE": 16, "BLOCK_M": 64, "BLOCK_N": 32 if fp32 else 64, "SPLIT": split}
    flags |= {"ARRIVE": arrive, "UNROLL": 1, "PRECISION": "ieee" if fp32 else "tf32", "HAS_SINKS": sinks}
    flags |= {"SPLIT_KEYS": split_keys, "FOLD": fold, "PDL": True}
    pointers = dict.fromkeys(("table_ptr", "k_start_ptr", "k_end_ptr"), "*i32") | SPLIT_POINTERS
    if fp32:
        pointers |= dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), "*fp32")
    compile_for_hopper(paged_attention._attention_kernel, flags, **pointers)


@pytest.mark.parametrize("weight", [False, True])
def test_rms_norm_compiles(weight):
    compile_for_hopper(
        rms_norm._rms_norm_kernel,
        {"HAS_WEIGHT": weight, "BLOCK": 4096, "PDL": True},
        options={"num_warps": rms_norm.NUM_WARPS},
    )


def test_swiglu_compiles():
    compile_for_hopper(swiglu._swiglu_kernel, {"BLOCK": swiglu.BLOCK})


@pytest.mark.parametrize("sinks", [False, True])
def test_attention_combine_compiles(sinks):
    flags = {"SPLITS_PAD": 32, "D": 128, "D_PAD": 128, "PDL": True, "HAS_SINKS": sinks}
    compile_for_hopper(paged_attention._combine_kernel, flags, part_ptr="*fp32", lse_ptr="*fp32")


def fold_flags(pdl: bool) -> dict:
    return {
        "ROWS": 4,
        "D": 128,
        "D_PAD": 128,
        "SPLIT_KEYS": INVARIANT_KEYS,
        "UNROLL": 4,
        "PDL": pdl,
        "HAS_SINKS": False,
    }


@pytest.mark.parametrize("sinks", [False, True])
def test_invariant_fold_compiles(sinks):
    flags = fold_flags(True) | {"HAS_SINKS": sinks}
    compile_for_hopper(paged_attention._fold_kernel, flags, part_ptr="*fp32", lse_ptr="*fp32", k_end_ptr="*i32")


@pytest.mark.parametrize("weight,write", [(True, True), (False, False)])
def test_qk_norm_rope_compiles(weight, write):
    flags = {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HAS_WEIGHT": weight, "WRITE": write, "HALF": 64, "BLOCK": 64}
    flags |= {"PDL": True}
    compile_for_hopper(qk_norm_rope._qk_norm_rope_kernel, flags, slot_ptr="*i64")


@pytest.mark.parametrize("norm,weight", [(False, False), (True, True), (True, False)])
def test_quantize_rows_compiles(norm, weight):
    flags = {"K": 4096, "NORM": norm, "NORM_WEIGHT": weight, "BLOCK": quantize_rows.MAX_BLOCK, "PDL": True}
    compile_for_hopper(quantize_rows._quantize_rows_kernel, flags, q_ptr="*fp8e4nv", scale_ptr="*fp32")


@pytest.mark.parametrize(
    "rows,split,arrive,norm,fp32,sinks",
    [(1, True, True, True, False, False), (16, True, False, True, False, True), (16, False, False, False, False, False),
     (4, True, True, True, True, True)],
)  # fmt: skip
def test_qkv_attention_compiles(rows, split, arrive, norm, fp32, sinks):
    flags = {"G": 4, "HALF": 64, "PAGE": 16, "BLOCK_M": max(16, 4 * rows), "BLOCK_N": 32 if fp32 else 64, "TILES": 1}
    flags |= {"BLOCK_S": 16, "HAS_NORM": norm, "SPLIT": split, "PRECISION": "ieee" if fp32 else "tf32", "PDL": True}
    flags |= {"HAS_SINKS": sinks}
    flags |= {"ARRIVE": arrive, "UNROLL": 1}
    pointers = dict.fromkeys(("pos_ptr", "slot_ptr", "table_ptr", "k_start_ptr", "k_end_ptr"), "*i64")
    tensors = "*fp32" if fp32 else "*bf16"
    pointers |= dict.fromkeys(("qkv_ptr", "q_norm_ptr", "k_norm_ptr", "cos_ptr", "sin_ptr", "k_ptr", "v_ptr"), tensors)
    pointers |= SPLIT_POINTERS | {"out_ptr": tensors}
    compile_for_hopper(paged_attention._qkv_attention_kernel, flags, **pointers)


def test_graph_inputs_compiles():
    """Five int64 inputs (a fused step's): tuples of pointers, and of sizes and strides as floats."""
    pointers = dict.fromkeys(("bufs", "xs"), ("*i64",) * 5)
    sizes = dict.fromkeys(("groups", "widths", "cols", "pads"), ("fp32",) * 5) | {"x_strides": ("fp32",) * 15}
    compile_for_hopper(graph_inputs._fill_kernel, {"BLOCK": graph_inputs.BLOCK}, **pointers, **sizes)


def test_layers_kv_write_compiles():
    flags = {"NUM_KV_HEADS": 8, "HALF": 64, "BLOCK": 64}
    caches = dict.fromkeys(("k_caches", "v_caches"), ("*bf16",) * 5)  # the drafter's 5 layers
    caches["slot_ptrs"] = ("*i64",) * 5  # each layer's cache group's slots
    compile_for_hopper(qk_norm_rope._layers_kv_write_kernel, flags, **caches)


def registers(compiled) -> tuple[int, int]:
    """Registers a thread of a compiled kernel takes, and bytes it spills: ptxas (Triton's own) on
    its PTX, for sm_90a."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", ptx.with_suffix(".cubin")],
                                capture_output=True, text=True, check=True).stderr  # fmt: skip
    spills = re.search(r"(\d+) bytes spill stores", report)
    return int(re.search(r"Used (\d+) registers", report).group(1)), int(spills.group(1)) if spills else 0


@pytest.mark.parametrize("rows", [1, 16], ids=["decode", "verify"])
def test_fused_attention_fits_three_programs_an_sm_in_16_row_tiles(rows):
    """A decode step at batch 16 launches 16 sequences x 8 kv heads x 3 key splits = 384 programs
    of one 16-row tile, and a verify at batch 1 (16 rows x 4 heads in 4 tiles of 16, `step_grid`)
    8 x 4 x 12 = 384: at 3 an SM (<= 168 registers a thread, 4 warps) one wave on the H200's 132
    SMs. The first version made the new keys after the key loop and took 197, 2 an SM: plain B=16
    4.95-4.96 -> 5.15-5.16 ms a step. Compiled as the JIT specializes those launches (unit
    strides, aligned pointers) with the launcher's tiles."""
    tile = paged_attention._key_tile(torch.bfloat16, 128)  # BLOCK_N, PRECISION and the launch options
    options = {name: tile.pop(name) for name in ("num_warps", "num_stages")}
    block_m, tiles, splits = paged_attention.step_grid(1 if rows > 1 else 16, 8, rows * 4, 1024, 132)
    assert block_m == 16
    flags = {"G": 4, "HALF": 64, "PAGE": 16, "BLOCK_M": block_m, "TILES": tiles, "BLOCK_S": 16, "HAS_NORM": True}
    flags |= {"HAS_SINKS": False}
    flags |= paged_attention.split_flags(splits, block_m) | {"PDL": True}  # as launched on Hopper
    unit = ("stride_tm", "stride_pb", "stride_mb", "stride_ms", "stride_sb", "stride_ss", "stride_eb", "stride_es")
    flags |= tile | dict.fromkeys(unit, 1) | ({"S": 1} if rows == 1 else {})
    pointers = dict.fromkeys(("pos_ptr", "slot_ptr", "table_ptr", "k_start_ptr", "k_end_ptr"), "*i64")
    pointers |= SPLIT_POINTERS
    aligned = ("B", "stride_kn", "stride_kh", "stride_vn", "stride_vh", "stride_tb")
    compiled = compile_for_hopper(paged_attention._qkv_attention_kernel, flags, aligned, options, **pointers)
    used, spilled = registers(compiled)
    assert options["num_warps"] == 4 and used <= 168 and spilled == 0, (used, spilled)


def qkv_attention_flags(pdl: bool) -> dict:
    return {"G": 4, "HALF": 64, "PAGE": 16, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_S": 16, "HAS_NORM": True,
            "SPLIT": True, "ARRIVE": True, "UNROLL": 1, "PRECISION": "tf32", "PDL": pdl, "TILES": 1,
            "HAS_SINKS": False}  # fmt: skip


def paged_attention_flags(pdl: bool, split_keys: int, arrive: bool) -> dict:
    """`_attention_kernel` split across programs: by the heuristic, combined by the last to arrive,
    or at row invariance's fixed splits, folded by `_fold_kernel`."""
    return {"G": 4, "D": 128, "D_PAD": 128, "PAGE": 16, "BLOCK_M": 64, "BLOCK_N": 64, "SPLIT": True, "ARRIVE": arrive,
            "UNROLL": 1, "PRECISION": "tf32", "HAS_SINKS": False, "SPLIT_KEYS": split_keys, "FOLD": False, "PDL": pdl}  # fmt: skip


PAGED_ATTENTION_POINTERS = dict.fromkeys(("table_ptr", "k_start_ptr", "k_end_ptr"), "*i32") | SPLIT_POINTERS
PDL_KERNELS = {  # kernel, its flags, pointer types: what launches with programmatic dependent launch
    "mma": (kernel._skinny_kernel, lambda pdl: flags_for("rms", False, FP8=False, SPLIT_K=1, TMA=True,
            **MMA_TILE | {"PDL": pdl}), SCALES | tile_sources(False, True, MMA_TILE)),
    "reduce": (kernel._splitk_reduce_kernel, lambda pdl: {"HAS_BIAS": False, "NORM": True, "RESIDUAL": True,
               "FP8": False, "SPLIT_K": 2, "BLOCK": kernel.REDUCE_BLOCK, "PDL": pdl}, SCALES),
    "attention": (paged_attention._qkv_attention_kernel, qkv_attention_flags,
                  dict.fromkeys(("pos_ptr", "slot_ptr", "table_ptr", "k_start_ptr", "k_end_ptr"), "*i64")
                  | SPLIT_POINTERS),
    "combine": (paged_attention._combine_kernel, lambda pdl: {"SPLITS_PAD": 32, "D": 128,
                "D_PAD": 128, "PDL": pdl, "HAS_SINKS": False}, {"part_ptr": "*fp32", "lse_ptr": "*fp32"}),
    "paged_attention": (paged_attention._attention_kernel, lambda pdl: paged_attention_flags(pdl, 0, True),
                        PAGED_ATTENTION_POINTERS),
    "invariant_attention": (paged_attention._attention_kernel,
                            lambda pdl: paged_attention_flags(pdl, INVARIANT_KEYS, False), PAGED_ATTENTION_POINTERS),
    "fold": (paged_attention._fold_kernel, fold_flags, {"part_ptr": "*fp32", "lse_ptr": "*fp32", "k_end_ptr": "*i32"}),
    "rms_norm": (rms_norm._rms_norm_kernel, lambda pdl: {"HAS_WEIGHT": True, "BLOCK": 4096, "PDL": pdl}, {}),
    "qk_norm_rope": (qk_norm_rope._qk_norm_rope_kernel, lambda pdl: {"NUM_HEADS": 32, "NUM_KV_HEADS": 8,
                     "HAS_WEIGHT": True, "WRITE": True, "HALF": 64, "BLOCK": 64, "PDL": pdl}, {"slot_ptr": "*i64"}),
    "quantize": (quantize_rows._quantize_rows_kernel, lambda pdl: {"K": 4096, "NORM": True, "NORM_WEIGHT": False,
                 "BLOCK": quantize_rows.MAX_BLOCK, "PDL": pdl}, {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}),
}  # fmt: skip
LET_IN_AFTER_MAIN_LOOP = (
    "mma",
    "attention",
    "paged_attention",
    "invariant_attention",
)  # at their top they lost (pdl.py): DFlash B=1 5.06 -> 6.17 ms
# A PTX line that touches global memory (predicated or not): loads, stores, async and TMA copies, atomics.
GLOBAL_ACCESS = re.compile(r"^\s*(@!?%p\d+\s+)?(ld\.global|st\.global|cp\.async|atom\.|red\.)")


def first_line(lines: list[str], found) -> int:
    return next(i for i, line in enumerate(lines) if found(line))


@pytest.mark.parametrize("name", PDL_KERNELS)
@pytest.mark.parametrize("pdl", [True, False])
def test_pdl_kernels_wait_for_the_previous_and_let_the_next_in(name, pdl):
    """With PDL each of these kernels waits for the kernel before it (griddepcontrol.wait) before
    it touches global memory, and lets the next one launch (griddepcontrol.launch_dependents):
    the GEMM and the attention after their last MMA, the small kernels at their top; without PDL,
    neither instruction."""
    fn, flags, pointers = PDL_KERNELS[name]
    ptx = compile_for_hopper(fn, flags(pdl), **pointers).asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) is pdl and ("griddepcontrol.launch_dependents" in ptx) is pdl
    if not pdl:
        return
    lines = ptx.splitlines()
    wait = first_line(lines, lambda line: "griddepcontrol.wait" in line)
    assert wait < first_line(lines, GLOBAL_ACCESS.match), f"{name} reads or writes memory before its wait"
    let_in = first_line(lines, lambda line: "griddepcontrol.launch_dependents" in line)
    if name in LET_IN_AFTER_MAIN_LOOP:
        last_mma = max(i for i, line in enumerate(lines) if "wgmma.mma_async" in line)
        assert let_in > last_mma, f"{name} lets the next kernel in before its main loop ends"
    else:
        assert let_in < wait, f"{name} lets the next kernel in after its wait"
