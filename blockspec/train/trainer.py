"""The training loop: AdamW with linear warm-up and cosine decay, bf16 autocast on CUDA (fp32
master weights), fp32 on CPU, a tqdm bar with loss / accuracy / offline tau, a JSONL log with
per-position accuracy, and resumable checkpoints (every save_every steps, at the end, and on
Ctrl-C / SIGINT or SIGTERM: a scheduler's, a `timeout`'s or a preemption's stop)."""

import json
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from blockspec.models.causal_lm import CausalLM
from blockspec.models.dflash import DFlashDrafter
from blockspec.train.batches import BatchOrder, collate, padded_width
from blockspec.train.checkpoint import load_checkpoint, save_checkpoint
from blockspec.train.config import TrainConfig
from blockspec.train.data import Example
from blockspec.train.distributed import SINGLE, World, data_parallel
from blockspec.train.loss import (
    DSparkWeights,
    Objective,
    StepResult,
    dflash2_loss,
    dflash_loss,
    dspark_loss,
    row_weights,
    sample_anchors,
)


@dataclass
class Meter:
    """Sums over a log window, kept on the device (no sync per step)."""

    loss: float | torch.Tensor = 0.0
    correct: float | torch.Tensor = 0.0
    total: float | torch.Tensor = 0.0
    inverse_tau: float | torch.Tensor = 0.0
    blocks: float | torch.Tensor = 0.0
    steps: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor, r: StepResult, tokens: int) -> None:
        self.loss += loss.detach()
        self.correct, self.total = self.correct + r.correct, self.total + r.total
        self.inverse_tau, self.blocks = self.inverse_tau + r.inverse_tau, self.blocks + r.blocks
        self.steps, self.tokens = self.steps + 1, self.tokens + tokens

    def reduce(self, world: World, device: torch.device) -> None:
        """Sums over ranks, each having seen its share of every batch (its loss is its share)."""
        parts = [self.loss, self.correct, self.total, self.inverse_tau, self.blocks, self.tokens]
        flat = [torch.as_tensor(x, dtype=torch.float64, device=device).reshape(-1) for x in parts]
        sums = world.all_sum(torch.cat(flat)).split([f.numel() for f in flat])
        self.loss, self.correct, self.total, self.inverse_tau, self.blocks = sums[:5]
        self.tokens = int(sums[5])

    def summary(self) -> dict:
        acc = (self.correct / torch.as_tensor(self.total).clamp_min(1)).tolist()
        return {
            "loss": float(self.loss) / max(1, self.steps),
            "acc": [round(a, 4) for a in acc],
            # Harmonic mean over anchors: the engine spends 1/tau steps per token, so long accepted
            # runs count for less than their share of anchors. Greedy, on the training labels.
            "tau_est": float(self.blocks) / max(1e-9, float(self.inverse_tau)),
            "tok_s": self.tokens / (time.perf_counter() - self.start),
        }


