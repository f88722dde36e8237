"""The model flags of `pdd up`, as vLLM's (--model, --served-model-name, --max-model-len,
--dtype, a KV space), down to each service's settings; the API's model id and max_tokens."""

from __future__ import annotations

import json

import pytest

from pdd import cli
from pdd.launch import ENV_PREFIX, KV_SERVICES, UpOptions, service_specs
from services.router.api.openai_request import parse_request
from services.router.core.errors import APIError
from shared import config
from shared.model.tokenizer import ByteTokenizer

SETTINGS = {
    "prefill": config.PrefillSettings,
    "relay": config.RelaySettings,
    "main_decode": config.MainDecodeSettings,
    "router": config.RouterSettings,
}


def _settings(opts: UpOptions, monkeypatch: pytest.MonkeyPatch) -> dict[str, config.CommonSettings]:
    """Each service's settings as it reads them from the environment `pdd up` gives it."""
    out = {}
    for spec in service_specs(opts)[1:]:
        with monkeypatch.context() as m:
            for key, value in spec.env.items():
                m.setenv(key, value)
            out[spec.name] = SETTINGS[spec.service]()
    return out


def test_model_flags_reach_every_service(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PDD_MODEL__PRESET", "PDD_MODEL__PATH", "PDD_ENGINE__KV_MEMORY_MB"):
        monkeypatch.delenv(name, raising=False)
    argv = ["up", "--model", "m.gguf", "--served-model-name", "smol", "--max-model-len", "2048"]
    opts = cli.up_options(cli.parse_args([*argv, "--dtype", "bfloat16", "--kv-cache-space", "6"])[0])
    assert (opts.model, opts.served_model_name, opts.max_model_len, opts.dtype) == (
        "m.gguf",
        "smol",
        2048,
        "bfloat16",
    )
    for name, s in _settings(opts, monkeypatch).items():
        assert (s.model.path, s.model.served_model_name, s.model.dtype) == ("m.gguf", "smol", "bfloat16"), (
            name
        )
        assert s.model.preset is None and s.engine.max_model_len == 2048, name
        if name in KV_SERVICES:  # the machine's 6 GiB split among its three engines
            assert s.engine.kv_cache_space_gib == 2.0, name


def test_no_model_flag_leaves_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PDD_MODEL__PRESET", "PDD_MODEL__PATH", "PDD_MODEL__DTYPE"):
        monkeypatch.delenv(name, raising=False)
    opts = cli.up_options(cli.parse_args(["up"])[0])
    assert opts == UpOptions() and opts.model is None and opts.dtype == "auto"
    for spec in service_specs(opts)[1:]:
        p = ENV_PREFIX[spec.service]
        assert not {f"{p}MODEL__PATH", f"{p}MODEL__PRESET", f"{p}MODEL__DTYPE"} & set(spec.env)
    for s in _settings(opts, monkeypatch).values():  # the embedded default model, auto dtype
        assert (s.model.path, s.model.preset, s.model.dtype, s.engine.max_model_len) == (
            None,
            None,
            "auto",
            None,
        )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--max-model-len", "long"], "invalid int value"),
        (["--mod", "x"], "ambiguous option"),  # a prefix of --model and --model-preset
    ],
)
def test_bad_model_flags_are_refused(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["up", *argv])
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="--max-model-len must be at least 2"):
        UpOptions(max_model_len=1)


def _parse(body: dict, max_model_len: int = 64, default: int | None = None):
    raw = json.dumps({"prompt": "0123456789", **body}).encode()
    return parse_request(
        raw,
        False,
        model_id="smol",
        tokenizer=ByteTokenizer(),
        max_model_len=max_model_len,
        max_tokens_default=default,
    )


def test_max_tokens_defaults_to_the_rest_of_the_context() -> None:
    assert _parse({}).params.max_tokens == 64 - 10
    assert _parse({}, default=7).params.max_tokens == 7  # PDD_ROUTER_MAX_TOKENS_DEFAULT
    assert _parse({"max_tokens": 3}).params.max_tokens == 3
    with pytest.raises(APIError, match="exceeds the context limit of 10 tokens"):
        _parse({}, max_model_len=10)  # a prompt that fills the context leaves nothing


def test_the_model_id_is_the_served_name() -> None:
    assert _parse({"model": "smol"}).body.model == "smol"
    with pytest.raises(APIError) as e:
        _parse({"model": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    assert e.value.status == 404 and "model 'HuggingFaceTB/SmolLM2-135M-Instruct' does not exist" in str(
        e.value
    )
