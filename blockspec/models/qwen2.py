"""Qwen2: the shared decoder with biased q/k/v projections and an unbiased o projection, whatever
`attention_bias` says; its sliding layers (use_sliding_window, from max_window_layers on) come with
the config's `layer_types`."""

from transformers import PretrainedConfig

from blockspec.layers.decoder import LayerSpec
from blockspec.models.hf_config import decoder_spec
from blockspec.models.registry import TargetFamily


def layer_spec(config: PretrainedConfig) -> LayerSpec:
    return decoder_spec(config, qkv_bias=True, o_bias=False)


FAMILY = TargetFamily("qwen2", architectures=("Qwen2ForCausalLM",), model_types=("qwen2",), layer_spec=layer_spec)
