"""GET /metrics: the host's HTTP API and its session in Prometheus' text format (prometheus_client).

Two sources. What the API sees as requests run is counted by :class:`ApiMetrics` (one per HTTP
server; `handle` in kafilad/control/openai_api.py meters every request, and api_common's
`generate_whole` / `stream_generation` meter each generation through `metered`). What the session
knows is read from the daemon's status (`Node.status()`, kafilad/proto/status.py: the `kafila-ctl
status --json` document) at each scrape (:class:`SnapshotCollector`), so it never goes stale:

```
kafila_http_requests_total{route, method, code}        answers by route template ("other" for unknown
                                                       paths) and status; code "gone": the client left first
kafila_generations_total{route, outcome}               generation requests by outcome: stop, length,
                                                       client_gone, busy (429), refused (400), failed
kafila_prompt_tokens_total{route}                      prompt tokens of finished generations
kafila_generated_tokens_total{route}                   tokens generated (a request a client left counts its own)
kafila_time_to_first_token_seconds{route}              histogram: request read -> first token handed to the answer
kafila_inter_token_seconds{route}                      histogram: between consecutive tokens of one request
kafila_generation_seconds{route}                       histogram: request read -> generation's end
kafila_session_state{state}                            1 for the session's state (every HostState listed), none: idle
kafila_session_info{session_id, model}                 1 while a session is hosted
kafila_requests_running / _queued, kafila_concurrency, kafila_queue_limit      the admission queue (gauges)
kafila_replans_total                                   plans made after the session's first (its plan epoch - 1)
kafila_members{status}                                 members ready / lost / standby / other
kafila_stage_predicted_step_seconds{member}            the plan's decode step time per stage
kafila_stage_measured_step_seconds{member}             the median decode step measured on the last request
kafila_edge_path{from, to, path}                       1 per ring edge with its path kind (direct, relayed, pending, ...)
kafila_edge_rtt_seconds{from, to}                      measured round-trip time per edge (where measured)
kafila_edge_sent_bytes_total{from, to}                 ring bytes the edge's sender sent for finished requests
kafila_last_generation_tokens_per_second               decode speed of the last finished request (when known)
kafila_prompt_cached_tokens_total{route}               prompt tokens finished generations took from the prompt cache
kafila_prompt_cache_enabled, _hits_total, _saved_tokens_total, _entries, _tokens, _budget_tokens
                                                       the head's prompt cache (status "prompt_cache"; hits and
                                                       tokens saved count from the session's start)
kafila_speculation_enabled, _passes_total, _drafted_tokens_total, _accepted_tokens_total, _plain_passes_total,
kafila_speculation_acceptance_ratio, _gain_ratio  the head's speculative decoding (status "speculation")
```
Counters of the API start at zero with the daemon (Prometheus handles the reset of a restart);
`route` is a route template, never a client's path, so label sets stay bounded. Requests the
HTTP server refuses before any handler sees them (431, 413, 408, 503 when full:
kafilad/control/http_server.py) are not counted here. The time to first token runs from the
request read, so it includes the wait in the host's queue and the prompt's tokenizing.
"""

from __future__ import annotations

import contextvars
import time
from typing import Awaitable, Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kafilad.errors import ContextTooLongError, GenerationCancelled, HostBusyError, KafilaError
from kafilad.proto.status import HostStatus, NodeStatus

#: what GET /metrics answers with (the text format every Prometheus scrapes)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
#: histogram buckets (s): a first token takes a prefill over the ring; tokens come every step
TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GENERATION_BUCKETS_S = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: the session states listed under kafila_session_state (kafilad/proto/session_events.py HostState)
SESSION_STATES = ("starting", "forming", "planning", "loading", "ready", "recovering", "degraded", "failed",
                  "closed")


