# ---- transport fixtures (bus / kv / wan): nats_security, nats_server, nats_pair(_via_wan) -------------
from tests.fixtures_nats import nats_pair, nats_pair_via_wan, nats_security, nats_server  # noqa: F401
# ---- end transport fixtures -----------------------------------------------------------------------
