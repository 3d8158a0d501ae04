"""The header each bench writes beside its result rows: the device, the dtype, the command that
reproduces the run, and the bench's own fields."""

import shlex
import subprocess
import sys
from pathlib import Path

import torch


def cpu_name() -> str:
    """`cpu: <model name>, <n> threads` where /proc/cpuinfo names the model, else `cpu`."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    return f"cpu: {model}, {torch.get_num_threads()} threads" if model else "cpu"


def source_revision() -> str | None:
    """The commit of the checkout blockspec runs from, `+changes` where tracked files differ from
    it; None outside a git checkout (an installed package, a copy without its history)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        )
        diff = subprocess.run(["git", "-C", root, "diff", "--quiet", "HEAD"], capture_output=True, check=False)
    except OSError:  # no git
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if diff.returncode == 1 else "")


# Read when a bench starts (it imports this module first), not when it writes its rows: a commit or
# an edit made while it runs is not the code it ran.
START_REVISION = source_revision()


def run_meta(module: str, device: torch.device, dtype: torch.dtype, **fields) -> dict:
    """{"device", "dtype", **fields, "command"[, "revision"]} of a run of `python -m <module>` with
    this process's arguments, from the checkout at `START_REVISION`."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    command = " ".join([f"python -m {module}", *map(shlex.quote, sys.argv[1:])])
    revision = START_REVISION
    return {"device": name, "dtype": str(dtype), **fields, "command": command} | (
        {"revision": revision} if revision else {}
    )
