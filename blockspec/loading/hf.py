"""Hugging Face model directories: config, safetensors weights, tokenizer, eos ids."""

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from blockspec.layers.moe import Experts
from blockspec.layers.mxfp4 import dequantize_stored
from blockspec.loading.finish import AS_STORED, LoadOptions, finish_target
from blockspec.loading.weights import CheckpointError, checkpoint_dir, fill_module, load_weights, read_json
from blockspec.models.causal_lm import CausalLM
from blockspec.models.registry import TargetFamily, family_for

log = logging.getLogger(__name__)


@dataclass
class Target:
    model: CausalLM
    tokenizer: PreTrainedTokenizerBase | None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""


# Fields without which transformers would fill in its defaults (Llama-7B's widths) and the
# checkpoint would fail later with a shape error that does not name the missing field.
GEOMETRY_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def load_config(path: Path, required: tuple[str, ...] = (*GEOMETRY_FIELDS, "vocab_size")):
    """The model config of a directory; `required` fields must be in its config.json (a drafter
    has no vocabulary of its own: it needs only the geometry), or in its `text_config` where it
    nests one (a multimodal checkpoint: `text_model_config`). A model whose every MLP is sparse
    may give `moe_intermediate_size` for `intermediate_size`."""
    checkpoint_dir(path)
    raw = read_json(path / "config.json")
    fields = raw.get("text_config", raw) if isinstance(raw, dict) else None
    fields = fields if isinstance(fields, dict) else {}
    sparse = "moe_intermediate_size" in fields
    missing = [f for f in required if f not in fields and not (f == "intermediate_size" and sparse)]
    if missing:
        raise CheckpointError(f"{path / 'config.json'}: fields missing: {', '.join(missing)}")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers and huggingface_hub raise many kinds; all mean the same here
        raise CheckpointError(f"{path / 'config.json'}: not a usable model config ({e})") from e
    return text_model_config(config, raw, path) if "text_config" in raw else config


def text_model_config(config, raw: dict, path: Path):
    """The text model's config of a multimodal checkpoint (Qwen3.5's ...ForConditionalGeneration),
    under the architecture the checkpoint names and with its top-level `tie_word_embeddings`;
    its vision tower is not loaded (the family's weight mapping leaves it out)."""
    text = config.get_text_config()
    text.architectures = config.architectures
    if "tie_word_embeddings" in raw:
        text.tie_word_embeddings = raw["tie_word_embeddings"]
    log.warning("%s: a multimodal checkpoint: its text model is loaded, its vision tower is not (text only)", path)
    return text


def as_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def eos_token_ids(path: Path, config) -> list[int]:
    gen = path / "generation_config.json"
    if gen.is_file() and "eos_token_id" in (data := read_json(gen)):
        return as_list(data["eos_token_id"])
    return as_list(getattr(config, "eos_token_id", None))


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # as load_config: the tokenizers library raises its own kinds too
        raise CheckpointError(f"{path}: the tokenizer files do not load ({type(e).__name__}: {e})") from e
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):  # transformers builds one from the config alone
        raise CheckpointError(
            f"{path}: the tokenizer has no tokens but its special ones: its vocabulary file (tokenizer.json, or "
            f"the file its class {type(tokenizer).__name__} reads, such as tokenizer.model) is missing"
        )
    return tokenizer


def target_family(config, source: Path) -> TargetFamily:
    """The registered family of `config`, and a config it can build (else CheckpointError naming `source`)."""
    try:
        family = family_for(config)
    except ValueError as e:  # the registry's one error: no family of that architecture
        raise CheckpointError(f"{source}: {e}") from None
    try:
        problems = family.problems(config)
    except ValueError as e:  # a field the family's layer plan cannot even be read from
        raise CheckpointError(f"{source}: {e}") from None
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
    return family


def build_target(
    family: TargetFamily,
    config,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    source: Path,
    options: LoadOptions,
) -> CausalLM:
    """The target of `config` (of `family`, `target_family`) with the checkpoint tensors `weights`,
    ready (`finish_target`)."""
    spec = family.layer_spec(config)
    weights = family.weights.to_model(weights, spec, source)
    head, embed = weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight")
    if config.tie_word_embeddings and head is not None and embed is not None and not torch.equal(head, embed):
        config.tie_word_embeddings = False  # as transformers does: the file's own, different head is kept
    with torch.device("meta"):
        model = family.build(config)
    # MXFP4 experts load as they are where the model keeps them so (never in bf16: gpt-oss-120b's
    # would not fit one GPU), else dequantized exactly, one tensor at a time
    if options.mxfp4_experts and any(n.endswith("_blocks") for n in weights):
        for experts in [m for m in model.modules() if isinstance(m, Experts)]:
            experts.hold_mxfp4()
    else:
        weights = dequantize_stored(weights, dtype)
    # A tied pair is one tensor, loaded (and checked) under the name the file stores it by: the
    # embedding, or the head where the file holds only that (it serves both, as in transformers).
    names = ("model.embed_tokens.weight", "lm_head.weight")
    kept, other = names[::-1] if embed is None and head is not None else names
    tied = (other,) if config.tie_word_embeddings else ()
    kept_weights = {n: t for n, t in weights.items() if n not in tied}
    fill_module(model, kept_weights, dtype, device, source, tied, family.weights.packing(spec))
    if tied:  # one Parameter under both names
        owner, _, attr = other.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(kept))
    model.rotary.to(device)
    return finish_target(model, options)


def load_target(
    path: str | Path | None, dtype: torch.dtype, device: torch.device, options: LoadOptions = AS_STORED
) -> Target:
    """A Hugging Face model directory, a .gguf file, or None: the embedded default (SmolLM2); its
    derived weights made as `options` ask (`finish_target`)."""
    if path is None or str(path).endswith(".gguf"):
        from blockspec.loading.gguf import default_gguf_path, load_gguf  # gguf is only needed here

        path = Path(path) if path is not None else default_gguf_path()
        ckpt = load_gguf(path, dtype)
        family = target_family(ckpt.config, path)
        model = build_target(family, ckpt.config, ckpt.state_dict, dtype, device, path, options)
        return Target(model, ckpt.tokenizer, ckpt.eos_token_ids, path.stem)
    path = Path(path)
    config = load_config(path)
    family = target_family(config, path)  # first: an unsupported model fails before anything loads
    tokenizer = load_tokenizer(path)  # before the weights: a broken tokenizer fails fast
    model = build_target(family, config, load_weights(path), dtype, device, path, options)
    return Target(model, tokenizer, eos_token_ids(path, config), path.name)
