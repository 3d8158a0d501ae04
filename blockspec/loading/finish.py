"""A model's derived weights, made once when it is loaded or built with random weights, under
explicit options (`LoadOptions`): a target's norm weights folded into the GEMMs after them, a
drafter's stacked context K/V weight and its FP8 copies. The models record what was made
(`norms_folded`, `fp8`, both derived from the weights); nothing changes them afterwards."""

from dataclasses import dataclass

import torch

from blockspec.config import SpeculativeConfig
from blockspec.layers.linear import fused_gemms_on
from blockspec.loading.fp8 import quantize_drafter, resolve_fp8
from blockspec.models.causal_lm import CausalLM
from blockspec.models.registry import Drafter


@dataclass(frozen=True)
class LoadOptions:
    """The derived weights to make at load; all off: the checkpoint's weights as they are."""

    # A target's norm weights folded into the GEMMs after them (`CausalLM.fold_norms`): where the
    # GEMMs that fuse the norm run (`blockspec.layers.linear.fused_gemms_on`), they then skip its multiply.
    fold_norms: bool = False
    fp8: bool = False  # a drafter's projections and context K/V weight as FP8 copies (`quantize_drafter`)
    fp8_lm_head: bool = False  # with fp8, an FP8 copy of the target's LM head for the drafter's logits


AS_STORED = LoadOptions()  # nothing derived


def target_options(fold_norms: bool | None, device: torch.device) -> LoadOptions:
    """A target's options: norms folded as asked, by default where the GEMMs that fuse them run.
    Call after `use_kernels`, which decides those GEMMs."""
    return LoadOptions(fold_norms=fold_norms if fold_norms is not None else fused_gemms_on(device))


def drafter_options(spec: SpeculativeConfig, device: torch.device, hidden_size: int) -> LoadOptions:
    """A drafter's options: FP8 copies as `spec.fp8` resolves for a drafter of `hidden_size`."""
    fp8 = resolve_fp8(spec.fp8, device, hidden_size)
    return LoadOptions(fp8=fp8, fp8_lm_head=fp8 and spec.fp8_lm_head)


def finish_target(model: CausalLM, options: LoadOptions) -> CausalLM:
    """`model` ready for inference, its norms folded as `options` ask."""
    if options.fold_norms:
        model.fold_norms()
    return model.eval()


def finish_drafter(drafter: Drafter, target: CausalLM, options: LoadOptions) -> Drafter:
    """`drafter` ready for inference: its context K/V weight stacked (`fuse_kv`) and its FP8 copies
    made as `options` ask, of the LM head it reads too (the target keeps its own; its own is
    replaced)."""
    drafter.fuse_kv()
    if options.fp8:
        own = drafter.lm_head
        head = own if own is not None else target.lm_head
        quantize_drafter(drafter, head if options.fp8_lm_head else None)
        if options.fp8_lm_head and own is not None:
            drafter.lm_head = None
    return drafter.eval()
