"""Gated DeltaNet, the linear-attention mixer of Qwen3.5 / Qwen3.6 / Qwen3-Next.

Per layer: one projection of the normed input into q|k|v (the convolved part), the output gate z
and the per-head b (beta's logit) and a (the decay's); a causal depthwise convolution with SiLU
over q|k|v, whose last `conv_kernel - 1` inputs are the sequence's conv state; then the gated delta
rule over the rows, a recurrence on a per-head [key_dim, value_dim] fp32 state:

    S <- S * exp(g) ;  S <- S + k (beta * (v - S^T k))^T ;  o = S^T q

with q and k L2-normed and q scaled by key_dim^-1/2, g = -exp(A_log) * softplus(a + dt_bias) and
beta = sigmoid(b); value heads share key heads in groups. The output is RMS-normed per head, gated
by SiLU(z) and projected back. A row past a sequence's length gets g = 0 and beta = 0, which leaves
the state exactly as it is, so padded batches and a verify's rejected rows never move it.

The recurrence is one function for both devices (`gated_delta_rule_in_slots`, on states in the
pool): the sequential reference on the CPU (each row's arithmetic the same whatever rows follow,
so a verify's rows equal plain decoding's); on CUDA up to RECURRENT_MAX_ROWS rows a sequence
(decode, verify, the commit's replay, short prompts) the Triton kernel of `kernels.gated_delta`,
past them (long prompts) flash-linear-attention's chunked kernel (`fla-core`)."""

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.fast_path import cuda_compiled, fast_kernels, fast_path
from blockspec.layers.linear import Linear
from blockspec.layers.norm import RMSNorm, fold_norm_weight
from blockspec.layers.recurrent_state import RecurrentStates

if TYPE_CHECKING:
    from blockspec.layers.decoder import LayerSpec

# Up to these rows a sequence, the pool's kernel (`kernels.gated_delta`); past them fla's chunked one
RECURRENT_MAX_ROWS = 64


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The widths of a model's Gated DeltaNet layers (transformers' `linear_*` config fields)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def problems(self) -> list[str]:
        sizes = {
            "linear_num_key_heads": self.num_key_heads,
            "linear_num_value_heads": self.num_value_heads,
            "linear_key_head_dim": self.key_head_dim,
            "linear_value_head_dim": self.value_head_dim,
        }
        problems = [f"{name} must be a positive integer, got {v!r}" for name, v in sizes.items() if not v or v < 1]
        if problems:
            return problems
        if self.num_value_heads % self.num_key_heads:
            heads = f"linear_num_value_heads {self.num_value_heads}, linear_num_key_heads {self.num_key_heads}"
            problems.append(f"value heads must share the key heads in equal groups ({heads})")
        if self.conv_kernel < 2:
            problems.append(f"linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}")
        return problems


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dk, Dv] fp32 ->
    (outputs [B, T, Hv, Dv], the state after the T rows), row by row in fp32."""
    groups = v.shape[2] // k.shape[2]
    q, k = (l2norm(x.float()).repeat_interleave(groups, dim=2) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        kv_mem = (state * k[:, t, ..., None]).sum(-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        state = state + k[:, t, ..., None] * delta[..., None, :]
        out[:, t] = (state * q[:, t, ..., None]).sum(-2)
    return out, state


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    final: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`gated_delta_rule_ref` on a batch of states (not the pool's), the final state only where
    `final` asks (None otherwise); on CUDA without grad fla's recurrent kernel (few rows) or chunked
    one (prompts). Outputs in v's dtype."""
    if not fast_path(q):
        out, state = gated_delta_rule_ref(q, k, v, g, beta, state)
        return out.to(v.dtype), state if final else None
    recurrent, chunked = fla_kernels()
    op = recurrent if q.shape[1] <= RECURRENT_MAX_ROWS else chunked
    return op(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=final, use_qk_l2norm_in_kernel=True)