def uses_flex(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether the block masks run as FlexAttention ("auto": on CUDA); flex on the CPU is refused
    (`train_on` asks before any data is generated)."""
    cuda = device.type == "cuda"
    if cfg.attention == "flex" and not cuda:
        raise ValueError("attention=flex needs CUDA (FlexAttention has no backward on the CPU): use dense")
    return cfg.attention == "flex" or (cfg.attention == "auto" and cuda)


def step_loss(cfg: TrainConfig, weights: torch.Tensor, flex: bool) -> Callable[..., StepResult]:
    """The loss of cfg's method, as `Objective` calls it."""
    chunk = math.ceil(cfg.loss_chunk_gib * 2**28)  # fp32 elements of each vocabulary-wide tensor; 0: no chunks
    if cfg.method == "dflash":
        return partial(dflash_loss, weights=weights, flex=flex, chunk_elements=chunk)
    if cfg.method == "dflash2":
        return partial(
            dflash2_loss, weights=weights, selector_weight=cfg.selector_weight, flex=flex, chunk_elements=chunk
        )
    terms = DSparkWeights(cfg.ce_weight, cfg.l1_weight, cfg.confidence_weight)
    return partial(dspark_loss, weights=weights, terms=terms, flex=flex, chunk_elements=chunk)


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        target: CausalLM,
        drafter: DFlashDrafter,
        examples: list[Example],
        device: torch.device,
        world: World = SINGLE,
    ) -> None:
        self.cfg, self.target, self.drafter, self.examples, self.device = cfg, target, drafter, examples, device
        self.world = world
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        cuda = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=cuda or None
        )
        self.order = BatchOrder([e.length for e in examples], cfg.batch_size, cfg.seed)
        if self.order.batch_size < world.size:
            raise ValueError(f"batch_size {self.order.batch_size} is smaller than the {world.size} ranks sharing it")
        self.flex = uses_flex(cfg, device)
        self.pad_multiple = 128 if self.flex else 1  # few distinct shapes for the compiled kernel
        self.out = Path(cfg.output)
        ckpt = self.out / "checkpoint"
        resume = cfg.resume and (ckpt / "state.json").is_file()  # so a repeated --resume command also starts
        self.step = load_checkpoint(ckpt, drafter, self.optimizer, self.identity()) if resume else 0
        if self.step > cfg.steps:
            raise ValueError(f"{ckpt} is at step {self.step}, past --steps {cfg.steps}: give at least that many")
        weights = row_weights(drafter.num_drafts, cfg.loss_gamma, device)
        self.objective = data_parallel(Objective(drafter, step_loss(cfg, weights, self.flex)), world)

    def identity(self) -> dict:
        """What a checkpoint must match to be resumed: the target and what the drafter's weights
        mean (same shapes can read other layers or another mask token)."""
        d = self.drafter
        rows = {} if d.shifted == d.shifted_by_default else {"shifted": d.shifted}  # older checkpoints: the default
        return {"model": self.cfg.model, "method": self.cfg.method, "block_size": d.block_size,
                "target_layer_ids": list(d.target_layer_ids), "mask_token_id": d.mask_token_id, **rows}  # fmt: skip

    def lr_at(self, step: int) -> float:
        cfg, warmup = self.cfg, int(self.cfg.warmup * self.cfg.steps)
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, cfg.steps - warmup)
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def train_step(self) -> tuple[torch.Tensor, StepResult, int]:
        """One step over the step's batch, of which this rank takes every size-th example: the
        padded width and the anchors' random keys are the whole batch's, so the ranks together
        compute exactly the single-process step."""
        cfg, world = self.cfg, self.world
        examples = [self.examples[i] for i in self.order(self.step)]
        width = padded_width(examples, self.pad_multiple)
        keys = torch.rand(
            len(examples), width, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step)
        )
        batch = collate(examples[world.rank :: world.size], self.device, width)
        anchors, valid = sample_anchors(batch, cfg.blocks_per_seq, keys[world.rank :: world.size])
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            result = self.objective(self.target, batch, anchors, valid)
        loss = (result.loss_sum / world.all_sum(result.weight.detach().clone()).clamp_min(1e-6)).sum()
        self.optimizer.zero_grad(set_to_none=True)
        (loss * world.size).backward()  # DDP averages the ranks' gradients: their sum is the batch's
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        return loss, result, int(batch.lengths.sum())

    def save(self) -> None:
        if self.world.main:
            save_checkpoint(
                self.out / "checkpoint",
                self.step,
                self.drafter,
                self.optimizer,
                {"config": asdict(self.cfg), "identity": self.identity()},
            )

    def log(self, meter: Meter, bar: tqdm) -> None:
        meter.reduce(self.world, self.device)
        if not self.world.main:
            return
        s = meter.summary() | {"step": self.step, "lr": self.lr_at(self.step - 1)}
        with open(self.out / "log.jsonl", "a") as f:
            f.write(json.dumps(s) + "\n")
        bar.set_postfix(
            loss=f"{s['loss']:.3f}", acc1=f"{s['acc'][0]:.2f}", tau=f"{s['tau_est']:.2f}", tok_s=f"{s['tok_s']:.0f}"
        )
        acc = " ".join(f"{a:.2f}" for a in s["acc"])
        bar.write(f"step {self.step}: loss {s['loss']:.4f} tau~{s['tau_est']:.2f} acc/row {acc}")

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (one all-reduce, a host sync, where there are several)."""
        if self.world.size == 1:
            return flag
        return bool(self.world.all_sum(torch.tensor([float(flag)], device=self.device)).item())

    def run(self, until: int | None = None) -> None:
        """Train up to step `until` (default cfg.steps), checkpointing on the way."""
        end = min(until or self.cfg.steps, self.cfg.steps)
        self.out.mkdir(parents=True, exist_ok=True)
        self.drafter.train()
        bar = tqdm(total=end, initial=self.step, desc="training drafter", unit="step", disable=not self.world.main)
        meter = Meter()
        # SIGTERM stops at the next logged step, every rank at the same one, and saves a checkpoint
        # as Ctrl-C does (a signal handler can be set from the main thread only)
        stops: list[int] = []
        on_term = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGTERM, lambda signum, frame: stops.append(signum)) if on_term else None
        try:
            while self.step < end:
                meter.add(*self.train_step())
                bar.update(1)
                if self.step % self.cfg.log_every == 0 or self.step == end:
                    self.log(meter, bar)
                    meter = Meter()
                if self.step % self.cfg.save_every == 0:
                    self.save()
                if self.step % self.cfg.log_every == 0 and self.any_rank(bool(stops)):
                    raise KeyboardInterrupt(f"stopped by SIGTERM at step {self.step}")
        except KeyboardInterrupt:
            self.save()
            raise
        finally:
            bar.close()
            if on_term:
                signal.signal(signal.SIGTERM, before or signal.SIG_DFL)  # None: one set outside Python
        self.save()
        self.drafter.eval()
