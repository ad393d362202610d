"""Operations: Prometheus metrics on their own port; TLS and mutual TLS with certificates made here."""

import datetime
import ipaddress
import urllib.request

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from client.channel import instance_of
from model.variants import REGISTRY
from protos.inference import grpc_service_pb2, grpc_service_pb2_grpc
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.serving import start


def test_metrics_count_requests_batches_and_queue(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, metrics_port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = posenc_pb2_grpc.PosencStub(ch)
            for _ in range(3):
                stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="abc")))
            with pytest.raises(grpc.RpcError):
                stub.Predict(pb.PredictRequest(model="nope", prompt=pb.Prompt(text="abc")))
        body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
    finally:
        srv.stop(grace=1)
    assert 'posenc_requests_total{code="OK",model="rope",rpc="Predict"} 3.0' in body
    assert 'posenc_requests_total{code="NOT_FOUND",model="unknown",rpc="Predict"} 1.0' in body
    assert 'posenc_request_seconds_count{rpc="Predict"} 4.0' in body
    assert 'posenc_batch_size_count{model="rope"}' in body  # warm-up + 3 requests
    assert 'posenc_queue_depth{model="alibi"} 0.0' in body


def make_cert(name, issuer_key=None, issuer_name=None, ca=False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key, cert, cert.public_bytes(serialization.Encoding.PEM), pem_key


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert, ca_pem, _ = make_cert("posenc test CA", ca=True)
    _, _, server_pem, server_key = make_cert("localhost", ca_key, ca_cert.subject)
    _, _, client_pem, client_key = make_cert("client", ca_key, ca_cert.subject)
    files = {"ca": ca_pem, "cert": server_pem, "key": server_key, "client_cert": client_pem,
             "client_key": client_key}
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
    return {name: d / f"{name}.pem" for name in files}


def call(port, creds):
    with grpc.secure_channel(f"127.0.0.1:{port}", creds,
                             options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        return posenc_pb2_grpc.PosencStub(ch).ListModels(pb.ListModelsRequest(), timeout=10)


def test_tls(tiny_artifacts, pki):
    root, _ = tiny_artifacts
    srv = start(root, tls_cert=pki["cert"], tls_key=pki["key"])
    try:
        ok = call(srv.port, grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes()))
        assert len(ok.models) == len(REGISTRY)
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:  # plaintext is refused
            with pytest.raises(grpc.RpcError) as err:
                posenc_pb2_grpc.PosencStub(ch).ListModels(pb.ListModelsRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(grace=1)


def test_mutual_tls_requires_a_client_certificate(tiny_artifacts, pki):
    root, _ = tiny_artifacts
    srv = start(root, tls_cert=pki["cert"], tls_key=pki["key"], tls_client_ca=pki["ca"])
    try:
        ca = pki["ca"].read_bytes()
        with_cert = grpc.ssl_channel_credentials(root_certificates=ca, private_key=pki["client_key"].read_bytes(),
                                                 certificate_chain=pki["client_cert"].read_bytes())
        assert len(call(srv.port, with_cert).models) == len(REGISTRY)
        with pytest.raises(grpc.RpcError) as err:
            call(srv.port, grpc.ssl_channel_credentials(root_certificates=ca))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(grace=1)


def test_every_answer_names_the_replica_that_gave_it(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, instance="replica-7")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = posenc_pb2_grpc.PosencStub(ch)
            _, call_ = stub.Predict.with_call(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="abc")))
            assert ("posenc-instance", "replica-7") in tuple(call_.trailing_metadata())  # unary: with the status
            assert instance_of(call_) == "replica-7"
            with pytest.raises(grpc.RpcError) as err:  # errors carry it too
                stub.Predict(pb.PredictRequest(model="nope", prompt=pb.Prompt(text="abc")))
            assert ("posenc-instance", "replica-7") in tuple(err.value.trailing_metadata())
            stream = stub.Generate(pb.GenerateRequest(model="alibi", prompt=pb.Prompt(text="a"), max_new_tokens=2))
            assert ("posenc-instance", "replica-7") in tuple(stream.initial_metadata())  # a stream: up front
            list(stream)
            assert instance_of(stream) == "replica-7"
            kserve = grpc_service_pb2_grpc.GRPCInferenceServiceStub(ch)
            _, call_ = kserve.ServerLive.with_call(grpc_service_pb2.ServerLiveRequest())
            assert instance_of(call_) == "replica-7"
    finally:
        srv.stop(grace=1)


def test_healthcheck_command_reads_grpc_health(tiny_artifacts):
    from service import healthcheck

    root, _ = tiny_artifacts
    srv = start(root)
    target = f"127.0.0.1:{srv.port}"
    try:
        assert healthcheck.check(target) == (True, "SERVING")
        assert healthcheck.main(["--target", target, "--service", "posenc.v1.Posenc"]) == 0
        assert healthcheck.check(target, "no.such.Service")[0] is False  # NOT_FOUND
    finally:
        srv.stop(grace=1)
    ok, status = healthcheck.check(target, timeout=1.0)  # nothing listens any more
    assert not ok and status.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))
    assert healthcheck.main(["--target", target, "--timeout", "1"]) == 1
