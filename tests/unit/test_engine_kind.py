"""Which engine runs behind the seam: EngineSettings.kind (PDD_ENGINE__KIND, `pdd up --engine`);
a kind this build cannot run stops a service before it starts, with exit 2."""

from __future__ import annotations

import os

import pytest

from pdd import cli
from pdd.config_show import rows
from pdd.launch import UpOptions, service_specs
from services.main_decode.service import MainDecodeService
from services.prefill.service import PrefillService
from services.relay.service import RelayService
from shared.config import EngineSettings, MainDecodeSettings, ModelSettings, PrefillSettings, RelaySettings
from shared.engine import EngineError, LLMEngine
from shared.engine.factory import build_engine
from shared.vllm.checkpoint import vllm_refuses

SERVICES = [
    (PrefillService, PrefillSettings),
    (RelayService, RelaySettings),
    (MainDecodeService, MainDecodeSettings),
]
UNAVAILABLE = "the vLLM engine needs vLLM, which is not installed in this environment"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in os.environ:
        if key.startswith("PDD_"):
            monkeypatch.delenv(key)


def test_the_kind_is_a_setting_of_every_engine_service(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineSettings().kind == "pdd"
    monkeypatch.setenv("PDD_ENGINE__KIND", "vllm")
    monkeypatch.setenv("PDD_MD_ENGINE__KIND", "pdd")  # a service's own variable wins
    assert PrefillSettings().engine.kind == RelaySettings().engine.kind == "vllm"
    assert MainDecodeSettings().engine.kind == "pdd"
    row = {r.setting: r for r in rows("relay")[0]}["engine.kind"]
    assert row.env == ("PDD_RELAY_ENGINE__KIND", "PDD_ENGINE__KIND") and row.current == "vllm"


def test_pdd_engine_alone_names_the_kind_beside_the_engines_other_settings(monkeypatch) -> None:
    """`engine` is also the nested EngineSettings: a bare word there is its kind."""
    monkeypatch.setenv("PDD_ENGINE", "vllm")
    monkeypatch.setenv("PDD_ENGINE__KV_MEMORY_MB", "7")
    monkeypatch.setenv("PDD_RELAY_ENGINE", "pdd")
    md, relay = MainDecodeSettings().engine, RelaySettings().engine
    assert (md.kind, md.kv_memory_mb) == ("vllm", 7) and (relay.kind, relay.kv_memory_mb) == ("pdd", 7)


def test_the_factory_builds_pdds_engine_and_refuses_vllm() -> None:
    assert isinstance(build_engine(ModelSettings(preset="tiny"), EngineSettings(kv_memory_mb=1)), LLMEngine)
    with pytest.raises(EngineError, match=UNAVAILABLE):
        build_engine(ModelSettings(preset="tiny"), EngineSettings(kind="vllm"))


@pytest.mark.parametrize(("service", "settings"), SERVICES)
async def test_a_service_given_vllm_exits_2_before_it_starts(service, settings, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PDD_ENGINE__KIND", "vllm")
    with pytest.raises(SystemExit) as e:
        await service.preflight(settings())
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert UNAVAILABLE in err and "PDD_ENGINE=pdd" in err


def test_up_engine_flag(capsys) -> None:
    assert cli.up_options(cli.parse_args(["up", "--engine", "pdd"])[0]).engine == "pdd"
    with pytest.raises(SystemExit) as e:
        cli.up_options(cli.parse_args(["up", "--engine", "vllm"])[0])
    assert e.value.code == 2 and UNAVAILABLE in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["up", "--engine", "tgi"])
    assert not any("ENGINE__KIND" in k for s in service_specs(UpOptions()) for k in s.env)  # the default
    opts = UpOptions()
    opts.engine = "vllm"  # as a build that has it would be given
    engine_envs = {k: v for s in service_specs(opts) for k, v in s.env.items() if k.endswith("ENGINE__KIND")}
    assert {"PDD_PREFILL_ENGINE__KIND", "PDD_RELAY_ENGINE__KIND", "PDD_MD_ENGINE__KIND"} <= set(engine_envs)
    assert set(engine_envs.values()) == {"vllm"}


def test_vllm_given_a_gguf_file_exits_2_naming_it(monkeypatch, capsys) -> None:
    from shared.engine import factory

    assert vllm_refuses(ModelSettings(preset="tiny")) is None
    assert "GGUF" in vllm_refuses(ModelSettings())  # the default model is a GGUF file
    monkeypatch.setattr(factory, "engine_unavailable", lambda kind: None)  # as where vLLM imports
    factory.require_available_engine(
        EngineSettings(kind="vllm"), "main_decode", ModelSettings(preset="small")
    )
    with pytest.raises(SystemExit) as e:
        factory.require_available_engine(EngineSettings(kind="vllm"), "main_decode", ModelSettings())
    assert e.value.code == 2 and "not a GGUF file" in capsys.readouterr().err
