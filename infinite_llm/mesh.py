"""The local mesh: etcd, the global manager, N attention servers, M compute instances, the router and the
OpenAI-compatible REST gateway as real processes on loopback (``infinite-llm up``; also the tests' and
benchmarks' fixture).

Each service is ``python -m infinite_llm.cli serve <role> ...`` on a free port; ``start`` returns when every
one answers the standard gRPC health check with SERVING (the gateway: HTTP ``GET /health`` with 200) and
every attention server and compute instance is registered with the manager. The router discovers the
compute instances from the manager (``serve router --manager``), so instances started later with
:meth:`LocalMesh.spawn_compute` take requests too. Homes: attention server ``attn-i`` is the home of compute
instance ``compute-(i mod M)``. ``stop`` sends SIGTERM (graceful drain), then SIGKILL after a grace period;
it removes the run directory ``log_dir``, or, when something failed (``keep_logs``), keeps only the logs in
it. On Linux every service and etcd also get SIGTERM when the launching process dies (``parent_death``), and
``run_dir_reaper`` then keeps only the logs, as after a failure.

One machine hosts every process, so they share its cores: every service but the compute instances runs with
one OpenMP thread, and ``service_nice`` (default 0: off) runs them at that CPU niceness (``nice(1)``; etcd
keeps this process's). Why one might: a compute instance's dense layers are OpenMP regions over every core,
each ending with its slowest thread, and a thread queued behind a busy neighbour stalls the region
(``benchmarks/neighbour_nice.py``: 3.5x on 2 cores). In the mesh the other services mostly run while the
compute instance waits for them, and on 2 cores niceness 10 measured no steadier gain than the machine's
noise (``benchmarks/mesh_overhead.py --service-nice``), so it is not the default.

mTLS is on unless ``insecure``: ``start`` writes a cluster CA and one certificate per role into
``<log_dir>/tls`` (or uses ``tls_dir``, default ``$INFINITE_LLM_TLS_DIR``, holding every role's files) and
starts each service with ``--tls-dir``; :meth:`LocalMesh.tls` gives a role's identity to callers. etcd gets
a CA of its own in ``<log_dir>/etcd-tls`` (``rpc/certs.write_etcd_tls_dir``), signing only etcd's certificate
and the manager's etcd client certificate (``serve manager --etcd-tls-dir``): etcd admits the manager and no
other certificate of the cluster, as in Kubernetes.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infinite_llm.core.config import DEFAULT_BLOCK_SIZE
from infinite_llm.core.errors import InvalidRequest, Unavailable
from infinite_llm.parent_death import dying_with_parent, unwrapped
from infinite_llm.rpc.options import MANAGER_SERVICE, SHUTDOWN_GRACE_S
from infinite_llm.rpc.tls import TLS_DIR_ENV, TlsConfig, load_tls_dir
from infinite_llm.run_dir_reaper import STOPPED, drop_made
from infinite_llm.state.etcd_launcher import EtcdProcess, EtcdTls, free_port, start_etcd

log = logging.getLogger(__name__)
HOST = "127.0.0.1"
CRASH_LOOP_WINDOW_S = 120.0  # up gives up on a service that exits more than 5 times within this (seconds)
RESTARTED_ROLES = ("manager", "compute", "router", "gateway")  # Deployments in Kubernetes: restarted on a crash
SERVICE_NICE = 0  # CPU niceness of every local service but the compute instances (module docstring)


# Options the mesh passes its services only as its own defaults, with no `up` option of their own: a config
# file's `serve: <role>:` value replaces them (the flag is left out). Every other option the mesh passes is
# refused in the file (its `up` flag decides it).
MESH_DEFAULTS = frozenset(
    {"max_num_seqs", "max_num_batched_tokens", "max_waiting", "discovery_interval", "member_ttl", "shutdown_grace"}
)


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the local mesh. ``kv_memory_bytes`` is per attention server (bytes)."""

    attention_servers: int = 3
    compute_instances: int = 1
    kv_memory_bytes: int = 64 << 20
    router_port: int = 50051  # 0 = any free one
    # The compute instances' weights and activations and the attention servers' KV (float32, bfloat16, float16) and
    # where both compute (cpu, cuda, cuda:N); None: their own default (or INFINITE_LLM_SERVE_* variables).
    dtype: str | None = None
    device: str | None = None
    manager_port: int = 0
    standby_managers: int = 0  # hot standbys (serve manager --standby) beside the leader, each on a free port
    model: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    transport: str = "grpc"  # attention tensors: grpc, or torch (torch.distributed over gloo on loopback)
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_waiting: int = 1024  # per compute instance, before RESOURCE_EXHAUSTED
    member_ttl_s: int = 10
    startup_timeout_s: float = 180.0
    gateway_port: int = 8000  # OpenAI-compatible REST gateway (HTTP); 0 = any free port
    discovery_interval_s: float = 1.0  # how often the router re-reads the manager's compute instances
    tls_dir: str | None = field(default_factory=lambda: os.environ.get(TLS_DIR_ENV) or None)  # None: make a CA
    insecure: bool = False  # plaintext gRPC everywhere (local experiments)
    shutdown_grace_s: float = SHUTDOWN_GRACE_S  # each service's --shutdown-grace (seconds)
    prefix_caching: bool = True  # compute instances share prompt prefixes' rBlocks (--no-prefix-caching: off)
    service_nice: int = SERVICE_NICE  # CPU niceness of every service but compute instances (0: as this process)
    # A YAML file of option values (``infinite-llm --config``): every service reads its ``serve: <role>:``
    # section from it. ``file_options``: the options each section sets, by role; one the mesh also passes on
    # that service's command line would be silently beaten by the flag, so it is refused (InvalidRequest).
    config_file: str | None = None
    file_options: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.attention_servers < 1 or self.compute_instances < 1:
            raise ValueError("a mesh needs at least one attention server and one compute instance")
        if self.standby_managers < 0:
            raise ValueError(f"standby_managers must be >= 0, got {self.standby_managers}")
        if not 0 <= self.service_nice <= 19:
            raise ValueError(f"service_nice must be in [0, 19], got {self.service_nice}")


