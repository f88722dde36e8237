class KVTransferError(Exception):
    """A KV transfer (or the whole channel) failed: refused, unauthenticated, rejected by the
    receiver, aborted, peer gone, or timed out. The message says which."""


class FrameError(Exception):
    """The peer broke the wire protocol (bad header, limit exceeded): the connection is dropped."""


class KVConnectionLost(KVTransferError):
    """The connection carrying the transfer dropped (reset, EOF, TLS error) or could not be
    made: the receiver did not refuse anything, so the transfer may go on over a fresh one."""
