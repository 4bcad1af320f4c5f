"""``infinite-llm tls etcd-init``: the etcd TLS directory for an etcd of one's own (etcd's CA, etcd's and the
manager's etcd certificates), with the names etcd is dialled by."""

from __future__ import annotations

from cryptography import x509
from typer.testing import CliRunner

from infinite_llm.cli import app


def test_etcd_init_writes_etcds_ca_and_both_certificates_with_the_given_names(tmp_path):
    result = CliRunner().invoke(app, ["tls", "etcd-init", str(tmp_path / "etcd"), "--host", "etcd.example"])
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (tmp_path / "etcd").iterdir())
    assert files == ["ca.pem", "etcd-key.pem", "etcd.pem", "manager-key.pem", "manager.pem"]
    cert = x509.load_pem_x509_certificate((tmp_path / "etcd" / "etcd.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "etcd.example"]
    assert "--etcd-tls-dir" in " ".join(result.output.split())


def test_etcd_init_refuses_a_validity_under_a_day(tmp_path):
    result = CliRunner().invoke(app, ["tls", "etcd-init", str(tmp_path / "etcd"), "--days", "0"])
    assert result.exit_code == 2 and not (tmp_path / "etcd").exists()
