"""Safetensors checkpoints: reading (single file or sharded with an index), mapping their tensor
names to a model's (`WeightMapping`), filling a model built on the meta device, and writing shards
of bounded size."""

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from blockspec.layers.decoder import LayerSpec, Packing, packed_parts

INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, malformed or does not fit its model."""


def checkpoint_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such model directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: config.json is missing")
    return path


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def weight_files(path: Path) -> list[Path]:
    if (path / INDEX).is_file():
        index = read_json(path / INDEX)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{path / INDEX}: expected a 'weight_map' of tensor name -> file name")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing or not files:
            raise CheckpointError(f"{path}: shards listed in {INDEX} are missing: {missing or 'none listed'}")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(f.name for f in path.glob("*.bin")) + sorted(f.name for f in path.glob("*.pt"))
        refused = f" ({', '.join(pickled[:3])}: pickled weights are not loaded, safetensors only)" if pickled else ""
        raise CheckpointError(f"{path}: no *.safetensors weights found{refused}")
    return files


LFS_POINTER = b"version https://git-lfs"  # how a Git LFS pointer file begins


def lfs_pointer(file: Path) -> bool:
    """Whether `file` is a Git LFS pointer left where the weights should be (a clone without `git lfs pull`)."""
    with file.open("rb") as f:
        return f.read(len(LFS_POINTER)) == LFS_POINTER


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    weights, origin = {}, {}
    for file in weight_files(path):
        try:
            shard = load_file(file)
        except (SafetensorError, OSError) as e:
            if file.is_file() and lfs_pointer(file):
                raise CheckpointError(f"{file}: a Git LFS pointer, not the weights (fetch them: git lfs pull)") from e
            raise CheckpointError(f"{file}: not a valid safetensors file ({e})") from e
        twice = sorted(set(shard) & set(weights))
        if twice:
            raise CheckpointError(f"{path}: {twice[0]} is in both {origin[twice[0]].name} and {file.name}")
        weights.update(shard)
        origin.update(dict.fromkeys(shard, file))
    return weights


def fill_module(
    module: nn.Module,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    source: Path,
    optional: tuple[str, ...] = (),
    packing: Packing | None = None,
) -> None:
    """Assign checkpoint tensors to a module built on the meta device; every parameter must
    come from the checkpoint (except `optional` ones) with exactly its shape (`check_tensors`)."""
    check_tensors(module, weights, source, optional, packing)
    state = {n: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for n, t in weights.items()}
    module.load_state_dict(state, strict=False, assign=True)


def check_tensors(
    module: nn.Module,
    weights: dict[str, torch.Tensor],
    source: Path,
    optional: tuple[str, ...] = (),
    packing: Packing | None = None,
) -> None:
    """Raise CheckpointError unless `weights` are exactly the module's parameters and its uint8
    buffers (MXFP4 experts held as stored, `Experts.hold_mxfp4`), but `optional` may be absent, each
    of the tensor's shape: a float tensor for a parameter, uint8 for such a buffer. Missing packed
    projections are named by their parts, as the checkpoint would hold them (`packing`)."""
    params = dict(module.named_parameters(remove_duplicate=False)) | {
        n: b for n, b in module.named_buffers() if b.dtype == torch.uint8
    }
    missing = [s for n in params if n not in weights and n not in optional for s in stored_names(n, packing or {})]
    if missing:
        raise CheckpointError(f"{source}: tensors missing from the checkpoint: {missing[:8]}")
    unexpected = sorted(set(weights) - set(params))
    if unexpected:
        raise CheckpointError(f"{source}: tensors the model does not have: {unexpected[:8]}")
    for name, tensor in weights.items():
        if not params[name].is_floating_point():
            if tensor.dtype != params[name].dtype:
                raise CheckpointError(f"{source}: {name} is {tensor.dtype}, expected {params[name].dtype}")
        else:
            check_float(name, tensor, source)
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
            )


def check_float(name: str, tensor: torch.Tensor, source: Path) -> None:
    """Raise CheckpointError unless `tensor` may fill a float parameter: a 16, 32 or 64-bit float."""
    if not tensor.dtype.is_floating_point or tensor.element_size() == 1:
        raise CheckpointError(
            f"{source}: {name} is {str(tensor.dtype).removeprefix('torch.')}: 16/32/64-bit float weights "
            "expected (quantized checkpoints are not supported)"
        )


def save_sharded(weights: dict[str, torch.Tensor], path: Path, max_shard_bytes: int) -> None:
    """Write `model.safetensors` or, above `max_shard_bytes`, numbered shards plus an index."""
    shards, current, size = [], {}, 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor.contiguous()
        size += nbytes
    shards.append(current)
    path.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def module_in(name: str, modules: Iterable[str]) -> str | None:
    """The first of `modules` that is a component of the dotted `name` (None: none is)."""
    return next((m for m in modules if f".{m}." in name), None)


def stored_names(name: str, packing: Packing) -> list[str]:
    """A model parameter's name as a checkpoint stores it: a packed projection's as its parts'."""
    packed = module_in(name, packing)
    return [name] if packed is None else [name.replace(f".{packed}.", f".{part}.") for part, _ in packing[packed]]


