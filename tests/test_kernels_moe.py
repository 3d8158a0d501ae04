"""The fused MoE kernels (`blockspec.layers.kernels.fused_moe`) against `experts_ref`: both
activations, with and without biases, pairs fewer than, as many as and more than a block, experts
without rows, every row on one expert, T = 1, k = 1 and 4, odd H and I (masked tiles), bf16/fp16/
fp32 weights and MXFP4 ones (against `dequantize_mxfp4` + `experts_ref`).

With a GPU the kernels run for real (bf16, gpt-oss and Qwen3-MoE shapes, CUDA-graph capture and
replay). Without one they run in Triton's interpreter (fp16/fp32, small shapes; its tl.dot
mishandles bf16), switched on before triton is first imported: so on the CPU this file runs again
in a subprocess with TRITON_INTERPRET=1 (test_kernels_in_interpreter), and the kernels are also
compiled for sm_90 (ptxas, no GPU needed). Skipped without triton."""

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton")

from conftest import CUDA, INTERPRETED, interpreter_test, runs_kernel

from blockspec.layers import moe
from blockspec.layers.kernels import fused_moe as kernel
from blockspec.layers.moe import MoESpec, experts_ref
from blockspec.layers.mxfp4 import E2M1, dequantize_mxfp4

test_kernels_in_interpreter = interpreter_test(__file__)
cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
DEVICE = torch.device("cuda" if CUDA else "cpu")
host_only = pytest.mark.skipif(INTERPRETED, reason="no kernel: runs once, in the parent process")
SMALL = kernel.MoEConfig(16, 32, 32)  # interpreter tiles: several N tiles and K steps at small H, I


def spec(E: int, k: int, I: int, activation: str = "swiglu", bias: bool = False) -> MoESpec:
    """An MoESpec; the clamped SwiGLU's limit low (0.5) so that the clamps act on these weights."""
    return MoESpec(E, k, I, "softmax_topk", expert_bias=bias, activation=activation, swiglu_limit=0.5)


def make_moe(T: int, k: int, E: int, H: int, I: int, dtype, bias: bool, routing: str = "random", seed: int = 0):
    """(x, router weights, ids, gate_up, down, gate_up_bias, down_bias) on DEVICE. routing "random":
    each row's top k of random logits; "one": every pair on expert E - 2 (k = 1); "few": every pair
    on the first k + 1 experts (the others get none)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    logits = torch.randn(T, E, generator=gen)
    if routing == "one":
        assert k == 1
        logits[:, E - 2] += 100
    elif routing == "few":
        logits[:, : k + 1] += 100
    weights, ids = torch.softmax(logits, -1).topk(k, -1)
    weights = weights / weights.sum(-1, keepdim=True) * torch.rand(T, 1, generator=gen).add(0.5)
    gate_up = torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H)
    down = torch.randn(E, H, I, generator=gen) / math.sqrt(I)
    gate_up_bias = torch.randn(E, 2 * I, generator=gen) * 0.3 if bias else None
    down_bias = torch.randn(E, H, generator=gen) * 0.3 if bias else None
    tensors = (x, weights, ids, gate_up, down, gate_up_bias, down_bias)
    return tuple(None if t is None else t.to(DEVICE, dtype if t.is_floating_point() else t.dtype) for t in tensors)


def error_budget(args: tuple, m: MoESpec) -> tuple[torch.Tensor, float]:
    """(the float32 reference, the error allowed against it): twice the reference's own rounding
    error in the inputs' dtype (0 in float32), plus 1e-5 of its largest value."""
    ref = experts_ref(*(None if t is None else t.float() if t.is_floating_point() else t for t in args), m)
    own = experts_ref(*args, m).float() if args[0].dtype != torch.float32 else ref
    return ref, 2 * (own - ref).abs().max().item() + 1e-5 * ref.abs().max().item()


def assert_close_to_reference(y: torch.Tensor, args: tuple, m: MoESpec) -> None:
    ref, budget = error_budget(args, m)
    assert y.shape == args[0].shape and y.dtype == args[0].dtype, (y.shape, y.dtype)
    err = (y.float() - ref).abs().max().item()
    assert err <= budget, (err, budget, ref.abs().max().item())