@dataclass
class Proc:
    """One service process."""

    role: str
    name: str
    address: str
    popen: subprocess.Popen
    log_path: Path
    metrics_address: str | None = None  # HOST:PORT serving Prometheus /metrics
    fixed_port: bool = False  # the caller chose the port: never moved to another

    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class LocalMesh:
    """A running local mesh. Use as a context manager or call :meth:`stop`."""

    config: MeshConfig
    etcd: EtcdProcess | None = None
    procs: list[Proc] = field(default_factory=list)
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="infinite-llm-mesh-")))
    keep_logs: bool = False  # keep log_dir (and etcd's data) after stop; set when something failed
    _rebinds: dict[str, int] = field(default_factory=dict)  # restarts on fresh ports, per process name
    tls_dir: Path | None = None  # the certificates every service uses (None: plaintext), set by start
    etcd_tls_dir: Path | None = None  # etcd's CA, etcd's and the manager's etcd certificates (None: plaintext)
    _restarts: dict[str, list[float]] = field(default_factory=dict)  # exits seen by restart_crashed (monotonic s)
    _reaper: subprocess.Popen | None = None  # cleans log_dir if this process is killed outright (run_dir_reaper)

    @property
    def router_address(self) -> str:
        return self._by_role("router")[0].address

    @property
    def gateway_address(self) -> str:
        """HOST:PORT of the REST gateway (``http://{gateway_address}/v1`` is the OpenAI base URL)."""
        return self._by_role("gateway")[0].address

    @property
    def manager_address(self) -> str:
        """The manager's ``HOST:PORT``; with standbys, a gRPC target naming every manager (``ipv4:A,B``), on
        which the mesh's clients reach whichever leads (``rpc/options.py::serving_only``)."""
        managers = self._by_role("manager")
        if len(managers) == 1:
            return managers[0].address
        return "ipv4:" + ",".join(p.address for p in managers)

    def tls(self, role: str) -> TlsConfig | None:
        """The identity of ``role`` in this mesh (None when it runs plaintext)."""
        return None if self.tls_dir is None else load_tls_dir(self.tls_dir, role)

    def _setup_tls(self) -> None:
        from infinite_llm.rpc.certs import write_etcd_tls_dir, write_tls_dir

        if self.config.insecure:
            self.tls_dir = self.etcd_tls_dir = None
            return
        # up signs every role's certificate now and never again: the CA's key is not kept
        self.tls_dir = (
            Path(self.config.tls_dir) if self.config.tls_dir else write_tls_dir(self.log_dir / "tls", keep_ca_key=False)
        )
        self.etcd_tls_dir = write_etcd_tls_dir(self.log_dir / "etcd-tls")  # etcd is this mesh's alone

    def _by_role(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role]

    def attention_servers(self) -> list[Proc]:
        return self._by_role("attention")

    def compute_instances(self) -> list[Proc]:
        return self._by_role("compute")

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> LocalMesh:
        """Start everything in dependency order; raises ``Unavailable`` (after stopping all) on failure."""
        c = self.config
        try:
            self._setup_tls()
            self._refuse_beaten_file_options_of_every_role()
            tls = EtcdTls.from_etcd_tls_dir(self.etcd_tls_dir) if self.etcd_tls_dir else None  # the manager only
            self.etcd = start_etcd(data_dir=self.log_dir / "etcd", tls=tls)
            self._start_reaper(self.etcd.process.pid)
            etcd_tls = ["--etcd-tls-dir", str(self.etcd_tls_dir)] if self.etcd_tls_dir else []
            for i in range(1 + c.standby_managers):  # manager-0 first: it leads (a standby leads when none does)
                port = c.manager_port if i == 0 else 0
                args = self._manager_args(f"manager-{i}", self.etcd.endpoint.removeprefix("http://"), etcd_tls)
                self._spawn("manager", f"manager-{i}", port, args)
                leads = self.leads if i == 0 and c.standby_managers else None
                self._wait_healthy(self._by_role("manager")[-1:], check=leads)
            for i in range(c.attention_servers):
                self.spawn_attention(f"attn-{i}")
            for j in range(c.compute_instances):
                homes = [f"attn-{i}" for i in range(c.attention_servers) if i % c.compute_instances == j]
                self.spawn_compute(f"compute-{j}", homes)
            # The router reads the manager's list when it starts: let the instances load and register first.
            self._wait_healthy(self.compute_instances())
            self.wait_compute_registered(c.compute_instances)
            router = self.spawn_router("router", c.router_port)
            gateway = self._spawn("gateway", "gateway", c.gateway_port, self._gateway_args(router.address))
            self._wait_healthy([p for p in self.procs if p is not gateway])
            self._wait_healthy([gateway], check=http_health_check)
            self.wait_registered(c.attention_servers)
        except BaseException as e:
            self.keep_logs = not isinstance(e, InvalidRequest)  # the logs explain a failure, not a refused option
            self.stop()
            raise
        return self

    def _manager_args(self, name: str, etcd: str, etcd_tls: list[str]) -> list[str]:
        c = self.config
        standby = ["--standby"] if c.standby_managers else []
        return ["--etcd", etcd, *etcd_tls, "--member-ttl", str(c.member_ttl_s), "--block-size", str(c.block_size),
                "--manager-id", name, *standby]  # fmt: skip

    def _gateway_args(self, router_address: str) -> list[str]:
        return ["--router", router_address, *self._model_args()]

    def _router_args(self) -> list[str]:
        args = ["--manager", self.manager_address, "--discovery-interval", str(self.config.discovery_interval_s)]
        return [*args, *self._model_args()]

    def spawn_router(self, name: str, port: int = 0, shutdown_grace_s: float | None = None) -> Proc:
        """Start a router (``port`` 0: a free one) that follows the manager's compute instances; the first is the
        mesh's (:attr:`router_address`), tests start more (``shutdown_grace_s``: its own ``--shutdown-grace``)."""
        return self._spawn("router", name, port, self._router_args(), shutdown_grace_s)

    def spawn_attention(self, name: str, kv_memory_bytes: int | None = None) -> Proc:
        """Start one more attention server (also used by tests that add or kill servers) with
        ``kv_memory_bytes`` of KV memory (default: the mesh's ``kv_memory_bytes``)."""
        return self._spawn("attention", name, 0, self._attention_args(name, kv_memory_bytes))

    def _attention_args(self, name: str, kv_memory_bytes: int | None = None) -> list[str]:
        c = self.config
        return [
            "--server-id",
            name,
            "--kv-memory",
            str(c.kv_memory_bytes if kv_memory_bytes is None else kv_memory_bytes),
            "--block-size",
            str(c.block_size),
            "--transport",
            c.transport,
            "--manager",
            self.manager_address,
            *self._model_args(),
        ]

    def spawn_compute(self, name: str, homes: list[str] | None = None, port: int = 0) -> Proc:
        """Start one more compute instance (``port`` 0: a free one) with ``homes`` (attention server ids);
        it registers with the manager and the router follows it (also used by tests that add, kill and
        restart instances)."""
        return self._spawn("compute", name, port, self._compute_args(homes))

    def _compute_args(self, homes: list[str] | None = None) -> list[str]:
        c = self.config
        home_args = ["--home", ",".join(homes)] if homes else []
        return [
            "--manager",
            self.manager_address,
            "--block-size",
            str(c.block_size),
            "--transport",
            c.transport,
            "--max-num-batched-tokens",
            str(c.max_num_batched_tokens),
            "--max-num-seqs",
            str(c.max_num_seqs),
            "--max-waiting",
            str(c.max_waiting),
            "--prefix-caching" if c.prefix_caching else "--no-prefix-caching",
            *home_args,
            *self._model_args(),
        ]

    def respawn(self, proc: Proc) -> Proc:
        """Run ``proc``'s command again (same name, port and flags; its log goes on) once it exited, as a
        Kubernetes Deployment restarts a crashed pod. Returns ``proc``, now alive."""
        if proc.alive():
            raise ValueError(f"{proc.name} is still running")
        proc.popen = _popen(proc.popen.args, proc.log_path, proc.role, self.config.service_nice, append=True)
        return proc

    def restart_crashed(self, max_restarts: int = 5, window_s: float = CRASH_LOOP_WINDOW_S) -> list[Proc]:
        """Respawn every manager, compute instance, router and gateway that exited, and etcd (same port and
        data: the services ride its outage out, as a StatefulSet's etcd restarts); returns them (etcd as a
        :class:`Proc` of role ``etcd``). Attention servers stay down (the mesh recomputes their sequences on
        the others).

        Raises:
            Unavailable: one of them exited more than ``max_restarts`` times within ``window_s`` seconds (a
                crash loop; exits spread wider, such as failover drills on a manager, are restarted), or etcd
                could not start again.
        """
        restarted = []
        if self.etcd is not None and self.etcd.process.poll() is not None:
            self._count_exit("etcd", max_restarts, window_s, self.etcd.log_path)
            old = self.etcd
            self.etcd = start_etcd(data_dir=old.data_dir, client_port=old.client_port, tls=old.tls)
            if self._reaper is not None:  # the reaper waits for the running etcd, not the one that exited
                self._stop_reaper()
                self._start_reaper(self.etcd.process.pid)
            restarted.append(Proc("etcd", "etcd", f"{old.host}:{old.client_port}", self.etcd.process, old.log_path))
        for p in self.procs:
            if p.role in RESTARTED_ROLES and not p.alive():
                self._count_exit(p.name, max_restarts, window_s, p.log_path)
                restarted.append(self.respawn(p))
        return restarted

    def _count_exit(self, name: str, max_restarts: int, window_s: float, log_path: Path) -> None:
        """Record an exit of ``name``; raises ``Unavailable`` past ``max_restarts`` within ``window_s``."""
        now = time.monotonic()
        exits = [t for t in self._restarts.get(name, []) if now - t < window_s] + [now]
        self._restarts[name] = exits
        if len(exits) > max_restarts:
            raise Unavailable(f"{name} exited {len(exits)} times within {window_s:g} s:\n{tail(log_path)}")

    def _model_args(self) -> list[str]:
        return ["--model", self.config.model] if self.config.model else []

    def _spawn(self, role: str, name: str, port: int, args: list[str], shutdown_grace_s: float | None = None) -> Proc:
        """Start one service. ``port`` 0: a free one, moved by :meth:`_rebind` if it is taken before the
        service binds; another: the caller's, never moved."""
        fixed_port, port = port != 0, port or free_port()
        log_path = self.log_dir / f"{name}.log"
        cmd, metrics_address = self._command(role, name, port, args, shutdown_grace_s)
        self._refuse_beaten_file_options({role: self._beaten_file_options(role, cmd)})
        popen = _popen(cmd, log_path, role, self.config.service_nice)
        proc = Proc(role, name, f"{HOST}:{port}", popen, log_path, metrics_address, fixed_port)
        self.procs.append(proc)
        return proc

    def _command(
        self, role: str, name: str, port: int, args: list[str], shutdown_grace_s: float | None = None
    ) -> tuple[list[str], str]:
        """The command line of one service of ``role`` on ``port``, and the address of its ``/metrics``."""
        config_file = ["--config", self.config.config_file] if self.config.config_file else []
        cmd = [sys.executable, "-m", "infinite_llm.cli", *config_file, "serve", role]
        cmd += ["--host", HOST, "--port", str(port), *args]
        if role in ("attention", "compute"):
            for flag, value in (("--dtype", self.config.dtype), ("--device", self.config.device)):
                cmd += [flag, value] if value is not None else []
        cmd += ["--insecure"] if self.tls_dir is None else ["--tls-dir", str(self.tls_dir)]
        if role == "compute":
            cmd += ["--instance-id", name]
        grace = self.config.shutdown_grace_s if shutdown_grace_s is None else shutdown_grace_s
        cmd += ["--shutdown-grace", str(grace)]
        metrics_address = f"{HOST}:{port}"  # the gateway serves /metrics on its own HTTP port
        if role != "gateway":
            metrics_port = free_port()
            cmd += ["--metrics-port", str(metrics_port)]
            metrics_address = f"{HOST}:{metrics_port}"
        return _without_flags(cmd, set(self.config.file_options.get(role, ())) & MESH_DEFAULTS), metrics_address

    def _beaten_file_options(self, role: str, cmd: list[str]) -> list[str]:
        """The options of ``serve <role>`` the config file sets and ``cmd`` passes as flags (the flag would win
        without a word)."""
        names = [a[2:].replace("-", "_") for a in cmd[cmd.index("serve") :] if a.startswith("--")]
        flags = {n for name in names for n in (name, name.removeprefix("no_"))}  # --no-prefix-caching too
        return sorted(set(self.config.file_options.get(role, ())) & flags)

    def _refuse_beaten_file_options_of_every_role(self) -> None:
        """Before anything starts: every role's options the file sets and `up` passes, in one error (a role
        at a time would take a start and a failure per role to learn them all)."""
        placeholder = "127.0.0.1:1"  # addresses not known yet: only the flags' names count here
        commands = {
            "manager": self._manager_args(
                "manager-0", placeholder, ["--etcd-tls-dir", "-"] if self.etcd_tls_dir else []
            ),
            "attention": self._attention_args("attn-0"),
            "compute": self._compute_args(["attn-0"]),
            "router": self._router_args(),
            "gateway": self._gateway_args(placeholder),
        }
        self._refuse_beaten_file_options(
            {
                role: self._beaten_file_options(role, self._command(role, role, 1, args)[0])
                for role, args in commands.items()
            }
        )

    def _refuse_beaten_file_options(self, beaten: dict[str, list[str]]) -> None:
        """Raise ``InvalidRequest`` naming every option of ``beaten`` (role -> the file's keys `up` sets itself)
        and where to set it instead."""
        beaten = {role: keys for role, keys in beaten.items() if keys}
        if beaten:
            keys = ", ".join(f"serve.{role}.{k}" for role, ks in beaten.items() for k in ks)
            names = list(beaten)
            roles = "every " + (names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}")
            raise InvalidRequest(
                f"config file {self.config.config_file}: `up` sets {keys} itself on {roles} it starts, so "
                "the file's value would be ignored; remove it, and set it with an `up` option (flag or `up:` "
                "section) where there is one, e.g. --dtype, --device, --kv-memory, --block-size, --transport"
            )

    def leads(self, address: str) -> bool:
        """Whether the manager at ``address`` reports the GlobalManager service SERVING (it leads)."""
        return health_check(address, tls=self.tls("client"), service=MANAGER_SERVICE)

    def _wait_healthy(self, procs: list[Proc], check: Callable[[str], bool] | None = None) -> None:
        """Wait until ``check`` (default: the gRPC health check) passes for each of ``procs``."""
        check = check or (lambda address: health_check(address, tls=self.tls("client")))
        deadline = time.monotonic() + self.config.startup_timeout_s
        for p in procs:
            while not check(p.address):
                if not p.alive() and not self._rebind(p):
                    raise Unavailable(f"{p.name} exited during startup:\n{tail(p.log_path)}")
                if time.monotonic() > deadline:
                    raise Unavailable(
                        f"{p.name} not healthy after {self.config.startup_timeout_s:.0f} s:\n{tail(p.log_path)}"
                    )
                time.sleep(0.2)

    def _rebind(self, proc: Proc, max_tries: int = 3) -> bool:
        """Start a service again on fresh ports when it exited because its port was taken between
        :func:`free_port` and its bind (another process's ephemeral port: tensor channels and the tests'
        parallel meshes open many). A port the caller chose is never moved; the manager is not either (every
        other process is given its address). A router that moves takes the gateways that dial it along.
        Returns whether it was restarted."""
        tries = self._rebinds.get(proc.name, 0)
        movable = proc.role in ("attention", "compute", "router", "gateway") and not proc.fixed_port
        if not movable or tries >= max_tries or not _bind_failed(proc.log_path):
            return False
        self._rebinds[proc.name] = tries + 1
        old_address = proc.address
        self._restart_on(proc, free_port())
        log.warning("%s: its port was taken before it bound; started again on %s", proc.name, proc.address)
        if proc.role == "router":
            for gateway in self._by_role("gateway"):
                args = list(gateway.popen.args)
                if args[args.index("--router") + 1] == old_address:
                    gateway.popen.terminate()
                    try:
                        gateway.popen.wait(10)
                    except subprocess.TimeoutExpired:
                        gateway.popen.kill()
                        gateway.popen.wait()
                    self._restart_on(gateway, None, router=proc.address)
        return True

    def _restart_on(self, proc: Proc, port: int | None, router: str | None = None) -> None:
        """Start ``proc``'s command again (its log appended), on ``port`` (``None``: the same) and a fresh
        metrics port, dialling ``router`` when given."""
        args = list(proc.popen.args)
        if port is not None:
            args[args.index("--port") + 1] = str(port)
            proc.address = f"{HOST}:{port}"
        if "--metrics-port" in args:
            metrics_port = free_port()
            args[args.index("--metrics-port") + 1] = str(metrics_port)
            proc.metrics_address = f"{HOST}:{metrics_port}"
        elif port is not None:
            proc.metrics_address = proc.address  # the gateway serves /metrics on its own HTTP port
        if router is not None:
            args[args.index("--router") + 1] = router
        proc.popen = _popen(args, proc.log_path, proc.role, self.config.service_nice, append=True)

    def wait_registered(self, n: int, timeout_s: float = 30.0) -> None:
        """Wait until the manager lists exactly ``n`` attention servers."""
        from infinite_llm.services.admin import cluster_state

        deadline = time.monotonic() + timeout_s
        while len(cluster_state(self.manager_address, tls=self.tls("client")).servers) != n:
            if time.monotonic() > deadline:
                raise Unavailable(f"manager does not list {n} attention servers after {timeout_s:.0f} s")
            time.sleep(0.2)

    def wait_compute_registered(self, n: int, timeout_s: float = 30.0) -> None:
        """Wait until the manager lists exactly ``n`` compute instances."""
        from infinite_llm.services.admin import cluster_state

        deadline = time.monotonic() + timeout_s
        while len(cluster_state(self.manager_address, tls=self.tls("client")).compute_instances) != n:
            if time.monotonic() > deadline:
                raise Unavailable(f"manager does not list {n} compute instances after {timeout_s:.0f} s")
            time.sleep(0.2)

    def stop(self, grace_s: float | None = None) -> None:
        """Stop in stages, front to back (gateway and router drain their streams while the services behind
        them still answer, then compute instances, attention servers, the manager, etcd): SIGTERM each stage,
        SIGKILL what is left of it after ``grace_s`` (default: the services' shutdown grace + 5 s). The log
        directory is removed unless ``keep_logs``."""
        grace_s = self.config.shutdown_grace_s + 5.0 if grace_s is None else grace_s
        for roles in (("gateway", "router"), ("compute",), ("attention",), ("manager",)):
            stage = [p for p in self.procs if p.role in roles]
            for p in stage:
                if p.alive():
                    p.popen.terminate()
            deadline = time.monotonic() + grace_s
            for p in stage:
                try:
                    p.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        if not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        else:
            drop_made(self.log_dir)  # what a kept run directory must not hold: secrets, etcd's data
        self._stop_reaper()

    def _start_reaper(self, etcd_pid: int) -> None:
        """The process that drops the secrets and etcd's data from the run directory if this one is killed
        outright (``run_dir_reaper``); it waits for etcd, which the kernel stops then, for the stop grace."""
        grace_s = self.config.shutdown_grace_s + 5.0
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "infinite_llm.run_dir_reaper", str(self.log_dir), str(grace_s), str(etcd_pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _stop_reaper(self) -> None:
        """Tell the reaper this mesh stopped on purpose (it leaves without touching anything)."""
        reaper, self._reaper = self._reaper, None
        if reaper is None:
            return
        try:
            reaper.stdin.write(STOPPED)  # type: ignore[union-attr]
            reaper.stdin.close()  # type: ignore[union-attr]
            reaper.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            reaper.kill()
            reaper.wait()

    def __enter__(self) -> LocalMesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _without_flags(cmd: list[str], options: set[str]) -> list[str]:
    """``cmd`` without the ``--flag value`` pairs of ``options`` (option names, with underscores)."""
    flags = {"--" + o.replace("_", "-") for o in options}
    out: list[str] = []
    skip = False
    for arg in cmd:
        if skip:
            skip = False
        elif arg in flags:
            skip = True  # and its value
        else:
            out.append(arg)
    return out


def _popen(cmd: list[str], log_path: Path, role: str, nice: int = 0, append: bool = False) -> subprocess.Popen:
    """Start a service with its output in ``log_path``; on Linux it gets SIGTERM if this process dies
    (killed outright, it cannot stop the mesh: see ``parent_death``). ``cmd`` may be an earlier start's
    ``popen.args`` (a restart): its prefixes are made anew."""
    with open(log_path, "ab" if append else "wb") as out:
        return subprocess.Popen(
            dying_with_parent(_niced(_bare(cmd), role, nice)),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_env(role),
        )


def _niced(cmd: list[str], role: str, nice: int) -> list[str]:
    """``cmd`` run at CPU niceness ``nice`` through ``nice(1)``; compute instances, ``nice == 0`` and a machine
    without ``nice`` get ``cmd`` as is."""
    if role == "compute" or nice == 0 or shutil.which("nice") is None:
        return cmd
    return ["nice", "-n", str(nice), *cmd]


def _bare(cmd: list[str]) -> list[str]:
    """``cmd`` without the prefixes :func:`_popen` gave it."""
    cmd = unwrapped(cmd)
    return cmd[3:] if cmd[:2] == ["nice", "-n"] else cmd


def _env(role: str) -> dict[str, str]:
    """A service's environment: unbuffered logs; one OpenMP thread except for compute instances."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if role != "compute" and "OMP_NUM_THREADS" not in os.environ:
        # One machine hosts the whole mesh: only the dense layers get every core; more torch threads than
        # cores make OpenMP spin against each other.
        env["OMP_NUM_THREADS"] = "1"
    return env


def health_check(address: str, timeout_s: float = 1.0, tls: TlsConfig | None = None, service: str = "") -> bool:
    """True when ``address`` answers grpc.health.v1 with SERVING for ``service`` (default: the whole server;
    over mTLS as ``tls``'s identity; None: plaintext)."""
    from infinite_llm.rpc.channels import sync_channel

    with sync_channel(address, tls=tls) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_health_check(address: str, timeout_s: float = 1.0) -> bool:
    """True when ``GET http://{address}/health`` answers 200 (asked directly: no proxy from the environment)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{address}/health", timeout=timeout_s) as reply:
            return reply.status == 200
    except (OSError, ValueError):  # refused, reset, timed out, HTTP 503 (HTTPError is an OSError)
        return False


def port_in_use(port: int, host: str = HOST) -> bool:
    """Whether a process listens on ``host:port`` already (a bind as the services do fails). SO_REUSEADDR:
    a port left in TIME_WAIT by an earlier mesh is free, as it is for the services."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _bind_failed(log_path: Path) -> bool:
    """Whether a service's log ends saying one of its ports was taken (our gRPC server, uvicorn, the
    Prometheus metrics server)."""
    text = tail(log_path).lower()
    return "cannot bind" in text or "address already in use" in text


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
