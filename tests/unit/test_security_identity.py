"""Workload identities: the one URI SAN a certificate names its party by, parsed purely."""

import pytest

from shared.security import Pki
from shared.security.identity import PeerIdentity, identity_of, parse_identity, peer_identity, refusal


@pytest.mark.parametrize(
    "uri, expect",
    [
        ("spiffe://pdd/dc-b/main_decode", ("dc-b", "main_decode", None)),
        ("spiffe://pdd/dc-a/prefill/p-7", ("dc-a", "prefill", "p-7")),
        ("spiffe://pdd/dc-a/nats/nats-a", ("dc-a", "nats", "nats-a")),
    ],
)
def test_parse_round_trips(uri, expect) -> None:
    ident = parse_identity(uri)
    assert tuple(ident) == expect and ident.uri == uri


@pytest.mark.parametrize(
    "uri",
    [
        "spiffe://other/dc-a/prefill",  # another trust domain
        "https://pdd/dc-a/prefill",
        "spiffe://pdd/dc-a",  # no role
        "spiffe://pdd/dc-a/prefill/p/extra",
        "spiffe://pdd/dc-a/wizard",  # no such role
        "spiffe://pdd/dc-a/prefill/",  # empty instance
        "spiffe://pdd/DC-A/prefill",
        "spiffe://pdd/dc-a/prefill/../main_decode",
    ],
)
def test_malformed_identities_are_refused(uri) -> None:
    with pytest.raises(ValueError):
        parse_identity(uri)


def test_certificates_name_their_role_and_only_it(tmp_path) -> None:
    pki = Pki(tmp_path)
    pki.ensure(["prefill", "main_decode", "nats-b", "sender"], ["127.0.0.1"])
    der = {n: _der(pki.identity(n).cert) for n in ("prefill", "main_decode", "nats-b", "sender")}
    assert peer_identity(der["prefill"]) == PeerIdentity("dc-a", "prefill")
    assert peer_identity(der["main_decode"]) == ("dc-b", "main_decode", None)
    assert peer_identity(der["nats-b"]) == ("dc-b", "nats", "nats-b")
    with pytest.raises(ValueError, match="0 pdd identities"):  # a name outside the roles gets none
        peer_identity(der["sender"])
    assert refusal(der["main_decode"], ["main_decode"]) is None
    assert (
        refusal(der["prefill"], ["main_decode"])
        == "peer identity spiffe://pdd/dc-a/prefill is not main_decode"
    )
    assert "identity unknown" in (refusal(der["sender"], ["prefill"]) or "")
    assert refusal(None, ["prefill"]) == "peer presented no certificate"


def test_identity_of_secrets_names() -> None:
    assert identity_of("relay") == ("dc-a", "relay", None)
    assert identity_of("nats-a") == ("dc-a", "nats", "nats-a")
    assert identity_of("receiver") is None


def _der(path) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(Encoding.DER)


def test_a_service_refuses_to_start_under_another_identity(tmp_path, capsys) -> None:
    from types import SimpleNamespace

    from shared.security.credentials import require_own_identity

    pki = Pki(tmp_path)
    pki.ensure(["relay", "main_decode", "sender"], ["127.0.0.1"])

    def start(cert: str, role: str, dc: str) -> str:
        settings = SimpleNamespace(tls_cert=str(pki.identity(cert).cert), datacenter=dc)
        with pytest.raises(SystemExit) as e:
            require_own_identity(settings, role, "PDD_MD_")
        assert e.value.code == 2
        return capsys.readouterr().err.strip()

    require_own_identity(
        SimpleNamespace(tls_cert=str(pki.identity("main_decode").cert), datacenter="dc-b"),
        "main_decode",
        "PDD_MD_",
    )
    err = start("relay", "main_decode", "dc-b")
    assert err.startswith("main_decode: PDD_MD_TLS_CERT ") and "spiffe://pdd/dc-a/relay" in err
    assert "wrong role (relay, expected main_decode)" in err and "this is main_decode in dc-b" in err
    assert "wrong datacenter (dc-b, expected dc-a)" in start("main_decode", "main_decode", "dc-a")
    assert "0 pdd identities" in start("sender", "main_decode", "dc-b")  # a certificate of no role