def gated_delta_rule_in_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    states: RecurrentStates,
    rows: torch.Tensor,
    write: bool,
    outputs: bool = True,
) -> torch.Tensor | None:
    """The gated delta rule from each sequence's state in `pool` [slots, Hv, Dk, Dv] (at
    states.slots, zero where it starts at position 0) over its first rows[b] rows (later rows
    leave the state as it is); with `write`, the state after them stored back at its slot. Returns
    every row's outputs (None without `outputs`). On CUDA up to RECURRENT_MAX_ROWS rows, one Triton
    kernel reading and writing the pool in place (`kernels.gated_delta`)."""
    kernels = fast_kernels(q, "gated_delta") if q.shape[1] <= RECURRENT_MAX_ROWS else None
    if kernels is not None:
        return kernels.recurrent_in_slots(
            q, k, v, g, beta, pool, states.slots, states.starts, rows, outputs=outputs, write=write
        )
    g, beta = masked(g, beta, rows)
    out, final = gated_delta_rule(q, k, v, g, beta, states.initial(pool), final=write)
    if write:
        pool.index_copy_(0, states.slots, final)
    return out if outputs else None


def masked(g: torch.Tensor, beta: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g and beta [B, T, Hv] zero at each sequence's rows past rows[b]: the state stays there."""
    past = (torch.arange(g.shape[1], device=g.device) >= rows[:, None])[..., None]
    return g.masked_fill(past, 0), beta.masked_fill(past, 0)


def fla_kernels() -> tuple:
    """fla's recurrent and chunked gated delta rule kernels; where fla-core is missing, a ValueError
    naming the pip command (the CLI's one-line error, as for its other optional packages)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as e:
        raise ValueError(
            "Gated DeltaNet layers on CUDA run flash-linear-attention's kernels, and fla-core is not installed: "
            "pip install 'blockspec[hybrid]'"
        ) from e
    return fused_recurrent_gated_delta_rule, chunk_gated_delta_rule


@cuda_compiled
def decay_and_beta(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head log-decay g (fp32) and write strength beta of each row from its a and b logits."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


@cuda_compiled
def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's output, then the gate SiLU(z), as transformers' RMSNormGated rounds
    (on CUDA one compiled kernel, which may skip a rounding of an intermediate)."""
    dtype = x.dtype
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(dtype) * F.silu(z.float())).to(dtype)


