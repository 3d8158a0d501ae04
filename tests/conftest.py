"""Tiny random checkpoints, saved by transformers (targets) and by our own saver (drafters)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from blockspec.layers.fast_path import active_kernels, restore_kernels
from blockspec.loading.drafters import save_drafter
from blockspec.loading.hf import load_config, load_target, target_family
from blockspec.models.dflash import DFlashDrafter
from blockspec.models.dflash2 import DFlash2Drafter
from blockspec.models.dspark import DSparkDrafter
from blockspec.proposers import DRAFTER_PROPOSERS
from blockspec.proposers.base import Proposal, Proposer


@pytest.fixture(autouse=True)
def kernels_in_force():
    """Each test ends with the switches in force that it began with: an engine built in one (with
    row invariance, say) does not change the ops of the next."""
    before = active_kernels()
    yield
    restore_kernels(before)


FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
}
# The hybrid families' tiny Gated DeltaNet layers: 2 key heads, 4 value heads (grouped), 8 wide.
LINEAR_GEOMETRY = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
# Each MoE family's tiny experts: 8 of width 32, 2 a row (overridable as any config field).
MOE_GEOMETRY = {
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
    "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": 8},
    "qwen3_5": LINEAR_GEOMETRY,
    "qwen3_5_moe": LINEAR_GEOMETRY
    | {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
    "qwen3_next": LINEAR_GEOMETRY
    | {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
}
ROPES = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def make_target(
    path: Path,
    family: str = "llama",
    tied: bool = False,
    rope: str = "none",
    vocab: int = 128,
    layers: int = 4,
    seed: int = 0,
    hidden: int = 64,
    **extra,
) -> Path:
    config_cls, model_cls = FAMILIES[family]
    rope_params = {"rope_theta": 10000.0, "rope_type": "default"}
    if ROPES[rope]:
        rope_params.update(ROPES[rope])
    geometry = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}
    geometry |= MOE_GEOMETRY.get(family, {})
    config = config_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        rope_parameters=rope_params,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        **{**geometry, **extra},
    )
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(path)
    return path


@torch.no_grad()
def vary_norms(drafter: torch.nn.Module) -> None:
    """Norm weights away from 1, so that a norm applied twice or not at all shows."""
    for name, p in drafter.named_parameters():
        if "norm" in name:
            p.uniform_(0.8, 1.2)


def make_drafter(
    path: Path,
    target_path: Path,
    layers: int = 2,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    seed: int = 0,
    mask_token_id: int | None = None,
    **config_fields,
) -> Path:
    target = load_target(target_path, torch.float32, torch.device("cpu")).model
    tc = target.config
    dflash = {"mask_token_id": tc.vocab_size - 1 if mask_token_id is None else mask_token_id}
    if target_layer_ids is not None:
        dflash["target_layer_ids"] = target_layer_ids
    config = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        block_size=block_size,
        dflash_config=dflash,
        **config_fields,
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config, tc.num_hidden_layers, tc.hidden_size)
    vary_norms(drafter)
    save_drafter(drafter, target, path, dtype=torch.float32)
    return path


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("llama_pair")
    target = make_target(root / "target", "llama")
    return target, make_drafter(root / "drafter", target)


def twin_head_pair(root: Path, family: str, gap: float) -> tuple[str, str]:
    """A tiny random target (3 layers) whose LM head rows come in near-equal pairs, `gap` apart
    (relative), and a drafter for it: whichever token leads, its twin's logit is a near-tie."""
    target = make_target(root / family, family, layers=3)
    weights = load_file(target / "model.safetensors")
    head = weights["lm_head.weight"]
    g = torch.Generator().manual_seed(4)
    head[1::2] = head[0::2] * (1 + gap * torch.randn(head[0::2].shape, generator=g))
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return str(target), str(make_drafter(root / f"{family}_drafter", target, block_size=8))


def random_prompts(n: int, seed: int = 3) -> list[list[int]]:
    """n random prompts of 3 to 40 tokens (ids 3..127)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 128, (int(torch.randint(3, 41, (), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


INVARIANCE_PROMPTS = [[5, 9, 3], [7, 11, 40, 2, 8, 100, 17, 64, 31, 12], [(7 * i) % 120 + 3 for i in range(29)]]


def alone_and_in_batch(llm, params, prompts: list, others: list) -> tuple[list, list]:
    """The prompts' output tokens each alone, and in one batch with the others after them."""
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    batch = [o.outputs[0].token_ids for o in llm.generate(list(prompts) + list(others), params)[: len(prompts)]]
    return alone, batch


