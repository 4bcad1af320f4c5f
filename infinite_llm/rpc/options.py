"""Channel and server options in one place, so both ends of every connection agree.

Sizes are bytes, times are seconds unless the option name says ``_ms``.
"""

from __future__ import annotations

import json
import re

# A prefill chunk's AttendStream layer carries queries [tokens, heads, head_dim] plus new K/V: 2048 tokens of a
# 32-head, 128-dim fp32 model is ~32 MiB of queries alone. gRPC's default receive limit (4 MiB) would
# refuse it; 256 MiB leaves headroom. Bulk transfers (migration) stream ~1 MiB chunks instead.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# Keepalive: a client pings an idle connection every 30 s and drops it after 10 s without an answer, so a
# dead peer is noticed in < 1 min. The server accepts pings every 10 s (it would otherwise answer a
# ping-happy client with GOAWAY "too_many_pings").
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_PING_INTERVAL_MS = 10_000

# Reconnect quickly to a peer that was down (gRPC's default backoff grows to 120 s, so a router that started
# before its compute instance finished loading would refuse requests for minutes). Times in ms. Only the
# initial and the maximum backoff are set: C-core reads grpc.min_reconnect_backoff_ms as the time a
# connection attempt may take (MIN_CONNECT_TIMEOUT, default 20 s, doc/connection-backoff.md), so setting it
# to 250 ms failed TCP + TLS handshakes that took longer on a busy machine ("connection attempt timed out
# before receiving SETTINGS frame"; grpc/grpc#33423).
RECONNECT_BACKOFF_MS = (250, 2_000)  # first, most

DEFAULT_TIMEOUT_S = 30.0  # deadline of a call that names none (DESIGN.md §4: every call has a deadline)
# A compute instance keeps one AttendStream per attention server for many steps (StepEnd between them), so
# that a step opens no call (the blocking gRPC API starts two threads per call). Each stream's deadline is
# this long (seconds); a stream is not given a step that could outlive it, and each step keeps its own
# deadline on the client. The server advertises StepEnd support in the stream's initial metadata.
STREAM_LIFETIME_S = 600.0
STEPS_PER_STREAM_KEY = "infinite-llm-steps-per-stream"
STEPS_PER_STREAM_MANY = "many"
DEFAULT_GRACE_S = 5.0  # server.stop(grace): in-flight calls get this long to finish
# After SIGTERM a service process refuses new calls (health NOT_SERVING) and gives those in flight this long
# to finish (seconds): the pods' terminationGracePeriodSeconds. ``serve ... --shutdown-grace``.
SHUTDOWN_GRACE_S = 30.0
# Before that, an attention server holding rBlocks waits up to this long for the manager to migrate them to
# other servers (seconds; ``serve attention --drain-timeout``, services/attention/server.py).
DRAIN_TIMEOUT_S = 60.0

# The global manager's gRPC service: of the managers a client's target lists (a headless Service's pods, or
# ``ipv4:HOST:PORT,HOST:PORT``), only the leader reports it SERVING (standbys: NOT_SERVING).
MANAGER_SERVICE = "infinite_llm.v1.GlobalManager"
# A client following a leader re-resolves its target's DNS name at most this often (milliseconds; gRPC's
# default is 30 s, so a manager pod that replaced both old ones during a rollout would stay unknown that long).
DNS_RERESOLVE_MS = 2_000
# Keepalive of those clients (time, timeout; ms): a frozen manager (SIGSTOP, a paused VM, a stuck node) keeps
# its connections open and its health stream silent, so health checking would count it SERVING and round
# robin would send it every other call until the usual keepalive (30 s + 10 s) gave up on it, which calls to
# it keep postponing (each restarts the keepalive timer). An idle connection is pinged every 2 s, and any
# ping (gRPC also pings beside calls) not answered within 5 s drops it: the frozen manager leaves the pick
# list within ~7 s, before a standby can lead (the leader's 10 s session lease), so members' heartbeats
# reach the new leader in time. Pings are answered by gRPC's own threads, not the manager's event loop, so a
# busy manager is not mistaken for a frozen one.
MANAGER_KEEPALIVE_MS = (2_000, 5_000)

