"""TLS (issue 32): the contract over ``rediss://`` with a private CA made here, against a
server that listens with TLS only (``--port 0 --tls-port``), so every connection
asynclock makes beside the caller's (renewals, the overflow pool, the wake-up
subscription) must speak TLS with the caller's ``ssl_*`` settings, client certificates
included; and the CLI with the CA in the URL (``?ssl_ca_certs=``) or in ``SSL_CERT_FILE``."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import SSLConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from test_acl import acl_refusals, acl_setuser, create_user, exercise, user_url
from test_operate import _cli

import asynclock
from asynclock._session._connections import companion_for, connection_settings
from asynclock.testing import (
    RedisServer,
    ServerStartError,
    TLSFiles,
    available_engines,
    keys_left,
    resp_command,
)

ENGINES = list(available_engines())

pytestmark = [
    pytest.mark.skipif(not ENGINES, reason="needs a server binary"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


class Certificates:
    """A private CA, a server certificate for 127.0.0.1 and a client certificate, all
    signed by it (PEM files in ``directory``), made with the ``openssl`` command."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ca = directory / "ca.pem"
        self._openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=asynclock test CA",
        )  # fmt: skip
        self.server = self._signed("server", "127.0.0.1", "serverAuth,clientAuth")
        self.client = self._signed("client", "asynclock test client", "clientAuth")

    def files(self) -> TLSFiles:
        return TLSFiles(self.ca, *self.server, *self.client)

    def _signed(self, name: str, common_name: str, usage: str) -> tuple[Path, Path]:
        extensions = self.directory / f"{name}.ext"
        extensions.write_text(
            "basicConstraints = CA:FALSE\n"
            "subjectAltName = IP:127.0.0.1, DNS:localhost\n"
            f"extendedKeyUsage = {usage}\n"
        )
        self._openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", "-subj", f"/CN={common_name}",
        )  # fmt: skip
        self._openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", str(extensions),
        )  # fmt: skip
        return self.directory / f"{name}.pem", self.directory / f"{name}.key"

    def _openssl(self, *args: str) -> None:
        subprocess.run(
            ["openssl", *args], cwd=self.directory, check=True, capture_output=True, timeout=60
        )


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return Certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(params=ENGINES)
def server(request: pytest.FixtureRequest, certificates: Certificates) -> Iterator[RedisServer]:
    """A server listening with TLS only, that requires a client certificate."""
    server = RedisServer(request.param, tls=certificates.files())
    try:
        server.start()
    except ServerStartError as exc:
        server.stop()
        if "TLS support" in str(exc) or "tls-port" in str(exc):  # (Valkey's; Redis's)
            pytest.skip(f"this {request.param}-server was built without TLS")
        raise
    try:
        yield server
    finally:
        server.stop()


def _client_tls(certificates: Certificates) -> dict[str, Any]:
    return {
        "ssl_ca_certs": str(certificates.ca),
        "ssl_certfile": str(certificates.client[0]),
        "ssl_keyfile": str(certificates.client[1]),
    }


async def test_the_server_speaks_tls_only(server: RedisServer, certificates: Certificates) -> None:
    """(What makes the tests below prove something: no plain connection, none without a
    client certificate, and none that does not trust the CA.)"""
    assert server.url.startswith("rediss://")
    with pytest.raises(ConnectionError):  # (closed without a reply)
        resp_command("127.0.0.1", server.port, "PING")
    for settings in ({"ssl_ca_certs": str(certificates.ca)}, _client_tls(certificates)):
        if "ssl_certfile" in settings:
            settings = {**settings, "ssl_ca_certs": None}  # (the CA not trusted)
        client = Redis.from_url(server.url, **settings)
        try:
            with pytest.raises(RedisConnectionError):
                async with asynclock.lease(client, "x", ttl=5):
                    pass
        finally:
            await client.aclose()


async def test_the_contract_over_tls_as_a_user_with_the_acl_rules(
    server: RedisServer, certificates: Certificates, prefix: str
) -> None:
    """Every kind, renewals, waiters woken by pub/sub, the overflow pool, once(), every()
    over TLS with a client certificate, as a user made from ``asynclock acl``."""
    create_user(server, acl_setuser("--prefix", prefix))
    await exercise(user_url(server), prefix, **_client_tls(certificates))
    assert await acl_refusals(server, **_client_tls(certificates)) == []