def layer_parts(names: list[str], packed: str, parts: list[tuple[str, int]]) -> dict[str, list[str]]:
    """Each decoder layer's `packed` projection of which `names` hold any part -> all its parts' names."""
    found = {}
    for name in names:
        part = module_in(name, [p for p, _ in parts])
        if part is not None and ".layers." in f".{name}":  # decoder layers' only
            found.setdefault(
                name.replace(f".{part}.", f".{packed}."), [name.replace(f".{part}.", f".{p}.") for p, _ in parts]
            )
    return found


def pack(weights: dict[str, torch.Tensor], source: Path, packing: Packing) -> dict[str, torch.Tensor]:
    """Concatenate the parts of each packed projection (q/k/v, gate/up) into it; packing: packed
    name -> its parts and the rows each must have (checked per part: a sum could hide a wrong split),
    in order (a part that another's name holds, as a shared expert's `.gate_proj.`, is packed first)."""
    out = dict(weights)
    for packed, parts in packing.items():
        for packed_name, names in layer_parts(list(out), packed, parts).items():
            missing = [n for n in names if n not in out]
            if missing:
                raise CheckpointError(f"{source}: tensors missing from the checkpoint: {missing}")
            for part, (_, rows) in zip(names, parts):
                if out[part].dim() == 0 or out[part].shape[0] != rows:
                    raise CheckpointError(f"{source}: {part} has shape {tuple(out[part].shape)}, expected {rows} rows")
            widths = {out[n].shape[1:] for n in names}
            if len(widths) > 1:
                raise CheckpointError(
                    f"{source}: {names} have mismatched shapes {[tuple(out[n].shape) for n in names]}"
                )
            out[packed_name] = torch.cat([out.pop(n) for n in names])
    return out


def unpack(weights: dict[str, torch.Tensor], packing: Packing) -> dict[str, torch.Tensor]:
    """The inverse of `pack`, for writing checkpoints."""
    out = {}
    for name, tensor in weights.items():
        packed = module_in(name, packing)
        chunks = [tensor] if packed is None else tensor.split([rows for _, rows in packing[packed]])
        out.update(zip(stored_names(name, packing), chunks))
    return out


def stored_name(name: str) -> str | None:
    """A checkpoint tensor's name as the model's parameter: the same, but for the rotary tables that
    some checkpoints hold (None: not loaded; computed here from the config)."""
    return None if "rotary_emb" in name else name


# An MXFP4 weight's stored halves, uint8 (`layers.mxfp4`): the only checkpoint tensors that are no floats
MXFP4_PARTS = ("_blocks", "_scales")
Convert = Callable[[dict[str, torch.Tensor], LayerSpec, Path], dict[str, torch.Tensor]]


def as_stored(weights: dict[str, torch.Tensor], spec: LayerSpec, source: Path) -> dict[str, torch.Tensor]:
    return weights


@dataclass(frozen=True)
class WeightMapping:
    """A checkpoint's tensor names -> a model's parameters: `rename` maps each name (None: the
    tensor is not loaded), `convert` brings tensors stored in another layout into the model's
    (per-expert tensors stacked, MXFP4 dequantized; it may consume the dict it is given), then the
    parts of each packed projection are concatenated (`packing` of the model's layer spec)."""

    rename: Callable[[str], str | None] = stored_name
    packing: Callable[[LayerSpec], Packing] = packed_parts
    convert: Convert = as_stored

    def to_model(self, weights: dict[str, torch.Tensor], spec: LayerSpec, source: Path) -> dict[str, torch.Tensor]:
        renamed = {new: t for name, t in weights.items() if (new := self.rename(name)) is not None}
        for name, tensor in renamed.items():  # before `convert` and `pack` combine them (a cat converts)
            if not name.endswith(MXFP4_PARTS):
                check_float(name, tensor, source)
        return pack(self.convert(renamed, spec, source), source, self.packing(spec))
