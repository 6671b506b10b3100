"""Server metrics in the Prometheus text format (no client library: a few counters, gauges, histograms)."""

from __future__ import annotations

import bisect
import threading

_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                  2.5)
_E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class Histogram:
    def __init__(self, buckets=_BUCKETS_S):
        self.buckets, self.counts, self.sum, self.n = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, x: float) -> None:
        i = bisect.bisect_left(self.buckets, x)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += x
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        return out + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.n}"]


class Metrics:
    """Written by the engine thread (and the HTTP thread: e2e and inter-token latency, as its clients see
    them), read by the HTTP thread. Each histogram has one writer; plain ints and floats: a torn read is
    harmless."""

    def __init__(self, max_batch: int):
        self.max_batch = max_batch
        self.requests = self.finished = self.rejected = self.errors = 0
        # prompt_tokens: every accepted request's usage.prompt_tokens (counted by the HTTP layer); the engine
        # splits each sequence's prompt, at its admission, into prompt_prefilled (computed) and
        # cached_prompt_tokens (served from the prefix cache)
        self.prompt_tokens = self.prompt_prefilled = self.generation_tokens = 0
        self.queue_depth = self.slots_in_use = self.running = self.waiting = 0
        self.pages_total = self.pages_in_use = self.pages_free = self.pages_cached = 0
        self.cache_usage = 0.0  # pages requests hold / the pool's pages
        self.cached_prompt_tokens = self.preemptions = 0
        # Speculative decoding: rows whose drafts a step verified, the drafts, and those accepted.
        self.spec_verified = self.spec_drafted = self.spec_accepted = 0
        self.ttft, self.step_time, self.queue_time = Histogram(), Histogram(), Histogram()
        self.e2e, self.itl = Histogram(_E2E_BUCKETS_S), Histogram(_ITL_BUCKETS_S)
        self._lock = threading.Lock()

    def observe_ttft(self, s: float) -> None:
        self.ttft.observe(s)

    def observe_step(self, s: float) -> None:
        self.step_time.observe(s)

    def observe_queue(self, s: float) -> None:
        """Arrival to admission into a slot (engine thread)."""
        self.queue_time.observe(s)

    def observe_e2e(self, s: float) -> None:
        """Arrival to the last token of one choice (HTTP thread)."""
        self.e2e.observe(s)

    def observe_itl(self, s: float) -> None:
        """Between two tokens of one choice as its handler receives them (HTTP thread)."""
        self.itl.observe(s)

    def render(self) -> str:
        """The /metrics page."""
        from k2jax.runtime.compiles import count as compiles

        rows = [
            ("k2jax_requests_total", "counter", "requests accepted", self.requests),
            ("k2jax_requests_finished_total", "counter", "requests finished (any reason)", self.finished),
            ("k2jax_requests_rejected_total", "counter", "requests refused with 429 (queue full)", self.rejected),
            ("k2jax_request_errors_total", "counter", "requests answered with a 4xx", self.errors),
            ("k2jax_prompt_tokens_total", "counter", "prompt tokens of the requests accepted (their usage."
             "prompt_tokens summed)", self.prompt_tokens),
            ("k2jax_prompt_tokens_prefilled_total", "counter", "prompt tokens computed when a sequence was admitted "
             "(not served from the prefix cache)", self.prompt_prefilled),
            ("k2jax_generation_tokens_total", "counter", "tokens generated", self.generation_tokens),
            ("k2jax_queue_depth", "gauge", "requests waiting for a slot", self.queue_depth),
            ("k2jax_slots_in_use", "gauge", "decode slots holding a request", self.slots_in_use),
            ("k2jax_slots_total", "gauge", "decode slots", self.max_batch),
            ("k2jax_cache_usage_ratio", "gauge", "pages of the KV cache pool requests hold / all its pages",
             round(self.cache_usage, 6)),
            ("k2jax_kv_pages_total", "gauge", "pages of the KV cache pool", self.pages_total),
            ("k2jax_kv_pages_in_use", "gauge", "pages some request holds", self.pages_in_use),
            ("k2jax_kv_pages_free", "gauge", "pages held by nothing (not even the prefix cache)", self.pages_free),
            ("k2jax_kv_pages_cached", "gauge", "pages indexed by the prefix cache", self.pages_cached),
            ("k2jax_prompt_tokens_cached_total", "counter", "prompt tokens served from the prefix cache when a "
             "sequence was admitted", self.cached_prompt_tokens),
            ("k2jax_preemptions_total", "counter", "requests preempted (pages freed, recomputed later)",
             self.preemptions),
            ("k2jax_compilations_total", "counter", "XLA compilations in this process", compiles()),
            ("k2jax_spec_decode_verified_rows_total", "counter", "rows whose drafted tokens a step verified "
             "(speculative decoding)", self.spec_verified),
            ("k2jax_spec_decode_draft_tokens_total", "counter", "drafted tokens verified", self.spec_drafted),
            ("k2jax_spec_decode_accepted_tokens_total", "counter", "drafted tokens accepted (output as they were "
             "drafted)", self.spec_accepted),
            ("k2jax_spec_decode_mean_accepted_length", "gauge", "accepted drafted tokens per verified row",
             round(self.spec_accepted / max(self.spec_verified, 1), 6)),
        ]
        out = []
        for name, kind, help_, v in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {v}"]
        for name, h, help_ in (("k2jax_time_to_first_token_seconds", self.ttft, "arrival to first token"),
                               ("k2jax_step_seconds", self.step_time, "one engine step (prefill + decode)"),
                               ("k2jax_request_queue_time_seconds", self.queue_time, "arrival to a slot"),
                               ("k2jax_e2e_request_latency_seconds", self.e2e, "arrival to the last token"),
                               ("k2jax_inter_token_latency_seconds", self.itl, "between two tokens of a choice")):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *h.lines(name)]
        return "\n".join(out) + "\n"
