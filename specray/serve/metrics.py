"""Prometheus metrics of one server, in a registry of its own, named under ``specray:``.

Latencies are measured where the client sees them, in the server, per engine request (per
choice): time to first token from admission, one inter-token observation per output token
after the first (a delta carrying k tokens, as speculative decoding gives, spreads its interval
evenly over them, so the count is always ``sum(tokens - 1)``), and end-to-end latency.
Engine state (running and waiting requests, KV usage per pool, speculative-decoding counts as
vLLM names them) is read from ``EngineStats`` at scrape time, so it is never stale.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# seconds; fine at the low end where CPU token latencies of small models live
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
PREFIX = "specray:"


class EngineStatsCollector:
    """Reads ``stats()`` (an ``EngineStats``, or None while the engine starts) on every scrape."""

    def __init__(self, stats, model_name: str):
        self._stats = stats
        self._model = model_name

    def describe(self):
        return []  # no fixed list: the per-pool and per-position samples depend on the engine

    def collect(self):
        stats = self._stats()
        if stats is None:
            return
        labels = ["model_name"]

        def gauge(name, doc, value):
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric([self._model], value)
            return family

        def counter(name, doc, value):
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric([self._model], value)
            return family

        yield gauge("num_requests_running", "requests in the engine's running batch", stats.num_running)
        yield gauge("num_requests_waiting", "requests queued in the engine, not yet running", stats.num_waiting)
        kv = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "fraction of the pool's pages in use (1 = full)",
                               labels=[*labels, "pool"])
        for pool, usage in sorted(stats.kv_usage.items()):
            kv.add_metric([self._model, pool], usage)
        yield kv
        yield counter("spec_decode_num_drafts", "verify steps that checked drafts", stats.num_drafts)
        yield counter("spec_decode_num_draft_tokens", "draft tokens proposed", stats.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "draft tokens accepted", stats.num_accepted_tokens)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "draft tokens accepted at each draft position", labels=[*labels, "position"])
        for position, count in enumerate(stats.accepted_per_position):
            per_pos.add_metric([self._model, str(position)], count)
        yield per_pos
        for name, doc, values in (("prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                   stats.prefix_cache_queries),
                                  ("prefix_cache_hits", "prompt tokens served from the prefix cache",
                                   stats.prefix_cache_hits)):
            family = CounterMetricFamily(PREFIX + name, doc, labels=[*labels, "pool"])
            for pool, count in sorted((values or {}).items()):
                family.add_metric([self._model, pool], count)
            yield family
        if stats.adaptive:
            yield from self._adaptive(stats.adaptive, labels, counter)

    def _adaptive(self, adaptive: dict, labels, counter):
        """Adaptive speculation: the draft length chosen per decode row and step (a histogram,
        one bucket per length 0..k), steps in which no row drafted, length switches, and (dspark
        with a confidence head) the drafts that head kept from the verify."""
        hist = adaptive["draft_length_histogram"]
        cumulative = [sum(hist[:k + 1]) for k in range(len(hist))]
        family = HistogramMetricFamily(PREFIX + "spec_decode_draft_length",
                                       "draft length chosen per decode row and step (0: a plain decode)",
                                       labels=labels)
        family.add_metric([self._model], [(str(float(k)), c) for k, c in enumerate(cumulative)]
                          + [("+Inf", cumulative[-1] if cumulative else 0)],
                          sum_value=sum(k * n for k, n in enumerate(hist)))
        yield family
        yield counter("spec_decode_num_steps_without_drafting", "steps in which no decoding row drafted",
                      adaptive["num_steps_without_drafting"])
        yield counter("spec_decode_num_draft_length_switches", "steps whose held draft lengths changed",
                      adaptive["num_draft_length_switches"])
        if "num_drafts_not_verified" in adaptive:
            yield counter("spec_decode_num_drafts_not_verified", "drafts the confidence head kept from the verify",
                          adaptive["num_drafts_not_verified"])


class ServerMetrics:
    def __init__(self, model_name: str, stats=lambda: None):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name, doc):
            return Histogram(PREFIX + name, doc, labels, buckets=LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "time from admission to the first output token")
        self.itl = histogram("inter_token_latency_seconds", "time between consecutive output tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "time from admission to the last output token")
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of finished and running requests",
                                     labels, registry=self.registry).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "output tokens generated", labels,
                                         registry=self.registry).labels(model_name)
        self.finished = Counter(PREFIX + "request_success", "engine requests finished, by finish reason",
                                [*labels, "finished_reason"], registry=self.registry)
        self.registry.register(EngineStatsCollector(stats, model_name))

    def track(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """The latency metrics of one engine request, fed its deltas as they arrive."""

    def __init__(self, metrics: ServerMetrics, clock=time.perf_counter):
        self._m = metrics
        self._clock = clock
        self._start = self._last = clock()
        self._num_tokens = 0

    def on_delta(self, delta) -> None:
        count = len(delta.new_token_ids)
        if count:
            now = self._clock()
            if self._num_tokens == 0:
                self._m.ttft.observe(now - self._start)
                self._m.prompt_tokens.inc(delta.num_prompt_tokens)
                gaps, interval = count - 1, 0.0  # tokens beyond the first in the first delta: no wait seen
            else:
                gaps, interval = count, (now - self._last) / count
            for _ in range(gaps):
                self._m.itl.observe(interval)
            self._m.generation_tokens.inc(count)
            self._num_tokens += count
            self._last = now
        if delta.finish_reason is not None:
            self._m.e2e.observe(self._clock() - self._start)
            self._m.finished.labels(self._m.model_name, delta.finish_reason).inc()
