"""The server's Prometheus metrics, written in the text exposition format (no dependency).

With data-parallel replicas every metric a replica produces is reported twice over: the total
(no label, as a single-engine server reports it: dashboards need not change) and once per
replica (label `replica="i"`); the totals are the sums of the replicas' series. Rejections
(`tabed_rejected_requests_total`) happen at the front, most before a replica is chosen: total only."""
from __future__ import annotations

import bisect
import copy
from collections import defaultdict


class Counter:
    """A monotonically increasing count, optionally split by one label."""

    def __init__(self, name: str, help: str, label: str = ""):
        self.name, self.help, self.label = name, help, label
        self.values: dict[str, float] = defaultdict(float)

    def inc(self, amount: float = 1.0, value: str = ""):
        self.values[value] += amount

    def add(self, other: "Counter"):
        """Add another counter's counts (a replica's) to this one."""
        for v, n in other.values.items():
            self.values[v] += n

    def total(self) -> float:
        """The count summed over the label's values."""
        return sum(self.values.values())

    def render(self, extra: str = "", header: bool = True) -> list[str]:
        """The exposition lines; `extra`: one more label (`replica="0"`) on every sample."""
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"] if header else []
        for v, n in sorted(self.values.items()) or [("", 0.0)]:
            labels = ",".join(filter(None, [f'{self.label}="{v}"' if self.label and v else "", extra]))
            lines.append(f"{self.name}{{{labels}}} {n:g}" if labels else f"{self.name} {n:g}")
        return lines


