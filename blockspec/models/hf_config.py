"""The fields of Hugging Face decoder configs that the target families and the drafters read
alike: geometry, per-layer attention, and what of them the decoder layers cannot run."""

from transformers import PretrainedConfig

from blockspec.layers.decoder import LayerKind, LayerSpec, kind_problems
from blockspec.sampling import is_int

SWIGLU_ACTS = ("silu", "swish")
# Sizes that must be positive where a config gives them (a layer plan is read from them)
POSITIVE_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def num_kv_heads(config: PretrainedConfig) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def attention_bias(config: PretrainedConfig) -> bool:
    return bool(getattr(config, "attention_bias", False))


def decoder_spec(config: PretrainedConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool = False) -> LayerSpec:
    """The layer spec of a Llama-style config; the family says what its config does not (biases, q/k norm)."""
    return LayerSpec(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=num_kv_heads(config),
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        intermediate_size=getattr(config, "intermediate_size", 0),  # 0: every MLP sparse (Qwen3.5-MoE)
        eps=config.rms_norm_eps,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=qk_norm,
    )


def layer_types(config: PretrainedConfig) -> list[str]:
    """Each layer's attention as transformers lays them out (`layer_types`; Qwen2/Qwen3 with
    use_sliding_window slide from max_window_layers on): full causal, or over the last
    `sliding_window` positions. A config without `layer_types` slides every layer where it keeps a
    window (Qwen3-MoE: `sliding_window` is None unless use_sliding_window), as transformers does."""
    if getattr(config, "layer_types", None):
        return list(config.layer_types)
    sliding = getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


def decoder_layer_kinds(config: PretrainedConfig) -> list[LayerKind]:
    """Each layer's attention from `layer_types`, every MLP dense."""
    return [LayerKind(t) for t in layer_types(config)]


def sliding_window(config: PretrainedConfig, kinds: list[LayerKind]) -> int | None:
    """The window of the sliding layers; None where no layer slides."""
    return config.sliding_window if any(k.attention == "sliding_attention" for k in kinds) else None


def size_problems(config: PretrainedConfig) -> list[str]:
    """POSITIVE_SIZES that a config gives and are not positive integers: checked before anything is
    read from them."""
    sizes = {f: getattr(config, f, None) for f in POSITIVE_SIZES}
    return [
        f"{f} must be a positive integer, got {v!r}"
        for f, v in sizes.items()
        if v is not None and not (is_int(v) and v > 0)
    ]


def quant_method(config: PretrainedConfig) -> str | None:
    """The checkpoint's `quantization_config.quant_method` (None: float weights)."""
    quantization = getattr(config, "quantization_config", None) or {}
    return quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method


def config_problems(config: PretrainedConfig, kinds: list[LayerKind]) -> list[str]:
    """What a target's or drafter's config asks for that its layers (of `kinds`) cannot do: weights
    quantized other than gpt-oss's MXFP4 experts, an MLP activation other than SwiGLU's, query heads
    that do not share the K/V heads evenly, layer kinds without a module, sliding layers without a
    window."""
    heads, kv_heads, problems = config.num_attention_heads, num_kv_heads(config), []
    method = quant_method(config)
    if method not in (None, "mxfp4"):
        problems.append(f"quantization_config.quant_method {method!r} is not supported (float weights only)")
    act = getattr(config, "hidden_act", "silu")
    if act not in SWIGLU_ACTS:
        problems.append(f"hidden_act {act!r} is not supported (the MLP is SwiGLU: silu only)")
    if heads % kv_heads:
        problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    problems += kind_problems(kinds)
    window = getattr(config, "sliding_window", None)
    if any(k.attention == "sliding_attention" for k in kinds) and not (is_int(window) and window > 0):
        problems.append(f"sliding_attention layers need a positive sliding_window, got {window!r}")
    return problems
