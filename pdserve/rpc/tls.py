"""Mutual TLS between the services, and who may call what.

Every service takes --tls-cert, --tls-key and --tls-ca. With them, prefill and decode accept only
peers whose certificate the CA signed (require_client_auth), and each internal method checks the
peer's role, the certificate's common name, before its handler runs. The router's own port is
TLS with a server certificate only: its callers are clients, who present an API key instead.
Outgoing channels present the service's certificate and verify the peer's as its role's name
(the address dialled is often an IP the certificate cannot list).

Without them a service speaks plaintext, which is allowed on loopback only, or with --insecure.
"""

import ipaddress
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.rpc.api_key import ApiKeyInterceptor, aio_api_key_interceptors, api_key_metadata

log = logging.getLogger(__name__)

# Internal methods and the one role that may call each.
ALLOWED_ROLES = {
    "/pdserve.v1.DecodeService/Decode": "router",
    "/pdserve.v1.DecodeService/GetPoolStats": "router",
    "/pdserve.v1.DecodeService/PushKv": "prefill",
    "/pdserve.v1.DecodeService/GetDataEndpoints": "prefill",
    "/pdserve.v1.PrefillService/Prefill": "router",
    "/pdserve.v1.PrefillService/ScorePrompt": "router",
}


class TlsConfigError(ValueError):
    """The TLS settings are incomplete, unreadable, or missing where they are required."""


@dataclass(frozen=True)
class Tls:
    """The PEM bytes of one service's certificate, key and CA."""

    cert: bytes
    key: bytes
    ca: bytes
    paths: tuple[str, str, str]

    @classmethod
    def load(cls, cert: str, key: str, ca: str) -> "Tls | None":
        """None when no file is named (plaintext); TlsConfigError when only some are."""
        given = [p for p in (cert, key, ca) if p]
        if not given:
            return None
        if len(given) != 3:
            raise TlsConfigError("--tls-cert, --tls-key and --tls-ca go together: give all three")
        try:
            data = [Path(p).read_bytes() for p in (cert, key, ca)]
        except OSError as exc:
            raise TlsConfigError(f"cannot read {exc.filename}: {exc.strerror}") from None
        tls = cls(data[0], data[1], data[2], paths=(cert, key, ca))
        tls.check()
        return tls

    def check(self) -> None:
        """Parses the files now, so that a wrong one stops the service at start, naming it, and
        not at its first handshake (gRPC reads them only then)."""
        cert, key, ca = self.paths
        try:
            ssl.create_default_context(cafile=ca)
        except ssl.SSLError as exc:
            raise TlsConfigError(f"--tls-ca {ca}: not a PEM CA certificate ({exc})") from None
        try:
            ssl.create_default_context().load_cert_chain(cert, key)
        except ssl.SSLError as exc:
            raise TlsConfigError(
                f"--tls-cert {cert} and --tls-key {key}: not a PEM certificate and its own "
                f"private key ({exc})"
            ) from None

    # -- gRPC
    def server_credentials(self, require_client_auth: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca,
            require_client_auth=require_client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    # -- the TCP data plane (Python's ssl module reads files, not bytes)
    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.paths[2])
        ctx.load_cert_chain(self.paths[0], self.paths[1])
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def https_context(self) -> ssl.SSLContext:
        """For the HTTP API: the same certificate, and no client certificate asked for (its
        clients show an API key instead)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.paths[0], self.paths[1])
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.paths[2])
        ctx.load_cert_chain(self.paths[0], self.paths[1])
        return ctx


def client_channel(address: str, server_name: str | None = None) -> grpc.Channel:
    """A blocking channel for the command-line clients (generate, chat, health): TLS when
    PDSERVE_TLS_CA is set (with PDSERVE_TLS_CERT and PDSERVE_TLS_KEY, also a client
    certificate), plaintext otherwise; PDSERVE_API_KEY's key on every call (rpc/api_key.py).
    server_name: verify the server's certificate as that name (a role) instead of the address."""
    creds = _client_credentials_from_env()
    options = target_name_option(server_name) if server_name else None
    channel = (
        grpc.secure_channel(address, creds, options=options)
        if creds
        else grpc.insecure_channel(address)
    )
    return grpc.intercept_channel(channel, ApiKeyInterceptor()) if api_key_metadata() else channel


