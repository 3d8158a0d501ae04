"""Resumable training state in a directory: the drafter's float32 weights and the optimizer's
tensors as safetensors (never pickle), the step and the optimizer's settings as JSON.

No RNG state is stored: the data order and the anchors are functions of (seed, step)
(`BatchOrder`, the per-step anchor generator) and nothing else in a step is random, so the
step is the whole data position. A new checkpoint replaces the old one only once complete."""

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from blockspec.loading.weights import CheckpointError, check_tensors


def mismatches(saved: dict, wanted: dict) -> str:
    """The keys of `wanted` whose value `saved` does not have, as "key saved -> wanted; ..."."""
    return "; ".join(f"{k} {saved.get(k)!r} -> {v!r}" for k, v in wanted.items() if saved.get(k) != v)


def save_checkpoint(path: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> None:
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: p.detach().cpu().contiguous() for n, p in model.named_parameters()}, tmp / "model.safetensors")
    state = optimizer.state_dict()
    tensors = {f"{i}.{k}": v.detach().cpu().contiguous() for i, s in state["state"].items() for k, v in s.items()}
    save_file(tensors, tmp / "optimizer.safetensors")
    meta = {"step": step, "param_groups": state["param_groups"], **extra}
    (tmp / "state.json").write_text(json.dumps(meta, indent=1))
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, identity: dict) -> int:
    """Restore model and optimizer in place; returns the step to continue from. `identity`: what
    the checkpoint's run must have had (saved as extra["identity"])."""
    try:
        meta = json.loads((path / "state.json").read_text())
        weights, optimizer_tensors = load_file(path / "model.safetensors"), load_file(path / "optimizer.safetensors")
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"{path}: not a complete training checkpoint ({e})") from e
    differ = mismatches(meta.get("identity", identity), identity)  # saved before identities: not compared
    if differ:
        raise CheckpointError(f"{path}: the checkpoint is of another run: {differ}")
    check_tensors(model, weights, path)  # a drafter of another geometry: named, not torch's size mismatch
    model.load_state_dict(weights, strict=True)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in optimizer_tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return meta["step"]
