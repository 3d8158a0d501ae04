"""Llama: the shared decoder as it is, q/k/v and o biased together where `attention_bias` says so.
Its rope scalings (llama3 and the others) are read from the config alike for every family
(`blockspec.layers.rotary`)."""

from transformers import PretrainedConfig

from blockspec.layers.decoder import LayerSpec
from blockspec.models.hf_config import attention_bias, decoder_spec
from blockspec.models.registry import TargetFamily


def layer_spec(config: PretrainedConfig) -> LayerSpec:
    bias = attention_bias(config)
    return decoder_spec(config, qkv_bias=bias, o_bias=bias)


FAMILY = TargetFamily("llama", architectures=("LlamaForCausalLM",), model_types=("llama",), layer_spec=layer_spec)