class Histogram:
    """Observations counted into cumulative `le` buckets, with their sum and count."""

    def __init__(self, name: str, help: str, buckets: list[float]):
        self.name, self.help, self.buckets = name, help, sorted(buckets)
        self.counts = [0] * (len(self.buckets) + 1)    # the last one: above every bucket
        self.sum = 0.0

    def observe(self, x: float):
        self.counts[bisect.bisect_left(self.buckets, x)] += 1
        self.sum += x

    @property
    def count(self) -> int:
        return sum(self.counts)

    def add(self, other: "Histogram"):
        """Add another histogram's observations (a replica's, same buckets) to this one."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.sum += other.sum

    def render(self, extra: str = "", header: bool = True) -> list[str]:
        """The exposition lines; `extra`: one more label (`replica="0"`) on every sample."""
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"] if header else []
        pre, braces = (extra + ",", f"{{{extra}}}") if extra else ("", "")
        total = 0
        for le, n in zip(self.buckets + [float("inf")], self.counts):
            total += n
            lines.append(f'{self.name}_bucket{{{pre}le="{"+Inf" if le == float("inf") else f"{le:g}"}"}} {total}')
        lines += [f"{self.name}_sum{braces} {self.sum:g}", f"{self.name}_count{braces} {total}"]
        return lines


def hit_rate_lines(cached: float, prompt: float) -> list[str]:
    """The prefix cache's hit rate as a gauge: prompt tokens served from cached KV over all prompt
    tokens of finished requests (0 before any)."""
    return ["# HELP tabed_prefix_cache_hit_rate Prompt tokens of finished requests whose prefill a cached "
            "prefix saved, over all their prompt tokens.", "# TYPE tabed_prefix_cache_hit_rate gauge",
            f"tabed_prefix_cache_hit_rate {cached / prompt if prompt else 0.0:g}"]


_SECONDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class ServerMetrics:
    """Everything /metrics reports. Updated from the event loop's thread only. `replicas`: the
    number of data-parallel replicas, each with a ServerMetrics of its own in `self.replicas`
    (their front's own series then count only rejections)."""

    def __init__(self, replicas: int = 0):
        self.requests = Counter("tabed_requests_total", "Finished requests by finish reason.", "finish_reason")
        self.rejected = Counter("tabed_rejected_requests_total", "Requests refused with an HTTP error, "
                                "by status.", "status")
        self.prompt_tokens = Counter("tabed_prompt_tokens_total", "Prompt tokens of finished requests "
                                     "(image tokens included).")
        self.completion_tokens = Counter("tabed_completion_tokens_total", "Generated tokens.")
        self.cached_tokens = Counter("tabed_prompt_tokens_cached_total", "Prompt tokens of finished requests "
                                     "whose prefill a cached prefix saved (prefix caching).")
        self.cache_hits = Counter("tabed_prefix_cache_hits_total", "Finished requests that reused a cached "
                                  "prefix.")
        self.ttft = Histogram("tabed_time_to_first_token_seconds", "From a request's arrival to its "
                              "first generated token.", _SECONDS)
        self.itl = Histogram("tabed_inter_token_latency_seconds", "Per request: time from its first "
                             "to its last token over the tokens in between.",
                             [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0])
        self.latency = Histogram("tabed_request_latency_seconds", "From a request's arrival to its "
                                 "last token.", _SECONDS)
        self.accepted = Histogram("tabed_accepted_length", "Drafted tokens accepted per speculative "
                                  "block.", [0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16])
        self.tau = Histogram("tabed_block_efficiency", "Per speculative request: tokens per target "
                             "forward (tau).", [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0])
        self.step_outputs = Histogram("tabed_step_requests", "Requests that got tokens or finished per "
                                      "engine step (about the batch size).", [1, 2, 4, 8, 16, 32, 64, 128])
        self.running = 0
        self.replicas = [ServerMetrics() for _ in range(replicas)]
        self.routed = Counter("tabed_replica_requests_total", "Requests handed to each replica (those it "
                              "accepted).", "replica")
        for i in range(replicas):
            self.routed.values[str(i)] = 0.0
        self.up = {i: 1 for i in range(replicas)}       # replica -> 1 serving, 0 dead

    def _per_replica(self) -> tuple:
        return (self.requests, self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.cache_hits,
                self.ttft, self.itl, self.latency, self.accepted, self.tau, self.step_outputs)

    def finished(self, out, arrival: float, first: float | None, last: float):
        """Record one finished request (`out`: its GenerationOutput; times from perf_counter)."""
        self.requests.inc(value=out.finish_reason)
        s = out.stats
        self.prompt_tokens.inc(s.prompt_tokens)
        self.completion_tokens.inc(len(out.token_ids))
        self.cached_tokens.inc(s.cached_tokens)
        self.cache_hits.inc(float(s.cached_tokens > 0))
        if first is None:
            return
        self.ttft.observe(first - arrival)
        self.latency.observe(last - arrival)
        if len(out.token_ids) > 1:
            self.itl.observe((last - first) / (len(out.token_ids) - 1))
        if s.speculative and s.target_forwards:
            for a in s.accepted_lengths:
                self.accepted.observe(a)
            self.tau.observe(s.block_efficiency)

    def render(self) -> str:
        if self.replicas:
            return self._render_replicas()
        lines = ["# HELP tabed_requests_running Requests in the engine now.",
                 "# TYPE tabed_requests_running gauge", f"tabed_requests_running {self.running}"]
        for m in (self.requests, self.rejected, self.prompt_tokens, self.completion_tokens, self.cached_tokens,
                  self.cache_hits, self.ttft, self.itl, self.latency, self.accepted, self.tau, self.step_outputs):
            lines += m.render()
        lines += hit_rate_lines(self.cached_tokens.total(), self.prompt_tokens.total())
        return "\n".join(lines) + "\n"

    def _render_replicas(self) -> str:
        """Each metric's total (the sum over the replicas) and then its per-replica series."""
        label = [f'replica="{i}"' for i in range(len(self.replicas))]
        running = [r.running for r in self.replicas]
        lines = ["# HELP tabed_requests_running Requests in the engines now.", "# TYPE tabed_requests_running gauge",
                 f"tabed_requests_running {sum(running)}"]
        lines += [f"tabed_requests_running{{{lab}}} {n}" for lab, n in zip(label, running)]
        lines += ["# HELP tabed_replica_up Whether each data-parallel replica serves (1) or died (0).",
                  "# TYPE tabed_replica_up gauge"] + [f"tabed_replica_up{{{lab}}} {self.up[i]}"
                                                      for i, lab in enumerate(label)]
        lines += self.routed.render()
        lines += self.rejected.render()
        sums = {}
        for k, total in enumerate(self._per_replica()):
            total = copy.deepcopy(total)
            for rep in self.replicas:
                total.add(rep._per_replica()[k])
            lines += total.render()
            sums[total.name] = total
            for rep, lab in zip(self.replicas, label):
                lines += rep._per_replica()[k].render(extra=lab, header=False)
        lines += hit_rate_lines(sums[self.cached_tokens.name].total(), sums[self.prompt_tokens.name].total())
        return "\n".join(lines) + "\n"
