"""A model's derived weights, made once when it is loaded or built with random weights, under
explicit options (`LoadOptions`): a target's norm weights folded into the GEMMs after them and its
MXFP4 experts kept as such, a drafter's stacked context K/V weight and its FP8 copies, and on the
CPU each linear's packed weight (a float32 engine's drafter's in bf16, with one of the target's LM
head). The models record what was made (`norms_folded`, `fp8`, both derived from the weights);
nothing changes them afterwards."""

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from blockspec.config import SpeculativeConfig, auto_flag
from blockspec.layers.cpu_gemm import bf16_supported, native_cpu_bf16, pack, packing_supported
from blockspec.layers.linear import fused_gemms_on, pack_linears
from blockspec.layers.moe import Experts
from blockspec.loading.fp8 import quantize_drafter, resolve_fp8
from blockspec.models.causal_lm import CausalLM
from blockspec.models.hf_config import quant_method
from blockspec.models.registry import Drafter


@dataclass(frozen=True)
class LoadOptions:
    """The derived weights to make at load; all off: the checkpoint's weights as they are."""

    # A target's norm weights folded into the GEMMs after them (`CausalLM.fold_norms`): where the
    # GEMMs that fuse the norm run (`blockspec.layers.linear.fused_gemms_on`), they then skip its multiply.
    fold_norms: bool = False
    fp8: bool = False  # a drafter's projections and context K/V weight as FP8 copies (`quantize_drafter`)
    fp8_lm_head: bool = False  # with fp8, an FP8 copy of the target's LM head for the drafter's logits
    # A target's experts kept in MXFP4 where its checkpoint stores them so (`stores_mxfp4`): loaded
    # as stored, never in bf16 (gpt-oss-120b's bf16 experts would not fit one GPU), for the MoE
    # kernel to read a quarter of their bf16 bytes.
    mxfp4_experts: bool = False
    cpu_packed: bool = False  # each linear's weight also packed for the CPU's GEMMs (`layers.cpu_gemm`)
    # the packed copies' dtype (None: the weights'); a drafter's, with one of the target's LM head too
    cpu_packed_dtype: torch.dtype | None = None


AS_STORED = LoadOptions()  # nothing derived


def target_options(fold_norms: bool | None, device: torch.device, mxfp4_experts: bool = False) -> LoadOptions:
    """A target's options: norms folded as asked, by default where the GEMMs that fuse them run;
    MXFP4 experts kept as asked; on the CPU its linears' weights packed (`packing_supported`). Call
    after `use_kernels`, which decides those GEMMs and the packing."""
    return LoadOptions(
        fold_norms=fold_norms if fold_norms is not None else fused_gemms_on(device),
        mxfp4_experts=mxfp4_experts,
        cpu_packed=packing_supported(device),
    )


def stores_mxfp4(config: PretrainedConfig) -> bool:
    """The checkpoint's experts are MXFP4 (gpt-oss: `quantization_config.quant_method`)."""
    return quant_method(config) == "mxfp4"


def drafter_options(spec: SpeculativeConfig, device: torch.device, hidden_size: int, dtype: torch.dtype) -> LoadOptions:
    """A drafter's options: FP8 copies as `spec.fp8` resolves for a drafter of `hidden_size`; on the
    CPU its linears' weights packed (`packing_supported`), in bf16 for a float32 engine as
    `spec.cpu_bf16` resolves (`cpu_packed_dtype`)."""
    fp8 = resolve_fp8(spec.fp8, device, hidden_size)
    packed = packing_supported(device)
    packed_dtype = cpu_packed_dtype(spec.cpu_bf16, dtype) if packed else None
    return LoadOptions(fp8=fp8, fp8_lm_head=fp8 and spec.fp8_lm_head, cpu_packed=packed, cpu_packed_dtype=packed_dtype)


def cpu_packed_dtype(setting: bool | str, dtype: torch.dtype) -> torch.dtype | None:
    """bf16 for the packed copies of a float32 engine's drafter where `setting` (`cpu_bf16`) is on,
    or auto and the CPU multiplies bf16 natively; None (the weights' dtype) otherwise. On where
    oneDNN has no bf16 GEMM is a ValueError."""
    on = auto_flag(setting, "cpu_bf16")
    if on is None:
        on = native_cpu_bf16() and bf16_supported()
    if dtype != torch.float32 or not on:
        return None
    if not bf16_supported():
        raise ValueError("cpu_bf16 is on, but oneDNN has no bf16 GEMM on this CPU: set it to 'auto' or off")
    return torch.bfloat16


def finish_target(model: CausalLM, options: LoadOptions) -> CausalLM:
    """`model` ready for inference, its norms folded and its MXFP4 experts kept as `options` ask."""
    if options.fold_norms:
        model.fold_norms()
    if options.mxfp4_experts and stores_mxfp4(model.config):
        for experts in [m for m in model.modules() if isinstance(m, Experts) and not m.mxfp4]:
            experts.to_mxfp4()  # experts not loaded as MXFP4 (a preset's random ones): exactly requantized
    if options.cpu_packed:
        pack_linears(model)  # last: of the weights as they stay
    return model.eval()


def finish_drafter(drafter: Drafter, target: CausalLM, options: LoadOptions) -> Drafter:
    """`drafter` ready for inference: its context K/V weight stacked (`fuse_kv`), its FP8 copies
    made as `options` ask, of the LM head it reads too (the target keeps its own; its own is
    replaced), and on the CPU its packed copies (`pack_drafter`)."""
    drafter.fuse_kv()
    if options.fp8:
        own = drafter.lm_head
        head = own if own is not None else target.lm_head
        quantize_drafter(drafter, head if options.fp8_lm_head else None)
        if options.fp8_lm_head and own is not None:
            drafter.lm_head = None
    if options.cpu_packed:
        pack_drafter(drafter, target, options.cpu_packed_dtype)
    return drafter.eval()


def pack_drafter(drafter: Drafter, target: CausalLM, dtype: torch.dtype | None) -> None:
    """The drafter's packed CPU copies in `dtype` (None: its weights'): its linears', its context K/V
    weight's and, in a dtype other than the target's, the target's LM head where it reads that (the
    target's own copy serves it otherwise)."""
    pack_linears(drafter, dtype)
    if drafter.fused_kv_weight is not None:  # None: an FP8 copy replaced it
        drafter.fused_kv_packed = pack(drafter.fused_kv_weight, dtype)
    reads_target_head = drafter.lm_head is None and drafter.lm_head_fp8 is None
    if reads_target_head and dtype not in (None, target.lm_head.weight.dtype):
        drafter.lm_head_packed = pack(target.lm_head.weight, dtype)
