"""The gateway serves HTTPS when given a certificate (a real ``infinite-llm serve gateway`` process): the
certificate it presents is the one given, plain HTTP on that port gets no answer, and /health answers
(503: the router it names is not there)."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from cryptography import x509

from infinite_llm.rpc.certs import write_tls_dir
from infinite_llm.state.etcd_launcher import free_port


def test_gateway_serves_https_with_the_given_certificate(default_model_path, tmp_path):
    tls = write_tls_dir(tmp_path / "tls")
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "infinite_llm.cli", "serve", "gateway", "--router", f"127.0.0.1:{free_port()}"]
    cmd += [
        "--port",
        str(port),
        "--ssl-certfile",
        str(tls / "gateway.pem"),
        "--ssl-keyfile",
        str(tls / "gateway-key.pem"),
    ]
    cmd += ["--tls-dir", str(tls)]
    log = tmp_path / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        context = ssl.create_default_context(cafile=str(tls / "ca.pem"))
        deadline, reply = time.monotonic() + 120, None
        while reply is None and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                reply = httpx.get(f"https://127.0.0.1:{port}/health", verify=context, trust_env=False, timeout=5)
            except httpx.TransportError:
                time.sleep(0.5)
        assert reply is not None, log.read_text()
        assert reply.status_code == 503  # TLS works; the router is not there
        served = ssl.get_server_certificate(("127.0.0.1", port))
        given = x509.load_pem_x509_certificate((tls / "gateway.pem").read_bytes())
        assert x509.load_pem_x509_certificate(served.encode()).serial_number == given.serial_number
        with pytest.raises(httpx.TransportError):  # plain HTTP gets no answer: the handshake fails
            httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False, timeout=5)
        assert "gateway on https://" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
