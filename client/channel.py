"""Channels to posenc workers: targets, load balancing, TLS, and the retries that are safe.

A target is `HOST:PORT`, a comma-separated list of them (every address is resolved once and the calls are spread
over all of them), or a gRPC name such as `dns:///posenc:50051` whose resolver returns every replica.
Idempotent calls (ListModels, Predict, Score, Compare, Encoding, ModelInfer) are retried once when a replica
answers UNAVAILABLE (it is draining, or went away); Generate is never retried, so no stream is replayed after
its first token.  The retry is gRPC's own (a service-config retryPolicy), so it also sees calls made through
generated stubs on the same channel.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc

INSTANCE_HEADER = "posenc-instance"  # the worker names the replica that answered in this metadata key

IDEMPOTENT = {
    "posenc.v1.Posenc": ["ListModels", "Predict", "Score", "Compare", "Encoding"],
    "inference.GRPCInferenceService": ["ModelInfer", "ModelMetadata", "ModelReady", "ServerReady", "ServerLive",
                                       "ServerMetadata", "ModelConfig"],
}


class ChannelError(ValueError):
    """A target or TLS setting that cannot work (the CLIs print it as one line and exit 2)."""


@dataclass(frozen=True)
class TLS:
    """Client-side TLS: the CA that signed the worker's certificate, and a client certificate for mutual TLS."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    @classmethod
    def from_env(cls, ca=None, cert=None, key=None) -> TLS | None:
        """Flags first, then POSENC_TLS_CA / POSENC_TLS_CLIENT_CERT / POSENC_TLS_CLIENT_KEY; None = plaintext."""
        ca = ca or os.environ.get("POSENC_TLS_CA") or None
        cert = cert or os.environ.get("POSENC_TLS_CLIENT_CERT") or None
        key = key or os.environ.get("POSENC_TLS_CLIENT_KEY") or None
        if not (ca or cert or key):
            return None
        if bool(cert) != bool(key):
            raise ChannelError("a client certificate needs both --tls-cert and --tls-key "
                               "(POSENC_TLS_CLIENT_CERT / POSENC_TLS_CLIENT_KEY)")
        return cls(*(Path(p) if p else None for p in (ca, cert, key)))

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials from the PEM files; ChannelError when one cannot be read or is not PEM."""

        def read(path: Path | None, what: str) -> bytes | None:
            if path is None:
                return None
            try:
                data = path.read_bytes()
            except OSError as err:
                raise ChannelError(f"cannot read the {what} {path}: {err.strerror or err}") from None
            if b"-----BEGIN" not in data:
                raise ChannelError(f"the {what} {path} is not PEM")
            return data

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca, "TLS CA file"),
                                            private_key=read(self.key, "TLS client key"),
                                            certificate_chain=read(self.cert, "TLS client certificate"))


def service_config(lb: str = "pick_first", retries: bool = True) -> str:
    """The channel's gRPC service config as JSON: the load-balancing policy `lb`, and with `retries` one retry on
    UNAVAILABLE for the idempotent calls (IDEMPOTENT)."""
    config: dict = {"loadBalancingConfig": [{lb: {}}]}
    if retries:
        config["methodConfig"] = [{
            "name": [{"service": s, "method": m} for s, methods in IDEMPOTENT.items() for m in methods],
            "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
        }]
    return json.dumps(config)


def resolve(target: str) -> tuple[str, str | None]:
    """(gRPC target, load-balancing policy it implies or None).  A comma-separated list of HOST:PORT becomes one
    `ipv4:`/`ipv6:` target holding every address the hosts resolve to, spread round-robin."""
    target = target.strip()
    if not target:
        raise ChannelError("empty target: give HOST:PORT, a comma-separated list of them, or dns:///NAME:PORT")
    if "," not in target:
        return target, None
    v4, v6 = [], []
    for item in (t.strip() for t in target.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ChannelError(f"target {item!r} in the list is not HOST:PORT")
        host = host.strip("[]")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as err:
            raise ChannelError(f"cannot resolve {host!r} from the target list: {err.strerror or err}") from None
        for family, _, _, _, addr in infos:
            ip = ipaddress.ip_address(addr[0])
            (v4 if family == socket.AF_INET else v6).append(f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}")
    v4, v6 = list(dict.fromkeys(v4)), list(dict.fromkeys(v6))
    if v4 and v6:  # gRPC's static lists hold one family: keep the larger set
        v6 = [] if len(v4) >= len(v6) else v6
    return ("ipv4:" + ",".join(v4)) if v4 else ("ipv6:" + ",".join(v6)), "round_robin"


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer KEY` to every call's metadata (plaintext or TLS alike)."""

    def __init__(self, key: str):
        self.header = ("authorization", f"Bearer {key}")

    def _with_key(self, details):
        metadata = [m for m in (details.metadata or ()) if m[0] != "authorization"]
        return details._replace(metadata=[*metadata, self.header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_key(details), request_iterator)

    intercept_stream_stream = intercept_stream_unary


def api_key_from_env(key: str | None = None) -> str | None:
    """The API key to send: `key`, else POSENC_API_KEY; None = none.  It travels in a header, so it must be
    printable ASCII without spaces."""
    key = key or os.environ.get("POSENC_API_KEY") or None
    if key is not None and not all(33 <= ord(c) <= 126 for c in key):
        raise ChannelError("the API key (POSENC_API_KEY) must be printable ASCII without spaces")
    return key


def channel_for(target: str, lb: str | None = None, tls: TLS | None = None, retries: bool = True,
                server_name: str | None = None, api_key: str | None = None) -> grpc.Channel:
    """A channel to one worker or many.  `lb`: pick_first (default for one address) or round_robin (the default
    for a list; use it with dns:/// names that resolve to every replica).  `api_key` (else POSENC_API_KEY) goes
    with every call as `authorization: Bearer KEY`.

    A worker with --max-connection-age-seconds sends GOAWAY when a connection is that old; the channel then
    resolves the target again (at most once a second) and connects to every address it finds, so replicas added
    behind a dns:/// name get calls without a new channel."""
    key = api_key_from_env(api_key)
    resolved, implied = resolve(target)
    options = [("grpc.service_config", service_config(lb or implied or "pick_first", retries)),
               ("grpc.enable_retries", 1 if retries else 0),
               # re-resolve a dns:/// name within a second of losing a replica (gRPC's default waits 30 s, longer
               # than a rolling update: measured in make swarm-test)
               ("grpc.dns_min_time_between_resolutions_ms", 1000)]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if tls is None:
        channel = grpc.insecure_channel(resolved, options=options)
    else:
        channel = grpc.secure_channel(resolved, tls.credentials(), options=options)
    return grpc.intercept_channel(channel, _Bearer(key)) if key else channel


def instance_of(call) -> str | None:
    """The replica that answered a call (or an RpcError): trailing metadata on unary calls, initial on streams."""
    for part in (call.trailing_metadata, call.initial_metadata):
        found = dict(part() or ()).get(INSTANCE_HEADER)
        if found:
            return found
    return None
