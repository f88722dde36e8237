"""KV bulk channel: framed tensor streaming over TCP (WAN) or a Unix socket (local fast path)."""

from shared.kv.client import KVClient, open_kv_client
from shared.kv.errors import FrameError, KVConnectionLost, KVTransferError
from shared.kv.link_estimator import LinkEstimator, estimate_wan_seconds
from shared.kv.pool import KVClientPool
from shared.kv.server import KVServer, start_kv_server
from shared.kv.sink import KVSink
from shared.kv.transfer import RetryPolicy, TcpSender
from shared.kv.transport import register_transport

__all__ = [
    "FrameError",
    "KVClient",
    "KVClientPool",
    "KVConnectionLost",
    "KVServer",
    "KVSink",
    "TcpSender",
    "KVTransferError",
    "LinkEstimator",
    "RetryPolicy",
    "estimate_wan_seconds",
    "open_kv_client",
    "register_transport",
    "start_kv_server",
]
