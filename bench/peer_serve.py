"""`pdd bench peer`'s serving pieces: vLLM's OpenAI server started from the peer venv and
waited for, and one `vllm bench serve` run against a server (vLLM's or `pdd up`'s router)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx

from bench.peer_venv import Missing, Vllm
from pdd.benchkit.progress import progress

API_KEY = "peer-bench-key"
METRICS = ("request_throughput", "median_tpot_ms", "p99_itl_ms", "median_ttft_ms", "p99_ttft_ms")


def kv_env(vllm: Vllm, args) -> dict[str, str]:
    return {**vllm.env, "VLLM_CPU_KVCACHE_SPACE": f"{args.kv_space_gib:g}"}


def log_tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ok(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Missing(f"`vllm serve` exited ({proc.returncode}); see {log}:\n" + log_tail(log))
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise Missing(f"`vllm serve` not healthy in {timeout_s:.0f} s; see {log}")


@contextlib.contextmanager
def vllm_server(vllm: Vllm, args, ckpt: Path, model_id: str, max_model_len: int):
    port, log = _free_port(), args.workdir / "vllm-serve.log"
    argv = vllm.cli(
        "serve",
        str(ckpt),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--served-model-name",
        model_id,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        API_KEY,
        "--seed",
        "0",
    )
    with open(log, "w") as f:
        proc = subprocess.Popen(
            argv, env=kv_env(vllm, args), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_ok(f"http://127.0.0.1:{port}/health", proc, log, 900)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def serve_shape(quick: bool) -> dict:
    return (
        dict(num_prompts=16, input_len=64, output_len=32)
        if quick
        else dict(num_prompts=64, input_len=256, output_len=128)
    )


def bench_serve(vllm: Vllm, args, url: str, backend: str, model_id: str, ckpt: Path, name: str) -> dict:
    """One `vllm bench serve` run (the same flags for every server); its figures."""
    shape = serve_shape(args.quick)
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    result_file, log = f"serve-{name}.json", args.workdir / f"bench-serve-{name}.log"
    argv = vllm.cli(
        "bench",
        "serve",
        "--backend",
        backend,
        "--base-url",
        url,
        "--endpoint",
        endpoint,
        "--model",
        model_id,
        "--tokenizer",
        str(ckpt),
        "--dataset-name",
        "random",
        "--num-prompts",
        str(shape["num_prompts"]),
        "--max-concurrency",
        "8",
        "--random-input-len",
        str(shape["input_len"]),
        "--random-output-len",
        str(shape["output_len"]),
        "--ignore-eos",
        "--temperature",
        "0",  # greedy on both servers: their outputs compare
        "--seed",
        str(args.seed),
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(args.workdir),
        "--result-filename",
        result_file,
    )
    with (
        open(log, "w") as f,
        progress(f"serve: vllm bench serve --backend {backend} against {name.split('-')[0]}"),
    ):
        rc = subprocess.run(
            argv, env={**vllm.env, "OPENAI_API_KEY": API_KEY}, stdout=f, stderr=subprocess.STDOUT
        ).returncode
    path = args.workdir / result_file
    if rc != 0 or not path.exists():
        return {"error": f"vllm bench serve exit {rc}; see {log}", "log_tail": log_tail(log)}
    r = json.loads(path.read_text())
    lens = r.get("output_lens") or []
    errors = [e for e in r.get("errors") or [] if e]
    return {
        **{m: r.get(m) for m in METRICS},
        "completed": r.get("completed"),
        "failed": shape["num_prompts"] - (r.get("completed") or 0),
        "first_errors": errors[:3],
        "output_tokens": r.get("total_output_tokens"),
        "exact_output_lens": sum(n == shape["output_len"] for n in lens),
        "texts": r.get("generated_texts") or [],
        "duration_s": r.get("duration"),
    }
