"""Prometheus metrics of the server, in their own registry (one per app).

Drafted tokens are counted from what the drafter actually proposed for each verified step
(SamplingParams.return_drafts), not from the block width: a step near max_tokens or the end
of the context verifies fewer drafts. A step's accepted drafts are its committed tokens minus
the bonus token, so a step cut short by a stop token counts only the drafts that were used.
The speculative counters have vLLM's names (`spec_decode_num_drafts`, ...), under `blockspec_`."""

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from blockspec.engine.engine import LLMEngine
from blockspec.engine.kv_cache_manager import KVCacheManager
from blockspec.outputs import RequestOutput


class PrefixCacheCounters(Collector):
    """The KV cache manager's prefix-cache counts, read when scraped (vLLM's prefix_cache_* names)."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager

    def collect(self):
        a = self.kv_cache_manager
        yield CounterMetricFamily(
            "blockspec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", a.queries
        )
        yield CounterMetricFamily("blockspec_prefix_cache_hits", "Prompt tokens found there (not prefilled)", a.hits)


class ServerMetrics:
    def __init__(self, engine: LLMEngine) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "blockspec_requests", "Requests finished, by finish reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("blockspec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("blockspec_generation_tokens", "Tokens generated", registry=r)
        self.engine_steps = Counter("blockspec_engine_steps", "Batched decoding steps of the engine", registry=r)
        self.spec_steps = Counter(
            "blockspec_spec_decode_num_drafts",
            "Speculative steps summed over requests (one verify of one sequence)",
            registry=r,
        )
        self.draft_tokens = Counter("blockspec_spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter("blockspec_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.drafted_at = Counter(
            "blockspec_spec_decode_num_draft_tokens_per_pos",
            "Drafts verified at each draft position (0: the token right after the anchor)",
            ["position"],
            registry=r,
        )
        self.accepted_at = Counter(
            "blockspec_spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted at each draft position (0: the token right after the anchor)",
            ["position"],
            registry=r,
        )
        self.mean_acceptance = Gauge(
            "blockspec_spec_decode_mean_acceptance_length",
            "Tokens committed per speculative step (accepted drafts + bonus), since start",
            registry=r,
        )
        scheduler = engine.scheduler
        Gauge("blockspec_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: len(scheduler.running)
        )
        Gauge("blockspec_requests_waiting", "Requests waiting for admission", registry=r).set_function(
            lambda: len(scheduler.waiting)
        )
        Gauge("blockspec_kv_pages_free", "Free KV cache pages", registry=r).set_function(
            lambda: scheduler.kv_cache_manager.num_free
        )
        Gauge("blockspec_kv_pages_total", "KV cache pages that requests can use", registry=r).set(
            scheduler.kv_cache_manager.num_usable
        )
        r.register(PrefixCacheCounters(scheduler.kv_cache_manager))
        self.num_steps = self.num_committed = 0  # the mean's terms (a gauge cannot read counters)

    def request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def request_finished(self, finish_reason: str) -> None:
        self.requests.labels(finish_reason).inc()

    def step(self, out: RequestOutput) -> None:
        """Account the newest step of one request (its last acceptance length and drafts)."""
        committed = out.metrics.acceptance_lengths[-1]
        drafted = len(out.metrics.draft_token_ids[-1])
        accepted = committed - 1
        self.generation_tokens.inc(committed)
        self.spec_steps.inc()
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        for i in range(drafted):
            self.drafted_at.labels(str(i)).inc()
        for i in range(accepted):
            self.accepted_at.labels(str(i)).inc()
        self.num_steps += 1
        self.num_committed += committed
        self.mean_acceptance.set(self.num_committed / self.num_steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)