@cuda_compiled
def causal_conv(x_ext: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise causal convolution over rows, in fp32: x_ext [B, width + T, C] (the conv
    state, then the rows' inputs), weight [C, 1, K = width + 1] -> [B, T, C] row-major in x_ext's
    dtype (the recurrence reads each row's channels contiguously). Written as K shifted
    multiply-adds, so that on CUDA it compiles to one kernel with the SiLU."""
    K = weight.shape[-1]
    T = x_ext.shape[1] - K + 1
    w = weight.view(-1, K).float()
    out = x_ext[:, :T].float() * w[:, 0]
    for i in range(1, K):
        out = out + x_ext[:, i : i + T].float() * w[:, i]
    return F.silu(out).to(x_ext.dtype)


def conv_windows(x_ext: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """The conv state after rows[b] rows: x_ext [B, width + T, C] (the state, then the rows'
    inputs) -> its `width` rows ending before row width + rows[b]: [B, width, C]."""
    index = rows[:, None] + torch.arange(width, device=rows.device)
    return x_ext.gather(1, index[:, :, None].expand(-1, -1, x_ext.shape[2]))


def store_conv_states(pool: torch.Tensor, slots: torch.Tensor, x_ext: torch.Tensor, rows: torch.Tensor) -> None:
    """Each sequence's conv state after its first rows[b] rows into `pool` [slots, width, C] at its slot."""
    pool.index_copy_(0, slots, conv_windows(x_ext, rows, pool.shape[1]).to(pool.dtype))


class GatedDeltaNet(nn.Module):
    """The `linear_attention` mixer; its cache per layer is (conv_state [slots, K-1, conv_dim] in
    the model's dtype, recurrent_state [slots, Hv, Dk, Dv] fp32), indexed by state slot."""

    def __init__(self, s: "LayerSpec", layer_type: str) -> None:
        super().__init__()
        la: LinearAttentionSpec = s.linear_attention
        self.spec, self.eps = la, s.eps
        # q|k|v|z|b|a: one GEMM (`packed_parts`: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)
        self.in_proj = Linear(s.hidden_size, la.conv_dim + la.value_dim + 2 * la.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(la.conv_dim, la.conv_dim, la.conv_kernel, groups=la.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(la.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(la.num_value_heads))
        self.norm = RMSNorm(la.value_head_dim, s.eps)
        self.out_proj = Linear(la.value_dim, s.hidden_size, bias=False)

    @cached_property
    def splits(self) -> list[int]:
        la = self.spec
        return [la.conv_dim, la.value_dim, la.num_value_heads, la.num_value_heads]

    def forward(
        self,
        x: torch.Tensor,
        norm: RMSNorm | None,
        rope,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        attn,
        residual: bool = True,
    ) -> torch.Tensor:
        """x + mixer(norm(x)) (without `residual`: mixer(norm(x))); `attn.states` says where each
        sequence's state is and whether to write it now or leave it pending (a verify)."""
        la, (B, T) = self.spec, x.shape[:2]
        mixed, z, b, a = self.in_proj(x, norm=norm).split(self.splits, dim=-1)
        states: RecurrentStates | None = attn.states if cache is not None else None
        conv_state = states.initial(cache[0]) if states is not None else x.new_zeros(B, *self.cache_shapes[0])
        x_ext = torch.cat([conv_state, mixed], dim=1)  # [B, K-1 + T, C]
        qkv = causal_conv(x_ext, self.conv1d.weight)
        q, k, v = qkv.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        q, k = q.view(B, T, la.num_key_heads, -1), k.view(B, T, la.num_key_heads, -1)
        v = v.unflatten(-1, (la.num_value_heads, -1))
        g, beta = decay_and_beta(a, b, self.A_log, self.dt_bias)
        if states is None:
            zero = x.new_zeros(B, *self.cache_shapes[1], dtype=torch.float)
            out, _ = gated_delta_rule(q, k, v, g, beta, zero, final=False)
        else:  # padding rows leave the state as it is
            writes_now = states.pending is None
            out = gated_delta_rule_in_slots(q, k, v, g, beta, cache[1], states, states.lengths, write=writes_now)
            if writes_now:
                store_conv_states(cache[0], states.slots, x_ext, states.lengths)
            else:
                states.pending.append(PendingReplay(cache, states, x_ext, (q, k, v, g, beta)))
        o = gated_rms_norm(out, z.view(B, T, la.num_value_heads, -1), self.norm.weight, self.eps)
        return self.out_proj(o.flatten(-2), residual=x if residual else None)

    @property
    def cache_shapes(self) -> tuple[torch.Size, torch.Size]:
        """A sequence's conv state and recurrence state."""
        la = self.spec
        return torch.Size([la.conv_kernel - 1, la.conv_dim]), torch.Size(
            [la.num_value_heads, la.key_head_dim, la.value_head_dim]
        )

    def fold_norm(self, norm: RMSNorm) -> None:
        fold_norm_weight(norm, self.in_proj)


@dataclass
class PendingReplay:
    """A verify's deferred state write: the layer's recurrence inputs, replayed over the accepted rows
    at commit from the initial states, still in the pool (read again there rather than held: a
    verify's states of every layer at once would be the step's largest buffers)."""

    cache: tuple[torch.Tensor, torch.Tensor]
    states: RecurrentStates
    x_ext: torch.Tensor
    inputs: tuple[torch.Tensor, ...]  # q, k, v, g, beta

    def commit(self, rows: torch.Tensor) -> None:
        gated_delta_rule_in_slots(*self.inputs, self.cache[1], self.states, rows, write=True, outputs=False)
        store_conv_states(self.cache[0], self.states.slots, self.x_ext, rows)
