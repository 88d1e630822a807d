"""``GET /metrics``: the engine's counters in Prometheus text, under vLLM's metric names.

The analogy's ``top`` exported for a monitoring system: what ``get_stats()`` reports,
read at scrape time (a custom collector, so the numbers are never a copy that drifts),
plus per-request latency histograms observed as requests finish. The names are vLLM's
(``vllm:num_requests_running``, ``vllm:gpu_cache_usage_perc``, ...) with its
``model_name`` label, so a dashboard built for vLLM reads them; swap traffic, which
vLLM does not export, is under ``minipaged:``. Each server has its own registry: no
process-wide state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name, help, the get_stats() key
GAUGES = [
    ("vllm:num_requests_running", "Number of sequences running (holding KV blocks).", "num_running"),
    ("vllm:num_requests_waiting", "Number of sequences waiting to be admitted.", "num_waiting"),
    ("vllm:num_requests_swapped", "Number of sequences swapped out to the CPU pool.", "num_swapped"),
    ("vllm:gpu_cache_usage_perc", "KV cache usage of the device pool (1 means 100 percent).", "kv_usage"),
    ("vllm:cpu_cache_usage_perc", "KV cache usage of the CPU swap pool (1 means 100 percent).", "cpu_kv_usage"),
]
COUNTERS = [
    ("vllm:num_preemptions", "Cumulative number of preemptions.", "num_preemptions"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", "prefix_cache_hits"),
    ("minipaged:swap_out_bytes", "KV bytes copied to the CPU swap pool.", "bytes_swapped_out"),
    ("minipaged:swap_in_bytes", "KV bytes copied back from the CPU swap pool.", "bytes_swapped_in"),
]
# speculative decoding (get_stats()["spec_decode"], None when off): vLLM's names
SPEC_COUNTERS = [
    ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
]
SPEC_GAUGES = [
    ("vllm:spec_decode_draft_acceptance_rate", "Share of draft tokens accepted.", "acceptance_rate"),
    ("minipaged:spec_decode_mean_accepted_length", "Tokens a verifying step emits per sequence, on average.",
     "mean_accepted_length"),
]
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0)


class EngineCollector:
    """Reads the gauges and counters from the engine's latest stats at every scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict = {}     # set by the /metrics handler (read on the engine's thread) before collect

    def collect(self):
        for name, help_, key in GAUGES:
            family = GaugeMetricFamily(name, help_, labels=["model_name"])
            family.add_metric([self.model_name], float(self.stats.get(key) or 0))
            yield family
        for name, help_, key in COUNTERS:
            family = CounterMetricFamily(name, help_, labels=["model_name"])
            family.add_metric([self.model_name], float(self.stats.get(key) or 0))
            yield family
        spec = self.stats.get("spec_decode")
        if spec is not None:      # only an engine that speculates has these
            for kind, table in ((CounterMetricFamily, SPEC_COUNTERS), (GaugeMetricFamily, SPEC_GAUGES)):
                for name, help_, key in table:
                    family = kind(name, help_, labels=["model_name"])
                    family.add_metric([self.model_name], float(spec.get(key) or 0))
                    yield family


class ServerMetrics:
    """The registry behind ``/metrics``: the collector and three latency histograms."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.collector = EngineCollector(model_name)
        self.registry.register(self.collector)
        label = dict(labelnames=["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.",
                              **label).labels(model_name)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token in seconds.",
                              **label).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             **label).labels(model_name)

    def observe_finished(self, out: RequestOutput, num_output_tokens: int) -> None:
        """One finished request's latencies (from the engine's own timestamps); the time per
        output token counts its longest sample."""
        m = out.metrics
        arrival, first, done = m.get("arrival_time"), m.get("first_token_time"), m.get("finished_time")
        if arrival is None or done is None:
            return
        self.e2e.observe(done - arrival)
        if first is not None:
            self.ttft.observe(first - arrival)
            if num_output_tokens > 1:
                self.tpot.observe((done - first) / (num_output_tokens - 1))

    def render(self, stats: dict) -> bytes:
        self.collector.stats = stats
        return generate_latest(self.registry)