Options = list[tuple[str, int | str]]
# The GlobalManager calls that change nothing, and their retry policy on manager channels (gRPC service config).
READ_ONLY = ("GetClusterState", "ListComputeInstances")
READ_RETRY = {
    "maxAttempts": 3,
    "initialBackoff": "0.1s",
    "maxBackoff": "0.5s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}


def _common() -> Options:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def server_options() -> Options:
    """Options of every server. ``so_reuseport=0``: a second server on a taken port fails to bind."""
    return _common() + [
        ("grpc.so_reuseport", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def channel_options() -> Options:
    """Options of every client channel."""
    return _common() + [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ]


def serving_only(service: str = MANAGER_SERVICE) -> Options:
    """Channel options that send every call to a backend whose ``grpc.health.v1`` reports ``service`` SERVING.

    gRPC's client-side health checking (``healthCheckConfig``) over ``round_robin``: the channel connects to
    every address its target resolves to (a DNS name with one address per replica, such as a headless
    Kubernetes Service, or ``ipv4:HOST:PORT,HOST:PORT``), watches each one's health, and picks only among
    those SERVING. With one leading global manager and hot standbys (``serve manager --standby``), calls reach
    the leader wherever it runs, and move to the next one as soon as it reports SERVING; a frozen one leaves
    the pick list within a few seconds (``MANAGER_KEEPALIVE_MS``). A single
    ``HOST:PORT`` target behaves as before. No backend SERVING: calls fail with UNAVAILABLE ("backend
    unhealthy") unless they wait for ready. The read-only calls (``READ_ONLY``) are retried on UNAVAILABLE
    (``READ_RETRY``), each attempt picking again: an old leader that resumed after a freeze still reports
    SERVING for a moment, and refuses them as a standby. Reference: gRPC ``doc/health-checking.md`` (client-side).
    """
    config = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": service},
        "methodConfig": [{"name": [{"service": service, "method": m} for m in READ_ONLY], "retryPolicy": READ_RETRY}],
    }
    return [
        ("grpc.service_config", json.dumps(config, separators=(",", ":"))),
        ("grpc.dns_min_time_between_resolutions_ms", DNS_RERESOLVE_MS),
        ("grpc.keepalive_time_ms", MANAGER_KEEPALIVE_MS[0]),
        ("grpc.keepalive_timeout_ms", MANAGER_KEEPALIVE_MS[1]),
        ("grpc.http2.max_pings_without_data", 0),  # the health stream is quiet: keep pinging without data
        ("grpc.http2.ping_timeout_ms", MANAGER_KEEPALIVE_MS[1]),  # every ping, not only keepalive's
    ]


def merged(*option_lists: Options) -> Options:
    """The options of every list, a later list's value winning for a name they share."""
    return list({name: value for options in option_lists for name, value in options}.items())


_TRAILING_PORT = re.compile(r":(\d+)$")


def check_target(target: str) -> str:
    """Return ``target`` (a gRPC target: ``host:port``, ``[v6]:port``, ``dns:///name:port``,
    ``ipv4:a:port,b:port``) unless one of its addresses names a port above 65535, which gRPC would not
    refuse but wrap (99999 dials 34463, perhaps another service).

    An empty target passes, as before: a call on it fails (an ``RpcError``, UNKNOWN), which callers treat as
    a failed call to that peer (a grant may name no address when its server left meanwhile).

    Raises:
        ValueError: a port out of range.
    """
    for address in target.split(","):
        port = _TRAILING_PORT.search(address.strip())
        if port is not None and int(port.group(1)) > 65535:
            raise ValueError(f"{target!r}: port {int(port.group(1))} is out of range (0 to 65535)")
    return target
