"""Mutual TLS with certificates made by `pdserve certs`: the pipeline works over it, and every
internal method refuses a peer without a certificate, with another CA's, or of the wrong role."""

import asyncio
import http.client
import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from procs import Stack, generate, greedy_request, start_router, start_service, wait_until
from pdserve.certs import make_dev_certs, service_flags
from pdserve.models.loading import load_served_model
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

MODEL = load_served_model("tinygpt", weights=False).fingerprint


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_stack(certs, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("tls-stack"))
    decode = start_service("decode", *service_flags(certs, "decode"), tmp_dir=tmp)
    prefill = start_service("prefill", *service_flags(certs, "prefill"), tmp_dir=tmp)
    router = start_router([prefill], [decode], *service_flags(certs, "router"), tmp_dir=tmp)
    stack = Stack(router, [prefill], [decode])
    yield stack
    for service in (router, prefill, decode):
        service.stop()


def credentials(certs, role: str | None, ca=None) -> grpc.ChannelCredentials:
    """A client's credentials: the CA to verify servers with, and `role`'s certificate if any."""
    root = (ca or certs / "ca.pem").read_bytes()
    if role is None:
        return grpc.ssl_channel_credentials(root_certificates=root)
    return grpc.ssl_channel_credentials(
        root_certificates=root,
        private_key=(certs / f"{role}-key.pem").read_bytes(),
        certificate_chain=(certs / f"{role}.pem").read_bytes(),
    )


def reserve(channel):
    request = pb.DecodeRequest(
        request_id="x",
        prompt_token_ids=[1, 2, 3],
        sampling=pb.SamplingParams(max_tokens=2),
        model_fingerprint=MODEL,
    )
    call = pb_grpc.DecodeServiceStub(channel).Decode(request, timeout=5)
    next(call)
    call.cancel()


def pool_stats(channel):
    pb_grpc.DecodeServiceStub(channel).GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)


def push_kv(channel):
    pb_grpc.DecodeServiceStub(channel).PushKv(iter([pb.PushKvRequest()]), timeout=5)


def prefill_call(channel):
    request = pb.PrefillRequest(
        request_id="x", prompt_token_ids=[1], lease_id="0" * 32, decode_address="127.0.0.1:1"
    )
    pb_grpc.PrefillServiceStub(channel).Prefill(request, timeout=5)


def test_the_pipeline_runs_over_mutual_tls(tls_stack, certs):
    with grpc.secure_channel(tls_stack.router.address, credentials(certs, None)) as channel:
        tokens, _, last = generate(
            pb_grpc.RouterServiceStub(channel), greedy_request(list(range(30)), 6), 60
        )
    assert len(tokens) == 6
    assert last.metrics.handoff.transport == "tcp"  # the data plane, over TLS too
    wait_until(lambda: pool_whole(tls_stack, certs), 10, "decode's pool to be whole")


def test_the_http_api_serves_https_with_the_routers_certificate(tls_stack, certs):
    """With --tls-*, the router's HTTP API is HTTPS too, verified against the dev CA; a plaintext
    request to it gets no answer."""
    port = tls_stack.router.http_port
    trusting = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/v1/models", context=trusting) as reply:
        assert reply.status == 200 and json.load(reply)["data"][0]["id"] == "tinygpt"
    with pytest.raises((urllib.error.URLError, http.client.HTTPException, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
    with pytest.raises(urllib.error.URLError) as err:  # a client that does not trust the CA
        urllib.request.urlopen(f"https://127.0.0.1:{port}/v1/models", timeout=10)
    assert isinstance(err.value.reason, ssl.SSLCertVerificationError)


@pytest.mark.parametrize(
    "service, method, role",
    [
        ("decode", reserve, "router"),
        ("decode", pool_stats, "router"),
        ("decode", push_kv, "prefill"),
        ("prefill", prefill_call, "router"),
    ],
    ids=["Decode", "GetPoolStats", "PushKv", "Prefill"],
)
def test_internal_methods_refuse_wrong_peers(tls_stack, certs, tmp_path, service, method, role):
    address = (tls_stack.decodes[0] if service == "decode" else tls_stack.prefills[0]).address
    override = [("grpc.ssl_target_name_override", service)]

    def attempt(creds):
        with grpc.secure_channel(address, creds, options=override) as channel:
            try:
                method(channel)
            except grpc.RpcError as exc:
                return exc
        return None

    # No client certificate, or one from another CA: the handshake itself fails.
    assert attempt(credentials(certs, None)).code() == grpc.StatusCode.UNAVAILABLE
    other = make_dev_certs(tmp_path / "other")
    assert attempt(credentials(other, "router")).code() == grpc.StatusCode.UNAVAILABLE
    # A valid certificate of the wrong role: refused by name, before the handler runs.
    wrong = "client" if role != "client" else "decode"
    err = attempt(credentials(certs, wrong))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"only by the {role} role" in err.details() and repr(wrong) in err.details()


def test_a_plaintext_client_against_a_tls_port_fails_cleanly(tls_stack):
    with grpc.insecure_channel(tls_stack.router.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.RouterServiceStub(channel).Generate(greedy_request([1], 1), timeout=5).next()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_data_plane_refuses_a_peer_that_is_not_prefill(tls_stack, certs):
    """A client certificate of the router role (valid, wrong role) gets PERMISSION_DENIED from
    the data plane before any KV is read; a plain TCP client never completes a handshake."""
    from pdserve.kv.tcp_transport import LENGTH
    from pdserve.rpc.tls import Tls

    decode = tls_stack.decodes[0]
    port = _data_plane_port(decode)
    router_tls = Tls.load(*(str(p) for p in _paths(certs, "router")))

    async def main():
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=router_tls.client_context(), server_hostname="decode"
        )
        (length,) = LENGTH.unpack(await asyncio.wait_for(reader.readexactly(4), 10))
        reply = pb.DataPlaneReply.FromString(await reader.readexactly(length))
        writer.close()
        return reply

    reply = asyncio.run(main())
    assert reply.error_code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert "only the prefill role" in reply.error_message
    wait_until(lambda: pool_whole(tls_stack, certs), 10, "decode's pool to be whole")


def pool_whole(stack, certs) -> bool:
    """GetPoolStats as the router may call it: with the router's certificate."""
    options = [("grpc.ssl_target_name_override", "decode")]
    creds = credentials(certs, "router")
    with grpc.secure_channel(stack.decodes[0].address, creds, options=options) as channel:
        stats = pb_grpc.DecodeServiceStub(channel).GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)
    return stats.free_blocks == stats.total_blocks and not stats.pending_leases


def _paths(certs, role):
    return certs / f"{role}.pem", certs / f"{role}-key.pem", certs / "ca.pem"


def _data_plane_port(decode) -> int:
    text = open(decode.log_path).read()
    marker = "KV data plane (tcp) listening on 127.0.0.1:"
    return int(text.split(marker, 1)[1].split()[0])


def test_plaintext_beyond_loopback_needs_insecure(tmp_path):
    """A service asked to listen in plaintext where others can reach it refuses to start."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "decode",
            "--model",
            "tinygpt",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "plaintext" in out.stderr and "--insecure" in out.stderr