def assert_row_invariant_pair(target: str, drafter: str, device: str, dtype: str, specs: list[dict]) -> None:
    """Under row invariance, three prompts' greedy tokens alone and in a batch of 16 are one
    sequence under plain decoding and under each speculative config of `specs` (the drafter's
    directory filled in)."""
    from blockspec import LLM, SamplingParams

    prompts, others = INVARIANCE_PROMPTS, random_prompts(13)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target, None, device=device, dtype=dtype, row_invariant=True, warm_up=False)
    expected, batch = alone_and_in_batch(plain, params, prompts, others)
    assert batch == expected
    for spec in specs:
        llm = LLM(target, {"model": drafter, **spec}, device=device, dtype=dtype, row_invariant=True, warm_up=False)
        assert alone_and_in_batch(llm, params, prompts, others) == (expected, expected), spec


def assert_shipped_pair_row_invariant(device: str, max_tokens: int) -> None:
    """The shipped pair in bf16 under row invariance: three chat prompts' greedy tokens alone and in
    a batch of 16 are one sequence, speculative and plain. Skipped without the embedded GGUF."""
    from blockspec import LLM, SamplingParams
    from blockspec.loading.gguf import default_gguf_path

    try:
        default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(f"embedded GGUF target absent: {exc}")
    questions = ["Explain what a hash table is.", "Write a haiku about autumn.", "What is recursion?"]
    fillers = ["Name a prime number.", "Say hello in French.", "What is 2 + 2?", "Describe the sea.", "Count to five."]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    plain = LLM(device=device, dtype="bfloat16", speculative_config=None, row_invariant=True)
    spec = LLM(device=device, dtype="bfloat16", row_invariant=True)
    prompts = [spec.chat_prompt([{"role": "user", "content": q}]) for q in questions + fillers * 3]
    expected, batch = alone_and_in_batch(plain, params, prompts[:3], prompts[3:16])
    assert batch == expected
    assert alone_and_in_batch(spec, params, prompts[:3], prompts[3:16]) == (expected, expected)


def add_word_tokenizer(path: Path, vocab: int) -> Path:
    """A word-level tokenizer over tokens w0..w{vocab-1} (decoded space-separated), with eos w2
    and a tiny chat template, so text prompts, stop strings and chat work on tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")
    fast.chat_template = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}w5"
    fast.save_pretrained(path)
    return path


class OracleProposer(Proposer):
    """Proposes the plain-greedy continuation `answers[prompt]`, except at every 5th position:
    acceptance is long and rejections land at varied rows. With `rng`, each block is right for a
    random number of its drafts instead (every rejection row, in turn)."""

    on_device = False

    def __init__(self, answers: dict[tuple, list[int]], rng: torch.Generator | None = None) -> None:
        self.answers, self.rng = answers, rng

    def host_drafts(self, token_ids: list[list[int]], widths: list[int]) -> list[list[int]]:
        drafts = []
        for tokens, width in zip(token_ids, widths):
            prompt = next(p for p in self.answers if tuple(tokens[: len(p)]) == p)
            full, generated = self.answers[prompt], len(tokens) - len(prompt)
            ks = range(generated, generated + width - 1)  # indices in `full` of the tokens after the anchor
            right = int(torch.randint(0, width, (), generator=self.rng)) if self.rng is not None else None
            drafts.append([self.draft(full, k, k - generated, right) for k in ks])
        return drafts

    @staticmethod
    def draft(full: list[int], k: int, row: int, right: int | None) -> int:
        """The k-th answer token, or a wrong one: at every 5th position, or from row `right` on."""
        wrong = (k + 1) % 5 == 0 if right is None else row >= right
        return (full[k] + 1 + k % 7) % 128 if k < len(full) and wrong else full[k] if k < len(full) else (k * 13) % 128

    def propose(self, runner, inputs) -> Proposal:
        return Proposal(inputs.tokens[:, 1:])


@pytest.fixture
def oracle(monkeypatch):
    """The engine's DFlash proposer replaced by an `OracleProposer` of the answers filled in."""
    answers: dict[tuple, list[int]] = {}
    factory = SimpleNamespace(from_config=lambda drafter, spec: OracleProposer(answers))
    monkeypatch.setitem(DRAFTER_PROPOSERS, "dflash", factory)
    return answers


