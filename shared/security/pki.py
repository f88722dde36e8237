"""A private CA and one certificate per identity, created on first start and reused.

Every link that crosses the WAN (NATS client connections, the NATS gateway, the KV bulk
channel) runs TLS 1.3 with mutual certificates from this CA. Keys are EC P-256 and written
0600; certificates name every host a peer may dial (the WAN proxy in front of a service
included), so hostname checks hold without a special case, and the party's identity as a URI
(shared/security/identity.py), which is what peers check where a role matters.

ca.pem may hold several CA certificates (during a rotation: the new one and the old one, all
trusted); leaves are signed with the one whose key is ca.key.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.security.identity import identity_of, parse_identity

VALID_DAYS = 397  # what public CAs may issue; `pdd certs` renews
CA_NAME = "ca"


@dataclass(frozen=True)
class Identity:
    """The files one party presents: its certificate and key, and the CA it trusts."""

    ca: Path
    cert: Path
    key: Path


class Pki:
    """A directory holding ca.pem/ca.key and <name>.pem/<name>.key per identity."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)

    @property
    def ca_cert(self) -> Path:
        return self.dir / f"{CA_NAME}.pem"

    def identity(self, name: str) -> Identity:
        return Identity(self.ca_cert, self.dir / f"{name}.pem", self.dir / f"{name}.key")

    @property
    def ca_key(self) -> Path:
        return self.dir / f"{CA_NAME}.key"

    def ensure(
        self,
        names: Iterable[str],
        hosts: Iterable[str],
        *,
        renew: bool = False,
        reissue: bool = False,
        uri_of: Callable[[str], str | None] = lambda n: i.uri if (i := identity_of(n)) else None,
    ) -> None:
        """Create the CA and each identity's certificate unless present (all anew with renew;
        the leaves only, from the same CA, with reissue). A leaf that lacks its identity or was
        not signed by the current CA is reissued (an older layout, a rotated CA)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        if renew or not (self.ca_cert.exists() and self.ca_key.exists()):
            reissue = True
            _write_key(self.ca_key, ca_key := ec.generate_private_key(ec.SECP256R1()))
            _write_cert(self.ca_cert, _ca_certificate(ca_key))
        hosts = sorted(set(hosts))
        for name in names:
            ident, uri = self.identity(name), uri_of(name)
            if reissue or not (ident.key.exists() and self.issued(ident.cert, uri)):
                self.issue(ident.cert, ident.key, name, hosts, uri)

    def signer(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        """The CA certificate of ca.pem whose key is ca.key, and that key."""
        key = _read_key(self.ca_key)
        mine = key.public_key().public_bytes(serialization.Encoding.DER, _SPKI)
        for cert in x509.load_pem_x509_certificates(self.ca_cert.read_bytes()):
            if cert.public_key().public_bytes(serialization.Encoding.DER, _SPKI) == mine:
                return cert, key
        raise ValueError(f"{self.ca_cert} holds no certificate for {self.ca_key}")

    def fingerprint(self) -> str:
        """sha256 of the signing CA's certificate, hex: what a bundle records."""
        return self.signer()[0].fingerprint(hashes.SHA256()).hex()

    def issued(self, cert_path: Path, uri: str | None) -> bool:
        """The certificate exists, names `uri` and was signed by the current CA."""
        if not cert_path.exists():
            return False
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        try:
            cert.verify_directly_issued_by(self.signer()[0])
        except (ValueError, TypeError, InvalidSignature):
            return False
        return _uris(cert) == ([uri] if uri else []) and (not uri or cert.subject == leaf_subject("", uri))

    def issue(
        self, cert_path: Path, key_path: Path, name: str, hosts: Iterable[str], uri: str | None
    ) -> None:
        """A new key and certificate from the existing CA; nothing else is touched."""
        ca, ca_key = self.signer()
        key = ec.generate_private_key(ec.SECP256R1())
        _write_key(key_path, key)
        _write_cert(cert_path, _leaf_certificate(name, sorted(set(hosts)), key, ca, ca_key, uri))


_SPKI = serialization.PublicFormat.SubjectPublicKeyInfo


def _uris(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return san.get_values_for_type(x509.UniformResourceIdentifier)


def _name(common_name: str, unit: str | None = None) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdd"),
            *([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit)] if unit else []),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def leaf_subject(name: str, uri: str | None) -> x509.Name:
    """A leaf's subject: O=pdd, OU=<dc>, CN=<role> for a party with an identity (every
    instance of a role alike: identity.distinguished_name), else O=pdd, CN=<name>."""
    if uri is None:
        return _name(name)
    ident = parse_identity(uri)
    return _name(ident.role, ident.dc)


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return builder.not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(
        now + dt.timedelta(days=VALID_DAYS)
    )


def _ca_certificate(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    # A name of its own (and key identifiers): while a rotation trusts two CAs, a verifier must
    # find each leaf's issuer, not the first CA of the same name.
    name = _name(f"pdd private CA {os.urandom(4).hex()}")
    builder = x509.CertificateBuilder().subject_name(name).issuer_name(name)
    builder = _validity(builder.public_key(key.public_key()).serial_number(x509.random_serial_number()))
    builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    builder = builder.add_extension(ski, critical=False)
    usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)  # cert + CRL signing
    return builder.add_extension(usage, critical=True).sign(key, hashes.SHA256())


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _leaf_certificate(
    name: str,
    hosts: list[str],
    key: ec.EllipticCurvePrivateKey,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    uri: str | None,
) -> x509.Certificate:
    """Server and client use in one certificate: every service both listens and dials."""
    builder = x509.CertificateBuilder().subject_name(leaf_subject(name, uri)).issuer_name(ca.subject)
    builder = _validity(builder.public_key(key.public_key()).serial_number(x509.random_serial_number()))
    builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    builder = builder.add_extension(aki, critical=False)
    names = [_san(h) for h in dict.fromkeys([name, *hosts])]
    names += [x509.UniformResourceIdentifier(uri)] if uri else []
    builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False).sign(ca_key, hashes.SHA256())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_private(path, data)


def _read_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    write_private(path, cert.public_bytes(serialization.Encoding.PEM))


def write_private(path: Path, data: bytes) -> None:
    """Write a file readable by its owner only (created 0600, never world-readable meanwhile)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def server_context(ident: Identity) -> ssl.SSLContext:
    """TLS 1.3 server that requires a client certificate from the same CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(ident.cert, ident.key)
    ctx.load_verify_locations(ident.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ident: Identity, check_hostname: bool = True) -> ssl.SSLContext:
    """TLS 1.3 client that presents its certificate and checks the server's CA and name.
    check_hostname=False: for a caller that checks the server's identity instead (the CA
    check stays)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = check_hostname
    ctx.load_cert_chain(ident.cert, ident.key)
    ctx.load_verify_locations(ident.ca)
    return ctx
