"""``infinite-llm tls init`` and ``tls etcd-init``: the etcd TLS directory for an etcd of one's own (etcd's CA,
etcd's and the manager's etcd certificates), with the names etcd is dialled by; neither writes a new CA over
an existing one without ``--force``."""

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


def test_init_refuses_a_directory_holding_a_ca_and_keeps_its_files(tmp_path):
    """Servers reload changed certificate files: a second init over a live cluster's directory would break
    every connection, so it exits 2 naming the files and --force, and leaves them as they were."""
    assert CliRunner().invoke(app, ["tls", "init", str(tmp_path)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = CliRunner().invoke(app, ["tls", "init", str(tmp_path)])
    assert result.exit_code == 2, result.output
    flat = " ".join(result.output.split())
    assert f"{tmp_path} already holds a CA or keys (ca.pem, ca-key.pem, manager.pem, manager-key.pem," in flat
    assert "give --force to write a new CA anyway" in flat
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_init_with_force_writes_a_new_ca_over_the_old_one(tmp_path):
    assert CliRunner().invoke(app, ["tls", "init", str(tmp_path)]).exit_code == 0
    old_ca, old_key = (tmp_path / "ca.pem").read_bytes(), (tmp_path / "router-key.pem").read_bytes()
    result = CliRunner().invoke(app, ["tls", "init", str(tmp_path), "--force"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "ca.pem").read_bytes() != old_ca and (tmp_path / "router-key.pem").read_bytes() != old_key


def test_init_refuses_even_a_lone_key_but_not_unrelated_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    assert CliRunner().invoke(app, ["tls", "init", str(tmp_path / "b")]).exit_code == 0
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "client-key.pem").write_text("a key")
    result = CliRunner().invoke(app, ["tls", "init", str(tmp_path / "c")])
    assert result.exit_code == 2 and "(client-key.pem)" in " ".join(result.output.split()), result.output
    assert (tmp_path / "c" / "client-key.pem").read_text() == "a key"


def test_etcd_init_refuses_an_existing_etcd_ca_unless_forced(tmp_path):
    directory = str(tmp_path / "etcd")
    assert CliRunner().invoke(app, ["tls", "etcd-init", directory]).exit_code == 0
    old = (tmp_path / "etcd" / "etcd-key.pem").read_bytes()
    result = CliRunner().invoke(app, ["tls", "etcd-init", directory])
    assert result.exit_code == 2, result.output
    flat = " ".join(result.output.split())
    assert "already holds a CA or keys (ca.pem, etcd.pem, etcd-key.pem, manager.pem, manager-key.pem)" in flat
    assert (tmp_path / "etcd" / "etcd-key.pem").read_bytes() == old
    assert CliRunner().invoke(app, ["tls", "etcd-init", directory, "--force"]).exit_code == 0
    assert (tmp_path / "etcd" / "etcd-key.pem").read_bytes() != old
