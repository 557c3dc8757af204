"""TLS and API keys for both front doors.

- TLS: `--tls-cert`/`--tls-key` serve gRPC and HTTP over TLS; `--tls-client-ca` also
  requires client certificates signed by that CA (mutual TLS).
- API keys: with `--api-key` (repeatable) or `--api-key-file` (one per line), every RPC and
  HTTP route except health needs `authorization: Bearer <key>` (gRPC metadata, HTTP
  header); otherwise UNAUTHENTICATED / 401. A request belongs to the key that started it:
  Abort stops only the caller's own requests, and server status needs an `--admin-key`,
  which may also abort anyone's.
- Reflection is off when keys are on, unless `--reflection`.
- Binding a non-loopback address with neither TLS nor a key is refused unless `--insecure`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hmac
import ipaddress
import logging
import ssl
from pathlib import Path

import grpc

from server.rpc_checks import checked

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
ADMIN_METHODS = ("/jaxserve.v1.Inference/GetServerStatus",)
# The caller's key travels from the interceptor to the servicer in a context variable.
caller_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("caller_key",
                                                                         default=None)


@dataclasses.dataclass
class Security:
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    api_keys: frozenset[str] = frozenset()
    admin_keys: frozenset[str] = frozenset()
    insecure: bool = False
    reflection: bool = False
    _warned: bool = dataclasses.field(default=False, repr=False)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        for path in (self.tls_cert, self.tls_key, self.tls_client_ca):
            if path and not Path(path).is_file():
                raise ValueError(f"{path}: no such file")
        self.api_keys = frozenset(self.api_keys) | frozenset(self.admin_keys)

    @classmethod
    def from_args(cls, args) -> "Security":
        keys = set(args.api_key or [])
        if args.api_key_file:
            if not Path(args.api_key_file).is_file():
                raise ValueError(f"--api-key-file {args.api_key_file}: no such file")
            keys |= {line.strip() for line in Path(args.api_key_file).read_text().splitlines()
                     if line.strip()}
        return cls(args.tls_cert, args.tls_key, args.tls_client_ca, frozenset(keys),
                   frozenset(args.admin_key or []), args.insecure, args.reflection)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def auth(self) -> bool:
        return bool(self.api_keys)

    @property
    def serve_reflection(self) -> bool:
        return not self.auth or self.reflection

    def check_bind(self, host: str) -> None:
        """Refuse an open, unprotected address (ValueError saying what to add)."""
        if _is_loopback(host) or self.tls or self.auth:
            return
        if not self.insecure:
            raise ValueError(
                f"refusing to serve {host} without TLS or an API key: anyone who reaches it "
                f"could generate, abort requests and read status. Add --tls-cert/--tls-key "
                f"and/or --api-key, or --insecure to serve it open anyway")
        if not self._warned:
            log.warning("serving %s without TLS or API keys (--insecure)", host)
            self._warned = True

    def key_of(self, authorization: str | None) -> str | None:
        """The API key a `Bearer <key>` header carries, if it is one of ours."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization[len("Bearer "):].strip()
        for key in self.api_keys:
            if hmac.compare_digest(given.encode(), key.encode()):
                return key
        return None

    def is_admin(self, key: str | None) -> bool:
        return key is not None and key in self.admin_keys

    # ------------------------------------------------------------------ gRPC

    def grpc_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        ca = Path(self.tls_client_ca).read_bytes() if self.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())],
            root_certificates=ca, require_client_auth=ca is not None)

    def grpc_interceptors(self) -> list:
        return [_AuthInterceptor(self)] if self.auth else []

    # ------------------------------------------------------------------ HTTP

    def uvicorn_ssl(self) -> dict:
        if not self.tls:
            return {}
        extra = {"ssl_ca_certs": self.tls_client_ca,
                 "ssl_cert_reqs": ssl.CERT_REQUIRED} if self.tls_client_ca else {}
        return {"ssl_certfile": self.tls_cert, "ssl_keyfile": self.tls_key, **extra}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED without a known key (health excepted); PERMISSION_DENIED for admin
    methods without an admin key. The caller's key is left in `caller_key`."""

    def __init__(self, security: Security):
        self.security = security

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        key = self.security.key_of(metadata.get("authorization"))
        if key is None:
            return _denied(handler, grpc.StatusCode.UNAUTHENTICATED,
                           "missing or unknown API key: send metadata "
                           "'authorization: Bearer <key>'")
        if details.method in ADMIN_METHODS and not self.security.is_admin(key):
            return _denied(handler, grpc.StatusCode.PERMISSION_DENIED,
                           f"{details.method} needs an admin key")
        return _with_key(handler, key)


def _denied(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    async def deny(request, context):
        await context.abort(code, message)
    return checked(handler, deny)


def _with_key(handler: grpc.RpcMethodHandler, key: str):
    async def remember(request, context):  # awaited in the call's task: the method sees it
        caller_key.set(key)
    return checked(handler, remember)