class ApiMetrics:
    """The event counters and histograms of one HTTP API (module docstring); `render` answers a scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kafila_http_requests", "HTTP requests answered, by route template and status.",
                                ["route", "method", "code"], registry=r)
        self.generations = Counter("kafila_generations", "Generation requests by outcome.", ["route", "outcome"],
                                   registry=r)
        self.prompt_tokens = Counter("kafila_prompt_tokens", "Prompt tokens of finished generations.", ["route"],
                                     registry=r)
        self.generated_tokens = Counter("kafila_generated_tokens", "Tokens generated.", ["route"], registry=r)
        self.cached_tokens = Counter("kafila_prompt_cached_tokens", "Prompt tokens taken from the prompt cache "
                                     "(not prefilled again) by finished generations.", ["route"], registry=r)
        self.ttft = Histogram("kafila_time_to_first_token_seconds", "From the request read to its first token.",
                              ["route"], buckets=TTFT_BUCKETS_S, registry=r)
        self.inter_token = Histogram("kafila_inter_token_seconds", "Between consecutive tokens of one request.",
                                     ["route"], buckets=INTER_TOKEN_BUCKETS_S, registry=r)
        self.duration = Histogram("kafila_generation_seconds", "From the request read to its generation's end.",
                                  ["route"], buckets=GENERATION_BUCKETS_S, registry=r)

    def render(self, status: Optional[NodeStatus]) -> bytes:
        """The text a scrape gets: these metrics, then the status's (None: the API's alone)."""
        out = generate_latest(self.registry)
        if status is not None:
            scrape = CollectorRegistry(auto_describe=False)
            scrape.register(SnapshotCollector(status))
            out += generate_latest(scrape)
        return out


class RequestMeter:
    """One request's metering: its route label and when it was read (`time.perf_counter()` s)."""

    def __init__(self, metrics: ApiMetrics, route: str, method: str, clock: Callable[[], float] = time.perf_counter):
        self.metrics, self.route, self.method, self.clock = metrics, route, method, clock
        self.t0_s = clock()

    def answered(self, code: str) -> None:
        """Count the answer: an HTTP status ("200"), or "gone" when the client left before one."""
        self.metrics.requests.labels(self.route, self.method, code).inc()


#: the meter of the request the current trio task serves (set by openai_api.handle for each request)
CURRENT: contextvars.ContextVar[Optional[RequestMeter]] = contextvars.ContextVar("kafila_request_meter",
                                                                                 default=None)


Generate = Callable[[Callable[[dict], Awaitable[None]]], Awaitable[dict]]


def metered(generate: Generate, meter: Optional[RequestMeter] = None) -> Generate:
    """`generate(emit)` (api_common) that also feeds the request's meter (`CURRENT` when not given):
    time to first token, time between tokens, tokens in and out, the outcome. Without a meter
    `generate` itself."""
    meter = meter or CURRENT.get()
    if meter is None:
        return generate
    m, route = meter.metrics, meter.route

    async def run(emit: Callable[[dict], Awaitable[None]]) -> dict:
        last: list[Optional[float]] = [None]
        seen = [0]

        async def on_event(ev: dict) -> None:
            if ev.get("token_id") is not None:
                now = meter.clock()
                if last[0] is None:
                    m.ttft.labels(route).observe(now - meter.t0_s)
                else:
                    m.inter_token.labels(route).observe(now - last[0])
                last[0] = now
                seen[0] += 1
            await emit(ev)

        try:
            result = await generate(on_event)
        except GenerationCancelled as e:
            m.generations.labels(route, "client_gone").inc()
            m.generated_tokens.labels(route).inc(e.tokens or seen[0])
            raise
        except HostBusyError:
            m.generations.labels(route, "busy").inc()
            raise
        except KafilaError as e:
            outcome = "refused" if isinstance(e, ContextTooLongError) else "failed"
            m.generations.labels(route, outcome).inc()
            m.generated_tokens.labels(route).inc(seen[0])
            raise
        m.generations.labels(route, str(result.get("finish_reason") or "stop")).inc()
        m.prompt_tokens.labels(route).inc(int(result.get("prompt_tokens") or 0))
        m.cached_tokens.labels(route).inc(int(result.get("cached_tokens") or 0))
        m.generated_tokens.labels(route).inc(len(result.get("token_ids") or ()))
        m.duration.labels(route).observe(meter.clock() - meter.t0_s)
        return result

    return run


