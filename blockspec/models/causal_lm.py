"""The decoder-only target that every family builds (`TargetFamily.build`): embedding, decoder
layers of the family's kinds, final norm, LM head. Parameter names are Hugging Face's but for the
packed projections (`blockspec.layers.decoder.packed_parts`)."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.decoder import DecoderLayer, KVCache, LayerKind, LayerSpec, decoder_stack
from blockspec.layers.fast_path import cuda_compiled
from blockspec.layers.linear import Linear
from blockspec.layers.norm import RMSNorm
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.models.hf_config import sliding_window

embedding = cuda_compiled(F.embedding)  # on CUDA one fused gather, where aten's launches cost more than it


class Backbone(nn.Module):
    def __init__(self, vocab_size: int, s: LayerSpec, kinds: list[LayerKind]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s, k) for k in kinds)
        self.norm = RMSNorm(s.hidden_size, s.eps)


class CausalLM(nn.Module):
    """Target model. `forward` returns the final hidden states and the concatenated
    residual-stream outputs of the layers in `capture` (the drafter's context features).
    `norms_folded`: `fold_norms` ran (loading runs it where asked, `blockspec.loading.finish`)."""

    def __init__(self, config: PretrainedConfig, spec: LayerSpec, kinds: list[LayerKind]) -> None:
        super().__init__()
        self.config, self.spec, self.layer_kinds = config, spec, kinds
        self.sliding_window = sliding_window(config, kinds)
        self.model = Backbone(config.vocab_size, spec, kinds)
        self.lm_head = Linear(spec.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, spec.head_dim)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def fold_norms(self) -> None:
        """Each layer's norm weights into the GEMMs after them (`DecoderLayer.fold_norms`), so that
        the GEMMs that fuse the norm skip its multiply: the same model up to one rounding of those
        weights. The final norm keeps its weight: its output is the drafter's feature, and a tied LM
        head is the embedding."""
        for layer in self.layers:
            layer.fold_norms()

    @property
    def norms_folded(self) -> bool:
        """`fold_norms` ran (it folds every layer at once: the first tells)."""
        return len(self.layers) > 0 and self.layers[0].input_layernorm.weight is None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embedding(input_ids, self.model.embed_tokens.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the LM head's dtype: the greedy argmax reads them as they are (an fp32 copy of a
        verify's logits would be a launch of its own), sampling converts them."""
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[KVCache],
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embed(input_ids)
        rope = self.rotary(positions, x.dtype)
        hidden, captured = decoder_stack(self.model.layers, x, rope, kv_caches, attn, self.model.norm, capture)
        captured[len(self.model.layers) - 1] = hidden  # HF's hidden_states[L] (what drafters train on) is normed
        captured[-1] = x  # HF's hidden_states[0], the embedding output (DeepSpec's layer id -1)
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return hidden, features