def aio_client_channel(address: str) -> grpc.aio.Channel:
    """client_channel for asyncio clients (the load client)."""
    creds = _client_credentials_from_env()
    interceptors = aio_api_key_interceptors() or None
    if creds is None:
        return grpc.aio.insecure_channel(address, interceptors=interceptors)
    return grpc.aio.secure_channel(address, creds, interceptors=interceptors)


def _client_credentials_from_env() -> grpc.ChannelCredentials | None:
    ca, cert, key = (os.environ.get(f"PDSERVE_TLS_{name}", "") for name in ("CA", "CERT", "KEY"))
    if not ca:
        return None
    try:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(ca).read_bytes(),
            private_key=Path(key).read_bytes() if key else None,
            certificate_chain=Path(cert).read_bytes() if cert else None,
        )
    except OSError as exc:
        raise TlsConfigError(f"cannot read {exc.filename}: {exc.strerror}") from None


def target_name_option(role: str) -> list[tuple[str, str]]:
    """Channel options that verify the peer's certificate as `role`, whatever address is dialled."""
    return [("grpc.ssl_target_name_override", role)]


def check_plaintext_allowed(host: str, insecure: bool, what: str) -> None:
    """Plaintext on an address others can reach needs --insecure, and is logged loudly."""
    if is_loopback(host):
        log.info("%s: plaintext on loopback (%s); give --tls-* to encrypt", what, host)
        return
    if not insecure:
        raise TlsConfigError(
            f"{what} would listen in plaintext on {host}, which others can reach: give "
            "--tls-cert, --tls-key and --tls-ca (pdserve certs makes development ones), listen "
            "on 127.0.0.1, or pass --insecure"
        )
    log.warning("%s: PLAINTEXT on %s (--insecure): anyone who reaches it can call it", what, host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def peer_role(context) -> str | None:
    """The common name of the peer's verified certificate, or None without one."""
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else None


def peer_identity(context) -> str:
    """Who is calling, for the limits kept per caller (decode's pending-lease shares): the role
    and name of the peer's verified certificate under mTLS ("router CN=router,O=..."), else the
    host it connects from (without TLS, every process on one machine is one caller: an address
    is all there is to tell callers apart, and a port would let one caller be many)."""
    auth = context.auth_context()
    role = peer_role(context)
    if role is not None:
        subject = (auth.get("x509_subject") or [b""])[0].decode(errors="replace")
        return f"{role} {subject}".rstrip()
    return peer_host(context.peer())


def peer_host(peer: str) -> str:
    """The host of a grpc peer string: ipv4:1.2.3.4:5 -> 1.2.3.4, ipv6:[::1]:5 -> ::1."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return peer  # unix: and the like name the socket, which is as close as it gets


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Refuses an internal method to any peer without the role it needs (PERMISSION_DENIED),
    before the handler runs or a byte of the request is acted on."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        role = ALLOWED_ROLES.get(details.method)
        if handler is None or role is None:
            return handler
        return _guarded(handler, details.method, role)


def _guarded(handler, method: str, role: str):
    async def refuse_unless_allowed(context) -> None:
        peer = peer_role(context)
        if peer != role:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} may be called only by the {role} role; this peer's certificate says "
                f"{peer!r}"
                if peer
                else f"{method} needs a client certificate of the {role} role",
            )

    def wrap(behavior: Callable, streaming_response: bool):
        if streaming_response:

            async def stream(request, context):
                await refuse_unless_allowed(context)
                async for item in behavior(request, context):
                    yield item

            return stream

        async def unary(request, context):
            await refuse_unless_allowed(context)
            return await behavior(request, context)

        return unary

    kinds = [
        ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
        ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
    ]
    for attribute, make, streaming in kinds:
        behavior = getattr(handler, attribute)
        if behavior is not None:
            return make(
                wrap(behavior, streaming),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler
