"""Tool calls read from a streamed output, delta by delta, into OpenAI's stream shape: the
first delta of a call carries its `index`, `id`, `type` and `function.name`, the next ones
fragments of `function.arguments` (concatenated, they are the arguments' JSON text).

A small state machine over the text so far (as vLLM's streaming parsers do): each delta
re-reads the call regions of the whole text (hermes: between `<tool_call>` tags; llama3_json:
top-level JSON objects; required: the objects of the JSON array; named: the whole text is the
arguments) and sends what is new: a call's name once it is complete, then the part of its
arguments not sent yet. Content (hermes: the text before the first `<tool_call>`; llama3_json:
an output that does not start as JSON) streams as it comes, except a tail that may be the
start of a tag, held until it is not (or the output ends)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .tool_parsers import HERMES_END, HERMES_START, PYTHON_TAG, call_id

NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)+)"')
ARGUMENTS = {
    "hermes": ("arguments",),
    "llama3_json": ("arguments", "parameters"),
    "required": ("parameters",),
}


def tag_overlap(text: str, tag: str) -> int:
    """The length of the longest start of `tag` that ends `text` (0: none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at `start` ends (exclusive); None if not yet."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            esc, in_str = (False, in_str) if esc else (c == "\\", c != '"')
            continue
        if c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def objects(text: str, start: int) -> list[str]:
    """The top-level JSON objects from `start` on (the last one possibly unfinished)."""
    out = []
    while (i := text.find("{", start)) != -1:
        end = json_end(text, i)
        out.append(text[i:end])
        if end is None:
            break
        start = end
    return out


def hermes_regions(text: str) -> list[str]:
    out, pos = [], 0
    while (start := text.find(HERMES_START, pos)) != -1:
        body_at = start + len(HERMES_START)
        end = text.find(HERMES_END, body_at)
        if end == -1:
            body = text[body_at:]
            out.append(body[: len(body) - tag_overlap(body, HERMES_END)].strip())
            break
        out.append(text[body_at:end].strip())
        pos = end + len(HERMES_END)
    return out


def arguments_of(region: str, keys: tuple[str, ...]) -> str | None:
    """The arguments' JSON text so far (an object or array value of one of `keys`)."""
    match = re.search('"(?:' + "|".join(keys) + r')"\s*:\s*', region)
    if not match or match.end() >= len(region) or region[match.end()] not in "{[":
        return None
    end = json_end(region, match.end())
    return region[match.end() : end]


@dataclass
class _Sent:
    name: str
    arguments: str = ""


class ToolStream:
    """One choice's stream. `choice`: none | auto | required | named; `parser`: the auto format."""

    def __init__(self, choice: str, parser: str = "hermes", named: str | None = None, parallel: bool = True):
        self.choice, self.parser, self.named, self.parallel = choice, parser, named, parallel
        self.text = ""
        self.content_sent = 0
        self.sent: list[_Sent] = []
        self.mode = {"none": "content", "named": "named", "required": "required"}.get(choice, "")

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, delta: str, final: bool = False) -> dict:
        """The OpenAI delta fields (`content`, `tool_calls`) for this piece of text; `final`:
        the output ends here (a held tail goes out as content)."""
        self.text += delta
        if not self.mode:
            self.mode = self._decide(final)
        if not self.mode:
            return {}
        if self.mode == "content":
            return self._content(len(self.text))
        if self.mode == "named":
            return self._calls([(self.named or "", self.text)])
        if self.mode == "hermes":
            return self._hermes(final)
        return self._calls(self._regions())

    def _decide(self, final: bool) -> str:
        """auto: which way the output goes, once its start tells."""
        if self.parser == "hermes":
            return "hermes"
        text = self.text.lstrip()
        if text.startswith(PYTHON_TAG) or text.startswith("{"):
            return "llama3_json"
        if text and not PYTHON_TAG.startswith(text) or final:
            return "content"
        return ""  # not yet known: wait

    def _content(self, upto: int) -> dict:
        piece = self.text[self.content_sent : upto]
        self.content_sent = max(self.content_sent, upto)
        return {"content": piece} if piece else {}

    def _hermes(self, final: bool) -> dict:
        at = self.text.find(HERMES_START)
        if at == -1:
            upto = len(self.text) - (0 if final else tag_overlap(self.text, HERMES_START))
            return self._content(upto)
        out = self._content(at)
        regions = hermes_regions(self.text)
        return out | self._calls([(_name(r), arguments_of(r, ARGUMENTS["hermes"])) for r in regions])

    def _regions(self) -> list[tuple[str | None, str | None]]:
        if self.mode == "required":
            start = self.text.find("[")
            found = [] if start == -1 else objects(self.text, start + 1)
        else:
            tag = self.text.find(PYTHON_TAG)
            found = objects(self.text, 0 if tag == -1 else tag + len(PYTHON_TAG))
        keys = ARGUMENTS[self.mode]
        return [(_name(r), arguments_of(r, keys)) for r in found]

    def _calls(self, regions: list[tuple[str | None, str | None]]) -> dict:
        entries = []
        for i, (name, arguments) in enumerate(regions[: None if self.parallel else 1]):
            if i == len(self.sent):
                if not name:
                    break  # a call's name comes whole, and before the next call's
                self.sent.append(_Sent(name))
                entries.append({"index": i, "id": call_id(), "type": "function", "function": {"name": name}})
            fresh = (arguments or "")[len(self.sent[i].arguments) :]
            if fresh:
                self.sent[i].arguments += fresh
                if entries and entries[-1]["index"] == i:
                    entries[-1]["function"]["arguments"] = fresh
                else:
                    entries.append({"index": i, "function": {"arguments": fresh}})
        for entry in entries:
            entry["function"].setdefault("arguments", "")
        return {"tool_calls": entries} if entries else {}


def _name(region: str) -> str | None:
    match = NAME.search(region)
    return match.group(1) if match else None