class SnapshotCollector:
    """The session's gauges and counters from one status snapshot (module docstring).

    Args:
        status: the daemon's status (kafilad/proto/status.py NodeStatus, ``Node.status()``).
    """

    def __init__(self, status: NodeStatus):
        self.status = status

    def collect(self) -> Iterable:
        state = self.status.state
        s = self.status.session
        states = GaugeMetricFamily("kafila_session_state", "1 for the hosted session's state.", labels=["state"])
        if isinstance(s, HostStatus):
            for name in SESSION_STATES if state in SESSION_STATES else (*SESSION_STATES, str(state)):
                states.add_metric([name], 1.0 if name == state else 0.0)
        yield states
        if not isinstance(s, HostStatus):
            return
        info = GaugeMetricFamily("kafila_session_info", "1 while a session is hosted.",
                                 labels=["session_id", "model"])
        info.add_metric([str(s.session_id or ""), str(s.model_id or "")], 1.0)
        yield info
        if s.requests is not None:
            req = s.requests
            for value, name, doc in (
                    (req.running, "kafila_requests_running", "Requests running on the ring."),
                    (req.queued, "kafila_requests_queued", "Requests waiting for their turn (queue depth)."),
                    (req.concurrency, "kafila_concurrency", "Requests the session runs at once."),
                    (req.queue_limit, "kafila_queue_limit", "Requests that may wait past those.")):
                if isinstance(value, (int, float)):
                    yield GaugeMetricFamily(name, doc, value=float(value))
        if isinstance(s.epoch, int):
            yield CounterMetricFamily("kafila_replans", "Plans made after the session's first.",
                                      value=float(max(0, s.epoch - 1)))
        yield from self._members(s.members)
        yield from self._edges(s.edges)
        yield from self._prompt_cache(s.prompt_cache)
        yield from self._speculation(s.speculation)
        last = s.last_generation or {}
        if isinstance(last.get("decode_tokens_per_s"), (int, float)):
            yield GaugeMetricFamily("kafila_last_generation_tokens_per_second",
                                    "Decode speed of the last finished request.",
                                    value=float(last["decode_tokens_per_s"]))

    @staticmethod
    def _prompt_cache(cache: Optional[dict]) -> Iterable:
        """The head's prompt cache (kafilad/executor/prefix.py) when the host is the head."""
        if not isinstance(cache, dict):
            return
        yield GaugeMetricFamily("kafila_prompt_cache_enabled", "1 while the session keeps a prompt cache.",
                                value=1.0 if cache.get("on") else 0.0)
        for key, fam in (("hits", CounterMetricFamily("kafila_prompt_cache_hits", "Requests that reused a cached "
                                                      "prefix (this session).")),
                         ("tokens_saved", CounterMetricFamily("kafila_prompt_cache_saved_tokens", "Prompt tokens "
                                                              "not prefilled again (this session).")),
                         ("entries", GaugeMetricFamily("kafila_prompt_cache_entries", "Prefixes cached.")),
                         ("entry_tokens", GaugeMetricFamily("kafila_prompt_cache_tokens", "Tokens cached.")),
                         ("budget_tokens", GaugeMetricFamily("kafila_prompt_cache_budget_tokens",
                                                             "Tokens the plan admitted for the cache."))):
            if isinstance(cache.get(key), (int, float)):
                fam.add_metric([], float(cache[key]))
                yield fam

    @staticmethod
    def _speculation(spec: Optional[dict]) -> Iterable:
        """The head's speculative decoding (kafilad/node/serving/drafts.py `Drafter.status`) when the host is the head."""
        if not isinstance(spec, dict):
            return
        yield GaugeMetricFamily("kafila_speculation_enabled", "1 while the head speculates (drafts decode tokens).",
                                value=1.0 if spec.get("on") else 0.0)
        for key, fam in (("passes", CounterMetricFamily("kafila_speculation_passes", "Decode passes that carried "
                                                        "drafts, a batched one once per row (this session).")),
                         ("batch_passes", CounterMetricFamily("kafila_speculation_batch_passes", "Drafted decode "
                                                              "passes of a lockstep batch (this session).")),
                         ("drafted", CounterMetricFamily("kafila_speculation_drafted_tokens", "Draft tokens sent round "
                                                         "the ring (this session).")),
                         ("accepted", CounterMetricFamily("kafila_speculation_accepted_tokens", "Draft tokens the head "
                                                          "accepted (this session).")),
                         ("plain_passes", CounterMetricFamily("kafila_speculation_plain_passes", "Decode passes of "
                                                              "speculating requests that carried no drafts.")),
                         ("acceptance", GaugeMetricFamily("kafila_speculation_acceptance_ratio", "Drafts accepted "
                                                          "/ drafts sent.")),
                         ("gain", GaugeMetricFamily("kafila_speculation_gain_ratio", "Tokens/s of drafted passes ÷ "
                                                    "of plain ones (when both were timed)."))):
            if isinstance(spec.get(key), (int, float)):
                fam.add_metric([], float(spec[key]))
                yield fam

    @staticmethod
    def _members(members: tuple) -> Iterable:
        counts = {"ready": 0, "lost": 0, "standby": 0, "other": 0}
        predicted = GaugeMetricFamily("kafila_stage_predicted_step_seconds", "The plan's decode step time per stage.",
                                      labels=["member"])
        measured = GaugeMetricFamily("kafila_stage_measured_step_seconds",
                                     "Median decode step measured per stage on the last request.", labels=["member"])
        for m in members:
            kind = "lost" if getattr(m, "lost", None) else "standby" if getattr(m, "standby", False) \
                else "ready" if getattr(m, "ready", False) else "other"
            counts[kind] += 1
            name = str(m.name)
            if isinstance(m.predicted_stage_s, (int, float)):
                predicted.add_metric([name], float(m.predicted_stage_s))
            if isinstance(m.measured_stage_s, (int, float)):
                measured.add_metric([name], float(m.measured_stage_s))
        fam = GaugeMetricFamily("kafila_members", "Members of the session by status.", labels=["status"])
        for k, n in counts.items():
            fam.add_metric([k], float(n))
        yield fam
        yield predicted
        yield measured

    @staticmethod
    def _edges(edges: list) -> Iterable:
        path = GaugeMetricFamily("kafila_edge_path", "1 per ring edge, labelled with its path kind.",
                                 labels=["from", "to", "path"])
        rtt = GaugeMetricFamily("kafila_edge_rtt_seconds", "Measured round-trip time per ring edge.",
                                labels=["from", "to"])
        sent = CounterMetricFamily("kafila_edge_sent_bytes", "Ring bytes the edge's sender sent for finished requests.",
                                   labels=["from", "to"])
        for e in edges:
            if not isinstance(e, dict):
                continue
            ends = [str(e.get("from")), str(e.get("to"))]
            path.add_metric([*ends, str(e.get("path") or "pending")], 1.0)
            if isinstance(e.get("rtt_ms"), (int, float)):
                rtt.add_metric(ends, float(e["rtt_ms"]) / 1000.0)
            if isinstance(e.get("bytes_sent"), (int, float)):
                sent.add_metric(ends, float(e["bytes_sent"]))
        yield path
        yield rtt
        yield sent


__all__ = ["ApiMetrics", "RequestMeter", "CURRENT", "metered", "SnapshotCollector", "CONTENT_TYPE", "SESSION_STATES"]
