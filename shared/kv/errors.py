class KVTransferError(Exception):
    """A KV transfer (or the whole channel) failed: refused, unauthenticated, rejected by the
    receiver, aborted, peer gone, or timed out. The message says which."""


class FrameError(Exception):
    """The peer broke the wire protocol (bad header, limit exceeded): the connection is dropped."""
