import os

# Systems the tests start get the pool the engine had before sizes followed available memory:
# several test systems at once must not each take a share of this machine's RAM.
os.environ.setdefault("PDD_ENGINE__KV_MEMORY_MB", "64")

# ---- transport fixtures (bus / kv / wan): nats_security, nats_server, nats_pair(_via_wan) -------------
from tests.fixtures_nats import nats_pair, nats_pair_via_wan, nats_security, nats_server  # noqa: F401
# ---- end transport fixtures -----------------------------------------------------------------------
