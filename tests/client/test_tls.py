"""TLS and mutual TLS end to end: certificates made here, real workers on loopback, the client CLI and the
healthcheck as subprocesses (their flags and their environment defaults), and clients without the right
certificate refused."""

import datetime
import ipaddress
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.serving import start

ROOT = Path(__file__).resolve().parents[2]
SAN = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])


def issue(folder: Path, name: str, issuer=None, *, ca: bool = False, san=None, usage=None):
    """A key and certificate under `folder` (NAME.key, NAME.pem), signed by `issuer` = (cert, key) or self-signed."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .issuer_name(issuer[0].subject if issuer else subject)
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san is not None:
        b = b.add_extension(san, critical=False)
    if usage is not None:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    cert = b.sign(issuer[1] if issuer else key, hashes.SHA256())
    (folder / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = issue(d, "ca", ca=True)
    issue(d, "server", ca, san=SAN, usage=ExtendedKeyUsageOID.SERVER_AUTH)
    issue(d, "client", ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    other = issue(d, "other-ca", ca=True)  # a CA the workers do not know
    issue(d, "stranger", other, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    issue(d, "selfsigned", san=SAN)  # a server certificate that is its own CA
    return d


@pytest.fixture(scope="module")
def workers(tiny_artifacts, pki, tmp_path_factory):
    """A TLS worker, a mutual-TLS worker and a self-signed TLS worker, each serving one model."""
    root, _ = tiny_artifacts
    models = tmp_path_factory.mktemp("tls-models")
    shutil.copytree(root / "rope", models / "rope")
    tls = start(models, tls_cert=pki / "server.pem", tls_key=pki / "server.key")
    mtls = start(models, tls_cert=pki / "server.pem", tls_key=pki / "server.key", tls_client_ca=pki / "ca.pem")
    own = start(models, tls_cert=pki / "selfsigned.pem", tls_key=pki / "selfsigned.key")
    yield {"tls": tls.port, "mtls": mtls.port, "self": own.port}
    for srv in (tls, mtls, own):
        srv.stop(grace=1)


def run(module, port, *args, env=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("POSENC_")}
    target = ["--target", f"127.0.0.1:{port}"] if port else []
    return subprocess.run([sys.executable, "-m", module, *target, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, env={**clean, **(env or {})})


def test_client_cli_over_tls_and_mutual_tls(workers, pki):
    res = run("client", workers["tls"], "--tls-ca", str(pki / "ca.pem"), "list")
    assert res.returncode == 0 and "rope" in res.stdout, res.stderr
    res = run("client", workers["mtls"], "--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "client.pem"),
              "--tls-key", str(pki / "client.key"), "list")
    assert res.returncode == 0 and "rope" in res.stdout, res.stderr
    env = {"POSENC_TLS_CA": str(pki / "ca.pem"), "POSENC_TLS_CLIENT_CERT": str(pki / "client.pem"),
           "POSENC_TLS_CLIENT_KEY": str(pki / "client.key")}  # the same from the environment
    res = run("client", workers["mtls"], "predict", "--model", "rope", "dog", env=env)
    assert res.returncode == 0 and "rank" in res.stdout, res.stderr
    res = run("client", workers["tls"], "--tls-ca", str(pki / "ca.pem"), "--tls-server-name", "localhost",
              "list")
    assert res.returncode == 0, res.stderr


def test_clients_without_the_right_certificate_are_refused(workers, pki):
    ca = ["--tls-ca", str(pki / "ca.pem")]
    refused = [
        run("client", workers["tls"], "--timeout", "5", "list"),  # plaintext to a TLS port
        run("client", workers["tls"], "--timeout", "5", "--tls-ca", str(pki / "other-ca.pem"), "list"),  # wrong CA
        run("client", workers["tls"], "--timeout", "5", *ca, "--tls-server-name", "elsewhere.example", "list"),
        run("client", workers["mtls"], "--timeout", "5", *ca, "list"),  # no client certificate
        run("client", workers["mtls"], "--timeout", "5", *ca, "--tls-cert", str(pki / "stranger.pem"),
            "--tls-key", str(pki / "stranger.key"), "list"),  # a client certificate from another CA
    ]
    for res in refused:
        assert res.returncode == 2 and "UNAVAILABLE" in res.stderr and "rope" not in res.stdout, res


def test_healthcheck_over_tls_and_mutual_tls(workers, pki):
    ca, client = str(pki / "ca.pem"), ["--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key")]
    res = run("service.healthcheck", workers["tls"], "--tls-ca", ca)
    assert res.returncode == 0 and "SERVING" in res.stdout, res
    res = run("service.healthcheck", workers["mtls"], "--tls-ca", ca, *client)
    assert res.returncode == 0 and "SERVING" in res.stdout, res
    res = run("service.healthcheck", workers["tls"], "--tls-ca", ca, "--tls-server-name", "localhost")
    assert res.returncode == 0, res
    env = {"POSENC_TLS_CA": ca, "POSENC_TLS_CLIENT_CERT": client[1], "POSENC_TLS_CLIENT_KEY": client[3],
           "POSENC_PORT": str(workers["mtls"])}  # all from the environment, the port too
    res = run("service.healthcheck", None, env=env)
    assert res.returncode == 0 and "SERVING" in res.stdout, res
    for res in (run("service.healthcheck", workers["tls"]),  # plaintext
                run("service.healthcheck", workers["mtls"], "--tls-ca", ca),  # no client certificate
                run("service.healthcheck", workers["tls"], "--tls-ca", ca, "--tls-server-name", "elsewhere"),
                run("service.healthcheck", workers["mtls"], "--tls-ca", ca, "--tls-cert",
                    str(pki / "stranger.pem"), "--tls-key", str(pki / "stranger.key"))):
        assert res.returncode == 1 and "UNAVAILABLE" in res.stdout, res


def test_healthcheck_inside_the_container_trusts_the_workers_own_self_signed_certificate(workers, pki):
    """The compose file's healthcheck command, run with the worker's environment: nothing but POSENC_TLS_CERT."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command = compose["services"]["worker"]["healthcheck"]["test"]
    assert command[:4] == ["CMD", "python", "-m", "service.healthcheck"]
    unset = {k: "" for k in compose["services"]["worker"]["environment"] if k.startswith("POSENC_TLS")}
    worker_env = {**unset, "POSENC_TLS_CERT": str(pki / "selfsigned.pem"),
                  "POSENC_TLS_KEY": str(pki / "selfsigned.key"), "POSENC_PORT": str(workers["self"])}
    res = run("service.healthcheck", None, *command[4:], env=worker_env)
    assert res.returncode == 0 and "SERVING" in res.stdout, res
    res = run("service.healthcheck", None, *command[4:], env={"POSENC_PORT": str(workers["self"])})
    assert res.returncode == 1, res  # without TLS settings it cannot talk to a TLS worker
    # a CA-signed certificate works too: gRPC accepts the exact certificate as its own trust anchor
    res = run("service.healthcheck", workers["tls"], env={"POSENC_TLS_CERT": str(pki / "server.pem")})
    assert res.returncode == 0, res
    res = run("service.healthcheck", workers["tls"], env={"POSENC_TLS_CERT": str(pki / "selfsigned.pem")})
    assert res.returncode == 1, res  # ... and only that certificate


@pytest.mark.parametrize("args, message", [
    (["--tls-cert", "x.pem"], "needs both"),
    (["--tls-ca", "/nonexistent/ca.pem"], "cannot read"),
    (["--tls-ca", "README.md"], "not PEM"),
    (["--timeout", "soon"], "not a number"),
    (["--timeout", "0"], "must be > 0"),
])
def test_healthcheck_bad_options_are_one_line_and_exit_2(args, message):
    res = run("service.healthcheck", 1, *args)
    assert res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res
