"""Engine configuration."""

import numbers
import types
import typing
from dataclasses import dataclass, field, fields, replace

DRAFTER_METHODS = ("dflash", "dflash2", "dspark")  # speculative methods that run a drafter model


def of_type(value, kind: type) -> bool:
    """isinstance, but a bool is no number here (True for a count is a mistake) and an int is a float."""
    if kind is int or kind is float:
        number = numbers.Integral if kind is int else numbers.Real
        return isinstance(value, number) and not isinstance(value, bool)
    return isinstance(value, kind)


def check_types(config) -> None:
    """TypeError naming a dataclass config's field whose value is not of its annotated type: a
    string such as "off" for a switch would read as on."""
    for f in fields(config):
        value = getattr(config, f.name)
        kinds = typing.get_args(f.type) if isinstance(f.type, types.UnionType) else (f.type,)
        if not any(of_type(value, kind) for kind in kinds):
            expected = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise TypeError(f"{type(config).__name__}.{f.name} must be {expected}, got {value!r}")


@dataclass
class SpeculativeConfig:
    # "dflash": a drafter model of any DFlash-family kind (its checkpoint says which); "dflash2",
    # "dspark": one of that kind only (vLLM's names); "ngram": prompt lookup
    method: str = "dflash"
    model: str | None = None  # drafter directory (dflash)
    num_speculative_tokens: int | None = None  # drafts per step; None: all the drafter's block makes
    window: int | None = None  # drafter sees only the last `window` context positions
    prompt_lookup_min: int = 1  # ngram: shortest suffix to match
    prompt_lookup_max: int = 4  # ngram: longest suffix to match
    # FP8 drafter projections (layers/quantization.py: W8A8, weights and activations in E4M3);
    # "auto": on for Hopper+ GPUs and drafters of hidden size >= 2048 (BLOCKSPEC_FP8=0/1 overrides).
    fp8: bool | str = "auto"
    fp8_lm_head: bool = True  # with fp8, the drafter reads an FP8 copy of the target's LM head
    # On the CPU, a float32 engine's drafter reads bfloat16 packed copies of its weights and of the LM
    # head it reads (`layers.cpu_gemm`): drafts need no fp32, the target verifies them in fp32, so
    # greedy output is unchanged; but at bf16's rounding a row's drafts depend on the rows beside it,
    # and so a seeded sampled request's text on its batch. Off by default for that; "auto": on where
    # the CPU multiplies bf16 natively (AVX512-BF16, AMX); on where oneDNN has no bf16 GEMM is an error.
    cpu_bf16: bool | str = False
    # DSpark drafters with a confidence head: only the leading drafts whose confidence (the predicted
    # chance each is accepted, given the ones before it were) is at least this are verified; 0: off.
    confidence_threshold: float = 0.0
    # Each step picks the block width (1, 2, 4, ... up to the widest) that maximises committed
    # tokens per second, from running acceptance rates and measured step times (engine/adaptive.py).
    adaptive_width: bool = True
    # With adaptive width: a width-1 step keeps each sequence's target features (up to this many
    # positions) instead of committing them to the drafter's context, and the next step that drafts
    # commits them all at once (`engine.step.flush_context`), so that on a GPU a plain step costs
    # about what plain decoding's does (8 is a good size). 0: every step commits its own.
    deferred_context: int = 0
    # Benchmarks only: blocks accepted at this mean acceptance length at the full block, the drafter
    # still run (`proposers.simulated`), so that random weights can be timed at a realistic tau.
    simulate_tau: float | None = None

    def __post_init__(self) -> None:
        check_types(self)
        if self.method not in (*DRAFTER_METHODS, "ngram"):
            supported = ", ".join(repr(m) for m in (*DRAFTER_METHODS, "ngram"))
            raise ValueError(f"speculative method {self.method!r} is not supported (supported: {supported})")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 0 <= self.confidence_threshold <= 1:
            raise ValueError(f"confidence_threshold must be in [0, 1], got {self.confidence_threshold}")
        if self.deferred_context < 0:
            raise ValueError(f"deferred_context must be >= 0, got {self.deferred_context}")
        if self.deferred_context and (self.method not in DRAFTER_METHODS or not self.adaptive_width):
            raise ValueError(
                "deferred_context defers a drafter model's context at the width-1 steps of adaptive width: "
                "it needs both"
            )
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.simulate_tau is not None and (self.method not in DRAFTER_METHODS or self.simulate_tau < 1):
            raise ValueError("simulate_tau is a mean acceptance length (>= 1) of a drafter model")
        auto_flag(self.fp8, "fp8 setting")  # a word it does not know fails here, not at load
        auto_flag(self.cpu_bf16, "cpu_bf16")

    @classmethod
    def from_dict(cls, value: "dict | SpeculativeConfig") -> "SpeculativeConfig":
        if isinstance(value, SpeculativeConfig):
            return value
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}")
        return cls(**value)


