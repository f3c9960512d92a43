"""TLS for both fronts (``--tls-cert``/``--tls-key``), and client certificates
(``--tls-client-ca``): Triton's clients over HTTPS and gRPC with TLS, a cleartext
client refused, a client without a certificate refused when one is required. The
certificates are made here, self-signed, with the ``cryptography`` package."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http.aio as thttp_aio
from tritonclient.utils import InferenceServerException

from aiodla import ConfigurationError, Engine
from aiodla.serve import Server

from support import expected_affine

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

X = np.linspace(-2, 2, 192, dtype=np.float16).reshape(1, 3, 8, 8)


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key: its PEM file
    and its key's."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    return {name: self_signed(tmp_path, name) for name in ("server", "client")}


@pytest_asyncio.fixture
async def tls_server(
    engines: dict[str, Engine], certs: dict[str, tuple[Path, Path]]
) -> AsyncIterator[Server]:
    cert, key = certs["server"]
    async with Server(
        engines, http="127.0.0.1:0", grpc="127.0.0.1:0", tls_cert=cert, tls_key=key
    ) as server:
        yield server


def trusting(cert: Path, client: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(cert))
    if client is not None:
        context.load_cert_chain(*map(str, client))
    return context


@pytest.mark.asyncio
async def test_https_serves_tritonclient(
    tls_server: Server, certs: dict[str, tuple[Path, Path]]
) -> None:
    url = f"127.0.0.1:{tls_server.http_port}"
    client = thttp_aio.InferenceServerClient(
        url, ssl=True, ssl_context=trusting(certs["server"][0])
    )
    try:
        tensor = thttp_aio.InferInput("x", list(X.shape), "FP16")
        tensor.set_data_from_numpy(X)
        result = await client.infer("affine", [tensor])
    finally:
        await client.close()
    assert result.as_numpy("y").tobytes() == expected_affine(X).tobytes()
    # Cleartext to the TLS port is not served.
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.get(f"http://{url}/v2/health/live") as response:
                await response.read()


@pytest.mark.asyncio
async def test_grpc_with_tls_serves_tritonclient(
    tls_server: Server, certs: dict[str, tuple[Path, Path]]
) -> None:
    url = f"127.0.0.1:{tls_server.grpc_port}"
    client = tgrpc_aio.InferenceServerClient(
        url, ssl=True, root_certificates=str(certs["server"][0])
    )
    plain = tgrpc_aio.InferenceServerClient(url)
    try:
        tensor = tgrpc_aio.InferInput("x", list(X.shape), "FP16")
        tensor.set_data_from_numpy(X)
        result = await client.infer("affine", [tensor])
        with pytest.raises(InferenceServerException):
            await plain.is_server_live(client_timeout=10)
    finally:
        await client.close()
        await plain.close()
    assert result.as_numpy("y").tobytes() == expected_affine(X).tobytes()


# CPython 3.10's asyncio leaves the transport of a refused TLS handshake unclosed (its
# SSL protocol was rewritten in 3.11); the refusal itself is what this test holds.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.asyncio
async def test_client_certificates_required(
    engines: dict[str, Engine], certs: dict[str, tuple[Path, Path]]
) -> None:
    cert, key = certs["server"]
    client_cert, client_key = certs["client"]
    async with Server(
        engines,
        http="127.0.0.1:0",
        grpc="127.0.0.1:0",
        tls_cert=cert,
        tls_key=key,
        tls_client_ca=client_cert,
    ) as server:
        grpc_url = f"127.0.0.1:{server.grpc_port}"
        with_cert = tgrpc_aio.InferenceServerClient(
            grpc_url,
            ssl=True,
            root_certificates=str(cert),
            private_key=str(client_key),
            certificate_chain=str(client_cert),
        )
        without = tgrpc_aio.InferenceServerClient(grpc_url, ssl=True, root_certificates=str(cert))
        try:
            assert await with_cert.is_server_live()
            with pytest.raises(InferenceServerException):
                await without.is_server_live(client_timeout=10)
        finally:
            await with_cert.close()
            await without.close()
        live = f"https://127.0.0.1:{server.http_port}/v2/health/live"
        async with aiohttp.ClientSession() as session:
            async with session.get(live, ssl=trusting(cert, certs["client"])) as response:
                assert response.status == 200
            with pytest.raises(aiohttp.ClientError):
                async with session.get(live, ssl=trusting(cert)) as response:
                    await response.read()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tls_cert": "server"}, "tls_cert and tls_key"),
        ({"tls_key": "server"}, "tls_cert and tls_key"),
        ({"tls_client_ca": "client"}, "tls_client_ca needs tls_cert"),
        ({"tls_cert": "missing", "tls_key": "missing"}, "missing.pem"),
        ({"tls_cert": "server", "tls_key": "client"}, "server.pem"),
    ],
)
async def test_tls_files_are_checked_when_the_server_is_made(
    engines: dict[str, Engine],
    certs: dict[str, tuple[Path, Path]],
    tmp_path: Path,
    options: dict[str, str],
    message: str,
) -> None:
    def path(name: str, key: bool) -> Path:
        if name == "missing":
            return tmp_path / ("missing.key" if key else "missing.pem")
        return certs[name][1 if key else 0]

    files = {k: path(v, k == "tls_key") for k, v in options.items()}
    with pytest.raises(ConfigurationError, match=message):
        Server(engines, http="127.0.0.1:0", **files)  # type: ignore[arg-type]


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True])
async def test_serving_beyond_loopback_in_cleartext_warns(
    engines: dict[str, Engine],
    certs: dict[str, tuple[Path, Path]],
    caplog: pytest.LogCaptureFixture,
    tls: bool,
) -> None:
    cert, key = certs["server"] if tls else (None, None)
    async with Server(engines, http="0.0.0.0:0", grpc="127.0.0.1:0", tls_cert=cert, tls_key=key):
        pass
    async with Server(engines, http="127.0.0.1:0", grpc="localhost:0"):
        pass
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if tls:
        assert warnings == []
    else:
        (warning,) = warnings
        assert "HTTP on 0.0.0.0:" in warning and "no authentication" in warning
        assert "gRPC" not in warning


def test_loopback_addresses() -> None:
    from aiodla.serve._app import _loopback

    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("::") and not _loopback("det.local")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-cert", "server"], "tls_cert and tls_key"),
        (["--tls-cert", "server", "--tls-key", "client"], "cannot use certificate"),
        (["--tls-cert", "/dev/zero", "--tls-key", "client"], "/dev/zero is not a regular file"),
    ],
)
def test_the_command_refuses_tls_files_before_opening_a_model(
    certs: dict[str, tuple[Path, Path]], args: list[str], message: str
) -> None:
    from click.testing import CliRunner

    from aiodla import _cli

    files = {"server": certs["server"][0], "client": certs["client"][1]}
    argv = ["serve", "no-such-model.bin", *(str(files.get(a, a)) for a in args)]
    result = CliRunner().invoke(_cli.cli, argv)
    assert result.exit_code != 0
    assert message in result.output and "no-such-model" not in result.output, result.output
