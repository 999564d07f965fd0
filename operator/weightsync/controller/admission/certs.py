"""The webhook's TLS material: an operator-managed CA and serving certificate.

Managed mode (the default) generates a CA and a serving certificate for the webhook's
host (the Service DNS names, or the URL's host or IP) with `cryptography`, and keeps
them in a Secret in the operator's namespace, so a restarted operator reuses the same
CA and the webhook configurations' caBundle does not churn. A stored pair that does
not cover the host, or expires within `RENEW_BEFORE`, is replaced. The Secret uses the
`kubernetes.io/tls` keys (`tls.crt`, `tls.key`, `ca.crt`), the same files a
cert-manager Certificate produces, so directory mode reads either.
"""

from __future__ import annotations

import base64
import ipaddress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_VALIDITY = timedelta(days=3650)
CERT_VALIDITY = timedelta(days=365)
RENEW_BEFORE = timedelta(days=30)
CERT_FILE, KEY_FILE, CA_FILE = "tls.crt", "tls.key", "ca.crt"


@dataclass(frozen=True, slots=True)
class TlsBundle:
    """PEM-encoded serving certificate, its key, and the CA that signed it."""

    cert: bytes
    key: bytes
    ca: bytes

    def write(self, directory: Path) -> tuple[Path, Path, Path]:
        """Write the three files (key readable by the owner only); return their paths."""
        directory.mkdir(parents=True, exist_ok=True)
        paths = directory / CERT_FILE, directory / KEY_FILE, directory / CA_FILE
        for path, data in zip(paths, (self.cert, self.key, self.ca), strict=True):
            path.write_bytes(data)
        paths[1].chmod(0o600)
        return paths

    def to_secret_data(self) -> dict[str, str]:
        return {
            CERT_FILE: base64.b64encode(self.cert).decode(),
            KEY_FILE: base64.b64encode(self.key).decode(),
            CA_FILE: base64.b64encode(self.ca).decode(),
        }

    @classmethod
    def from_secret_data(cls, data: dict[str, str] | None) -> TlsBundle | None:
        if not data or not all(k in data for k in (CERT_FILE, KEY_FILE, CA_FILE)):
            return None
        return cls(*(base64.b64decode(data[k]) for k in (CERT_FILE, KEY_FILE, CA_FILE)))


def dns_names_for_service(name: str, namespace: str) -> list[str]:
    return [
        name,
        f"{name}.{namespace}",
        f"{name}.{namespace}.svc",
        f"{name}.{namespace}.svc.cluster.local",
    ]


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for host in hosts:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "weightsync"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def generate(hosts: list[str], now: datetime | None = None) -> TlsBundle:
    """A fresh CA and a serving certificate for `hosts` (DNS names or IP addresses)."""
    if not hosts:
        raise ValueError("a serving certificate needs at least one host")
    now = now or datetime.now(UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("weightsync-webhook-ca")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + CERT_VALIDITY)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return TlsBundle(
        cert=cert.public_bytes(serialization.Encoding.PEM),
        key=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        ca=ca_cert.public_bytes(serialization.Encoding.PEM),
    )


def usable(bundle: TlsBundle, hosts: list[str], now: datetime | None = None) -> bool:
    """Whether a stored bundle covers every host, chains to its CA and is not expiring."""
    now = now or datetime.now(UTC)
    try:
        cert = x509.load_pem_x509_certificate(bundle.cert)
        ca = x509.load_pem_x509_certificate(bundle.ca)
        serialization.load_pem_private_key(bundle.key, password=None)
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return False
    covered = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    covered |= set(names.get_values_for_type(x509.DNSName))
    wanted = set()
    for host in hosts:
        try:
            wanted.add(str(ipaddress.ip_address(host)))
        except ValueError:
            wanted.add(host)
    fresh = (
        cert.not_valid_after_utc - now > RENEW_BEFORE
        and ca.not_valid_after_utc - now > RENEW_BEFORE
    )
    return wanted <= covered and fresh
