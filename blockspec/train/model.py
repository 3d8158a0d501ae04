"""A fresh drafter for a target, DFlash, DSpark or DFlash2 (`TrainConfig.method`): its config (the
target's geometry unless told otherwise, in the layout it is published in) and its initial weights.

Init "random" (default): every linear and the Markov embedding N(0, initializer_range), norms 1;
DFlash2's block convolutions the identity and its selector's successor codebook zero (it starts as
DFlash, ranking by the LM head), the predecessor codebook N(0, initializer_range) and
hidden_projection N(0, 0.02). Init "copy": when a drafter layer has the target's layer
geometry, drafter layer i starts as target layer L-n+i (the last n layers, which turn a late
residual stream into next-token logits through the LM head the drafter shares), the final norm
as the target's, `fc` as the identity on the deepest captured feature (about the stream those
layers read) and `hidden_norm` as the first copied layer's input norm. On SmolLM2-135M random
reached the higher held-out acceptance, so random is the default."""

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase, Qwen3Config

from blockspec.layers.moe import SparseMoE
from blockspec.layers.rotary import rope_parameters
from blockspec.loading.drafters import load_drafter, validate
from blockspec.models.causal_lm import CausalLM
from blockspec.models.dflash import ARCHITECTURE, DFlashDrafter, default_target_layer_ids
from blockspec.models.dflash2 import ARCHITECTURE as DFLASH2_ARCHITECTURE
from blockspec.models.dflash2 import BlockConv, DFlash2Drafter
from blockspec.models.dspark import ARCHITECTURES as DSPARK_ARCHITECTURES
from blockspec.train.config import TrainConfig


def default_mask_token_id(tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> int:
    """An embedding row no text uses: past the tokenizer's tokens when the vocabulary is padded
    (as the published Qwen3 drafters do), else the last added token that is not
    bos/eos/pad (SmolLM2: <empty_output>), else the last row."""
    if tokenizer is None:
        return vocab_size - 1
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    spare = [i for i in tokenizer.added_tokens_decoder if i not in tokenizer.all_special_ids and i < vocab_size]
    return max(spare) if spare else vocab_size - 1


def method_fields(cfg: TrainConfig, mask_token_id: int, target_layer_ids: list[int]) -> dict:
    """The drafter kind's own config fields: z-lab's `dflash_config`, or DeepSpec's top-level ones."""
    fields = {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids}
    if cfg.rows != "auto":
        fields["sample_from_anchor"] = cfg.rows == "shifted"
    if cfg.method == "dflash":
        return {"architectures": [ARCHITECTURE], "dflash_config": fields}
    if cfg.method == "dflash2":
        fields |= {"conv_kernel_size": cfg.conv_kernel_size, "conv_group_size": cfg.conv_group_size}
        fields |= {"selector_rank": cfg.selector_rank, "selector_top_k": cfg.selector_top_k}
        return {"architectures": [DFLASH2_ARCHITECTURE], "dflash_config": fields}
    heads = {"markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type}
    heads |= {"enable_confidence_head": cfg.confidence_head}
    heads |= {"confidence_head_with_markov": cfg.confidence_head and cfg.markov_rank > 0}
    return {"architectures": [DSPARK_ARCHITECTURES[0]], **fields, **heads}


def drafter_config(target: CausalLM, cfg: TrainConfig, mask_token_id: int) -> Qwen3Config:
    tc, s = target.config, target.spec
    ids = cfg.target_layer_ids or default_target_layer_ids(tc.num_hidden_layers, cfg.layers)
    return Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=s.hidden_size,  # the drafter reads the target's embedding and LM head
        intermediate_size=cfg.intermediate_size or s.intermediate_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.num_heads or s.num_heads,
        num_key_value_heads=cfg.num_kv_heads or s.num_kv_heads,
        head_dim=cfg.head_dim or s.head_dim,
        rms_norm_eps=s.eps,
        max_position_embeddings=tc.max_position_embeddings,
        rope_parameters=rope_parameters(tc),
        block_size=cfg.block_size,
        **method_fields(cfg, mask_token_id, list(ids)),
    )


def copy_target_layers(drafter: DFlashDrafter, target: CausalLM) -> bool:
    """Copy init (see the module doc); False, leaving the random init, when shapes differ or the
    target's last layers are MoE."""
    n = len(drafter.layers)
    sources = list(target.model.layers)[-n:]
    pairs = []
    for dst, src in zip(drafter.layers, sources):
        src_params = dict(src.named_parameters())
        for name, p in dst.named_parameters():
            if name in src_params:
                pairs.append((p, src_params[name]))
    moe = any(isinstance(src.mlp, SparseMoE) for src in sources)  # its MLPs are not the drafter's dense ones
    if len(sources) < n or moe or any(p.shape != q.shape for p, q in pairs):
        return False
    with torch.no_grad():
        for p, q in pairs:
            p.copy_(q)
        drafter.norm.weight.copy_(target.model.norm.weight)
        drafter.hidden_norm.weight.copy_(sources[0].input_layernorm.weight)
        h, ids = drafter.spec.hidden_size, drafter.target_layer_ids
        deepest = ids.index(max(ids))  # features are concatenated in the order of the ids
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, deepest * h : (deepest + 1) * h] = torch.eye(h)
    return True


