"""Files the fake internet serves, made fresh at fixture time: a test CA, a server
certificate it signed, and a PEP 503 package index holding one small wheel.

Used by :mod:`hermes_modal_tool.testing.fakenet`; needs ``cryptography`` (a dev
dependency). Nothing here touches the network.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import zipfile
from pathlib import Path

# The one package of the local index: ``pip install hmt-fakenet-demo`` puts
# ``hmt_fakenet_demo.py`` (``MESSAGE``) on the path.
DEMO_PROJECT = "hmt-fakenet-demo"
DEMO_VERSION = "1.0"
DEMO_MESSAGE = "installed from the fake internet"


def make_pki(directory: Path, names: list[str], addresses: list[str]) -> tuple[Path, Path, Path]:
    """Make a test CA and a server certificate for ``names`` (DNS) and ``addresses`` (IP).

    Args:
        directory: an existing directory; ``ca.pem``, ``server.pem`` and
            ``server-key.pem`` are written there.
        names: DNS names for the certificate's subjectAltName.
        addresses: IPv4/IPv6 addresses (strings) for its subjectAltName.

    Returns:
        ``(ca_cert, server_cert, server_key)`` paths (PEM). The CA is valid for one day
        and is trusted by nothing but the clients a test points at ``ca.pem``.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hermes-modal-tool fakenet test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = (directory / "ca.pem", directory / "server.pem", directory / "server-key.pem")
    paths[0].write_bytes(ca_cert.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    paths[2].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def make_index(root: Path) -> Path:
    """Write a PEP 503 simple index under ``root`` with one pure-Python wheel.

    Layout: ``root/simple/index.html``, ``root/simple/<project>/index.html`` linking
    ``root/packages/<wheel>`` with its ``#sha256=`` fragment. The wheel is written
    directly as a zip (``METADATA``, ``WHEEL``, ``RECORD``), so no build tool runs.

    Returns:
        The path of the wheel.
    """
    dist = DEMO_PROJECT.replace("-", "_")
    files = {
        f"{dist}.py": f"MESSAGE = {DEMO_MESSAGE!r}\n".encode(),
        f"{dist}-{DEMO_VERSION}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {DEMO_PROJECT}\nVersion: {DEMO_VERSION}\n"
            "Summary: the fake internet's demo package\n"
        ).encode(),
        f"{dist}-{DEMO_VERSION}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: hermes-modal-tool fakenet\n"
            b"Root-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record_name = f"{dist}-{DEMO_VERSION}.dist-info/RECORD"
    record = "".join(f"{n},{_record_hash(d)},{len(d)}\n" for n, d in files.items())
    files[record_name] = (record + f"{record_name},,\n").encode()
    (root / "packages").mkdir(parents=True, exist_ok=True)
    wheel = root / "packages" / f"{dist}-{DEMO_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    project_dir = root / "simple" / DEMO_PROJECT
    project_dir.mkdir(parents=True, exist_ok=True)
    (root / "simple" / "index.html").write_text(
        f'<!DOCTYPE html><html><body><a href="{DEMO_PROJECT}/">{DEMO_PROJECT}</a></body></html>\n'
    )
    (project_dir / "index.html").write_text(
        "<!DOCTYPE html><html><body>"
        f'<a href="../../packages/{wheel.name}#sha256={sha}">{wheel.name}</a>'
        "</body></html>\n"
    )
    return wheel