@pytest.fixture
def random_oracle(monkeypatch):
    """`oracle` whose blocks are right for a random number of drafts each (seeded)."""
    answers: dict[tuple, list[int]] = {}
    rng = torch.Generator().manual_seed(0)
    factory = SimpleNamespace(from_config=lambda drafter, spec: OracleProposer(answers, rng))
    monkeypatch.setitem(DRAFTER_PROPOSERS, "dflash", factory)
    return answers


def count_launches_ahead(llm) -> list[bool]:
    """Records, for every step that could have been launched ahead, whether it was."""
    record, launch_ahead = [], llm.engine.launch_ahead

    def counted(prev):
        flight = launch_ahead(prev)
        record.append(flight is not None)
        return flight

    llm.engine.launch_ahead = counted
    return record


# -- Triton kernels: on a GPU for real, on the CPU in Triton's interpreter, in a subprocess --------
# (TRITON_INTERPRET must be set before triton is first imported, and this file's imports import it)
CUDA = torch.cuda.is_available()
INTERPRETED = not CUDA and os.environ.get("TRITON_INTERPRET") == "1"
runs_kernel = pytest.mark.skipif(not (CUDA or INTERPRETED), reason="CPU: run by interpreter_test")


def interpreter_test(test_file: str):
    """A test that, on the CPU, runs every test of `test_file` again under TRITON_INTERPRET=1."""

    @pytest.mark.skipif(CUDA or INTERPRETED, reason="the kernel tests run in this process")
    def test_kernels_in_interpreter() -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file]
        run = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]

    return test_kernels_in_interpreter


