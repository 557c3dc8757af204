"""Prometheus metrics for both front doors (gRPC and HTTP), named as vLLM names them.

Every request goes through the AsyncEngine, which reports to `Metrics`: admission, each
output, the end. Gauges (running / waiting requests, KV cache use) and the prefix-cache
counters are the engine's snapshot taken at scrape time. Names take vLLM's with a `jaxserve:`
prefix and a `model_name` label, so vLLM dashboards work after a rename; docs/serving.md
lists them and docs/grafana.json plots them.
"""

from __future__ import annotations

import dataclasses

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.engine.speculative.stats import SpeculationStats
from jaxserve.outputs import StepOutput
from server.engine_core import EngineSnapshot

PREFIX = "jaxserve:"
# Buckets as vLLM's (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
disable_created_metrics()  # no `_created` series beside every counter (as vLLM)


@dataclasses.dataclass
class RequestTimes:
    """One request's clock readings (time.monotonic())."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0
    lora_name: str | None = None  # the request's LoRA adapter, if any


class Metrics:
    """The registry one server exposes at GET /metrics."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, label, buckets=buckets,
                             registry=self.registry).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(PREFIX + name, doc, label, registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)  # present at 0 from the start
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Time between output tokens (per step that produced tokens).",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to end.",
                             LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Time a request waited before it first ran.", LATENCY_BUCKETS)
        self.step = histogram("step_time_seconds", "Engine step time.", STEP_BUCKETS)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                        TOKEN_BUCKETS)
        self.request_generation = histogram("request_generation_tokens",
                                            "Generated tokens per request.", TOKEN_BUCKETS)
        self._lora_tokens = Counter(PREFIX + "lora_generation_tokens",
                                    "Generated tokens per LoRA adapter.",
                                    ["model_name", "lora_name"], registry=self.registry)
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)

    def on_output(self, times: RequestTimes, out: StepOutput, now: float) -> None:
        """Called (engine thread) for every output of a request admitted at times.arrival."""
        n = len(out.new_token_ids)
        if n:
            if times.first_token is None:
                times.first_token = now
                self.ttft.observe(now - times.arrival)
            else:
                self.tpot.observe((now - times.last_token) / n)
            times.last_token = now
            times.num_generated += n
            self.generation_tokens.inc(n)
            if times.lora_name is not None:
                self._lora_tokens.labels(self.model_name, times.lora_name).inc(n)
        if out.finished:
            self._success.labels(self.model_name, out.finish_reason or "abort").inc()
            self.prompt_tokens.inc(out.num_prompt_tokens)
            self.request_prompt.observe(out.num_prompt_tokens)
            self.request_generation.observe(times.num_generated)
            self.e2e.observe(now - times.arrival)
            if out.first_scheduled_at is not None:
                self.queue.observe(max(out.first_scheduled_at - times.arrival, 0.0))

    def scrape(self, snapshot: EngineSnapshot) -> bytes:
        """The exposition text, the engine's gauges and counters from `snapshot`."""
        self._engine.snapshot = snapshot
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters the engine keeps, from the snapshot of the scrape."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: EngineSnapshot | None = None

    def collect(self):
        if self.snapshot is None:  # registering collects once, before any scrape
            return
        status = self.snapshot.status
        labels = [self.model_name]
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch.", status.num_running),
                ("num_requests_waiting", "Requests waiting to run.", status.num_waiting),
                ("kv_cache_usage_perc", "Fraction of KV cache pages in use (0-1).",
                 status.kv_cache_usage)):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric(labels, value)
            yield gauge
        routers = self.snapshot.routers
        if routers:  # a mixture of experts
            imbalance = GaugeMetricFamily(
                PREFIX + "expert_imbalance", "Mixture-of-experts layers: the busiest "
                "expert's routed tokens over the mean (1 = even), since start.",
                labels=["model_name", "layer"])
            for layer, _, value in routers:
                imbalance.add_metric([self.model_name, str(layer)], value)
            yield imbalance
        for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 status.prefix_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 status.prefix_hits),
                ("num_preemptions", "Requests preempted (their KV recomputed later).",
                 status.num_preemptions)):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter
        if status.host_capacity:
            yield from self._host_tier(labels, status)
        if status.speculation is not None:
            yield from self._speculation(labels, status.speculation)
        if status.lora_running is not None:
            running = GaugeMetricFamily(PREFIX + "lora_requests_running",
                                        "Running requests per LoRA adapter.",
                                        labels=["model_name", "lora_name"])
            for name, n in sorted(status.lora_running.items()):
                running.add_metric([self.model_name, name], n)
            yield running
        if status.images is not None:
            yield from self._images(labels, status.images)
        if self.snapshot.kv is not None:
            yield from self._kv_transfer(labels, self.snapshot.kv)

    @staticmethod
    def _host_tier(labels: list[str], status):
        """The prefix cache's pages in host memory (kv_offloading_size)."""
        usage = GaugeMetricFamily(PREFIX + "host_kv_cache_usage_perc", "Fraction of the "
                                  "host KV cache's pages holding evicted pages (0-1).",
                                  labels=["model_name"])
        usage.add_metric(labels, status.host_pages / status.host_capacity)
        yield usage
        for name, doc, value in (
                ("host_kv_cache_stored_pages", "KV pages copied out to host memory as the "
                 "device's prefix cache evicted them.", status.pages_offloaded),
                ("host_prefix_cache_hits", "Prompt tokens found in the host KV cache and "
                 "copied back (within prefix_cache_hits).", status.host_hits)):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter

    @staticmethod
    def _kv_transfer(labels: list[str], kv):
        """Prefill/decode disaggregation (engine_core.py's KVStats; a prefill server's
        SenderStats): K/V pulled here, and held and sent here."""
        counters = [("kv_transfer_pulled", "Requests whose K/V this server pulled.", kv.pulled),
                    ("kv_transfer_pulled_bytes", "Bytes of K/V pulled.", kv.pulled_bytes),
                    ("kv_transfer_pull_seconds", "Seconds spent pulling K/V.", kv.pull_seconds),
                    ("kv_transfer_failed", "Requests whose K/V could not be pulled (or "
                     "added).", kv.failed)]
        sender = kv.sender
        if sender is not None:
            counters += [("kv_transfer_sent", "Requests whose K/V a decode server pulled "
                          "from here.", sender.sent),
                         ("kv_transfer_sent_bytes", "Bytes of K/V sent.", sender.sent_bytes),
                         ("kv_transfer_send_seconds", "Seconds spent sending K/V.",
                          sender.send_seconds),
                         ("kv_transfer_expired", "Requests whose K/V no decode server "
                          "pulled within kv_hold_seconds (released).", sender.expired)]
            for name, doc, value in (
                    ("kv_transfer_held", "Requests whose K/V wait here to be pulled.",
                     sender.held),
                    ("kv_transfer_held_bytes", "Bytes of K/V held here.", sender.held_bytes)):
                gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
                gauge.add_metric(labels, value)
                yield gauge
        for name, doc, value in counters:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter

    @staticmethod
    def _images(labels: list[str], stats):
        """A vision-language model's images (multimodal/images.py's ImageStats)."""
        for name, doc, value in (
                ("mm_images_encoded", "Images the vision tower encoded.",
                 stats.images_encoded),
                ("mm_encoder_cache_hits", "Images a request found already encoded (the "
                 "encoder cache).", stats.encoder_cache_hits),
                ("mm_encoder_seconds", "Host time spent dispatching the vision tower.",
                 stats.encoder_seconds)):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter
        usage = GaugeMetricFamily(PREFIX + "mm_encoder_cache_usage_perc", "Fraction of the "
                                  "encoder cache's rows holding images (0-1).",
                                  labels=["model_name"])
        usage.add_metric(labels, stats.encoder_cache_used_tokens / stats.encoder_cache_tokens)
        yield usage

    @staticmethod
    def _speculation(labels: list[str], stats: SpeculationStats):
        """Speculative decoding's counters (vLLM's spec_decode_* names)."""
        for name, doc, value in (
                ("spec_decode_num_drafts", "Sequence-steps that verified drafts.",
                 stats.proposed[0]),
                ("spec_decode_num_draft_tokens", "Draft tokens verified.", stats.num_proposed),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 stats.num_accepted)):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position (0 = the first draft).",
            labels=["model_name", "position"])
        for position, value in enumerate(stats.accepted):
            per_position.add_metric([*labels, str(position)], value)
        yield per_position
        active = GaugeMetricFamily(PREFIX + "spec_decode_active", "1 while steps may speculate "
                                   "(the batch within disable_by_batch_size, no prompt "
                                   "computed), else 0.",
                                   labels=["model_name"])
        active.add_metric(labels, float(stats.active))
        yield active
