"""A checkpoint's chat template, rendered as Hugging Face transformers' `apply_chat_template`
does: the same sandboxed jinja2 environment, helpers and template variables, so a prompt is
byte-identical to the one the model was tuned on."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused these messages (`raise_exception`) or failed while rendering them."""


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; a
    prompt renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Not jinja's own filter: that one escapes <, >, & and ' for HTML, which no template wants.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    """Templates come with checkpoints, i.e. untrusted code: sandboxed, and unable to mutate inputs."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def read_templates(model_dir: Path, tokenizer_config: dict) -> dict[str, str]:
    """Templates by name. .jinja files, when there are any, win over tokenizer_config.json's
    `chat_template` (a string, or a list of {name, template})."""
    files = {}
    if (model_dir / "chat_template.jinja").is_file():
        files["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    for file in sorted((model_dir / "chat_templates").glob("*.jinja")):
        files[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if files:
        return files
    entry = tokenizer_config.get("chat_template")
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list):
        return {t["name"]: t["template"] for t in entry}
    return {}


def read_special_tokens(model_dir: Path, tokenizer_config: dict) -> dict[str, str]:
    """The special tokens a template sees (transformers' special_tokens_map): every `*_token`
    entry and the named `extra_special_tokens`, as strings."""
    entries = dict(tokenizer_config)
    if "added_tokens_decoder" not in tokenizer_config:  # an older checkpoint: its map file wins
        entries.update(_read_json(model_dir / "special_tokens_map.json"))
    tokens = {k: t for k, v in entries.items() if k.endswith("_token") and (t := _token_text(v)) is not None}
    extra = entries.get("extra_special_tokens")
    if isinstance(extra, dict):
        tokens.update({k: t for k, v in extra.items() if (t := _token_text(v)) is not None})
    return tokens


class ChatTemplate:
    """Renders a conversation into the prompt text the checkpoint's template prescribes."""

    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str]) -> None:
        if "default" not in templates:
            raise ValueError(f"chat templates {sorted(templates)} but none named 'default'")
        env = _environment()
        try:
            self._compiled = {name: env.from_string(source) for name, source in templates.items()}
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e} (line {e.lineno})") from None
        self.special_tokens = special_tokens
        self.sources = dict(templates)  # the templates' text, by name (what the router reads of them)

    @property
    def source(self) -> str:
        """The text of every template (default first): what they teach the model to write."""
        return "\n".join([self.sources["default"], *(t for n, t in self.sources.items() if n != "default")])

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template a Hugging Face checkpoint directory ships, or None if it has none."""
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        templates = read_templates(model_dir, config)
        if not templates:
            return None
        try:
            return cls(templates, read_special_tokens(model_dir, config))
        except ValueError as e:
            raise ValueError(f"{model_dir}: {e}") from None

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text; ChatTemplateError when the template refuses or fails on these messages.
        `extra`: more template variables (a request's chat_template_kwargs); they never replace
        the messages, tools or special tokens."""
        name = "tool_use" if tools is not None and "tool_use" in self._compiled else "default"
        # Keys set to None are dropped: templates test `is defined`, and would print "None".
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {
            "messages": messages,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **self.special_tokens,
        }
        variables = {k: v for k, v in (extra or {}).items() if k not in variables} | variables
        try:
            return self._compiled[name].render(**variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None
        except (
            Exception
        ) as e:  # the template is checkpoint code: its failure is this request's 400, not a 500
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
