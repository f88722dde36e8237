"""NATS subject names (DESIGN.md). Every subject starts with `pdd.`; ids become single tokens."""

from __future__ import annotations

PREFIX = "pdd"


def _tok(value: str) -> str:
    # A dot, space or wildcard inside an id would silently change which subject we hit.
    s = str(value)
    if not s or any(c in s for c in ". *>\t\r\n"):
        raise ValueError(f"invalid subject token {value!r}")
    return s


def prefill_submit() -> str:
    return f"{PREFIX}.prefill.submit"


def prefill_submit_to(inst: str) -> str:
    """One prefill instance's own submit subject (the router picks the least loaded)."""
    return f"{PREFIX}.prefill.{_tok(inst)}.submit"


def md_prepare(inst: str) -> str:
    return f"{PREFIX}.md.{_tok(inst)}.prepare"


def req_tokens(rid: str) -> str:
    return f"{PREFIX}.req.{_tok(rid)}.tokens"


def req_kv_ready(rid: str) -> str:
    return f"{PREFIX}.req.{_tok(rid)}.kv_ready"


def req_handoff(rid: str) -> str:
    return f"{PREFIX}.req.{_tok(rid)}.handoff"


def req_handoff_ack(rid: str) -> str:
    return f"{PREFIX}.req.{_tok(rid)}.handoff_ack"


def req_md_target(rid: str) -> str:
    return f"{PREFIX}.req.{_tok(rid)}.md_target"


def req_abort(rid: str) -> str:
    return f"{PREFIX}.req.{_tok(rid)}.abort"


def kv_events(inst: str) -> str:
    return f"{PREFIX}.kv.events.{_tok(inst)}"


def load(service: str, inst: str) -> str:
    return f"{PREFIX}.load.{_tok(service)}.{_tok(inst)}"


def all_kv_events() -> str:
    return f"{PREFIX}.kv.events.*"


def all_load() -> str:
    return f"{PREFIX}.load.*.*"


def all_req_aborts() -> str:
    return f"{PREFIX}.req.*.abort"


def all_req(kind: str) -> str:
    """Every request's `kind` subject (tokens, kv_ready, handoff, handoff_ack, abort)."""
    return f"{PREFIX}.req.*.{_tok(kind)}"
