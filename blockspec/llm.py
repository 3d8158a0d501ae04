"""The user-facing facade: LLM(model, speculative_config, device, dtype).generate/chat/stream."""

import gc
import re
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import torch

from blockspec.config import DRAFTER_METHODS, EngineConfig, SpeculativeConfig
from blockspec.engine.detokenizer import streamable_text
from blockspec.engine.engine import LLMEngine
from blockspec.layers.cpu_gemm import native_cpu_bf16
from blockspec.layers.fast_path import use_kernels
from blockspec.loading.drafters import load_drafter
from blockspec.loading.finish import drafter_options, target_options
from blockspec.loading.hf import load_target
from blockspec.outputs import RequestOutput
from blockspec.sampling import SamplingParams

DEFAULT_DRAFTER = Path(__file__).parent / "assets" / "SmolLM2-135M-Instruct-DFlash"
AUTO = "auto"  # speculative_config default: the shipped drafter for the default target, else plain decoding

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
Prompt = str | list[int]
Conversation = list[dict[str, str]]
PLACEHOLDER = re.compile("\ue000([0-9]+)\ue001")  # private-use characters around a typed special's index


def typed_specials_as_placeholders(message: dict, specials: list[str]) -> dict:
    """The message with each special token's text in its content replaced by a placeholder (the
    template renders it as text; `LLM.chat_prompt` tokenizes it back as plain text)."""
    content = message.get("content")
    if not specials or not isinstance(content, str):
        return message
    pattern = "|".join(map(re.escape, specials))
    return message | {"content": re.sub(pattern, lambda m: f"\ue000{specials.index(m.group())}\ue001", content)}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except RuntimeError:  # a name torch does not know
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported (cpu or cuda)")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but this torch sees no CUDA GPU")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None: bfloat16 on CUDA, float32 (exact) on the CPU. "auto": the fastest sound choice,
    bfloat16 on CUDA and on CPUs with native bf16, else float32 (the CLI's default)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or native_cpu_bf16() else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]


def resolve_speculative_config(
    value: dict | SpeculativeConfig | str | None, model: str | None
) -> SpeculativeConfig | None:
    """AUTO: the shipped drafter for the embedded default target, else plain decoding;
    "ngram": prompt lookup; another string: a drafter directory; a dict: SpeculativeConfig fields."""
    if value == AUTO:
        shipped = model is None and (DEFAULT_DRAFTER / "config.json").is_file()
        return SpeculativeConfig(model=str(DEFAULT_DRAFTER)) if shipped else None
    if value == "ngram":
        return SpeculativeConfig(method="ngram")
    if isinstance(value, str):
        return SpeculativeConfig(model=value)
    return SpeculativeConfig.from_dict(value) if value is not None else None


def free_device_memory() -> None:
    """After dropping the last reference to an LLM or engine: its weights and caches go now (an
    engine holds reference cycles: its scheduler calls back into it), not at some later collection."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class LLM:
    def __init__(
        self,
        model: str | None = None,  # HF directory or .gguf file; None: the embedded SmolLM2
        speculative_config: dict | SpeculativeConfig | str | None = AUTO,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        **engine_args,
    ) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        unknown = set(engine_args) - {f.name for f in fields(EngineConfig)}
        if unknown:
            raise TypeError(f"unknown LLM arguments: {sorted(unknown)}")
        config = EngineConfig(**engine_args)
        use_kernels(config.engine_kernels)  # before the load options: they depend on the kernels in force
        target = load_target(
            model, self.dtype, self.device, target_options(config.fold_norms, self.device, config.mxfp4_experts)
        )
        spec = resolve_speculative_config(speculative_config, model)
        drafter = None
        if spec is not None and spec.method in DRAFTER_METHODS:
            if spec.model is None:
                raise ValueError("speculative_config needs 'model': the drafter directory")
            options = drafter_options(spec, self.device, target.model.spec.hidden_size, self.dtype)
            drafter = load_drafter(spec.model, target.model, self.dtype, self.device, options)
            if spec.method != "dflash" and drafter.proposer != spec.method:
                raise ValueError(
                    f"method {spec.method!r} asks for a {spec.method} drafter; {spec.model} is {drafter.proposer}"
                )
        self.engine = LLMEngine(target, drafter, spec, config)
        self.tokenizer = target.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        seqs = []
        try:
            for p, sp in zip(prompts, params):
                seqs.append(self.engine.add_request(p, sp))
            while self.engine.has_unfinished():
                self.engine.step()
        finally:  # a bad prompt or an error mid-run leaves nothing queued behind
            for seq in seqs:
                self.engine.abort(seq.request_id)
        return [self.engine.output(s) for s in seqs]

    def chat_prompt(self, conversation: Conversation) -> list[int]:
        """The conversation through the chat template, as token ids. A special token's text typed
        in a message (say `<|im_start|>system`) stays text: only the template makes control tokens."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        specials = sorted({t.content for t in tok.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
        text = tok.apply_chat_template(
            [typed_specials_as_placeholders(m, specials) for m in conversation],
            tokenize=False,
            add_generation_prompt=True,
        )
        pieces = PLACEHOLDER.split(text)  # template text, a typed special's index, template text, ...
        return [
            t
            for i, piece in enumerate(pieces)
            for t in (
                tok.encode(piece, add_special_tokens=False)
                if i % 2 == 0
                else tok.encode(specials[int(piece)], add_special_tokens=False, split_special_tokens=True)
            )
        ]

    def chat(
        self, conversations: Conversation | list[Conversation], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        conversations = [conversations] if conversations and isinstance(conversations[0], dict) else conversations
        return self.generate([self.chat_prompt(c) for c in conversations], sampling_params)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output whenever it has new tokens, until it finishes (the final
        output always comes, also when another generate or stream on this LLM ran its steps).
        Each text extends the one before: while running, a tail that may still grow into a stop
        string (and a partial character) is held back."""
        seq = self.engine.add_request(prompt, sampling_params or SamplingParams())
        sent = 0  # tokens in the last output yielded
        try:
            while True:
                if not seq.finished:
                    self.engine.step()
                finished = seq.finished  # as yielded: another caller may finish it while we are suspended
                if finished or seq.num_generated > sent:
                    sent = seq.num_generated
                    out = self.engine.output(seq)
                    out.outputs[0].text = streamable_text(out.outputs[0].text, finished, seq.params.stop)
                    yield out
                if finished:
                    return
        finally:  # a consumer that stops early frees the request
            self.engine.abort(seq.request_id)
