"""TLS (mutual) and API keys on a real server, with real clients: grpcio with SSL
credentials, the `openai` package over HTTPS; certificates made with the openssl CLI."""

from __future__ import annotations

import ssl
import subprocess
import time

import grpc
import httpx
import openai
import pytest

from jaxserve.cli import main
from serverproc import running_server, ssl_context
from server.client import Client

KEYS = {"alice": "key-alice-1234", "bob": "key-bob-5678", "admin": "key-admin-0000"}


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both CA-signed."""
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "2", "-subj", "/CN=jaxserve test CA", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext",
                 cwd=d)
    return {k: str(d / f) for k, f in [("ca", "ca.pem"), ("server_cert", "server.pem"),
                                      ("server_key", "server.key"), ("client_cert", "client.pem"),
                                      ("client_key", "client.key")]}


@pytest.fixture(scope="module")
def server(checkpoints, certs, tmp_path_factory):
    path, _ = checkpoints("llama")
    tls = (certs["ca"], certs["client_cert"], certs["client_key"])
    flags = ["--tls-cert", certs["server_cert"], "--tls-key", certs["server_key"],
             "--tls-client-ca", certs["ca"], "--api-key", KEYS["alice"], "--api-key",
             KEYS["bob"], "--admin-key", KEYS["admin"]]
    log = tmp_path_factory.mktemp("secure") / "server.log"
    with running_server(path, log, *flags, tls=tls) as (target, proc):
        yield target, proc, tls


def client_for(server, who: str | None, cert: bool = True) -> Client:
    target, _, (ca, cert_file, key_file) = server
    return Client(target, KEYS.get(who), tls_ca=ca,
                  tls_cert=(cert_file, key_file) if cert else None)


def test_grpc_needs_a_known_key_over_mutual_tls(server):
    alice = client_for(server, "alice")
    ids, _, done = alice.complete([5, 6, 7], max_tokens=3, ignore_eos=True)
    assert len(ids) == 3 and done.finish_reason == "length"
    for who in (None, "mallory"):
        c = client_for(server, who)
        with pytest.raises(grpc.RpcError) as e:
            c.complete([5, 6, 7], max_tokens=3)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in e.value.details()
    no_cert = client_for(server, "alice", cert=False)  # the server wants a client certificate
    with pytest.raises(grpc.RpcError) as e:
        no_cert.complete([5, 6, 7], max_tokens=3, timeout=5)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    plaintext = Client(server[0], KEYS["alice"])
    with pytest.raises(grpc.RpcError):
        plaintext.complete([5, 6, 7], max_tokens=3, timeout=5)


def test_abort_and_status_are_scoped_to_the_caller(server):
    alice, bob, admin = (client_for(server, w) for w in ("alice", "bob", "admin"))
    stream = alice.generate([5, 6, 7], request_id="alices", max_tokens=100, ignore_eos=True,
                            temperature=0.0)
    assert next(stream).HasField("chunk")
    assert bob.abort("alices") == 0  # not bob's
    with pytest.raises(grpc.RpcError) as e:
        bob.status()
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert admin.status().running_requests >= 0
    assert alice.abort("alices") == 1
    assert list(stream)[-1].complete.finish_reason == "abort"
    stream = bob.generate([5, 6, 7], request_id="bobs", max_tokens=100, ignore_eos=True)
    assert next(stream).HasField("chunk")
    assert admin.abort("bobs") == 1  # an admin may abort anyone's
    assert list(stream)[-1].complete.finish_reason == "abort"


def test_reflection_is_off_with_keys(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)

    with pytest.raises(grpc.RpcError):
        ProtoReflectionDescriptorDatabase(client_for(server, "alice").channel).get_services()


def test_http_needs_a_key_over_mutual_tls(server):
    url, tls = server[1].http_url, server[2]
    assert url.startswith("https://")
    with httpx.Client(verify=ssl_context(tls)) as http:
        good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["alice"], http_client=http,
                             max_retries=0)
        reply = good.completions.create(model=good.models.list().data[0].id, prompt=[5, 6, 7],
                                        max_tokens=3, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", http_client=http,
                            max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert http.get(f"{url}/health").status_code == 200  # probes need no key
        assert http.get(f"{url}/metrics").status_code == 401
        assert http.get(f"{url}/metrics", headers={
            "Authorization": f"Bearer {KEYS['bob']}"}).status_code == 200
    with pytest.raises(httpx.HTTPError):  # no client certificate
        httpx.get(f"{url}/health", verify=ssl.create_default_context(cafile=tls[0]), timeout=5)


def test_an_open_address_needs_tls_a_key_or_insecure(capsys):
    start = time.perf_counter()
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "refusing to serve 0.0.0.0 without TLS or an API key" in capsys.readouterr().err
    assert time.perf_counter() - start < 5  # refused before any model is loaded
    assert main(["serve", "--tls-cert", "/nonexistent.pem", "--tls-key", "/x"]) == 2
    assert main(["serve", "--tls-cert", __file__]) == 2  # no key