@dataclass
class KernelConfig:
    """Switches of the fast paths (CUDA's; the CPU's packed weights), all on by default; off, each
    falls back to its reference (for A/B runs). The engine puts them in force when it is built
    (`blockspec.layers.fast_path.use_kernels`), where BLOCKSPEC_TRITON_LINEAR, BLOCKSPEC_PDL and
    BLOCKSPEC_FP8_KERNEL (0 or 1) override them."""

    triton_linear: bool = True  # few-row bf16/fp16 linears by the Triton skinny GEMM (off: cuBLAS, ops apart)
    pdl: bool = True  # the kernels that can launch with programmatic dependent launch do (Hopper+)
    fp8_kernel: bool = True  # FP8 linears on FP8 tensor cores (off: their reference, weights dequantized)
    # CPU linears on weights packed once at load (`blockspec.layers.cpu_gemm`; off: F.linear, which
    # repacks the weight each call, and no second copy of the weights in memory)
    cpu_packed: bool = True
    # Every row's numbers independent of the rows beside it (`blockspec.layers.row_invariant`); the
    # engine sets it from EngineConfig.row_invariant.
    row_invariant: bool = False

    def __post_init__(self) -> None:
        check_types(self)


# The command lines' words for a switch (--row-invariant, --warm-up) -> EngineConfig's bool
SWITCH_WORDS = {"off": False, "on": True}

_FLAG_WORDS = {"1": True, "on": True, "true": True, "0": False, "off": False, "false": False, "": False}


def parse_flag(value: str, what: str) -> bool:
    """A switch's word: 1/on/true or 0/off/false (empty: off); anything else is a ValueError
    naming `what`."""
    word = value.strip().lower()
    if word not in _FLAG_WORDS:
        raise ValueError(f"{what} must be 0 or 1 (on or off), got {value!r}")
    return _FLAG_WORDS[word]


def auto_flag(setting: bool | str | None, what: str) -> bool | None:
    """A switch that may be "auto" (or None): None for auto, else as `parse_flag` reads it."""
    if isinstance(setting, str):
        return None if setting.strip().lower() == "auto" else parse_flag(setting, f"{what} (or auto)")
    if setting is not None and not isinstance(setting, bool):
        raise TypeError(f"{what} must be True, False or 'auto', got {setting!r}")
    return setting


@dataclass
class EngineConfig:
    max_num_seqs: int = 64  # sequences decoded together in one step
    max_model_len: int | None = None  # tokens per sequence (prompt + output); None: the model's
    page_size: int = 16  # tokens per KV page
    # KV pages of the full-attention layers' pools; None: sized from max_num_seqs and max_model_len
    # (sliding layers' pools hold windows, sized to their bound: `kv_cache_manager.window_pool_pages`)
    num_pages: int | None = None
    max_num_batched_tokens: int = 8192  # prompt tokens admitted per prefill
    # Share the K/V pages of common prompt prefixes between requests, and on a linear-attention target
    # checkpoints of its states at their end (`engine.kv_cache_manager`); None: on.
    prefix_caching: bool | None = None
    # With prefix caching on a linear-attention target: the state checkpoints kept (each the size of a
    # sequence's recurrent states: `kv_cache_manager.StateCheckpoints`); None: max_num_seqs.
    state_checkpoints: int | None = None
    cuda_graphs: bool = True  # capture decoding steps as CUDA graphs (CUDA only)
    # With CUDA graphs: capture the step graphs (step kinds x batch buckets x row classes, the kinds
    # with logprobs, min_tokens, penalties and grammar masks among them) and compile the prefill's
    # kernels when the engine starts (`engine.warm_up`); off: at first use, stalling the requests
    # running then. On any device, with adaptive width: time the step widths at start
    # (`engine.step_costs`; on a CPU at batch 1); off: on live steps only.
    warm_up: bool = True
    # Launch each step before the one in flight reaches the host, from its results still on the
    # device (DFlash and plain decoding); None: on where the device runs asynchronously (CUDA).
    async_steps: bool | None = None
    # Fold the target's RMSNorm weights into the GEMMs after them, at load (`loading.finish`): the same
    # model up to one rounding of those weights, and the fused GEMMs skip a multiply; None: where
    # those GEMMs run (CUDA with the Triton kernels on).
    fold_norms: bool | None = None
    # Keep an MXFP4 checkpoint's experts in MXFP4 (gpt-oss), loaded as stored and read so by the MoE
    # kernel: exact, a quarter of the bytes (gpt-oss-120b fits one H200 only so). Off: dequantized to
    # the model's dtype at load, faster on the H200 (docs/benchmarks.md: h200-gpt-oss-20b-*). On the
    # CPU the reference dequantizes them at every call.
    mxfp4_experts: bool = False
    # Each row's numbers independent of how many rows share its GEMMs and attention (batch size, draft
    # width, prefill chunking), so that a request's output does not depend on the load and greedy
    # speculative decoding equals plain decoding bit for bit (`blockspec.layers.row_invariant`).
    # Off by default: its cost is not small yet on either device (docs/benchmarks.md,
    # *row-invariant*). Not for linear-attention targets, nor MoE ones on CUDA.
    row_invariant: bool = False
    # The fast paths' switches, put in force for the process when the engine is built (`engine_kernels`).
    kernels: KernelConfig = field(default_factory=KernelConfig)

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("max_num_seqs", "page_size", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (or None: the model's), got {self.max_model_len}")
        if self.state_checkpoints is not None and self.state_checkpoints < 1:
            raise ValueError("state_checkpoints must be >= 1 (or prefix_caching off)")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError("num_pages must be >= 2 (page 0 is reserved)")
        if self.kernels.row_invariant:  # the engine sets it from row_invariant: it would be overridden
            raise ValueError("set EngineConfig.row_invariant, not kernels.row_invariant (the engine sets that one)")

    @property
    def engine_kernels(self) -> KernelConfig:
        """The switches an engine of this config runs with: `kernels`, row invariance as asked."""
        return replace(self.kernels, row_invariant=self.row_invariant)
