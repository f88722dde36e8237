"""One vLLM LLM in a process of its own, for the connector test: greedy tokens for token-id
prompts, with or without PddConnector.

    python -m tests.vllm.llm_run SPEC.json OUT.json
SPEC: {model, prompts: [[ids]], max_tokens, kv_role?, store?, model_id?, chunk?, prefix_caching?, then?}
      chunk: max_num_batched_tokens, so a long prompt is prefilled over several steps
      prefix_caching: vLLM's own prefix cache on (off by default: only the connector supplies KV)
      then: prompts generated after `prompts` are done (so they may hit vLLM's prefix cache)
OUT:  {outputs: [[ids]], cached: [prompt tokens vLLM did not compute, per prompt]}, prompts then `then`
"""

from __future__ import annotations

import json
import sys


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
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    done = []
    for prompts in (spec["prompts"], spec.get("then")):
        if prompts:
            done += llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {
        "outputs": [list(d.outputs[0].token_ids) for d in done],
        "cached": [d.num_cached_tokens for d in done],
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = run(json.load(f))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