CASES = [  # T, k, E, H, I, dtype, bias, activation, routing
    (1, 1, 8, 40, 24, torch.float32, True, "swiglu", "random"),  # one pair; H, I not multiples of the tiles
    (4, 4, 8, 64, 32, torch.float32, False, "clamped_swiglu", "random"),  # 16 pairs: one block's worth
    (9, 4, 8, 72, 40, torch.float16, True, "clamped_swiglu", "random"),  # 36 pairs over 8 experts
    (20, 1, 8, 40, 24, torch.float32, True, "swiglu", "one"),  # all on one expert: 2 blocks
    (7, 3, 8, 48, 48, torch.float16, False, "swiglu", "few"),  # experts without rows
    (5, 2, 5, 40, 24, torch.float32, True, "clamped_swiglu", "random"),  # odd E
]


@runs_kernel
@pytest.mark.parametrize("T,k,E,H,I,dtype,bias,activation,routing", CASES)
def test_kernel_matches_reference_small(T, k, E, H, I, dtype, bias, activation, routing):
    args = make_moe(T, k, E, H, I, dtype, bias, routing, seed=T)
    m = spec(E, k, I, activation, bias)
    assert_close_to_reference(kernel.fused_moe_triton(*args, m, SMALL), args, m)


@runs_kernel
@pytest.mark.parametrize("T,k,E,dtype", [(3, 4, 8, torch.float16), (40, 1, 4, torch.float32)])
def test_kernel_with_chosen_tiles(T, k, E, dtype):
    """choose_config's tiles (16-row blocks, H and I in one K step each), and 32-row blocks."""
    args = make_moe(T, k, E, 64, 32, dtype, True)
    for activation in ("swiglu", "clamped_swiglu"):
        m = spec(E, k, 32, activation, True)
        assert_close_to_reference(kernel.fused_moe_triton(*args, m), args, m)
        assert_close_to_reference(kernel.fused_moe_triton(*args, m, kernel.MoEConfig(32, 32, 32)), args, m)


@runs_kernel
def test_kernel_empty_input():
    args = make_moe(0, 2, 8, 40, 24, torch.float32, False)
    assert kernel.fused_moe_triton(*args, spec(8, 2, 24), SMALL).shape == (0, 40)


@runs_kernel
@pytest.mark.parametrize("T,k,E,block_m", [(37, 3, 8, 16), (1, 1, 4, 16), (50, 2, 3, 32), (6, 4, 128, 16)])
def test_align_groups_pairs_by_expert(T, k, E, block_m, monkeypatch):
    """Each expert's pairs, in order, fill its blocks (experts in order), the last topped up with
    T * k; the blocks used are counted. Ids read in chunks of 16 (several per call)."""
    monkeypatch.setattr(kernel, "ALIGN_CHUNK", 16)
    ids = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).topk(k, -1).indices.to(DEVICE)
    pairs, nblocks = kernel.align_pairs(ids, E, block_m)
    expected = []
    for e in range(E):
        mine = (ids.flatten() == e).nonzero().flatten().tolist()
        expected += mine + [T * k] * (-len(mine) % block_m)
    assert nblocks.item() * block_m == len(expected) <= pairs.numel()
    assert pairs[: len(expected)].tolist() == expected


