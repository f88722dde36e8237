"""The serving machinery every service runs on: the engine loop and engine service base, the
process lifecycle, liveness, cache events and the request state machines."""
