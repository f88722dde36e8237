"""Engine errors: what the services catch and turn into clear client errors."""


class EngineError(Exception):
    """Something the engine cannot do (missing block, bad KV shape, no free block, ...)."""


class InvalidRequestError(EngineError):
    """The request itself is bad; the engine refused it and keeps serving the others."""


class KVShortageError(EngineError):
    """Not enough free KV blocks right now; the same call may succeed once blocks free up."""
