"""The cluster CA and per-role certificates (``cryptography``): what ``infinite-llm up`` and
``infinite-llm tls init`` write into a TLS directory.

Layout of a TLS directory (what :func:`infinite_llm.rpc.tls.load_tls_dir` reads): ``ca.pem`` (the cluster
CA certificate), ``<role>.pem`` and ``<role>-key.pem`` per role, and ``ca-key.pem`` (only where more
certificates are to be signed; never mounted into pods). Keys are ECDSA P-256, files with keys are 0600.

A certificate names its role twice: the subject's common name (``CN=attention``) and a URI SAN
``spiffe://infinite-llm/role/attention`` (what :func:`infinite_llm.rpc.tls.peer_role` reads first). Service
roles also carry DNS/IP SANs: :data:`~infinite_llm.rpc.tls.SERVER_NAME` (the name every channel of the mesh
checks, so pods reached by IP verify), ``localhost``, ``127.0.0.1``, ``::1`` and any ``hosts`` given
(Kubernetes Service names). The client role has no server name: its certificate cannot serve the mesh.

etcd has a CA of its own (:func:`etcd_pems`, :func:`write_etcd_tls_dir`), as kubeadm gives it: it signs only
the etcd members' certificate (``etcd.pem``: server, peer and etcd's own client calls) and the manager's
etcd client certificate (``manager.pem``). etcd trusts only that CA, so it admits the manager and nobody
else: a certificate of the cluster CA (a compute instance's, say) fails the handshake.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from infinite_llm.rpc.tls import CLIENT_ROLES, ROLE_URI_PREFIX, ROLES, SERVER_NAME

ORGANIZATION = "infinite-llm"
DEFAULT_DAYS = 365
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

Key = ec.EllipticCurvePrivateKey


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _builder(subject: x509.Name, issuer: x509.Name, key: Key, days: int) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # clocks of a cluster differ a little
        .not_valid_after(now + dt.timedelta(days=days))
    )


def make_ca(common_name: str = "infinite-llm cluster CA", days: int = DEFAULT_DAYS) -> tuple[x509.Certificate, Key]:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    cert = (
        _builder(name, name, key, days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _host_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """IP SANs for addresses, DNS SANs for the rest (duplicates dropped)."""
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _san(role: str, hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(ROLE_URI_PREFIX + role)]
    if role in CLIENT_ROLES:
        return names
    return names + _host_names((SERVER_NAME, *LOOPBACK_HOSTS, *hosts))


def make_leaf(
    role: str,
    ca_cert: x509.Certificate,
    ca_key: Key,
    hosts: Sequence[str] = (),
    days: int = DEFAULT_DAYS,
    common_name: str | None = None,
) -> tuple[x509.Certificate, Key]:
    """A certificate of ``role`` signed by the CA. ``common_name`` defaults to the role (tests give another
    one to make a second identity of the same role). Raises ValueError for an unknown role."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    return _sign(
        common_name or role, _san(role, hosts), serves=role not in CLIENT_ROLES, ca=(ca_cert, ca_key), days=days
    )


