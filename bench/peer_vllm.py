"""The vLLM half of the peer bench's engine comparison, run by the python of vLLM's own
virtualenv (so it imports nothing from pdd): `LLM.generate` greedy over the given token-id
prompts, EOS ignored; one untimed warm-up pass, then `repeat` timed passes from an empty prefix cache (the best is kept).

    python bench/peer_vllm.py IN.json OUT.json
IN:  {model, dtype?, max_model_len, kv_space_gib?, repeat, requests: [[prompt ids, output length], ...]}
OUT: {seconds, outputs: [[token ids], ...], version}
"""

from __future__ import annotations

import json
import sys
import time


def _generate(spec: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec["max_model_len"],
        seed=0,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
    )
    prompts = [{"prompt_token_ids": ids} for ids, _ in spec["requests"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in spec["requests"]]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (compiles, allocates)
    best, outputs = float("inf"), []
    for _ in range(max(1, spec["repeat"])):
        llm.reset_prefix_cache()  # no help from the pass before (pdd's side resets its cache too)
        t0 = time.perf_counter()
        done = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
        outputs = [list(d.outputs[0].token_ids) for d in done]
    return {"seconds": best, "outputs": outputs, "version": vllm.__version__}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = _generate(json.load(f))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
