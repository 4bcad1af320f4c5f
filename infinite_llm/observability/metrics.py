"""Prometheus metrics of each service (prometheus-client), named like vLLM's with our ``infinite_llm:`` prefix.

Each service builds its own ``CollectorRegistry`` (so several services can live in one test process) and
serves it with :func:`serve_metrics` on its ``--metrics-port``. vLLM names kept: ``num_requests_running``,
``num_requests_waiting``, ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``e2e_request_latency_seconds``, ``request_queue_time_seconds``, ``prompt_tokens_total``,
``generation_tokens_total``, ``num_preemptions_total``, ``request_success_total``. Ours: rBlocks per
attention server, remote attention RPC latency per server, placements, releases and migrations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)
P = "infinite_llm:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def serve_metrics(registry: CollectorRegistry, port: int, host: str) -> int | None:
    """Serve ``/metrics`` over HTTP on ``host:port`` (the service's own interface; port 0 = off)."""
    if not port:
        return None
    server, _ = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return server.server_port


class EngineMetrics:
    """Compute instance: request latencies, token counts, queue sizes, preemptions, remote attention RPCs."""

    def __init__(
        self,
        registry: CollectorRegistry,
        running: Callable[[], int],
        waiting: Callable[[], int],
        preemptions: Callable[[], int],
        prefix_cache: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        """``prefix_cache()``: the engine's running totals ``(queries, hits)`` in tokens (synced as counters)."""
        self.registry = registry
        Gauge(P + "num_requests_running", "Sequences in the running batch", registry=registry).set_function(running)
        Gauge(P + "num_requests_waiting", "Sequences waiting to be scheduled", registry=registry).set_function(waiting)
        self.ttft = Histogram(
            P + "time_to_first_token_seconds", "Arrival to first token", registry=registry, buckets=LATENCY_BUCKETS
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "Time between tokens of a request",
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds", "Arrival to finish", registry=registry, buckets=LATENCY_BUCKETS
        )
        self.queue = Histogram(
            P + "request_queue_time_seconds",
            "Arrival to first scheduled step",
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", registry=registry)
        self.success = Counter(P + "request_success", "Finished requests", ["finished_reason"], registry=registry)
        self._preemptions = preemptions
        self.preemptions = Counter(P + "num_preemptions", "Sequences preempted (recomputed later)", registry=registry)
        self._seen_preemptions = 0
        self.step_recoveries = Counter(
            P + "step_recoveries",
            "Steps an attention server failed or refused, after which every running sequence was recomputed",
            registry=registry,
        )
        self.attention_rpc = Histogram(
            P + "attention_rpc_latency_seconds",
            "One layer of one step on one attention server (AttendStream round trip)",
            ["server_id"],
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self.step_seconds = Histogram(
            P + "engine_step_seconds",
            "Wall time of one engine step (the whole batch's forward and sampling; aborted steps excluded)",
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        # live migration's pace (services/compute/migration.py): its cost is moving / (moving + stepping)
        self.migration_seconds = Counter(
            P + "migration_seconds",
            "Engine-thread time spent moving rBlocks of live migrations between steps",
            registry=registry,
        )
        self.migration_step_seconds = Counter(
            P + "migration_step_seconds",
            "Wall time of the steps run while a live migration was moving rBlocks (its moving excluded)",
            registry=registry,
        )
        self.migration_steps = Counter(
            P + "migration_steps", "Steps run while a live migration was moving rBlocks", registry=registry
        )

        # vLLM v1's names and units: tokens looked up in the prefix cache, and of those, tokens it served
        self.prefix_cache_queries = Counter(
            P + "prefix_cache_queries", "Prefix cache queries, in tokens", registry=registry
        )
        self.prefix_cache_hits = Counter(P + "prefix_cache_hits", "Prefix cache hits, in tokens", registry=registry)
        self._prefix_cache = prefix_cache
        self._seen_prefix = (0, 0)

    def sync_preemptions(self) -> None:
        """Bring the counters read from the engine (preemptions, prefix cache tokens) up to date."""
        now = self._preemptions()
        if now > self._seen_preemptions:
            self.preemptions.inc(now - self._seen_preemptions)
            self._seen_preemptions = now
        if self._prefix_cache is not None:
            queries, hits = self._prefix_cache()
            self.prefix_cache_queries.inc(max(queries - self._seen_prefix[0], 0))
            self.prefix_cache_hits.inc(max(hits - self._seen_prefix[1], 0))
            self._seen_prefix = (queries, hits)


class AttentionMetrics:
    """Attention server: its rBlocks (used / free / reserved), sequences, per-layer AttendStream time."""

    def __init__(self, registry: CollectorRegistry, server_id: str, stats: Callable[[], object]) -> None:
        labels = {"server_id": server_id}
        for name, doc, field in (
            ("rblocks_used", "rBlocks committed to sequences", "num_used"),
            ("rblocks_free", "rBlocks on the free list", "num_free"),
            ("rblocks_reserved", "rBlocks reserved, not yet committed", "num_reserved"),
            ("rblock_sequences", "Sequences holding rBlocks here", "num_sequences"),
            ("rblocks_cached", "rBlocks in the prefix cache (read or parked)", "num_cached"),
        ):
            g = Gauge(P + name, doc, ["server_id"], registry=registry)
            g.labels(**labels).set_function(lambda f=field: getattr(stats(), f))
        self.attend_step = Histogram(
            P + "attend_step_seconds",
            "Server time of one layer of an AttendStream step",
            ["server_id"],
            registry=registry,
            buckets=LATENCY_BUCKETS,
        ).labels(**labels)


class ManagerMetrics:
    """Global manager: placements, releases, migrations, and the capacity view per server."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.placements = Counter(P + "placements", "Successful Place calls", registry=registry)
        self.placed_rblocks = Counter(P + "placed_rblocks", "rBlocks placed", registry=registry)
        self.placement_failures = Counter(P + "placement_failures", "Place calls refused (capacity)", registry=registry)
        # a member that keeps retrying: another model, dtype or block size, or an id held by another identity
        self.registrations_refused = Counter(
            P + "registrations_refused",
            "Registrations refused (FAILED_PRECONDITION, PERMISSION_DENIED) by member kind",
            ["kind"],
            registry=registry,
        )
        self.releases = Counter(P + "releases", "Sequences released", registry=registry)
        self.migrations = Counter(P + "migrations", "rBlock migrations between servers", registry=registry)
        self.migrated_rblocks = Counter(P + "migrated_rblocks", "rBlocks moved by migrations", registry=registry)
        self.migrated_bytes = Counter(P + "migrated_bytes", "KV bytes moved by migrations", registry=registry)
        self.reattached_rblocks = Counter(
            P + "reattached_rblocks",
            "Block-table entries of other readers re-attached to a shared rBlock a migration moved",
            registry=registry,
        )
        self.view_free = Gauge(
            P + "cluster_rblocks_free", "Free rBlocks per server (manager's view)", ["server_id"], registry=registry
        )
        self.view_capacity = Gauge(
            P + "cluster_rblocks_capacity", "Capacity per server in rBlocks", ["server_id"], registry=registry
        )
        # 1 on the leading manager, 0 on a hot standby (whose other series are zeros: filter on this one)
        self.leader = Gauge(
            P + "manager_is_leader", "1 while this manager leads, 0 while it stands by", registry=registry
        )
        # refused admissions waiting their turn, first come, first served across compute instances (admissions.py)
        self.admission_claims = Gauge(
            P + "admission_claims",
            "Waiting sequences whose admission was refused (each holds later admissions back for its first 30 s)",
            registry=registry,
        )
        self.admission_claimed_rblocks = Gauge(
            P + "admission_claimed_rblocks", "rBlocks the waiting admission claims ask for", registry=registry
        )
        # vLLM's kv_cache_usage_perc, over the whole pool: set_function'd by the servicer (live members only)
        self.kv_cache_usage = Gauge(
            P + "kv_cache_usage_perc",
            "KV memory used over every live attention server, 0 to 1 (rBlocks placed or reserved / capacity)",
            registry=registry,
        )


class RouterMetrics:
    """Router: requests by outcome, in flight per compute instance."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(P + "router_requests", "Generate calls by final status", ["status"], registry=registry)
        self.in_flight = Gauge(
            P + "router_requests_in_flight", "Requests in flight per compute instance", ["instance"], registry=registry
        )
        self.generation_tokens = Counter(P + "router_generation_tokens", "Tokens relayed to clients", registry=registry)
