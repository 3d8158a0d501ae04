"""The skinny GEMM kernels compiled for Hopper (sm_90: Triton's front end, LLVM and ptxas) on a
machine without a GPU. The interpreter runs a kernel as Python, so it accepts what the compiler
refuses (tensors of mismatched shapes in a branch the flags select, a failing static assert);
compiling every flag combination the launcher can produce catches that in CI."""

import itertools

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.errors import CompilationError

from blockspec.layers.kernels import skinny_linear as kernel

HOPPER = GPUTarget("cuda", 90, 32)
POINTERS = ["x_ptr", "w_ptr", "bias_ptr", "norm_ptr", "res_ptr", "y_ptr"]
INTS = ["M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk"]


def compile_for_hopper(fn, types: dict[str, str], constants: dict) -> None:
    signature = {name: "constexpr" if name in constants else types[name] for name in fn.arg_names}
    paths = {(fn.arg_names.index(name),): value for name, value in constants.items()}
    try:
        triton.compile(ASTSource(fn, signature, constexprs=paths), target=HOPPER, options={"num_warps": 4})
    except RuntimeError as e:  # no CUDA backend or ptxas in this triton build
        if "ptxas" in str(e) or "backend" in str(e):
            pytest.skip(f"triton cannot compile for sm_90 here: {e}")
        raise


def types_for(fp8: bool) -> dict[str, str]:
    types = dict.fromkeys(POINTERS, "*bf16") | dict.fromkeys(INTS, "i32") | {"eps": "fp32"}
    types |= dict.fromkeys(["x_scale_ptr", "w_scale_ptr", "ws_ptr", "sq_ptr"], "*fp32")
    return types | ({"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv"} if fp8 else {})


def flags_for(norm: str | None, swiglu: bool, **more) -> dict:
    """A launch's flags: the norm prologue ("norm": with its weight, "rms": folded), the SwiGLU
    epilogue or else the residual add; `more`: the kernel's own."""
    return {"HAS_BIAS": True, "NORM": norm is not None, "NORM_WEIGHT": norm == "norm", "SWIGLU": swiglu,
            "RESIDUAL": not swiglu, "K_ITERS": 4, "EVEN_K": False, **more}  # fmt: skip


@pytest.mark.parametrize("norm,swiglu", [(None, False), ("norm", False), ("rms", False), ("rms", True), (None, True)])
def test_gemv_compiles(norm, swiglu):
    flags = flags_for(norm, swiglu, PDL=True, BLOCK_N=32, BLOCK_K=128)
    compile_for_hopper(kernel._gemv_kernel, types_for(False), flags)


MMA_TILE = {"IEEE": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}


@pytest.mark.parametrize("fp8,norm,swiglu,split_k", [
    (fp8, norm, swiglu, split_k)
    for fp8, norm, swiglu, split_k in itertools.product((False, True), (None, "norm", "rms"), (False, True), (1, 2))
    if not (fp8 and norm) and not (swiglu and split_k > 1)
])  # fmt: skip
def test_mma_kernel_compiles(fp8, norm, swiglu, split_k):
    flags = flags_for(norm, swiglu, FP8=fp8, SPLIT_K=split_k, **MMA_TILE)
    compile_for_hopper(kernel._skinny_kernel, types_for(fp8), flags)


def test_swiglu_with_split_k_is_refused_when_compiled():
    flags = flags_for("rms", True, FP8=False, SPLIT_K=2, **MMA_TILE)
    with pytest.raises(CompilationError, match="no split-K"):
        compile_for_hopper(kernel._skinny_kernel, types_for(False), flags)
