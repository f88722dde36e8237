"""One vLLM LLM in a process of its own, for the tests under tests/vllm: tokens for token-id
prompts (greedy, or as pdd's sampling params say), with or without PddConnector.

    python -m tests.vllm.llm_run SPEC.json OUT.json
SPEC: {model, prompts: [[ids]], max_tokens, kv_role?, store?, model_id?, chunk?, prefix_caching?, then?,
       sampling?, generated?}
      chunk: max_num_batched_tokens, so a long prompt is prefilled over several steps
      prefix_caching: vLLM's own prefix cache on (off by default: only the connector supplies KV)
      then: prompts generated after `prompts` are done (so they may hit vLLM's prefix cache)
      sampling: pdd SamplingParams dicts, one per prompt of `prompts` (shared/vllm/sampling.py
                maps them); without it every prompt is greedy, max_tokens long, EOS ignored
      generated: per prompt of `prompts`, how many of its last tokens were generated elsewhere
OUT:  {outputs: [[ids]], cached: [prompt tokens vLLM did not compute, per prompt], texts: [str],
       finish_reasons: [str], logprobs: [positions with logprobs or null],
       prompt_logprobs: [positions with prompt logprobs or null]}, prompts then `then`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if spec.get("kv_role"):
        kv = KVTransferConfig(
            kv_connector="PddConnector",
            kv_connector_module_path="shared.vllm.connector",
            kv_role=spec["kv_role"],
            kv_connector_extra_config={"pdd_store_dir": spec["store"], "pdd_model_id": spec["model_id"]},
        )
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        max_model_len=1024,
        seed=0,
        enforce_eager=True,
        enable_prefix_caching=bool(spec.get("prefix_caching")),
        kv_transfer_config=kv,
        **({"max_num_batched_tokens": spec["chunk"]} if spec.get("chunk") else {}),
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True)
    params = greedy
    if spec.get("sampling"):
        from shared.engine.sampling_params import SamplingParams as PddSamplingParams
        from shared.vllm.sampling import to_vllm_sampling_params

        generated = spec.get("generated") or [0] * len(spec["sampling"])
        params = [
            to_vllm_sampling_params(PddSamplingParams.from_dict(_int_keys(d)), generated=g)
            for d, g in zip(spec["sampling"], generated, strict=True)
        ]
    done = []
    for prompts in (spec["prompts"], spec.get("then")):
        if prompts:
            done += llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            params = greedy
    return {
        "outputs": [list(d.outputs[0].token_ids) for d in done],
        "cached": [d.num_cached_tokens for d in done],
        "texts": [d.outputs[0].text for d in done],
        "finish_reasons": [d.outputs[0].finish_reason for d in done],
        "logprobs": [_count(d.outputs[0].logprobs) for d in done],
        "prompt_logprobs": [_count(d.prompt_logprobs) for d in done],
    }


def _int_keys(params: dict) -> dict:
    """logit_bias's token ids back to ints (JSON made them strings)."""
    return {**params, "logit_bias": {int(t): b for t, b in params.get("logit_bias", {}).items()}}


def export_small(out: Path) -> Path:
    """The `small` preset (seed 0) as a Hugging Face directory with the byte tokenizer."""
    from shared.model.export_hf import save_hf
    from shared.model.llama import LlamaForCausalLM
    from shared.model.presets import init_preset_weights, preset_config

    model = LlamaForCausalLM(preset_config("small", 0))  # head_dim 64: the CPU kernels want 32k
    init_preset_weights(model, 0)
    return save_hf(model, out, byte_tokenizer=True)


def generate(tmp: Path, name: str, spec: dict) -> dict:
    """run(spec) in a process of its own (vLLM's environment), its log kept in tmp/name.log."""
    return run_module(tmp, name, "tests.vllm.llm_run", spec)


def run_module(tmp: Path, name: str, module: str, spec) -> dict:
    """`python -m module SPEC.json OUT.json` in vLLM's environment; OUT's contents."""
    from bench.peer_venv import vllm_env

    env = {**vllm_env(Path(sys.prefix), os.cpu_count() or 1), "PYTHONPATH": str(ROOT)}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    spec_path, out_path, log = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log, "w") as f:
        rc = subprocess.run(
            [sys.executable, "-m", module, str(spec_path), str(out_path)],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=600,
        ).returncode
    assert rc == 0, f"{name} run failed (exit {rc}):\n" + "\n".join(log.read_text().splitlines()[-30:])
    return json.loads(out_path.read_text())


def _count(logprobs) -> int | None:
    return None if logprobs is None else len(logprobs)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = run(json.load(f))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
