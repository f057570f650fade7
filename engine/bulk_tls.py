"""TLS for the bulk channel (``engine.bulk_channel``): each averager makes a throwaway key and a
self-signed certificate when it starts; senders learn the certificate's SHA-256 over libp2p (in
the ticket, ``engine.bulk_channel``), whose connections are authenticated to the libp2p
identity, and accept only that certificate. No certificate authority is involved: the pin is
what ties the TLS connection to the reducer's libp2p identity."""

from __future__ import annotations

import datetime
import hashlib
import os
import ssl
import tempfile

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["ServerCert", "client_context", "fingerprint", "make_server_cert"]

VALID_FOR = datetime.timedelta(days=30)
"""A certificate's validity (nobody checks it against a clock: the pin is what counts; it is
set so that TLS libraries that do look find it current)."""


class ServerCert:
    """This averager's TLS server context and the SHA-256 of its certificate (the pin)."""

    def __init__(self, context: ssl.SSLContext, pin: bytes) -> None:
        self.context = context
        self.pin = pin


def make_server_cert() -> ServerCert:
    """A fresh P-256 key and a self-signed certificate, loaded in a TLS 1.3 server context."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swarmtrain bulk channel")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + VALID_FOR)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    # ssl loads a chain only from a file: a private one, removed at once
    fd, path = tempfile.mkstemp(prefix="swarmtrain-bulk-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(pem)
        context.load_cert_chain(path)
    finally:
        os.unlink(path)
    return ServerCert(context, fingerprint(cert.public_bytes(serialization.Encoding.DER)))


def fingerprint(der: bytes) -> bytes:
    """The pin of a certificate: SHA-256 of its DER bytes."""
    return hashlib.sha256(der).digest()


def client_context() -> ssl.SSLContext:
    """A TLS 1.3 client context that accepts any certificate: the caller checks the pin
    (``fingerprint`` of the peer's certificate) before it sends anything."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context
