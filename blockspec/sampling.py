"""Sampling parameters, the token distributions they define, counter-based random draws, and the
acceptance rules of speculative decoding (greedy prefix match; rejection sampling), batched over
rows whose parameters differ.

Randomness is a function of (request seed, token position, purpose), hashed on the device: a
sampled row's draws do not depend on which rows share its step, no host generator is carried per
request, and nothing waits for the device. A purpose (`Stream`) separates the uniforms that draw a
draft, accept it, and draw the residual or bonus token at the same position. Every uniform decides
a token not yet committed, and none decides two: after a rejection at position t, the uniforms of
positions past t decided only discarded drafts, so they are fresh for the next step."""

import enum
import math
import numbers
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from blockspec.layers.fast_path import cuda_compiled, fast_kernels
from blockspec.structured_output import StructuredOutput


def is_int(value) -> bool:
    """An integer (numpy's too), not a bool (which Python counts as one): for checks of parsed JSON too."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class InvalidSamplingParam(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param  # the field at fault (the server's error names it)


MAX_LOGPROBS = 20  # most likely tokens a step reports per row (OpenAI's top_logprobs bound)
MAX_STOP_IDS = 16  # eos and stop token ids a request with min_tokens may have (a step's [B, 16] tensor)
DRAW_CHUNK = 1024  # tokens a chunk of `draw`'s two-level CDF
MAX_STOP_STRINGS = 64  # a request's stop strings: each is searched for after every token, on the engine's thread
MAX_STOP_CHARS = 1024  # a stop string's length, which that search's cost grows with


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # 0: off
    max_tokens: int | None = 16  # None: until the context is full
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # no eos, stop token or stop string ends the output before it has this many tokens (eos and
    # stop tokens are never drawn: their probability is 0 there, drafts of them rejected)
    min_tokens: int = 0
    seed: int | None = None  # a signed 64-bit int: each value its own draws
    include_stop_str_in_output: bool = False  # keep the stop string, or the stop token's text
    skip_special_tokens: bool = True  # in the output text
    # Each output token's log-probability under the target's distribution (its raw logits' log
    # softmax, before temperature and filters), and the `logprobs` most likely tokens'; None: none.
    logprobs: int | None = None
    # Each prompt token's log-probability given the tokens before it (the first has none), and the
    # `prompt_logprobs` most likely tokens'; None: none. Such a prompt is prefilled whole (no
    # prefix-cache hit: a cached page holds no logits).
    prompt_logprobs: int | None = None
    # vLLM's penalties (`blockspec.penalties`): of output tokens, per occurrence and once; of prompt
    # and output tokens, a divisor of positive logits (1: off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # the grammar the output follows (`blockspec.structured_output`); None: free text
    structured_output: StructuredOutput | None = None
    return_drafts: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = {
            "temperature": (
                is_number(self.temperature) and 0 <= self.temperature < math.inf,
                f"must be >= 0 and finite, got {self.temperature}",
            ),
            "top_p": (is_number(self.top_p) and 0 < self.top_p <= 1, f"must be in (0, 1], got {self.top_p}"),
            "top_k": (is_int(self.top_k) and self.top_k >= -1, f"must be -1, 0 or positive, got {self.top_k}"),
            "min_p": (is_number(self.min_p) and 0 <= self.min_p <= 1, f"must be in [0, 1], got {self.min_p}"),
            "max_tokens": (
                self.max_tokens is None or is_int(self.max_tokens) and self.max_tokens >= 1,
                f"must be >= 1 or None, got {self.max_tokens}",
            ),
            "stop": (
                len(self.stop) <= MAX_STOP_STRINGS
                and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
                f"must be at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters",
            ),
            "stop_token_ids": (
                all(is_int(t) and t >= 0 for t in self.stop_token_ids),
                "must be non-negative ints",
            ),
            "min_tokens": (
                is_int(self.min_tokens)
                and 0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens),
                f"must be >= 0 and at most max_tokens, got {self.min_tokens!r}",
            ),
            "logprobs": (
                self.logprobs is None or is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
                f"must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
            ),
            "prompt_logprobs": (
                self.prompt_logprobs is None
                or is_int(self.prompt_logprobs)
                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"must be None or in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
            ),
            "presence_penalty": (
                is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                f"must be in [-2, 2], got {self.presence_penalty!r}",
            ),
            "frequency_penalty": (
                is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                f"must be in [-2, 2], got {self.frequency_penalty!r}",
            ),
            "repetition_penalty": (
                is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 100,
                f"must be in (0, 100], got {self.repetition_penalty!r}",
            ),
            "seed": (
                self.seed is None or is_int(self.seed) and -(2**63) <= self.seed < 2**63,
                f"must be a 64-bit int, got {self.seed!r}",
            ),
        }
        for name, (ok, message) in checks.items():
            if not ok:
                raise InvalidSamplingParam(name, f"{name} {message}")
        if self.structured_output is not None and self.min_tokens:
            # a complete grammar allows only stop tokens, which min_tokens bans: no token would be left
            raise InvalidSamplingParam("min_tokens", "min_tokens cannot be combined with structured output")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0, 0, 1)

    @property
    def filtered(self) -> bool:
        """Top-k, top-p or min-p: its sampled steps run the "filtered" variant of `probs`."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    @property
    def logit_rules(self) -> bool:
        """Penalties or min_tokens: its steps run the "+rules" variant, which reads the penalty state."""
        return self.penalized or self.min_tokens > 0


SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "min_p")  # a row's parameters, as `sampling_row` packs them


def sampling_row(params: SamplingParams) -> list[float]:
    """A request's parameters as one row of a step's float32 [B, 4] sampling tensor."""
    return [params.temperature, max(params.top_k, 0), params.top_p, params.min_p]


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`probs` of logits [..., V] under one request's parameters."""
    row = torch.tensor(sampling_row(params), device=logits.device)
    return probs(logits, row.expand(*logits.shape[:-1], len(SAMPLING_COLUMNS)))


def probs(logits: torch.Tensor, sampling: torch.Tensor, filters: bool = True) -> torch.Tensor:
    """The distributions sampling draws from, a row's parameters in `sampling` [..., 4]
    (`SAMPLING_COLUMNS`): softmax(logits / T), restricted to the top-k tokens, then to the smallest
    top set with mass >= top_p, then to the tokens with at least min_p times the top probability
    (transformers' order). logits: [..., V]. Rows of temperature 0 (greedy: never drawn from) get
    T = 1. `filters=False` skips top-k, top-p and min-p (the sort and two passes over the rows)
    where no row asks for them."""
    temperature, top_k, top_p, min_p = (c[..., None] for c in sampling.float().unbind(-1))
    scores = tempered_scores(logits, temperature)
    if not filters:
        return torch.softmax(scores, dim=-1)
    vocab = scores.shape[-1]
    ranked, order = scores.sort(dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
    kth = ranked.gather(-1, k.expand(*scores.shape[:-1], 1) - 1)
    p = torch.softmax(scores.masked_fill(scores < kth, float("-inf")), dim=-1)
    ranked_p = p.gather(-1, order)
    outside = (ranked_p.cumsum(-1) - ranked_p >= top_p) & (top_p < 1)
    p = p.scatter(-1, order, ranked_p.masked_fill(outside, 0))
    return min_p_filter(p / p.sum(-1, keepdim=True), min_p)


@cuda_compiled  # on CUDA one pass over the logits
def tempered_scores(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(logits - max) / T in float32, T = 1 where it is 0. Shifted so the top score is 0 before
    dividing: a tiny T sends the others to -inf (the argmax limit), where logits / T would overflow
    to inf and softmax to NaN."""
    logits = logits.float()
    return (logits - logits.amax(-1, keepdim=True)) / torch.where(temperature > 0, temperature, 1.0)


@cuda_compiled
def min_p_filter(p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """p without the tokens below min_p times its top probability, renormalized."""
    p = p.masked_fill(p < min_p * p.amax(-1, keepdim=True), 0)
    return p / p.sum(-1, keepdim=True)


class Stream(enum.IntEnum):
    """What a uniform decides at its token position (`uniform`)."""

    DRAFT = 0  # the drafter's draw of a draft
    ACCEPT = 1  # the accept/reject test of a draft
    RESIDUAL = 2  # the draw after a rejection, or the bonus token


MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 x in [0, 2**32); the products stay
    below 2**63, so int64 arithmetic is exact on every device."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def random_bits(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """32 random bits a (seed, position, stream), int64 in [0, 2**32); seeds are any int64 (both
    halves of its bits count)."""
    return hash_bits(seeds, stream_key(positions, stream))


def stream_key(positions: torch.Tensor, stream: int) -> torch.Tensor:
    """What a (position, stream) pair hashes as: position * 8 + stream."""
    return positions * 8 + stream


def hash_bits(seeds: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`random_bits` of a key (`stream_key`)."""
    h = mix32(keys & MASK32)
    h = mix32(h ^ (seeds & MASK32))
    return mix32(h ^ (seeds >> 32 & MASK32))


def uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Float64 uniforms in [0, 1) with 53 random bits, one per (seed, position) pair (broadcast)."""
    seeds, positions = torch.broadcast_tensors(seeds, positions)
    keys = stream_key(positions.reshape(-1), stream)
    return uniform_of_keys(seeds.reshape(-1), keys).view(positions.shape)


@cuda_compiled  # on CUDA one kernel, not the hash's many elementwise launches; 1-D: no variant per rank
def uniform_of_keys(seeds: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`uniform` of 1-D seeds and keys (`stream_key`)."""
    high = hash_bits(seeds, keys)
    low = hash_bits(seeds, keys + len(Stream)) >> 11  # the low bits hash as stream + len(Stream)
    return (high * 2**21 + low).double() * 2**-53


def draw(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of (unnormalized) p [..., V] by inverse CDF at u [...]: the first token whose
    cumulative mass exceeds u times the total; tokens of zero mass are never drawn (a row without
    mass gives some index in range). The CDF is taken in two levels, over chunks of DRAW_CHUNK
    tokens and then inside the chosen chunk (float64 sums): one scan along a whole vocabulary row
    is latency bound on a GPU."""
    pad = -p.shape[-1] % DRAW_CHUNK
    chunks = (F.pad(p, (0, pad)) if pad else p).unflatten(-1, (-1, DRAW_CHUNK))  # [..., C, DRAW_CHUNK]
    mass = chunks.sum(-1, dtype=torch.float64)  # [..., C]
    cdf = mass.cumsum(-1)
    target = (u * cdf[..., -1])[..., None]
    # u * total can round up to the total: then the last chunk (token) of any mass
    chunk = torch.searchsorted(cdf, target, right=True).clamp_max(last_positive(mass))  # [..., 1]
    # >= 0 exactly: the chunk's cdf before it is <= target (cdf - mass could round above it)
    rest = target - F.pad(cdf[..., :-1], (1, 0)).gather(-1, chunk)
    inside = chunks.gather(-2, chunk[..., None].expand(*chunk.shape, DRAW_CHUNK))[..., 0, :]
    # the chunk's own sum can round below `rest`: then its last token of any mass
    token = torch.searchsorted(inside.cumsum(-1, dtype=torch.float64), rest, right=True)
    token = token.clamp_max(last_positive(inside))
    return (chunk * DRAW_CHUNK + token)[..., 0]


def sample_rows(logits: torch.Tensor, sampling: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [B, V] from softmax(logits / T), drawn at the uniforms u [B]: `draw`
    of `probs` without filters (a row's parameters in `sampling` [B, 4], its temperature read alone).
    On CUDA by a Triton kernel (`blockspec.layers.kernels.sample`): the reference is a softmax that
    gives a row one program and a dozen small kernels."""
    kernels = fast_kernels(logits, "sample")
    if kernels is not None:
        return kernels.sample_triton(logits, sampling[:, 0], u)
    return draw(probs(logits, sampling, filters=False), u)


def sample_drafts(
    logits: torch.Tensor, sampling: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(drafts [B, n] drawn from softmax(logits / T) of a drafter's logits [B, n, V] at the uniforms
    u [B, n], the distributions where the draw wrote them out): `draw` of `probs` without filters
    (a row's parameters in `sampling` [B, 4], its temperature read alone), q [B, n, V] kept for the
    acceptance test; on CUDA `sample_rows`' kernel, n rows a sequence's temperature, which writes
    none (`sample_block` reads the logits instead)."""
    B, n, V = logits.shape
    kernels = fast_kernels(logits, "sample")
    if kernels is None:
        q = probs(logits, sampling[:, None], filters=False)
        return draw(q, u), q
    return kernels.sample_triton(logits.reshape(B * n, V), sampling[:, 0], u.reshape(-1), n).view(B, n), None


def last_positive(x: torch.Tensor) -> torch.Tensor:
    """[..., 1] the index of the last positive entry of each row of x [..., n] (0 if none)."""
    index = torch.arange(x.shape[-1], device=x.device)
    return torch.where(x > 0, index, 0).amax(-1, keepdim=True)


@cuda_compiled
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[..., 1 + 2 * MAX_LOGPROBS] float32 per row of logits [..., V]: the log-probability of the
    row's token (tokens [...]), the MAX_LOGPROBS largest log-probabilities, and their token ids
    (exact in float32: below 2**24); one tensor, so one copy to the host."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(MAX_LOGPROBS, dim=-1)
    return torch.cat([logp.gather(-1, tokens[..., None]), top.values, top.indices.float()], dim=-1)


@cuda_compiled
def ban_early_stops(
    logits: torch.Tensor, positions: torch.Tensor, min_positions: torch.Tensor, stop_ids: torch.Tensor
) -> torch.Tensor:
    """logits [B, w, V] with each row's stop ids (stop_ids [B, MAX_STOP_IDS], padded with -1) at
    -inf where the row's token would stand before its sequence's min_positions [B] (positions
    [B, w]: the token each row decides): min_tokens."""
    banned = torch.zeros(logits.shape[0], logits.shape[-1], device=logits.device)
    banned = banned.scatter_add(1, stop_ids.clamp_min(0), (stop_ids >= 0).float()) > 0
    early = positions < min_positions[:, None]
    return logits.masked_fill(banned[:, None, :] & early[..., None], float("-inf"))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy tokens: logits.argmax(-1); on CUDA without grad, for 16- and 32-bit floats, by a
    Triton kernel (torch's reduction gives a row one program: see `blockspec.layers.kernels.argmax`).
    Elsewhere as `max`'s indices, the same first maximum: on the CPU torch's argmax is several times
    slower than its max, in bf16 most of all."""
    kernels = fast_kernels(logits, "argmax")
    if kernels is not None and logits.dtype in kernels.DTYPES:
        return kernels.argmax_triton(logits)
    return logits.max(dim=-1).indices


def greedy_accept(drafts: torch.Tensor, target_argmax: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per sequence: the longest prefix with d_i == argmax of target row i-1.
    drafts: [B, S-1]; target_argmax: [B, S]; num_drafts: [B] (rows past it never accept)."""
    cols = torch.arange(drafts.shape[1], device=drafts.device)
    match = (drafts == target_argmax[:, :-1]) & (cols < num_drafts[:, None])
    return match.int().cumprod(dim=1).sum(dim=1)


def sampled_accept(
    drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, num_drafts: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Accepted drafts per sequence under speculative sampling: draft i is accepted with probability
    min(1, p(d_i) / q(d_i)), i.e. when u_i * q(d_i) < p(d_i), up to the first rejection. drafts,
    u: [B, S-1]; p: [B, S, V]; q: [B, S-1, V], or None: point masses at the drafts (a proposer
    without a distribution, whose drafts are certain: n-gram lookup); num_drafts: [B]."""
    p_d = p[:, :-1].gather(-1, drafts[..., None])[..., 0].double()
    q_d = 1.0 if q is None else q.gather(-1, drafts[..., None])[..., 0].double()
    cols = torch.arange(drafts.shape[1], device=drafts.device)
    ok = (u * q_d < p_d) & (cols < num_drafts[:, None])
    return ok.int().cumprod(dim=1).sum(dim=1)


def acceptance_chances(
    p: torch.Tensor, q: torch.Tensor | None, num_drafts: torch.Tensor, drafts: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, S-1] each draft's chance of acceptance once the drafts before it were accepted: the sum
    over the vocabulary of min(p, q) of its row (the draft drawn from q, accepted with probability
    min(1, p / q)); 0 past a sequence's num_drafts [B]. p: [B, S, V]; q: [B, S-1, V], or None:
    point masses at `drafts` [B, S-1], whose chances are p at the drafts."""
    cols = torch.arange(p.shape[1] - 1, device=p.device)
    if q is None:
        return p[:, :-1].gather(-1, drafts[..., None])[..., 0].where(cols < num_drafts[:, None], 0.0)
    rows = q.shape[1]
    if q.device.type == "cpu":  # only the rows drafted (at T > 0, a few of a block); on CUDA a read would wait
        rows = min(rows, int(num_drafts.max()) if num_drafts.numel() else 0)
    chances = q.new_zeros(q.shape[:2])
    chances[:, :rows] = torch.minimum(p[:, :rows], q[:, :rows]).sum(-1).where(cols[:rows] < num_drafts[:, None], 0.0)
    return chances


@dataclass
class SampledBlock:
    accepted: torch.Tensor  # [B] drafts accepted
    token: torch.Tensor  # [B] the token drawn after them
    chances: torch.Tensor | None = None  # [B, S-1] `acceptance_chances` of the drafts reached, where asked


def sample_block(
    logits: torch.Tensor,
    draft_logits: torch.Tensor,
    q: torch.Tensor | None,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    sampling: torch.Tensor,
    u_accept: torch.Tensor,
    u_residual: torch.Tensor,
    imposed: torch.Tensor | None = None,
    chances: bool = False,
) -> SampledBlock:
    """Speculative sampling of a block, for drafts drawn from q = softmax(draft_logits / T) [B, S-1,
    V] (written out where the draw did: `sample_drafts`) and the target's softmax(logits / T) [B, S,
    V], no filters (a row's parameters in `sampling` [B, 4], its temperature read alone):
    `sampled_accept` at u_accept [B, S-1], then `residual_tokens` after j accepted drafts at
    u_residual[:, j] [B, S], and with `chances` the `acceptance_chances` of the drafts reached (the
    first rejected one included; 0 past it). `imposed` [B]: counts that replace the test's (a
    simulated proposal's: the step still costs what a real one does). On CUDA by Triton kernels
    (`blockspec.layers.kernels.speculative_sample`), which write neither distribution out over the
    block, only each sequence's residual row."""
    kernels = fast_kernels(logits, "speculative_sample")
    if kernels is not None:
        return kernels.speculative_sample_triton(
            logits, draft_logits, drafts, num_drafts, sampling[:, 0], u_accept, u_residual, imposed, chances
        )
    p = probs(logits, sampling[:, None], filters=False)
    q = q if q is not None else probs(draft_logits, sampling[:, None], filters=False)
    accepted = sampled_accept(drafts, p, q, num_drafts, u_accept) if imposed is None else imposed
    u = u_residual.gather(1, accepted[:, None])[:, 0]
    reached = torch.minimum(accepted + 1, num_drafts)
    chance = acceptance_chances(p, q, reached) if chances else None
    return SampledBlock(accepted, residual_tokens(accepted, p, q, num_drafts, u), chance)


def residual_tokens(
    accepted: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    num_drafts: torch.Tensor,
    u: torch.Tensor,
    drafts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token after the accepted drafts [B]: after a rejection at row a, drawn from
    normalize(max(p_a - q_a, 0)); with every draft accepted, from p's row after the last (past the
    last draft q counts as zero, so it is the same rule). p: [B, S, V]; q: [B, S-1, V], or None:
    point masses at `drafts` [B, S-1]; u: [B]."""
    vocab, rows = p.shape[-1], p.shape[1] - 1
    p_row = p.gather(1, accepted[:, None, None].expand(-1, 1, vocab))[:, 0]
    if rows:
        at = accepted.clamp_max(rows - 1)[:, None]
        if q is None:  # max(p - one-hot, 0): p with the rejected draft's id zeroed (p <= 1)
            residual = p_row.scatter(1, drafts.gather(1, at), 0.0)
        else:
            residual = (p_row - q.gather(1, at[:, :, None].expand(-1, 1, vocab))[:, 0]).clamp_min(0)
        # max(p - q, 0) is all zero only when p == q, where a rejection has probability 0.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_row)
        p_row = torch.where((accepted < num_drafts)[:, None], residual, p_row)
    return draw(p_row, u)
