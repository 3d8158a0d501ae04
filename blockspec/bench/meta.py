"""The header each bench writes beside its result rows: the device, the dtype, the command that
reproduces the run, and the bench's own fields."""

import shlex
import sys
from pathlib import Path

import torch


def cpu_name() -> str:
    """`cpu: <model name>, <n> threads` where /proc/cpuinfo names the model, else `cpu`."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    return f"cpu: {model}, {torch.get_num_threads()} threads" if model else "cpu"


def run_meta(module: str, device: torch.device, dtype: torch.dtype, **fields) -> dict:
    """{"device", "dtype", **fields, "command"} of a run of `python -m <module>` with this process's
    arguments."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    command = " ".join([f"python -m {module}", *map(shlex.quote, sys.argv[1:])])
    return {"device": name, "dtype": str(dtype), **fields, "command": command}
