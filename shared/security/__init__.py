"""Identity and encryption for the links between services: a private CA, TLS contexts, and
the generated credentials `pdd up` hands to each service."""

from shared.security.pki import Identity, Pki, client_context, server_context, write_private

__all__ = ["Identity", "Pki", "client_context", "server_context", "write_private"]
