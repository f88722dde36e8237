"""pdd's logits processing against vLLM's own code, on the same logits and token histories.

vLLM's interpreter (the CPU build `bench.peer_venv` installs, ~/.cache/pdd/vllm-venv) runs its
penalties op (repetition over prompt + output, frequency and presence over the output), its
min-p, logit-bias and min-tokens logits processors' arithmetic, on random rows; this process
runs shared/engine/logits_processors.py on the same inputs and compares: the processed logits
must agree to fp32 rounding and the greedy token (argmax) must be the same in every row.
Writes bench/out/vllm_sampling.json.

    python -m bench.vllm_sampling [--vllm-python ~/.cache/pdd/vllm-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from pdd.benchkit.progress import add_quiet_option

ROWS, VOCAB = 64, 1000


def make_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(ROWS):
        prompt = torch.randint(
            0, VOCAB, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g
        ).tolist()
        output = torch.randint(
            0, VOCAB // 4, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g
        ).tolist()
        rows.append(
            {
                "prompt": prompt,
                "output": output,
                "repetition": float(torch.empty(1).uniform_(0.5, 2.0, generator=g)),
                "frequency": float(torch.empty(1).uniform_(-2.0, 2.0, generator=g)),
                "presence": float(torch.empty(1).uniform_(-2.0, 2.0, generator=g)),
                "min_p": float(torch.empty(1).uniform_(0.0, 0.3, generator=g)),
                "bias": {
                    int(t): float(b)
                    for t, b in zip(
                        torch.randint(0, VOCAB, (3,), generator=g),
                        torch.randn(3, generator=g) * 5,
                        strict=True,
                    )
                },
                "min_tokens": int(torch.randint(0, 20, (1,), generator=g)),
                "stop_ids": torch.randint(0, VOCAB, (2,), generator=g).tolist(),
            }
        )
    return {"logits": torch.randn(ROWS, VOCAB, generator=g) * 4, "rows": rows, "eos": VOCAB - 1}


def vllm_reference(path: str) -> None:
    """In vLLM's interpreter: vLLM's code on the inputs at `path`; adds the results there."""
    from vllm.model_executor.layers.utils import apply_penalties

    data = torch.load(path)
    logits, rows, eos = data["logits"].clone(), data["rows"], data["eos"]
    # min_tokens, then logit_bias (vLLM's non-argmax-invariant processors, in their order).
    for i, r in enumerate(rows):
        if len(r["output"]) < r["min_tokens"]:
            logits[i, [eos, *r["stop_ids"]]] = float("-inf")
        for t, b in r["bias"].items():
            logits[i, t] += b
    pad = lambda seqs: torch.tensor([s + [VOCAB] * (max(map(len, seqs)) - len(s)) for s in seqs])  # noqa: E731
    penalized = apply_penalties(
        logits,
        pad([r["prompt"] for r in rows]),
        pad([r["output"] for r in rows]) if any(r["output"] for r in rows) else torch.full((ROWS, 1), VOCAB),
        torch.tensor([r["presence"] for r in rows]),
        torch.tensor([r["frequency"] for r in rows]),
        torch.tensor([r["repetition"] for r in rows]),
    )
    # min_p as vLLM's MinPLogitsProcessor.apply does it (on temperature-scaled logits; T = 1 here).
    probs = torch.softmax(penalized, dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * torch.tensor([r["min_p"] for r in rows])[:, None]
    data["vllm_processed"] = penalized.clone()
    data["vllm_min_p_kept"] = ~(probs < floor)
    torch.save(data, path)


def compare(data: dict) -> dict:
    from shared.engine import SamplingParams
    from shared.engine.logits_processors import apply_min_p, process_row

    ours = data["logits"].clone()
    for i, r in enumerate(data["rows"]):
        params = SamplingParams(
            repetition_penalty=r["repetition"],
            frequency_penalty=r["frequency"],
            presence_penalty=r["presence"],
            logit_bias=r["bias"],
            min_tokens=r["min_tokens"],
            stop_token_ids=r["stop_ids"],
            max_tokens=64,
        )
        process_row(ours[i], params, r["prompt"] + r["output"], len(r["prompt"]), (data["eos"],))
    theirs = data["vllm_processed"]
    finite = torch.isfinite(theirs)
    kept = apply_min_p(ours, [r["min_p"] for r in data["rows"]]) > float("-inf")
    return {
        "rows": ROWS,
        "vocab": VOCAB,
        "same_neg_inf": bool(torch.equal(finite, torch.isfinite(ours))),
        "max_abs_diff": float((ours[finite] - theirs[finite]).abs().max()),
        "same_greedy_token_rows": int((ours.argmax(-1) == theirs.argmax(-1)).sum()),
        "same_min_p_kept_rows": int((kept == data["vllm_min_p_kept"]).all(-1).sum()),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pdd bench vllm_sampling", description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=str(Path.home() / ".cache/pdd/vllm-venv/bin/python"))
    ap.add_argument("--out", default="bench/out/vllm_sampling.json")
    add_quiet_option(ap)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "inputs.pt")
        torch.save(make_inputs(), path)
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import vllm_sampling as v; v.vllm_reference({path!r})"
        subprocess.run([args.vllm_python, "-c", code], check=True, timeout=600)
        result = compare(torch.load(path))
    print(json.dumps(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    ok = result["same_neg_inf"] and result["max_abs_diff"] < 1e-4
    sys.exit(
        0 if ok and result["same_greedy_token_rows"] == ROWS and result["same_min_p_kept_rows"] == ROWS else 1
    )


if __name__ == "__main__":
    main()