def swiglu_rounded(gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SiLU(gate) * up in float32 of gate|up rounded to `dtype` first, as the unfused GEMM stores
    them (the fused kernels' SwiGLU epilogue against it)."""
    gate, up = gate_up.to(dtype).float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def make_dspark(
    path: Path,
    target_path: Path,
    dialect: str = "deepspec",
    block_size: int = 4,
    markov_rank: int = 8,
    head: str = "vanilla",
    confidence: bool = True,
    draft_vocab: int | None = None,
    markov_scale: float = 1.0,
    shifted: bool = True,
    seed: int = 0,
) -> Path:
    """A DSpark drafter for a target (`shifted`: row j drafts anchor+j+1, else z-lab's filled rows), saved in one of its published dialects: DeepSpec's (with the
    copies of the target's embedding and LM head it ships), SpecForge's (fields nested, heads under
    `logit_head.`) or speculators' (`transformer_layer_config`, hidden-state layer ids, its own
    embedding; "speculators-dflash" its DFlash kind). `draft_vocab`: a reduced vocabulary of that
    many target ids, with `d2t`."""
    target = load_target(target_path, torch.float32, torch.device("cpu")).model
    tc = target.config
    fields = {"block_size": block_size, "mask_token_id": tc.vocab_size - 1, "target_layer_ids": [1, 3]}
    fields |= {"markov_rank": markov_rank, "markov_head_type": head, "enable_confidence_head": confidence}
    fields |= {"confidence_head_with_markov": confidence and markov_rank > 0}
    if draft_vocab is not None:
        fields["draft_vocab_size"] = draft_vocab
    if not shifted:
        fields["sample_from_anchor"] = False
    config = Qwen3Config(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, architectures=["Qwen3DSparkModel"], **fields,
    )  # fmt: skip
    torch.manual_seed(seed)
    drafter = DSparkDrafter(config, tc.num_hidden_layers, tc.hidden_size)
    vary_norms(drafter)
    if drafter.markov_head is not None:
        with torch.no_grad():
            drafter.markov_head.markov_w2.weight.mul_(markov_scale)
    if draft_vocab is not None:
        drafter.draft_to_target = torch.randperm(tc.vocab_size)[:draft_vocab].sort().values
    save_drafter(drafter, target, path, dtype=torch.float32)
    config, weights = json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")
    embed = {"embed_tokens.weight": target.model.embed_tokens.weight.detach().clone()}
    if dialect == "deepspec" and draft_vocab is None:
        weights |= embed | {"lm_head.weight": target.lm_head.weight.detach().clone()}
    elif dialect == "specforge":
        nested = {k: config.pop(k) for k in fields if k != "block_size"}
        config |= {"architectures": ["DSparkDraftModel"], "dflash_config": {**nested, "projector_type": "dspark"}}
        weights = {
            ("logit_head." + n if n.startswith(("markov_head.", "confidence_head.")) else n): t
            for n, t in weights.items()
        }
    elif dialect.startswith("speculators"):  # "speculators-dflash": its DFlash kind (no heads, rows filled in)
        layers = {
            k: config.pop(k)
            for k in list(config)
            if k not in fields and k not in ("architectures", "num_target_layers")
        }
        kind = dialect.partition("-")[2] or "dspark"
        config = {
            **{k: v for k, v in config.items() if k != "target_layer_ids"},
            "speculators_model_type": kind,
            **({"sample_from_anchor": True} if kind == "dspark" else {}),
            "aux_hidden_state_layer_ids": [i + 1 for i in fields["target_layer_ids"]],
            "transformer_layer_config": layers,
        }
        weights |= embed
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, path / "model.safetensors")
    return path


def make_dflash2(
    path: Path,
    target_path: Path,
    block_size: int = 6,
    taps: int = 2,
    selector: tuple[int, int] = (8, 4),
    identity: bool = False,
    successor_zero: bool = False,
    scale: float = 1.0,
    seed: int = 0,
) -> Path:
    """A DFlash2 drafter for a target, in z-lab's layout: `taps`-tap block convolutions over groups
    of 16 channels (random, or the identity), a selector of (rank, top-k) (rank 0: none) with random
    codebooks (`successor_zero`: its successor codebook zero; `scale` multiplies the pair scores)."""
    target = load_target(target_path, torch.float32, torch.device("cpu")).model
    tc = target.config
    fields = {"mask_token_id": tc.vocab_size - 1, "target_layer_ids": [1, 3], "conv_kernel_size": taps}
    fields |= {"conv_group_size": 16 if taps else 0, "selector_rank": selector[0], "selector_top_k": selector[1]}
    config = Qwen3Config(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, architectures=["DFlash2DraftModel"],
        block_size=block_size, dflash_config=fields,
    )  # fmt: skip
    torch.manual_seed(seed)
    drafter = DFlash2Drafter(config, tc.num_hidden_layers, tc.hidden_size)
    vary_norms(drafter)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("base_kernel") and not identity:
                p.normal_(0, 0.3)[:, 0] += 1
            if "kernel_projection" in name and not identity:
                p.normal_(0, 0.05)
            if "codebook" in name:
                p.normal_(0, scale).mul_(0 if successor_zero and "successor" in name else 1)
    save_drafter(drafter, target, path, dtype=torch.float32)
    return path


def assert_greedy_equals_transformers_generate(target: Path, drafter: Path, n: int = 30) -> None:
    """Plain and speculative greedy decoding of a prompt are transformers' greedy generate, token
    for token."""
    from transformers import AutoModelForCausalLM

    from blockspec import LLM, SamplingParams

    ref = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt = [5, 9, 17, 3, 40, 41, 42, 7, 8, 100, 101]
    expected = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for spec in (None, {"model": str(drafter)}):
        out = LLM(str(target), spec, device="cpu", page_size=4).generate([prompt], params)[0].outputs[0].token_ids
        assert out == expected[0, len(prompt) :].tolist()


# safetensors dtype names of the published checkpoints' tensor lists (tests/fixtures/*/tensors.json)
DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64, "BOOL": torch.bool,
    "U8": torch.uint8,
}  # fmt: skip


def meta_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """A fixture's tensors.json as meta tensors of its names, shapes and dtypes."""
    header = json.loads((folder / "tensors.json").read_text())
    return {n: torch.empty(t["shape"], dtype=DTYPES[t["dtype"]], device="meta") for n, t in header.items()}


def published_target(folder: Path):
    """A published target's (config, family, model built on the meta device) from its config.json."""
    config = load_config(folder)
    family = target_family(config, folder)
    with torch.device("meta"):
        return config, family, family.build(config)
