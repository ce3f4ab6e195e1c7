"""A self-signed certificate for the tracking server (`pdmctl server start --tls`)."""

from __future__ import annotations

import os
from pathlib import Path


def self_signed(cert: Path, key_path: Path, host: str) -> bool:
    """`cert` (self-signed, for `host`, localhost and this host's names) and `key_path` (mode 0600),
    unless both exist: True when made."""
    import datetime
    import ipaddress
    import socket

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if cert.exists() and key_path.exists():
        return False
    cert.parent.mkdir(mode=0o700, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for name in dict.fromkeys([host, "localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            if name and name not in ("0.0.0.0", "::"):
                names.append(x509.DNSName(name))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pdmctl tracking server {socket.gethostname()}")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=825))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))  # fmt: skip
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return True
