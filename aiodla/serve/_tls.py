"""TLS for both fronts: the server's certificate and key, and optionally the CA that
client certificates must be signed by (mutual TLS, the one form of client
authentication the server has).

The files are read and checked once, when the server is made, so a wrong path or a
key that does not match its certificate fails before any engine serves; HTTP takes
them as an :class:`ssl.SSLContext`, gRPC as the PEM bytes of its server credentials.
Each must be a regular file of at most :data:`MAX_PEM_BYTES` (opened without blocking:
a FIFO or a device such as ``/dev/zero`` is refused, not read), and the key must not be
encrypted: the server cannot ask for a pass-phrase (OpenSSL would prompt on the
terminal, twice, then fail).
"""

from __future__ import annotations

import dataclasses
import os
import ssl
import stat

from .._errors import ConfigurationError

__all__ = ["MAX_PEM_BYTES", "Tls"]

#: The largest PEM file read (a certificate chain, a key, a CA bundle).
MAX_PEM_BYTES = 1024 * 1024

_Path = str | os.PathLike[str]


@dataclasses.dataclass(frozen=True)
class Tls:
    """The PEM files a TLS server needs, read: certificate chain, key, client CA."""

    cert_file: str
    key_file: str
    client_ca_file: str | None
    cert: bytes
    key: bytes
    client_ca: bytes | None

    @classmethod
    def load(cls, cert: _Path | None, key: _Path | None, client_ca: _Path | None) -> Tls | None:
        """None with no certificate (the fronts serve cleartext), else the files, read
        and checked; every error a :class:`ConfigurationError` naming the file."""
        if cert is None and key is None:
            if client_ca is not None:
                raise ConfigurationError(
                    "tls_client_ca needs tls_cert and tls_key: client certificates are "
                    "checked over TLS only"
                )
            return None
        if cert is None or key is None:
            raise ConfigurationError(
                "give tls_cert and tls_key together: the server's certificate (PEM) and "
                "its private key"
            )
        cert_file, key_file = os.fspath(cert), os.fspath(key)
        ca_file = None if client_ca is None else os.fspath(client_ca)
        cert_bytes = _read(cert_file, "tls_cert")
        key_bytes = _read(key_file, "tls_key")
        if _encrypted(key_bytes):
            raise ConfigurationError(
                f"tls_key: {key_file} is encrypted (it needs a pass-phrase, which the server "
                "cannot ask for); give it an unencrypted key, e.g. "
                "openssl pkey -in KEY -out KEY.plain, readable by the server's user only"
            )
        tls = cls(
            cert_file,
            key_file,
            ca_file,
            cert_bytes,
            key_bytes,
            None if ca_file is None else _read(ca_file, "tls_client_ca"),
        )
        tls.ssl_context()  # a key that does not match, a file that is not PEM: now
        return tls

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert_file, self.key_file, password=_no_pass_phrase)
        except _PassPhraseAsked:
            raise ConfigurationError(
                f"tls_key: {self.key_file} is encrypted (it needs a pass-phrase, which the "
                "server cannot ask for); give it an unencrypted key"
            ) from None
        except (ssl.SSLError, OSError) as exc:
            raise ConfigurationError(
                f"TLS: cannot use certificate {self.cert_file} with key {self.key_file}: {exc}"
            ) from None
        if self.client_ca_file is not None:
            try:
                context.load_verify_locations(cafile=self.client_ca_file)
            except (ssl.SSLError, OSError) as exc:
                raise ConfigurationError(
                    f"TLS: cannot read client CA {self.client_ca_file}: {exc}"
                ) from None
            context.verify_mode = ssl.CERT_REQUIRED
        return context


def _encrypted(pem: bytes) -> bool:
    """Whether a PEM key is encrypted: PKCS#8's ``ENCRYPTED PRIVATE KEY``, or the
    traditional format's ``Proc-Type: 4,ENCRYPTED`` header."""
    return any(
        line.startswith(b"-----BEGIN ENCRYPTED")
        or line.replace(b" ", b"") == b"Proc-Type:4,ENCRYPTED"
        for line in pem.splitlines()
    )


class _PassPhraseAsked(Exception):
    pass


def _no_pass_phrase() -> bytes:
    # OpenSSL calls this for an encrypted key instead of prompting on the terminal.
    raise _PassPhraseAsked


def _read(path: str, what: str) -> bytes:
    """A PEM file's bytes: a regular file (opened without blocking, so a FIFO does not
    hang the open), at most MAX_PEM_BYTES."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ConfigurationError(f"{what}: cannot read {path}: {exc.strerror}") from None
    try:
        regular = stat.S_ISREG(os.fstat(descriptor).st_mode)
    except OSError:
        regular = False
    if not regular:
        os.close(descriptor)
        raise ConfigurationError(
            f"{what}: {path} is not a regular file (a PEM file is); it is not read"
        )
    with os.fdopen(descriptor, "rb") as file:
        try:
            data = file.read(MAX_PEM_BYTES + 1)
        except OSError as exc:
            raise ConfigurationError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_PEM_BYTES:
        raise ConfigurationError(
            f"{what}: {path} is larger than {MAX_PEM_BYTES} bytes, more than a PEM "
            "certificate chain or key holds; it is not read"
        )
    return data
