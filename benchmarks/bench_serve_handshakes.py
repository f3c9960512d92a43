"""What stalled TLS handshakes hold in ``aiodla serve``'s HTTP front, against aiohttp's
own TLS site (how the front listened before it bounded handshakes), in one run.

``--clients`` connections each send the first bytes of a TLS record, then nothing; with
all of them pending, the report gives the live ``asyncio.sslproto.SSLProtocol`` objects
and the Python memory tracemalloc sees (each TLS connection's 256 KiB read buffer is a
``bytearray``), then the same once every client has gone (polled for up to 15 s). Usage::

    python benchmarks/bench_serve_handshakes.py [--clients 1000]

It needs about ``2 * clients`` open files (the script raises its soft limit when it can).
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.sslproto
import datetime
import gc
import ipaddress
import resource
import ssl
import tempfile
import tracemalloc
from pathlib import Path

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from aiodla import Engine, TensorSpec
from aiodla.emulator import make_loadable
from aiodla.serve import Server

STALLED_HELLO = b"\x16\x03\x01\x02\x00"  # a TLS handshake record's header, then nothing


def certificate(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def held() -> tuple[int, float]:
    """Live SSLProtocol objects, and MB that tracemalloc traces."""
    gc.collect()
    protocols = sum(isinstance(o, asyncio.sslproto.SSLProtocol) for o in gc.get_objects())
    return protocols, tracemalloc.get_traced_memory()[0] / 1e6


async def stall(port: int, clients: int) -> tuple[tuple[int, float], tuple[int, float]]:
    writers = []
    for _ in range(clients):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(STALLED_HELLO)
        writers.append(writer)
    await asyncio.sleep(1.0)  # every handshake that may start has started
    pending = held()
    for writer in writers:
        writer.transport.abort()
    # The server learns of a waiting connection's end only when its handshake starts
    # (a paused transport reads nothing): the queue drains 64 at a time.
    for _ in range(30):
        await asyncio.sleep(0.5)
        if held()[0] == 0:
            break
    return pending, held()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    clients = parser.parse_args().clients
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * clients + 256
    if soft < wanted and (hard == resource.RLIM_INFINITY or hard >= wanted):
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    with tempfile.TemporaryDirectory() as folder:
        cert, key = certificate(Path(folder))
        tracemalloc.start()
        # aiohttp's own TLS site: every accepted connection starts its handshake.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        runner = web.AppRunner(web.Application())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        before = await stall(runner.addresses[0][1], clients)
        await runner.cleanup()
        # aiodla serve's front: handshakes bounded in number and time.
        x = TensorSpec("x", (1, 3, 8, 8), "float16", "nchw")
        y = TensorSpec("y", (1, 3, 8, 8), "float16", "nchw")
        model = make_loadable([x], [y], "affine", 0.001, scale=1.0, bias=0.0)
        async with (
            Engine(model, runtime="emulated") as engine,
            Server(
                {"m": engine}, http="127.0.0.1:0", grpc=None, tls_cert=cert, tls_key=key,
                max_connections=2 * clients,
            ) as server,
        ):  # fmt: skip
            assert server.http_port is not None
            after = await stall(server.http_port, clients)
    print(f"{clients} stalled TLS handshakes: live SSLProtocol objects, traced MB")
    for name, (pending, gone) in (("aiohttp TLS site", before), ("aiodla serve", after)):
        print(
            f"  {name:17} pending: {pending[0]:5d} objects {pending[1]:7.1f} MB; "
            f"after they left: {gone[0]:5d} objects {gone[1]:7.1f} MB"
        )
    ratio = before[0][1] / max(after[0][1], 1e-9)
    print(f"  memory held while pending, aiohttp site / aiodla serve: {ratio:.1f} x")


if __name__ == "__main__":
    asyncio.run(main())
