"""`blockspec train`: data (the target's own responses), a fresh drafter, the training loop,
the drafter saved in its published layout (z-lab's DFlash and DFlash2, DeepSpec's DSpark), and
optionally tau on held-out prompts."""

import argparse
from pathlib import Path

import torch

from blockspec.llm import resolve_device, resolve_dtype
from blockspec.loading.drafters import save_drafter
from blockspec.loading.hf import load_target
from blockspec.train.config import TrainConfig, config_from_args
from blockspec.train.data import check_examples, generate_dataset, generator, read_examples
from blockspec.train.distributed import World, close_world, init_world
from blockspec.train.evaluate import acceptance_lengths, describe
from blockspec.train.model import build_drafter, default_mask_token_id
from blockspec.train.prompts import build_prompts, write_prompts
from blockspec.train.self_prompts import MAX_TOKENS, target_prompts
from blockspec.train.trainer import Trainer, uses_flex


def train(cfg: TrainConfig) -> Path:
    """Train a drafter as `cfg` says; returns the directory of the saved drafter (or the
    prompt file with cfg.write_prompts)."""
    if cfg.write_prompts:
        write_prompts(prompts_from(cfg), cfg.write_prompts)
        return Path(cfg.write_prompts)
    world, device = init_world(resolve_device(cfg.device))
    try:
        return train_on(cfg, world, device)
    finally:
        close_world(world)


def prompts_from(cfg: TrainConfig) -> list[str]:
    """cfg.num_prompts prompts from cfg.prompt_source."""
    if cfg.prompt_source == "offline":
        return build_prompts(cfg.num_prompts, cfg.seed)
    # the template up to a user's message (within max_prompt_tokens), then the request
    return target_prompts(generator(cfg, resolve_device(cfg.device), MAX_TOKENS), cfg.num_prompts, cfg.seed)


def output_dir(cfg: TrainConfig) -> Path:
    """cfg.output, made; ValueError where it is no directory, or holds a run that only --resume may go on with."""
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} is a file, not a directory")
    earlier = [p for p in (out / "checkpoint" / "state.json", out / "drafter" / "config.json") if p.is_file()]
    if earlier and not cfg.resume:
        raise ValueError(
            f"output {out} holds an earlier run ({earlier[0]}): pass --resume to go on with it, or another --output"
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


def train_on(cfg: TrainConfig, world: World, device: torch.device) -> Path:
    uses_flex(cfg, device)  # refused settings before hours of data generation
    out = output_dir(cfg)
    examples = read_examples(cfg.data) if cfg.data else generate_dataset(cfg, out / "data.jsonl", device, world)
    if not examples:
        raise ValueError("no training examples")
    if cfg.eval_prompts >= len(examples):
        raise ValueError(f"eval_prompts {cfg.eval_prompts} would hold out all {len(examples)} examples")
    held_out = examples[len(examples) - cfg.eval_prompts :] if cfg.eval_prompts else []
    examples = examples[: len(examples) - len(held_out)]
    say = print if world.main else lambda *_: None
    say(f"{len(examples)} training sequences, {sum(e.length for e in examples)} tokens; {len(held_out)} held out")

    target = load_target(cfg.model, resolve_dtype(None, device), device)
    target.model.requires_grad_(False)
    vocab = target.model.config.vocab_size
    check_examples(examples + held_out, vocab)
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else default_mask_token_id(target.tokenizer, vocab)
    drafter, init = build_drafter(target.model, cfg, mask_id)
    n_params = sum(p.numel() for p in drafter.parameters())
    say(
        f"{cfg.method} drafter: {cfg.layers} layers, {n_params / 1e6:.1f}M parameters, block {cfg.block_size}, "
        f"target layers {list(drafter.target_layer_ids)}, mask token {mask_id}, "
        f"init {init}"
    )
    trainer = Trainer(cfg, target.model, drafter, examples, device, world)
    path, dtype = out / "drafter", resolve_dtype(cfg.save_dtype, device)
    try:
        trainer.run()
    except KeyboardInterrupt:  # stopped (Ctrl-C, SIGTERM): the weights so far, usable as they are
        if world.main:
            export(trainer, path, dtype)
        raise
    if not world.main:
        return path
    export(trainer, path, dtype)
    del target, drafter, trainer  # the GPU memory, before the held-out prompts' engine
    if held_out:
        prompts = [e.prompt_ids for e in held_out]
        print("held-out prompts: " + describe(acceptance_lengths(cfg.model, path, prompts, cfg.max_new_tokens, device)))
    return path


def export(trainer: Trainer, path: Path, dtype: torch.dtype) -> None:
    """The drafter as trained so far, in its published layout."""
    save_drafter(trainer.drafter, trainer.target, path, dtype=dtype)
    print(f"drafter of step {trainer.step} of {trainer.cfg.steps} saved to {path}")


def main(args: argparse.Namespace) -> None:
    train(config_from_args(args))