async def test_ssl_settings_carry_over_to_every_connection_asynclock_makes(
    server: RedisServer, certificates: Certificates, prefix: str
) -> None:
    """Every ``ssl_*`` setting of the caller's client reaches asynclock's own connections
    (the renewal and overflow pools and the subscription are made from them), and each
    of those connections is a TLS one that the server accepted."""
    client = Redis(
        host="127.0.0.1",
        port=server.port,
        ssl=True,
        ssl_cert_reqs="required",
        ssl_check_hostname=True,
        ssl_min_version=ssl.TLSVersion.TLSv1_2,
        ssl_ciphers="HIGH:!aNULL",
        max_connections=4,
        **_client_tls(certificates),
    )
    try:
        theirs = client.connection_pool.connection_kwargs
        cls, ours = connection_settings(client)
        assert issubclass(cls, SSLConnection)
        given = {key: value for key, value in theirs.items() if key.startswith("ssl")}
        assert len(given) >= 6
        assert {key: ours.get(key) for key in given} == given
        async with asynclock.lease(client, "held", ttl=1.5, prefix=prefix) as held:
            companion = companion_for(client)

            async def wait() -> None:  # (another task: the lock is held by this one)
                async with asynclock.lease(client, "held", blocking_timeout=30, prefix=prefix):
                    pass

            waiter = asyncio.ensure_future(wait())
            async with asyncio.timeout(20):  # (the TLS handshake may be slow on a busy machine)
                while companion.room.connection is None:  # noqa: ASYNC110 (set once connected)
                    await asyncio.sleep(0.01)
            assert isinstance(companion.room.connection, SSLConnection)
            assert companion.room.connection.is_connected
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            await companion.overflow().ping()  # (made on demand, as an exhausted pool makes it)
            await companion.renewer().ping()
            for pool in (companion.renewer(), companion.overflow()):
                assert pool.connection_pool.connection_class is SSLConnection
            assert await held.is_held(verify=True)
        assert await keys_left(client, prefix) == []
    finally:
        await client.aclose()


async def test_the_command_line_over_tls(
    server: RedisServer,
    certificates: Certificates,
    prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``run``, ``inspect``, ``list`` and ``release --force --yes`` with
    ``--url rediss://...?ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...``; the CA
    from ``SSL_CERT_FILE`` instead works too."""
    ca, (cert, key) = certificates.ca, certificates.client
    query = f"ssl_certfile={cert}&ssl_keyfile={key}"
    url = f"{server.url}?ssl_ca_certs={ca}&{query}"
    common = ("--prefix", prefix)
    marker = tmp_path / "ran"
    code, _, err = await _cli(
        "run", "job", "--url", url, "--ttl", "1.5", *common, "--", sys.executable, "-c",
        f"import time; time.sleep(1.2); open({str(marker)!r}, 'w').write('x')",
    )  # fmt: skip
    assert (code, marker.read_text()) == (0, "x"), err
    client = Redis.from_url(server.url, **_client_tls(certificates))
    try:
        held = await asynclock.acquire(client, "held", ttl=30, prefix=prefix)
        code, out, err = await _cli("inspect", "held", "--json", "--url", url, *common)
        assert code == 0, err
        assert '"kind": "mutex"' in out
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        code, out, err = await _cli("list", "--url", f"{server.url}?{query}", *common)
        assert code == 0, err
        assert "held" in out
        monkeypatch.delenv("SSL_CERT_FILE")
        code, _, err = await _cli("list", "--url", f"{server.url}?{query}", *common)
        assert code == 69  # (the CA is not trusted: the handshake fails)
        assert "certificate" in err.lower(), err
        code, _, err = await _cli("release", "held", "--force", "--yes", "--url", url, *common)
        assert code == 0, err
        with pytest.raises(asynclock.LockLost):
            await held.release()
    finally:
        await client.aclose()