def random_init(drafter: DFlashDrafter, std: float) -> None:
    """The random init (see the module doc)."""
    identities = {id(m.kernel_projection) for m in drafter.modules() if isinstance(m, BlockConv)}
    for m in drafter.modules():
        if isinstance(m, nn.Linear | nn.Embedding) and id(m) not in identities:
            nn.init.normal_(m.weight, std=std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    selector = drafter.candidate_selector if isinstance(drafter, DFlash2Drafter) else None
    if selector is not None:  # its successor codebook stays zero
        nn.init.normal_(selector.predecessor_codebook, std=std)
        nn.init.normal_(selector.hidden_projection.weight, std=0.02)


def copy_drafter(drafter: DFlashDrafter, source: str, target: CausalLM) -> list[str]:
    """Init from the drafter directory `source` (see the module doc); returns the names of the
    parameters it lacks, whose modules it does not have (a DSpark drafter's heads), left random."""
    src = load_drafter(source, target, torch.float32, torch.device("cpu"))
    for flag, theirs, ours in (
        ("target-layer-ids", list(src.target_layer_ids), list(drafter.target_layer_ids)),
        ("mask-token-id", src.mask_token_id, drafter.mask_token_id),
    ):
        if theirs != ours:
            raise ValueError(f"--init {source} has {flag} {theirs}, the new drafter {ours}: set --{flag} to match")
    src_params, fresh = dict(src.named_parameters()), []
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name in src_params and src_params[name].shape == p.shape:
                p.copy_(src_params[name])
            elif name not in src_params and getattr(src, name.split(".")[0], None) is None:
                fresh.append(name)
            elif name not in src_params:
                raise ValueError(f"--init {source} lacks {name}, which the new drafter has")
            else:
                raise ValueError(
                    f"--init {source}: {name} is {tuple(src_params[name].shape)} there, {tuple(p.shape)} here"
                )
    return fresh


def build_drafter(target: CausalLM, cfg: TrainConfig, mask_token_id: int) -> tuple[DFlashDrafter, str]:
    """The drafter in float32 on the target's device, and what its init was."""
    if target.norms_folded:
        raise ValueError(
            "the target's norm weights are folded into its GEMMs (LoadOptions.fold_norms): train from one loaded without"
        )
    config = drafter_config(target, cfg, mask_token_id)
    kind = validate(config, target, "the training settings")  # what loading the saved drafter will check
    torch.manual_seed(cfg.seed)
    drafter = kind.build(config, target)  # its kind's class: DFlashDrafter, DSparkDrafter or DFlash2Drafter
    random_init(drafter, getattr(target.config, "initializer_range", 0.02))
    if cfg.init == "copy":
        init = "copied from the target" if copy_target_layers(drafter, target) else "random (copy does not fit)"
    elif cfg.init == "random":
        init = "random"
    else:
        fresh = copy_drafter(drafter, cfg.init, target)
        init = f"from {cfg.init}" + (f" ({len(fresh)} tensors it lacks random)" if fresh else "")
    return drafter.to(target.lm_head.weight.device), init
