"""The header each bench writes beside its result rows: the device, the dtype, the command that
reproduces the run, and the bench's own fields."""

import shlex
import sys

import torch


def run_meta(module: str, device: torch.device, dtype: torch.dtype, **fields) -> dict:
    """{"device", "dtype", **fields, "command"} of a run of `python -m <module>` with this process's
    arguments."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    command = " ".join([f"python -m {module}", *map(shlex.quote, sys.argv[1:])])
    return {"device": name, "dtype": str(dtype), **fields, "command": command}
