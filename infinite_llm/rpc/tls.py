"""Mutual TLS for every gRPC port (DESIGN.md §6): a TLS directory, the credentials built from it, and the
role of the peer at the other end.

A TLS directory holds ``ca.pem`` (the cluster CA), ``<role>.pem`` and ``<role>-key.pem`` (``rpc/certs.py``
writes one; Kubernetes mounts one Secret per role). :func:`load_tls_dir` reads the files of one role into
a :class:`TlsConfig`, from which servers get ``grpc.ssl_server_credentials(..., require_client_auth=True)``
(re-read on each handshake when the files change, so a renewed certificate needs no restart) and channels
``grpc.ssl_channel_credentials``. Channels check the server's certificate against :data:`SERVER_NAME`,
which every service certificate carries: pods are dialled by IP or by per-pod names no certificate
could list in advance.

Where a process's identity comes from: the entry point (``infinite-llm serve ...``) loads it once and
calls :func:`set_process_tls`; ``rpc/channels.py`` and ``rpc/server.py`` use it wherever their caller
passes none (:data:`FROM_PROCESS`). ``None`` means plaintext: libraries and unit tests that never set it
keep working without certificates.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc

from infinite_llm.core.errors import InvalidRequest

log = logging.getLogger(__name__)

ROLES: Final = ("manager", "attention", "compute", "router", "gateway", "client")
CLIENT_ROLES: Final = frozenset({"client"})  # roles that only dial; their certificates cannot serve
ROLE_URI_PREFIX: Final = "spiffe://infinite-llm/role/"
SERVER_NAME: Final = "infinite-llm.mesh"  # the DNS SAN of every service certificate; channels check it
TLS_DIR_ENV: Final = "INFINITE_LLM_TLS_DIR"


@dataclass(frozen=True, repr=False)
class TlsConfig:
    """This process's identity and the CA it trusts (PEM bytes). ``directory``: where they were read
    from (servers re-read it when its files change); ``server_name``: the name channels check in the
    server's certificate (``None``: the host of the target)."""

    role: str
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    directory: Path | None = None
    server_name: str | None = SERVER_NAME

    def __repr__(self) -> str:  # never print a key
        return f"TlsConfig(role={self.role!r}, directory={str(self.directory)!r})"

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that demand a client certificate signed by the CA (mTLS)."""
        if self.directory is None:
            return grpc.ssl_server_credentials(
                [(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem, require_client_auth=True
            )
        reloader = _Reloader(self.directory, self.role)
        return grpc.dynamic_ssl_server_credentials(
            reloader.initial(), reloader.fetch, require_client_authentication=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def tls_files(directory: Path, role: str) -> tuple[Path, Path, Path]:
    """``(ca.pem, <role>.pem, <role>-key.pem)`` of a TLS directory."""
    return directory / "ca.pem", directory / f"{role}.pem", directory / f"{role}-key.pem"


def load_tls_dir(
    directory: str | Path, role: str, server_name: str | None = SERVER_NAME, flag: str = "--tls-dir"
) -> TlsConfig:
    """Read ``ca.pem``, ``<role>.pem`` and ``<role>-key.pem`` from ``directory`` (``flag``: the option, keyword
    or environment variable that named it, for the messages).

    Raises:
        InvalidRequest: an unknown role, a missing or unreadable file, or a file that is not PEM.
    """
    if role not in ROLES:
        raise InvalidRequest(f"unknown role {role!r}; roles are {', '.join(ROLES)}", param="role")
    path, param = Path(directory), flag.lstrip("-").replace("-", "_")
    named = f"{flag} {directory}" if flag.startswith("--") else f"{flag}={str(directory)!r}"
    contents = []
    for file in tls_files(path, role):
        try:
            data = file.read_bytes()
        except OSError as e:
            raise InvalidRequest(f"{named}: cannot read {file.name}: {e.strerror}", param=param) from None
        if b"-----BEGIN" not in data:
            raise InvalidRequest(f"{named}: {file.name} is not PEM", param=param)
        contents.append(data)
    return TlsConfig(role, *contents, directory=path, server_name=server_name)


class _Reloader:
    """Re-reads a role's files when one changes (mtime), for ``grpc.dynamic_ssl_server_credentials``:
    gRPC asks on every new handshake; connections already up keep their certificate."""

    def __init__(self, directory: Path, role: str) -> None:
        self.directory, self.role = directory, role
        self._stamp = self._mtimes()

    def _mtimes(self) -> tuple[int, ...]:
        try:
            return tuple(os.stat(f).st_mtime_ns for f in tls_files(self.directory, self.role))
        except OSError:
            return ()

    def _config(self) -> grpc.ServerCertificateConfiguration:
        tls = load_tls_dir(self.directory, self.role)
        return grpc.ssl_server_certificate_configuration([(tls.key_pem, tls.cert_pem)], tls.ca_pem)

    def initial(self) -> grpc.ServerCertificateConfiguration:
        return self._config()

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = self._mtimes()
        if not stamp or stamp == self._stamp:
            return None  # unchanged (or mid-rotation): keep serving the current certificate
        try:
            config = self._config()
        except InvalidRequest as e:
            log.warning("keeping the current certificate: %s", e.message)
            return None
        self._stamp = stamp
        log.info("serving the renewed %s certificate from %s", self.role, self.directory)
        return config


# ---- the process's identity ------------------------------------------------------------------------------
class _FromProcess:
    def __repr__(self) -> str:
        return "FROM_PROCESS"


FROM_PROCESS: Final = _FromProcess()  # "use the identity the entry point set" (a default argument)
TlsArg = TlsConfig | None | _FromProcess

_process_tls: TlsConfig | None = None
_process_health_port = 0


def set_process_tls(tls: TlsConfig | None, health_port: int = 0) -> None:
    """Set the identity every server and channel of this process uses unless told otherwise (entry points).

    ``health_port`` (0 = none): the process's TLS server also answers ``grpc.health.v1`` in plaintext on
    this port, and nothing else there: Kubernetes' gRPC probes cannot present a certificate.
    """
    global _process_tls, _process_health_port
    _process_tls, _process_health_port = tls, health_port


def take_process_health_port() -> int:
    """The plaintext health port set with the identity (0: none), once: the first server takes it."""
    global _process_health_port
    port, _process_health_port = _process_health_port, 0
    return port


def resolve(tls: TlsArg) -> TlsConfig | None:
    """``tls`` itself, or this process's identity for :data:`FROM_PROCESS`."""
    return _process_tls if isinstance(tls, _FromProcess) else tls


