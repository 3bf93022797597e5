"""Prometheus metrics with vLLM's names and buckets, prefixed `twostep:`.

Everything is derived from real timestamps on finished RequestOutputs and from the engine's
counters; the registry belongs to one server (no process-global state).
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from twostep.outputs import PoolingRequestOutput, RequestOutput

PREFIX = "twostep:"
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_ENGINE_COUNTERS = {   # engine stats key -> metric suffix
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "spec_decode_num_drafts": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
    # prefill/decode disaggregation (with --kv-transfer-config)
    "kv_transfer_bytes_sent": "kv_transfer_bytes_sent",
    "kv_transfer_bytes_received": "kv_transfer_bytes_received",
    "kv_transfer_num_loads": "kv_transfer_num_loads",
    "kv_transfer_num_load_failures": "kv_transfer_num_load_failures",
    "kv_transfer_num_leases_expired": "kv_transfer_num_leases_expired",
}


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._refreshing = threading.Lock()
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between tokens.", TOKEN_LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "Mean time per output token.",
                         TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.",
                          REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.",
                            REQUEST_LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to last token.",
                           REQUEST_LATENCY_BUCKETS)
        self.kv_load = hist("kv_transfer_load_seconds", "A remote prefill's KV blocks: load start to "
                            "written here (decode instance).", TTFT_BUCKETS)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.request_success = counter("request_success", "Finished requests by finish reason.",
                                       ("finished_reason",))
        self.engine_counters = {key: counter(name, f"Engine counter {name}.")
                                for key, name in _ENGINE_COUNTERS.items()}
        self._last_engine: dict[str, int] = {key: 0 for key in _ENGINE_COUNTERS}
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position.", ("position",))
        self._last_per_pos: list[int] = []
        # Create every series at zero so scrapes see them before the first request.
        for metric in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prefill, self.decode,
                       self.running, self.waiting, self.kv_usage, self.prompt_tokens,
                       self.generation_tokens, *self.engine_counters.values()):
            metric.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)

    def observe_finished(self, out: RequestOutput | PoolingRequestOutput) -> None:
        m, name = out.metrics, self.model_name
        if isinstance(out, PoolingRequestOutput):      # one vector, no generated tokens
            self.request_success.labels(name, out.finish_reason or "abort").inc()
        else:
            for completion in out.outputs:
                self.request_success.labels(name, completion.finish_reason or "abort").inc()
                self.generation_tokens.labels(name).inc(len(completion.token_ids))
        self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
        if m.kv_load_start_time is not None and m.kv_load_end_time is not None:
            self.kv_load.labels(name).observe(m.kv_load_end_time - m.kv_load_start_time)
        if m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.labels(name).observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is None:
            return
        self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.prefill.labels(name).observe(m.first_token_time - m.first_scheduled_time)
        if m.last_token_time is not None:
            self.decode.labels(name).observe(m.last_token_time - m.first_token_time)
        for gap in m.inter_token_latencies:
            self.itl.labels(name).observe(gap)
        if m.tpot is not None:
            self.tpot.labels(name).observe(m.tpot)

    def refresh(self, engine) -> None:
        """The engine's gauges and counters now (an LLMEngine), read and applied as one so no counter
        goes back between two callers (the engine loop and a /metrics scrape)."""
        with self._refreshing:
            running, waiting, kv_usage = engine.num_running, engine.num_waiting, engine.kv_cache_usage
            stats = engine.get_stats()
            name = self.model_name
            self.running.labels(name).set(running)
            self.waiting.labels(name).set(waiting)
            self.kv_usage.labels(name).set(kv_usage)
            for key, counter in self.engine_counters.items():
                value = stats.get(key, 0)         # speculative counters exist only with speculation
                if value > self._last_engine[key]:
                    counter.labels(name).inc(value - self._last_engine[key])
                self._last_engine[key] = value
            per_pos = stats.get("spec_decode_accepted_per_position", [])
            for pos, value in enumerate(per_pos):
                last = self._last_per_pos[pos] if pos < len(self._last_per_pos) else 0
                self.accepted_per_pos.labels(name, str(pos)).inc(value - last)
            self._last_per_pos = list(per_pos)

    def render(self) -> bytes:
        return generate_latest(self.registry)
