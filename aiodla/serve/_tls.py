"""TLS for both fronts: the server's certificate and key, and optionally the CA that
client certificates must be signed by (mutual TLS, the one form of client
authentication the server has).

The files are read and checked once, when the server is made, so a wrong path or a
key that does not match its certificate fails before any engine serves; HTTP takes
them as an :class:`ssl.SSLContext`, gRPC as the PEM bytes of its server credentials.
"""

from __future__ import annotations

import dataclasses
import os
import ssl

from .._errors import ConfigurationError

__all__ = ["Tls"]

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
        tls = cls(
            cert_file,
            key_file,
            ca_file,
            _read(cert_file, "tls_cert"),
            _read(key_file, "tls_key"),
            None if ca_file is None else _read(ca_file, "tls_client_ca"),
        )
        tls.ssl_context()  # a key that does not match, a file that is not PEM: now
        return tls

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
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


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise ConfigurationError(f"{what}: cannot read {path}: {exc.strerror}") from None
