"""The mixture-of-experts MLP: a router weighs each row's top-k experts, each expert is a gated MLP,
and a row's output is the weighted sum of its experts' outputs.

The experts of a layer are stacked: `gate_up_proj` [E, 2I, H] (each expert's gate rows, then its
up rows) and `down_proj` [E, H, I], nn.Linear's layout per expert, optionally biased. The CPU
reference (`experts_ref`) groups the rows by expert and runs one GEMM pair per expert hit, as
transformers does; on CUDA the Triton kernel (`blockspec.layers.kernels.fused_moe`) groups them on
the device and reads each touched expert's weights once per block of its rows (once, for the few
rows of a decode or verify step), inside the step's CUDA graph."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from blockspec.layers.activation import silu_mul_ref
from blockspec.layers.fast_path import cuda_compiled, fast_kernels
from blockspec.layers.linear import Linear, gemm
from blockspec.layers.mlp import MLP
from blockspec.layers.mxfp4 import GROUP, dequantize_mxfp4, quantize_mxfp4
from blockspec.layers.norm import RMSNorm
from blockspec.layers.row_invariant import elementwise

if TYPE_CHECKING:
    from blockspec.layers.decoder import LayerSpec

ROUTINGS = ("softmax_topk", "topk_softmax")
ACTIVATIONS = ("swiglu", "clamped_swiglu")


@dataclass(frozen=True)
class MoESpec:
    """The experts of a model's MoE layers and how rows are routed to them."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    # softmax_topk: softmax over every expert, then its top k (renormalized to sum 1 where
    # norm_topk_prob): Qwen3-MoE. topk_softmax: the top k router logits, then their softmax: gpt-oss.
    routing: str
    norm_topk_prob: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    # swiglu: SiLU(gate) * up. clamped_swiglu (gpt-oss): gate clamped above and up on both sides at
    # `swiglu_limit`, then gate * sigmoid(alpha * gate) * (up + 1).
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # a dense SwiGLU expert every row takes, its output weighed by sigmoid(shared_expert_gate(x))
    # (Qwen3-Next, Qwen3.5-MoE); 0: none
    shared_expert_intermediate_size: int = 0

    def problems(self) -> list[str]:
        """What of this spec the layers cannot run."""
        problems = []
        if self.routing not in ROUTINGS:
            problems.append(f"MoE routing {self.routing!r} is not supported (supported: {', '.join(ROUTINGS)})")
        if self.activation not in ACTIVATIONS:
            problems.append(
                f"expert activation {self.activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
            )
        if not 0 < self.top_k <= self.num_experts:
            problems.append(f"num_experts_per_tok {self.top_k} must be in 1..num_experts ({self.num_experts})")
        return problems


@cuda_compiled  # on CUDA one or two fused launches around the top-k, where eager runs five
def route(logits: torch.Tensor, m: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> each row's expert weights [T, k] (in the logits' dtype, as
    transformers rounds them) and expert ids [T, k]."""
    if m.routing == "topk_softmax":
        top, ids = torch.topk(logits, m.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(probs, m.top_k, dim=-1)
    if m.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def expert_activation(gate_up: torch.Tensor, m: MoESpec) -> torch.Tensor:
    """[..., 2I] (gate | up) -> [..., I]."""
    if m.activation == "swiglu":
        return silu_mul_ref(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=m.swiglu_limit), up.clamp(-m.swiglu_limit, m.swiglu_limit)
    return gate * elementwise(torch.sigmoid, gate * m.swiglu_alpha) * (up + 1)


def experts_ref(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    m: MoESpec,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H], weights and ids [T, k] -> [T, H]: per expert hit (in id order), its rows' gated MLP,
    weighed and added to those rows; then added to `residual` [T, H] where given. The grouping is
    read on the host: a CUDA graph cannot hold it (the Triton kernel serves CUDA)."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("MoE layers in CUDA graphs need the Triton expert kernel (triton missing, or reference_ops)")
    out = torch.zeros_like(x)
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=m.num_experts).tolist()
    flat_weights = weights.flatten()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        rows = pairs // ids.shape[1]
        h = expert_activation(gemm(x[rows], gate_up[e], None if gate_up_bias is None else gate_up_bias[e]), m)
        y = gemm(h, down[e], None if down_bias is None else down_bias[e])
        out.index_add_(0, rows, (y * flat_weights[pairs, None]).to(x.dtype))
    return out if residual is None else residual + out


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: "Experts", residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`experts_ref`; on CUDA without grad the Triton grouped kernel (no host sync: it runs in graphs),
    which reads MXFP4 experts as they are stored."""
    biases, kernels = (experts.gate_up_bias, experts.down_bias), fast_kernels(x, "fused_moe")
    if kernels is not None:
        return kernels.fused_moe_triton(x, weights, ids, *experts.weights(), *biases, experts.spec, residual=residual)
    gate_up, down = (
        experts.weights() if not experts.mxfp4 else (dequantize_mxfp4(*w, x.dtype) for w in experts.weights())
    )
    return experts_ref(x, weights, ids, gate_up, down, *biases, experts.spec, residual)