def _sign(
    common_name: str, san: list[x509.GeneralName], serves: bool, ca: tuple[x509.Certificate, Key], days: int
) -> tuple[x509.Certificate, Key]:
    """A leaf certificate signed by ``ca``: client auth, and server auth if it ``serves``."""
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if serves:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    cert = (
        _builder(_name(common_name), ca_cert.subject, key, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: Key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def tls_dir_files(roles: Sequence[str] = ROLES, keep_ca_key: bool = True) -> list[str]:
    """The file names :func:`write_tls_dir` writes for ``roles``."""
    names = ["ca.pem", *(["ca-key.pem"] if keep_ca_key else [])]
    return names + [f"{role}{suffix}" for role in roles for suffix in (".pem", "-key.pem")]


class TlsDirExists(FileExistsError):
    """A TLS directory already holds files a new CA would replace (``files``: their names)."""

    def __init__(self, directory: Path, files: list[str]) -> None:
        super().__init__(f"{directory} already holds {', '.join(files)}; replacing them needs force")
        self.directory, self.files = directory, files


def write_tls_dir(
    directory: str | Path,
    roles: Sequence[str] = ROLES,
    hosts: Sequence[str] = (),
    days: int = DEFAULT_DAYS,
    keep_ca_key: bool = True,
    force: bool = False,
) -> Path:
    """Create a CA and one certificate per role in ``directory`` (made if missing); returns it.

    ``hosts``: extra DNS names / IPs for the service roles (e.g. ``manager.infinite-llm.svc``).
    ``keep_ca_key``: also write ``ca-key.pem`` (to sign more later); a pod never needs it.
    ``force``: replace files of an earlier CA. Without it, a directory already holding any of the files
    raises :class:`TlsDirExists` naming them: servers reload changed files, so a new CA written over a live
    cluster's directory would break every connection between its services.
    """
    out = Path(directory)
    _refuse_to_replace(out, tls_dir_files(roles, keep_ca_key), force)
    out.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = make_ca(days=days)
    _write(out / "ca.pem", cert_pem(ca_cert), private=False)
    if keep_ca_key:
        _write(out / "ca-key.pem", key_pem(ca_key), private=True)
    for role in roles:
        cert, key = make_leaf(role, ca_cert, ca_key, hosts, days)
        _write(out / f"{role}.pem", cert_pem(cert), private=False)
        _write(out / f"{role}-key.pem", key_pem(key), private=True)
    return out


def _refuse_to_replace(directory: Path, names: Iterable[str], force: bool) -> None:
    found = [] if force else [name for name in names if (directory / name).exists()]
    if found:
        raise TlsDirExists(directory, found)


# ---- etcd's own CA ---------------------------------------------------------------------------------------
ETCD_SERVER: Final = "etcd"  # file stem of the etcd members' certificate in an etcd TLS directory
ETCD_CLIENT: Final = "manager"  # the one client etcd admits; load_tls_dir(dir, ETCD_CLIENT) reads its files


def etcd_pems(hosts: Sequence[str] = (), days: int = DEFAULT_DAYS) -> tuple[bytes, dict[str, tuple[bytes, bytes]]]:
    """A new etcd CA and the two certificates it signs, as PEM: ``(ca_pem, {stem: (cert_pem, key_pem)})``.

    ``etcd`` (:data:`ETCD_SERVER`): the members' certificate, for their client port, their peer port and
    the calls a member makes as a client (peers, its own gateway), so server and client auth; its SANs are
    the loopback names and ``hosts`` (the names clients and peers dial: the Service, ``*.etcd.<ns>.svc``),
    which etcd's peers and the manager check. ``manager`` (:data:`ETCD_CLIENT`): the manager's client
    certificate (``CN=manager``, client auth only).
    """
    ca_cert, ca_key = make_ca("infinite-llm etcd CA", days)
    server = _sign(ETCD_SERVER, _host_names((*LOOPBACK_HOSTS, *hosts)), serves=True, ca=(ca_cert, ca_key), days=days)
    uri = [x509.UniformResourceIdentifier(ROLE_URI_PREFIX + ETCD_CLIENT)]
    client = _sign(ETCD_CLIENT, uri, serves=False, ca=(ca_cert, ca_key), days=days)
    pems = {
        stem: (cert_pem(cert), key_pem(key)) for stem, (cert, key) in ((ETCD_SERVER, server), (ETCD_CLIENT, client))
    }
    return cert_pem(ca_cert), pems


def write_etcd_tls_dir(
    directory: str | Path, hosts: Sequence[str] = (), days: int = DEFAULT_DAYS, force: bool = False
) -> Path:
    """Write an etcd TLS directory (made if missing; returns it): ``ca.pem`` (the etcd CA, not the cluster's),
    ``etcd.pem``/``etcd-key.pem`` (what etcd serves with) and ``manager.pem``/``manager-key.pem`` (what the
    manager dials etcd with: ``serve manager --etcd-tls-dir``). The etcd CA's key is not kept. Without
    ``force``, raises :class:`TlsDirExists` when the directory holds any of these files already."""
    out = Path(directory)
    stems = (ETCD_SERVER, ETCD_CLIENT)
    _refuse_to_replace(out, ["ca.pem", *(f"{s}{suffix}" for s in stems for suffix in (".pem", "-key.pem"))], force)
    out.mkdir(parents=True, exist_ok=True)
    ca, pems = etcd_pems(hosts, days)
    _write(out / "ca.pem", ca, private=False)
    for stem, (cert, key) in pems.items():
        _write(out / f"{stem}.pem", cert, private=False)
        _write(out / f"{stem}-key.pem", key, private=True)
    return out
