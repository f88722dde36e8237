"""The optional one-sided RDMA path for KV (Mooncake Transfer Engine): the engine, the pool
layout, prefill's writer and sender, the receiver's checks."""