def client_tls(tls: TlsArg | str | Path = FROM_PROCESS, role: str = "client") -> TlsConfig | None:
    """The identity of a tool or the SDK: ``tls`` itself; a TLS directory (its ``role`` files); or, for
    :data:`FROM_PROCESS`, the process's identity, else ``$INFINITE_LLM_TLS_DIR``'s ``role`` files, else
    plaintext (``None``). Raises InvalidRequest for a directory without the role's files."""
    if isinstance(tls, (str, Path)):
        return load_tls_dir(tls, role, flag="tls")
    if not isinstance(tls, _FromProcess):
        return tls
    if _process_tls is not None:
        return _process_tls
    directory = os.environ.get(TLS_DIR_ENV)
    return load_tls_dir(directory, role, flag=TLS_DIR_ENV) if directory else None


# ---- the peer's role ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    """Who is calling: ``role`` from the certificate (None: plaintext or no role) and ``identity``, the
    certificate's subject (e.g. ``O=infinite-llm,CN=attention``), '' without one."""

    role: str | None
    identity: str


def peer_of(context: grpc.aio.ServicerContext | grpc.ServicerContext) -> Peer:
    """The authenticated peer of a call, from gRPC's auth context (filled by the TLS handshake).

    The role is the URI SAN ``spiffe://infinite-llm/role/<role>``, else the common name, and only if it is
    one of :data:`ROLES`. A plaintext call has neither role nor identity.
    """
    auth = context.auth_context() or {}
    role = None
    for value in auth.get("x509_subject_alternative_name", ()) + auth.get("peer_uri", ()):
        text = value.decode(errors="replace")
        if text.startswith(ROLE_URI_PREFIX):
            role = text[len(ROLE_URI_PREFIX) :]
            break
    if role is None:
        names = auth.get("x509_common_name", ())
        role = names[0].decode(errors="replace") if names else None
    subject = auth.get("x509_subject", ())
    identity = subject[0].decode(errors="replace") if subject else ""
    return Peer(role if role in ROLES else None, identity)
