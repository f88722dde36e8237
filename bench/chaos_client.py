"""`pdd chaos`'s clients, as a load balancer's would act: a router that refuses a request (or
whose /health is not 200) is avoided for a while, and a stream whose connection breaks resumes
on another router with `Last-Event-ID`; every wait has a bound."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx

from bench.client import Timed

PIPELINES = ("p-md", "p-rld-md")  # the load alternates them
RESUME_WINDOW_S = 8.0  # a broken stream is reconnected for this long (the backends keep it ~4 s)


REFUSED_RETRY_S = 15.0  # a request refused by every router is retried for this long


AVOID_S = 1.0  # a router that refused or broke a stream is tried last for this long


class Routers:
    """The routers' URLs, in round-robin order from each request's own; one that refused, broke
    a stream or whose /health is not 200 comes last for AVOID_S (a watcher polls /health)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = list(urls)
        self._avoid: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Routers:
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._watcher.join()

    def avoid(self, i: int, seconds: float = AVOID_S) -> None:
        with self._lock:
            self._avoid[i] = time.monotonic() + seconds

    def order(self, first: int) -> list[int]:
        """Every router from `first` on, the avoided ones last."""
        now, k = time.monotonic(), len(self.urls)
        ring = [(first + j) % k for j in range(k)]
        with self._lock:
            return sorted(ring, key=lambda i: self._avoid.get(i, 0.0) > now)

    def _watch(self) -> None:
        with httpx.Client(timeout=1.0) as client:
            while not self._stop.wait(0.25):
                for i, url in enumerate(self.urls):
                    try:
                        healthy = client.get(f"{url}/health").status_code == 200
                    except httpx.HTTPError:
                        healthy = False
                    if not healthy:
                        self.avoid(i, 0.5)


@dataclass
class Stream(Timed):
    """One request across every connection it took (chunk times from its first send)."""

    started: float = 0.0  # monotonic time of the first send
    router: int = 0  # the router it was sent to first
    served_by: list[int] = field(default_factory=list)  # routers whose stream it read
    rid: str | None = None  # the request id its chunks carry
    last_event_id: str | None = None
    done: bool = False  # saw data: [DONE]
    refused: int = 0  # refusals (503, connection refused; of a reconnect: any non-200)
    broke: int = 0  # connections that broke mid-stream
    reconnects: int = 0  # reconnections with Last-Event-ID
    resumed: bool = False  # completed after a reconnect

    @property
    def ok(self) -> bool:
        return super().ok and self.done


class _Refused(Exception):
    """The router did not take the request: try another."""


class _Broke(Exception):
    """A started stream's connection broke (or ended without [DONE])."""


def _read(client: httpx.Client, body: dict, headers: dict, out: Stream, t0: float, timeout: float) -> None:
    """One connection: appends its chunks to `out`; returns at [DONE] or a clear error."""
    answered = False
    try:
        with client.stream("POST", "/v1/completions", json=body, headers=headers, timeout=timeout) as r:
            answered = True
            # refused: 503; a reconnect not taken (yet) by this router: any other status too
            if r.status_code == 503 or (r.status_code != 200 and "Last-Event-ID" in headers):
                raise _Refused(f"{r.status_code}: {r.read().decode(errors='replace')[:200]}")
            out.status = r.status_code
            out.pipeline_header = out.pipeline_header or r.headers.get("x-pdd-pipeline")
            if r.status_code != 200:
                out.error = r.read().decode(errors="replace")[:500]
                return
            event_id, data = None, None
            for line in r.iter_lines():
                if line.startswith("id:"):
                    event_id = line[3:].strip()
                elif line.startswith("data:"):
                    data = line[5:].strip()
                elif line == "" and (data is not None or event_id is not None):
                    if _event(data, out, t0):  # dispatched: its id is the last one seen
                        return
                    if event_id is not None:
                        out.last_event_id = event_id
                    event_id, data = None, None
            if data is not None and _event(data, out, t0):
                return
            raise _Broke("the stream ended without [DONE]")
    except httpx.HTTPError as e:  # before the response: nothing was seen, send it elsewhere
        raise (_Broke if answered else _Refused)(f"{type(e).__name__}: {e}") from None


def _event(data: str | None, out: Stream, t0: float) -> bool:
    """One SSE event's data; True once the stream is over ([DONE], or an error that a reconnect
    would not fix)."""
    if data is None:
        return False
    if data == "[DONE]":
        out.done = True
        return True
    d = json.loads(data)
    if "error" in d:
        out.error = str(d["error"].get("message"))
        return False
    if out.rid is None:
        out.rid = d.get("id")
    elif d.get("id") not in (None, out.rid):
        out.error = f"the reconnect started another request ({d.get('id')}, not {out.rid})"
        return True
    ids = d["choices"][0].get("token_ids") or [] if d.get("choices") else []
    if ids:
        out.chunks.append((time.monotonic() - t0, len(ids)))
        out.token_ids += ids
    if "pdd" in d:
        out.pdd = d["pdd"]
    return False


def stream_request(routers: Routers, first: int, body: dict, timeout: float) -> Stream:
    """A streamed completion sent to router `first`; refused: the next router; broken: resumed
    on another one with Last-Event-ID. Never longer than `timeout` in all."""
    t0 = time.monotonic()
    # An event stream asked for as such carries SSE ids, to resume from.
    out, headers = Stream(started=t0, router=first), {"Accept": "text/event-stream"}
    deadline, broke_at, refused_since, last = t0 + timeout, None, None, None
    while time.monotonic() < deadline:
        for i in routers.order(first if last is None else (last + 1) % len(routers.urls)):
            if time.monotonic() >= deadline:
                break
            try:
                with httpx.Client(base_url=routers.urls[i]) as client:
                    _read(client, body, headers, out, t0, max(1.0, deadline - time.monotonic()))
                if out.done and out.reconnects and out.error is None:
                    out.resumed = True
                out.served_by.append(i)
                out.end = time.monotonic() - t0
                return out
            except _Refused as e:
                out.refused += 1
                routers.avoid(i)
                refused_since = refused_since or time.monotonic()
                if broke_at is None and time.monotonic() - refused_since > REFUSED_RETRY_S:
                    return _failed(out, t0, f"refused by every router for {REFUSED_RETRY_S:.0f} s: {e}")
                if broke_at is not None and time.monotonic() - broke_at > RESUME_WINDOW_S:
                    return _failed(out, t0, f"not resumed within {RESUME_WINDOW_S:.0f} s: {e}")
            except _Broke as e:
                out.served_by.append(i)
                out.broke += 1
                routers.avoid(i)
                if out.error is not None:  # an error event came before the break
                    return _failed(out, t0, out.error)
                if out.last_event_id is None:
                    return _failed(out, t0, f"connection broke, no SSE id to resume from ({e})")
                broke_at = broke_at or time.monotonic()
                if time.monotonic() - broke_at > RESUME_WINDOW_S:
                    return _failed(out, t0, f"not resumed within {RESUME_WINDOW_S:.0f} s: {e}")
                headers = {"Accept": "text/event-stream", "Last-Event-ID": out.last_event_id}
                out.reconnects += 1
            last = i
        time.sleep(0.2)
    return _failed(out, t0, out.error or "no router finished it in time")


def _failed(out: Stream, t0: float, error: str) -> Stream:
    out.error = error
    out.end = time.monotonic() - t0
    return out
