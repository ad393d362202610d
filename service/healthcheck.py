"""python -m service.healthcheck [--target HOST:PORT] [--service NAME]: exit 0 when grpc.health.v1 says SERVING.

The container HEALTHCHECK and the compose healthcheck run this: it needs only grpcio and grpcio-health-checking,
imports nothing of the worker, and gives up after --timeout seconds so a wedged worker reads as unhealthy.
Exit status: 0 SERVING, 1 anything else (NOT_SERVING, unreachable, refused), 2 bad options or certificate files.

TLS (the same names as the client's): --tls-ca / POSENC_TLS_CA is the CA that signed the worker's certificate;
--tls-cert and --tls-key / POSENC_TLS_CLIENT_CERT and POSENC_TLS_CLIENT_KEY present a client certificate (mutual
TLS); --tls-server-name / POSENC_TLS_SERVER_NAME is the name the worker's certificate must carry when it is not
the target's host.  Inside the worker's own container, where POSENC_TLS_CERT names the worker's certificate and no
CA is given, the check trusts exactly that certificate (gRPC accepts it as its own trust anchor, self-signed or
not): the probe then needs no CA file of its own.  Mutual TLS needs a client certificate in the environment.
The worker answers health without an API key; POSENC_API_KEY, when set, is sent along (for a gateway in front).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model import cli
from model.cli import ClientTLS, Parser


class OptionError(ValueError):
    """A setting that cannot work: one line on stderr, exit status 2."""


def _pem(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise OptionError(f"cannot read the {what} {path}: {err.strerror or err}") from None
    if b"-----BEGIN" not in data:
        raise OptionError(f"the {what} {path} is not PEM")
    return data


def credentials(ca: str | None = None, cert: str | None = None, key: str | None = None,
                env: Mapping[str, str] | None = None) -> grpc.ChannelCredentials | None:
    """Flags first, then the environment; None = plaintext.  With no CA, no client certificate and the worker's own
    POSENC_TLS_CERT set (the container), trust that certificate."""
    if env is None:
        env = os.environ
    ca = ca or env.get("POSENC_TLS_CA") or None
    cert = cert or env.get("POSENC_TLS_CLIENT_CERT") or None
    key = key or env.get("POSENC_TLS_CLIENT_KEY") or None
    if bool(cert) != bool(key):
        raise OptionError("a client certificate needs both --tls-cert and --tls-key "
                          "(POSENC_TLS_CLIENT_CERT / POSENC_TLS_CLIENT_KEY)")
    if not ca and env.get("POSENC_TLS_CERT"):
        ca = env["POSENC_TLS_CERT"]  # the worker's own (self-signed) certificate
    if not (ca or cert):
        return None
    return grpc.ssl_channel_credentials(root_certificates=_pem(ca, "TLS CA file"),
                                        private_key=_pem(key, "TLS client key"),
                                        certificate_chain=_pem(cert, "TLS client certificate"))


def check(target: str, service: str = "", timeout: float = 3.0, creds: grpc.ChannelCredentials | None = None,
          server_name: str | None = None) -> tuple[bool, str]:
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = grpc.secure_channel(target, creds, options) if creds else grpc.insecure_channel(target, options)
    with channel:
        try:
            # The worker answers health without a key; one in POSENC_API_KEY goes along for gateways that want it.
            key = os.environ.get("POSENC_API_KEY")
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=timeout,
                                                             metadata=(("authorization", f"Bearer {key}"),) if key
                                                             else None)
        except grpc.RpcError as err:
            return False, f"{err.code().name}: {err.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m service.healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=os.environ.get("POSENC_HEALTH_TARGET",
                                                      f"127.0.0.1:{os.environ.get('POSENC_PORT', '50051')}"))
    p.add_argument("--service", default="", help="a service name; empty = the whole server")
    p.add_argument("--timeout", type=positive, default=3.0)
    cli.add_options(p, ClientTLS, "POSENC_")  # the TLS flags the client CLI shares (model.cli.ClientTLS)
    a = p.parse_args(argv)
    try:
        tls = cli.build(ClientTLS, a)
        ca, cert, key = (str(v) if v else None for v in (tls.tls_ca, tls.tls_cert, tls.tls_key))
        creds = credentials(ca, cert, key)
    except (OptionError, cli.SettingError) as err:
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 2
    ok, status = check(a.target, a.service, a.timeout, creds, tls.tls_server_name)
    print(f"{a.target}: {status}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
