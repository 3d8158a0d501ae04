"""Qwen3: the shared decoder with a per-head RMSNorm of q and k before rope, biases as
`attention_bias` says. The DFlash drafter's layers are Qwen3's too."""

from transformers import PretrainedConfig

from blockspec.layers.decoder import LayerSpec
from blockspec.models.hf_config import attention_bias, decoder_spec
from blockspec.models.registry import TargetFamily


def layer_spec(config: PretrainedConfig) -> LayerSpec:
    bias = attention_bias(config)
    return decoder_spec(config, qkv_bias=bias, o_bias=bias, qk_norm=True)


FAMILY = TargetFamily("qwen3", architectures=("Qwen3ForCausalLM",), model_types=("qwen3",), layer_spec=layer_spec)