class Experts(nn.Module):
    def __init__(self, m: MoESpec, hidden_size: int) -> None:
        super().__init__()
        self.spec = m
        E, inter = m.num_experts, m.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(E, hidden_size, inter))
        self.gate_up_bias = nn.Parameter(torch.empty(E, 2 * inter)) if m.expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(E, hidden_size)) if m.expert_bias else None
        self.mxfp4 = False  # `to_mxfp4` ran: the projections are (blocks, scales) buffers
        self.reset_parameters()

    def weights(self) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], ...]:
        """gate|up and down: each a weight, or MXFP4's (blocks, scales)."""
        if self.mxfp4:
            return (self.gate_up_blocks, self.gate_up_scales), (self.down_blocks, self.down_scales)
        return self.gate_up_proj, self.down_proj

    @torch.no_grad()
    def to_mxfp4(self) -> None:
        """The projections as MXFP4 (`quantize_mxfp4`, one expert at a time), a quarter of their
        bf16 bytes for the kernel to read; ValueError unless that is exact (weights that a
        checkpoint stored in MXFP4, loaded in bf16 or fp32)."""
        stored = {}
        for name in ("gate_up", "down"):
            w = getattr(self, f"{name}_proj")
            parts = [quantize_mxfp4(expert) for expert in w]
            if not all(torch.equal(dequantize_mxfp4(*q, w.dtype), expert) for q, expert in zip(parts, w)):
                raise ValueError(f"{name}_proj holds values that MXFP4 does not: its experts are not MXFP4's")
            stored[name] = torch.stack([b for b, _ in parts]), torch.stack([s for _, s in parts])
        self.store_mxfp4(stored)

    def hold_mxfp4(self) -> None:
        """The projections as empty MXFP4 buffers of their shapes (on a model built on the meta
        device: a checkpoint's MXFP4 experts then load into them as they are, never in bf16)."""
        empty = {}
        for name in ("gate_up", "down"):
            weight = getattr(self, f"{name}_proj")
            (E, rows, k), device = weight.shape, weight.device
            blocks = torch.empty(E, rows, k // GROUP, GROUP // 2, dtype=torch.uint8, device=device)
            empty[name] = blocks, torch.empty(E, rows, k // GROUP, dtype=torch.uint8, device=device)
        self.store_mxfp4(empty)

    def store_mxfp4(self, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each projection's (blocks, scales) as buffers in place of its weight."""
        for name, (blocks, scales) in parts.items():
            delattr(self, f"{name}_proj")
            self.register_buffer(f"{name}_blocks", blocks)
            self.register_buffer(f"{name}_scales", scales)
        self.mxfp4 = True

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's initialization per expert (random presets time models built this way)."""
        for weight, bias in zip(self.weights(), (self.gate_up_bias, self.down_bias)):
            bound = weight.shape[-1] ** -0.5
            for p in (weight, bias) if bias is not None else (weight,):
                nn.init.uniform_(p, -bound, bound)


class SparseMoE(nn.Module):
    """The MoE MLP kind of `LayerSpec.moe`, called as the dense MLP is."""

    def __init__(self, s: "LayerSpec") -> None:
        super().__init__()
        m = s.moe
        self.spec = m
        self.router = Linear(s.hidden_size, m.num_experts, bias=m.router_bias)  # few rows: the skinny kernel
        self.experts = Experts(m, s.hidden_size)
        if m.shared_expert_intermediate_size:
            self.shared_expert = MLP(s.hidden_size, m.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(s.hidden_size, 1, bias=False)
        self.touched: torch.Tensor | None = None  # [E] bool, where a benchmark counts the experts read

    def forward(self, x: torch.Tensor, norm: RMSNorm | None, residual: bool = True) -> torch.Tensor:
        """x + moe(norm(x)) (without `residual`: moe(norm(x)))."""
        h = norm(x) if norm is not None else x
        flat = h.reshape(-1, h.shape[-1])
        weights, ids = route(self.router(flat), self.spec)
        if self.touched is not None:
            self.touched.index_fill_(0, ids.flatten(), True)
        out = moe_experts(flat, weights, ids, self.experts, x.reshape(flat.shape) if residual else None)
        if self.spec.shared_expert_intermediate_size:
            shared = self.shared_expert(flat, None, residual=False)
            out = out + elementwise(torch.sigmoid, self.shared_expert_gate(flat)) * shared
        return out.view(x.shape)

    def fold_norm(self, norm: RMSNorm) -> None:
        """The norm before an MoE stays: it feeds the router and every expert."""
