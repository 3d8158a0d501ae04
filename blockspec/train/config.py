"""TrainConfig: every knob of `blockspec train`; the CLI flags are generated from its fields."""

import argparse
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from blockspec.llm import resolve_dtype
from blockspec.models.dspark import MARKOV_HEADS

METHODS = ("dflash", "dspark", "dflash2")
ROWS = ("auto", "shifted", "filled")
PROMPT_SOURCES = ("offline", "target")


def knob(default, doc: str):
    return field(default=default, metadata={"help": doc})


@dataclass
class TrainConfig:
    # target and output
    model: str | None = knob(None, "target: HF model directory or .gguf file (default: the embedded SmolLM2)")
    output: str = knob("runs/drafter", "output directory: drafter/, checkpoint/, data.jsonl, log.jsonl")
    device: str | None = knob(None, "cuda or cpu (default: cuda when available); bf16 autocast on cuda, fp32 on cpu")
    seed: int = knob(0, "seed of prompt choice, data order and anchors")
    # data: the target's own responses to prompts built from offline text
    data: str | None = knob(
        None, "reuse this generated-data JSONL as is (default: OUTPUT/data.jsonl, made or extended)"
    )
    prompts: str | None = knob(None, "text file of prompts, one JSON string a line (default: built from offline text)")
    write_prompts: str | None = knob(None, "only write num_prompts prompts into this file, then exit")
    prompt_source: str = knob(
        "offline",
        "where --write-prompts takes them: offline (built from text on this machine) or target (user requests "
        "the target writes itself from its chat template's user turn, Magpie)",
    )
    num_prompts: int = knob(1000, "prompts to generate responses for")
    max_new_tokens: int = knob(256, "response length cap")
    max_prompt_tokens: int = knob(384, "prompts longer than this (chat template applied) are skipped")
    temperature: float = knob(0.0, "sampling temperature of the generated responses (0: greedy)")
    gen_batch_size: int = knob(64, "sequences the engine decodes together while generating data")
    # drafter architecture (None: the target's value)
    method: str = knob(
        "dflash",
        "dflash (z-lab's: block row k drafts anchor+k), dspark (row j drafts anchor+j+1) or dflash2 (dflash with "
        "block convolutions and a candidate selector)",
    )
    rows: str = knob(
        "auto",
        "block rows: shifted (row j drafts anchor+j+1), filled (row j drafts anchor+j, z-lab's) or auto (the "
        "method's own: dspark shifted, dflash and dflash2 filled)",
    )
    layers: int = knob(4, "drafter layers")
    block_size: int = knob(16, "block width g: anchor + g-1 mask rows")
    intermediate_size: int | None = knob(None, "drafter MLP width")
    num_heads: int | None = knob(None, "drafter attention heads")
    num_kv_heads: int | None = knob(None, "drafter KV heads")
    head_dim: int | None = knob(None, "drafter head dim")
    target_layer_ids: tuple[int, ...] | None = knob(None, "target layers whose outputs feed the drafter, e.g. 1,8,15")
    mask_token_id: int | None = knob(None, "MASK token (default: an unused row, else a spare special token)")
    markov_rank: int = knob(256, "dspark: rank of the Markov head (0: none)")
    markov_head_type: str = knob("vanilla", "dspark: Markov head vanilla, gated or rnn")
    confidence_head: bool = knob(True, "dspark: a confidence head (reading the Markov embedding, if any)")
    conv_kernel_size: int = knob(2, "dflash2: taps of the block convolutions (rows each reads back, its own included)")
    conv_group_size: int = knob(16, "dflash2: channels sharing one dynamic convolution coefficient")
    selector_rank: int = knob(256, "dflash2: rank of the candidate selector's codebooks")
    selector_top_k: int = knob(16, "dflash2: candidates per draft row the selector scores")
    init: str = knob(
        "random", "random (N(0, 0.02)), copy (start from the target's last layers) or a drafter directory to start from"
    )
    # optimisation
    steps: int = knob(1000, "optimizer steps")
    batch_size: int = knob(8, "sequences per step")
    blocks_per_seq: int = knob(32, "anchors (blocks) sampled per sequence and step")
    lr: float = knob(6e-4, "peak learning rate (AdamW)")
    min_lr_ratio: float = knob(0.1, "cosine decay ends at lr * this")
    warmup: float = knob(0.04, "linear warm-up, as a fraction of steps")
    weight_decay: float = knob(0.0, "AdamW weight decay")
    grad_clip: float = knob(1.0, "gradient norm clip (0: off)")
    gamma: float | None = knob(
        None, "loss weight exp(-i/gamma) of a block's draft i (default: dflash and dflash2 3g/8+1, dspark 4)"
    )
    ce_weight: float = knob(0.1, "dspark: weight of the cross-entropy on the target's tokens")
    l1_weight: float = knob(0.9, "dspark: weight of the L1 distance to the target's distribution")
    confidence_weight: float = knob(1.0, "dspark: weight of the confidence head's loss")
    selector_weight: float = knob(1.0, "dflash2: weight of the candidate selector's loss")
    attention: str = knob("auto", "dense (bool mask, any device), flex (FlexAttention block mask, cuda) or auto")
    loss_chunk_gib: float = knob(
        1.0,
        "GiB of each vocabulary-wide fp32 loss tensor per checkpointed chunk of draft rows "
        "(0: all rows at once, no recomputation, the most memory)",
    )
    # checkpoints, logs, evaluation
    save_every: int = knob(200, "steps between resumable checkpoints")
    log_every: int = knob(10, "steps between log lines (per-position accuracy) in OUTPUT/log.jsonl")
    resume: bool = knob(False, "continue from OUTPUT/checkpoint when there is one")
    save_dtype: str = knob("bfloat16", "dtype of the saved drafter")
    eval_prompts: int = knob(0, "hold out this many examples and measure the drafter's tau on them at the end")

    def __post_init__(self) -> None:
        checks = [
            (self.method in METHODS, f"method must be one of {', '.join(METHODS)}, got {self.method!r}"),
            (
                self.prompt_source in PROMPT_SOURCES,
                f"prompt_source must be {'/'.join(PROMPT_SOURCES)}, got {self.prompt_source!r}",
            ),
            (self.rows in ROWS, f"rows must be {'/'.join(ROWS)}, got {self.rows!r}"),
            (
                not (self.method == "dflash2" and self.rows == "shifted"),
                "rows shifted: dflash2 drafters fill their rows",
            ),
            (self.block_size >= 2, "block_size must be >= 2"),
            (self.layers >= 1, "layers must be >= 1"),
            (self.steps >= 1 and self.batch_size >= 1 and self.blocks_per_seq >= 1, "steps/batch sizes must be >= 1"),
            (
                self.init in ("copy", "random") or Path(self.init).is_dir(),
                f"init must be copy, random or a drafter directory, got {self.init!r}",
            ),
            (self.attention in ("auto", "dense", "flex"), f"attention must be auto/dense/flex, got {self.attention!r}"),
            (self.gamma is None or self.gamma > 0, "gamma must be > 0"),
            (0 <= self.warmup < 1, "warmup is a fraction of steps in [0, 1)"),
            (self.save_every >= 1 and self.log_every >= 1, "save_every and log_every must be >= 1"),
            (self.eval_prompts >= 0, f"eval_prompts must be >= 0, got {self.eval_prompts}"),
            (self.markov_rank >= 0, f"markov_rank must be >= 0, got {self.markov_rank}"),
            (
                self.markov_head_type in MARKOV_HEADS,
                f"markov_head_type must be {'/'.join(MARKOV_HEADS)}, got {self.markov_head_type!r}",
            ),
            (
                min(self.ce_weight, self.l1_weight, self.confidence_weight) >= 0,
                "ce_weight, l1_weight and confidence_weight must be >= 0",
            ),
            (self.ce_weight + self.l1_weight > 0, "ce_weight or l1_weight must be > 0: nothing would train the drafts"),
            (
                min(self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k) >= 1,
                "conv_kernel_size, conv_group_size, selector_rank and selector_top_k must be >= 1",
            ),
            (
                self.method != "dflash2" or self.conv_kernel_size <= self.block_size,
                f"conv_kernel_size {self.conv_kernel_size} is wider than the block ({self.block_size} rows)",
            ),
            (self.selector_weight >= 0, f"selector_weight must be >= 0, got {self.selector_weight}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (0 <= self.min_lr_ratio <= 1, f"min_lr_ratio is a fraction of lr in [0, 1], got {self.min_lr_ratio}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (self.grad_clip >= 0, f"grad_clip must be >= 0 (0: off), got {self.grad_clip}"),
            (
                all(
                    v is None or v >= 1
                    for v in (self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim)
                ),
                "intermediate_size, num_heads, num_kv_heads and head_dim must be >= 1 (or unset: the target's)",
            ),
            (self.loss_chunk_gib >= 0, f"loss_chunk_gib must be >= 0, got {self.loss_chunk_gib}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        try:  # the dtype names run.py resolves it by, "auto" included
            resolve_dtype(self.save_dtype, torch.device("cpu"))
        except ValueError as e:
            raise ValueError(f"save_dtype: {e}") from None

    @property
    def loss_gamma(self) -> float:
        if self.gamma is not None:
            return self.gamma
        # DFlash's paper uses 7 for g=16, 5 for g=10 and 4 for g=8: about 3g/8 + 1; DeepSpec's DSpark 4.
        return 4.0 if self.method == "dspark" else 3 * self.block_size / 8 + 1


def flag_type(hint) -> typing.Callable[[str], object]:
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return lambda text: tuple(int(x) for x in text.split(","))
    return hint


def add_train_args(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(TrainConfig)
    for f in fields(TrainConfig):
        name, doc = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if hints[f.name] is bool:
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=doc)
        else:
            parser.add_argument(name, type=flag_type(hints[f.name]), default=f.default, help=doc)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