@host_only
def test_block_bound_holds_for_every_routing():
    """`max_blocks` is the blocks of the worst routing (one pair on every expert it can reach, the
    rest in whole blocks over as many of them, the remainder on one more), and at least those of
    even and random routings."""
    gen = torch.Generator().manual_seed(0)
    for P, E, bm in [(1, 8, 16), (8, 32, 16), (17, 4, 16), (1024, 128, 16), (100, 8, 64), (5000, 32, 128)]:
        touched = min(E, P)
        full, rest = divmod(P - touched, bm)
        worst = [1 + bm * (full // touched + (e < full % touched)) for e in range(touched)]
        worst[-1] += rest
        even = [P // touched + (e < P % touched) for e in range(touched)]
        randoms = [torch.bincount(torch.randint(E, (P,), generator=gen), minlength=E).tolist() for _ in range(20)]
        blocks = [sum(-(-c // bm) for c in counts) for counts in [worst, even, *randoms]]
        assert kernel.max_blocks(P, E, bm) == blocks[0] >= max(blocks), (P, E, bm, blocks)


@host_only
@pytest.mark.parametrize("E,k,H,I", [(32, 4, 2880, 2880), (128, 8, 2048, 768)], ids=["gpt-oss-20b", "qwen3-30b-a3b"])
def test_choose_config_for_model_shapes(E, k, H, I):
    """16-row blocks for decode and verify (<= 16 pairs an expert on average), 128 for prefill; at
    small T the programs of the blocks cover the H200's 132 SMs in both GEMMs."""
    for T in (1, 4, 16, 64, 128, 4096):
        P = T * k
        for N, K in ((2 * I, H), (H, I)):
            c = kernel.choose_config(P, E, N, K, 132)
            assert c.block_m == (16 if T <= 128 else 128), (T, c)
            assert c.block_n >= 32 and c.block_k >= 32 and c.block_k % kernel.MXFP4_GROUP == 0
            assert -(-N // c.block_n) * kernel.max_blocks(P, E, c.block_m) >= 132, (T, N, c)
            assert (c.block_m + c.block_n) * c.block_k * 2 * c.num_stages <= 192 * 1024  # bf16 tiles fit


# -- the tolerance catches wrong kernels --------------------------------------------------------


def per_pair_ref(args: tuple, m: MoESpec, rows: torch.Tensor) -> torch.Tensor:
    """`experts_ref` with pair p (row p // k, choice p % k) reading x[rows[p]]: the reference at
    rows = arange(T * k) // k."""
    x, weights, ids, *experts = args
    T, k = ids.shape
    y = experts_ref(x[rows], weights.reshape(-1, 1), ids.reshape(-1, 1), *experts, dataclasses.replace(m, top_k=1))
    return y.view(T, k, -1).float().sum(1).to(x.dtype)


def wrong_outputs(args: tuple, m: MoESpec) -> dict[str, torch.Tensor]:
    """What plausible kernel bugs would return: each a reference run on mangled inputs."""
    x, weights, ids, gate_up, down, gate_up_bias, down_bias = args
    E, I = m.num_experts, m.intermediate_size
    swapped = torch.cat((gate_up[:, I:], gate_up[:, :I]), 1)
    interleaved = gate_up.view(E, I, 2, -1).transpose(1, 2).reshape(gate_up.shape)  # gate = rows 0, 2, ...
    other = "swiglu" if m.activation == "clamped_swiglu" else "clamped_swiglu"
    P = ids.numel()
    return {
        "gate and up swapped": experts_ref(x, weights, ids, swapped, down, gate_up_bias, down_bias, m),
        "gate|up interleaved": experts_ref(x, weights, ids, interleaved, down, gate_up_bias, down_bias, m),
        "the next expert's weights": experts_ref(x, weights, (ids + 1) % E, gate_up, down, gate_up_bias, down_bias, m),
        "the other activation": experts_ref(*args, dataclasses.replace(m, activation=other)),
        "no router weights": experts_ref(x, torch.ones_like(weights), ids, gate_up, down, gate_up_bias, down_bias, m),
        "the other pairs' router weights": experts_ref(x, weights.flip(-1), ids, gate_up, down, gate_up_bias,
                                                       down_bias, m),
        "row = pair % T": per_pair_ref(args, m, torch.arange(P, device=x.device) % x.shape[0]),
        "no down bias": experts_ref(x, weights, ids, gate_up, down, gate_up_bias, None, m),
        "no gate|up bias": experts_ref(x, weights, ids, gate_up, down, None, down_bias, m),
    }  # fmt: skip


@host_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu"])
def test_tolerance_catches_wrong_kernels(dtype, activation):
    """Each of `wrong_outputs` is far outside the error allowed (and the clamps act)."""
    args = make_moe(9, 4, 8, 72, 40, dtype, True)
    m = spec(8, 4, 40, activation, True)
    gate_up = torch.nn.functional.linear(args[0].float(), args[3][0].float())
    assert (gate_up[:, :40] > m.swiglu_limit).any() and (gate_up[:, 40:].abs() > m.swiglu_limit).any()
    ref, budget = error_budget(args, m)
    right = per_pair_ref(args, m, torch.arange(36) // 4)  # the per-pair form, at the right rows: within it
    assert (right.float() - ref).abs().max().item() <= budget
    for bug, y in wrong_outputs(args, m).items():
        assert (y.float() - ref).abs().max().item() > 20 * budget, bug


# -- MXFP4 --------------------------------------------------------------------------------------


@host_only
def test_dequantize_mxfp4_reads_nibbles_low_first_and_scales():
    every_byte = torch.arange(256, dtype=torch.uint8).view(16, 16)  # 16 groups of 32 values
    scales = torch.tensor([127, 128, 120, 1, 200, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127, 130]).to(
        torch.uint8
    )
    w = dequantize_mxfp4(every_byte, scales)
    assert w.shape == (512,) and w.dtype == torch.float32
    for byte in range(256):
        g = byte // 16
        lo, hi = w[2 * byte : 2 * byte + 2] / 2.0 ** (scales[g].item() - 127)
        assert (lo.item(), hi.item()) == (E2M1[byte & 15], E2M1[byte >> 4]), byte
    assert dequantize_mxfp4(every_byte.view(2, 8, 16), scales.view(2, 8), torch.bfloat16).shape == (2, 256)


def make_mxfp4(E: int, N: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 weights [E, N, K]: every nibble, scales 2**-6 .. 2**-3 (about 1 / sqrt(K))."""
    blocks = torch.randint(256, (E, N, K // 32, 16), generator=gen, dtype=torch.uint8)
    return blocks.to(DEVICE), torch.randint(121, 125, (E, N, K // 32), generator=gen, dtype=torch.uint8).to(DEVICE)


def check_mxfp4(T, k, E, H, I, dtype, bias, activation, config=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, weights, ids, _, _, gate_up_bias, down_bias = make_moe(T, k, E, H, I, dtype, bias, seed=seed)
    gate_up, down = make_mxfp4(E, 2 * I, H, gen), make_mxfp4(E, H, I, gen)
    m = spec(E, k, I, activation, bias)
    y = kernel.fused_moe_triton(x, weights, ids, gate_up, down, gate_up_bias, down_bias, m, config)
    dense = dequantize_mxfp4(*gate_up, dtype), dequantize_mxfp4(*down, dtype)
    assert_close_to_reference(y, (x, weights, ids, *dense, gate_up_bias, down_bias), m)


@runs_kernel
@pytest.mark.parametrize(
    "T,k,E,H,I,dtype,bias,activation",
    [
        (1, 1, 4, 64, 32, torch.float32, True, "clamped_swiglu"),
        (9, 4, 8, 96, 64, torch.float32, False, "swiglu"),  # K of 96 in steps of 64: masked groups
        (5, 2, 8, 64, 96, torch.float16, True, "clamped_swiglu"),
    ],
)
def test_mxfp4_kernel_matches_dequantized_reference(T, k, E, H, I, dtype, bias, activation):
    check_mxfp4(T, k, E, H, I, dtype, bias, activation, kernel.MoEConfig(16, 32, 64))


# -- compiled for Hopper (no GPU needed) ---------------------------------------------------------

needs_compiler = pytest.mark.skipif(CUDA or INTERPRETED, reason="compiled in the parent process on the CPU")
GEMM_POINTERS = {"pairs_ptr": "*i32", "nblocks_ptr": "*i32", "ids_ptr": "*i64"}


def compile_gemm(fn, config: kernel.MoEConfig, mxfp4: bool, **flags):
    from test_kernels_compile import compile_for_hopper

    tiles = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k}
    pointers = GEMM_POINTERS | ({"w_ptr": "*u8", "s_ptr": "*u8"} if mxfp4 else {})
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    constants = {"H": 2880, "I": 2880, "IEEE": False, "MXFP4": mxfp4, "EVEN_K": 2880 % config.block_k == 0}
    constants |= tiles | flags
    return compile_for_hopper(fn, constants, ("P",), options, **pointers)


@needs_compiler
@pytest.mark.parametrize("pairs", [4, 32768], ids=["decode", "prefill"])
@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_gemms_compile_for_hopper(pairs, mxfp4):
    """Both GEMMs at gpt-oss-20b's shapes with the chosen tiles: wgmma (the weight tile on its wide
    side), pipelined loads (cp.async), no spills."""
    from test_kernels_compile import registers

    for fn, N, K, flags in (
        (kernel._gate_up_kernel, 5760, 2880, {"TOP_K": 4, "HAS_BIAS": True, "CLAMPED": True}),
        (kernel._down_kernel, 2880, 2880, {"HAS_BIAS": True}),
    ):
        config = kernel.choose_config(pairs, 32, N, K, 132)
        compiled = compile_gemm(fn, config, mxfp4, **flags)
        ptx = compiled.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async" in ptx, fn.__name__
        assert registers(compiled)[1] == 0, (fn.__name__, registers(compiled))


@needs_compiler
@pytest.mark.parametrize("experts,chunk", [(32, 16), (128, 1024)])
def test_align_compiles_for_hopper(experts, chunk):
    from test_kernels_compile import compile_for_hopper

    flags = {"E_PAD": experts, "BLOCK_M": 16, "CHUNK": chunk}
    compile_for_hopper(kernel._align_kernel, flags, ids_ptr="*i64", pairs_ptr="*i32", nblocks_ptr="*i32")


# -- the kernels on a GPU -----------------------------------------------------------------------

MODEL_SHAPES = [  # E, k, H, I, activation, bias
    (32, 4, 2880, 2880, "clamped_swiglu", True),  # gpt-oss-20b
    (128, 8, 2048, 768, "swiglu", False),  # Qwen3-30B-A3B
]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("E,k,H,I,activation,bias", MODEL_SHAPES)
@pytest.mark.parametrize("T", [1, 3, 16, 64, 200, 500, 2048])  # blocks of 16 .. 128 rows in one or the other
def test_kernel_matches_reference_cuda_bf16(T, E, k, H, I, activation, bias):
    args = make_moe(T, k, E, H, I, torch.bfloat16, bias, seed=T)
    m = MoESpec(E, k, I, "softmax_topk", expert_bias=bias, activation=activation)
    assert_close_to_reference(kernel.fused_moe_triton(*args, m), args, m)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 16, 500])
def test_mxfp4_kernel_cuda_bf16(T):
    check_mxfp4(T, 4, 32, 2880, 2880, torch.bfloat16, True, "clamped_swiglu", seed=T)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("routing", ["random", "one"])
def test_kernel_in_cuda_graph(routing):
    """Captured once, replayed on new rows and new routings (other experts, other block counts):
    the eager result bit for bit (deterministic: no atomics)."""
    E, k, H, I = 32, 4 if routing == "random" else 1, 2880, 2880
    replays = ["few", "random"] if k > 1 else ["random", "one"]
    m = MoESpec(E, k, I, "softmax_topk", expert_bias=True, activation="clamped_swiglu")
    x, weights, ids, *experts = make_moe(16, k, E, H, I, torch.bfloat16, True, routing)
    static = [x.clone(), weights.clone(), ids.clone()]
    kernel.fused_moe_triton(*static, *experts, m)  # warm-up: compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernel.fused_moe_triton(*static, *experts, m)
    for seed, replay in enumerate(replays, 1):
        for t, n in zip(static, make_moe(16, k, E, H, I, torch.bfloat16, True, replay, seed)):
            t.copy_(n)
        graph.replay()
        assert torch.equal(y, kernel.fused_moe_triton(*static, *experts, m)), replay
    assert_close_to_reference(y, (*static, *experts), m)


@cuda
@pytest.mark.cuda
@torch.no_grad()
def test_moe_experts_takes_the_kernel_on_cuda(monkeypatch):
    m = MoESpec(8, 2, 256, "softmax_topk", expert_bias=True)
    experts = moe.Experts(m, 512).to("cuda", torch.bfloat16)
    x, weights, ids, *tensors = make_moe(5, 2, 8, 512, 256, torch.bfloat16, True)
    for p, t in zip(experts.parameters(), tensors):
        p.copy_(t)
    calls, original = [], kernel.fused_moe_triton
    monkeypatch.setattr(kernel, "fused_moe_triton", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    y = moe.moe_experts(x, weights, ids, experts)
    assert_close_to_reference(y, (x, weights, ids, *tensors), m)
    residual = torch.randn_like(x)  # added in the launch that sums each row's pairs: rounded once
    torch.testing.assert_close(moe.moe_experts(x, weights, ids, experts, residual), residual + y, atol=2e-2, rtol=1e-2)
    assert calls == [1, 1]
