"""How loudly a refused bulk connection is logged, and why: a pure function of what failed."""

import logging
import ssl

from shared.kv.refusal import PeerRefused, handshake_refusal


def _verify_error(message: str) -> ssl.SSLCertVerificationError:
    e = ssl.SSLCertVerificationError(1, "certificate verify failed")
    e.verify_message = message
    return e


def _ssl_error(reason: str) -> ssl.SSLError:
    e = ssl.SSLError(1, reason)
    e.reason = reason
    return e


def test_refused_credentials_are_warnings_naming_the_fault() -> None:
    wrong = PeerRefused(
        "10.0.0.1:5", "peer identity spiffe://pdd/dc-a/relay is not prefill", "spiffe://pdd/dc-a/relay"
    )
    assert handshake_refusal(wrong) == (
        logging.WARNING,
        "peer identity spiffe://pdd/dc-a/relay is not prefill",
    )
    level, why = handshake_refusal(_verify_error("certificate has expired"))
    assert level == logging.WARNING and why.startswith("expired certificate")
    level, why = handshake_refusal(_verify_error("unable to get local issuer certificate"))
    assert level == logging.WARNING and why.startswith("unknown CA")
    level, why = handshake_refusal(_ssl_error("TLSV1_ALERT_UNKNOWN_CA"))
    assert level == logging.WARNING and why == "it refused our certificate (unknown ca)"


def test_connections_that_present_nothing_are_info() -> None:
    probe = PeerRefused("p", "peer identity spiffe://pdd/dc-a/router is not prefill", None, spoke=False)
    level, why = handshake_refusal(probe)
    assert level == logging.INFO and "a probe?" in why
    after = ConnectionResetError("tcp://x closed the connection after the TLS handshake (...)")
    assert handshake_refusal(after)[0] == logging.INFO and "a probe?" in handshake_refusal(after)[1]
    assert handshake_refusal(_ssl_error("PEER_DID_NOT_RETURN_A_CERTIFICATE"))[0] == logging.INFO
    assert handshake_refusal(_ssl_error("WRONG_VERSION_NUMBER")) == (
        logging.INFO,
        "not TLS (wrong version number)",
    )
    assert handshake_refusal(TimeoutError())[0] == logging.INFO
    assert handshake_refusal(ConnectionResetError("during the TLS handshake"))[0] == logging.INFO
