"""KV block copies of a paged cache (shared/kv/device_blocks.py) against the device's own copy
bandwidth.

    python -m bench.device_blocks [--quick]

On a CUDA device, for a few cache shapes (Llama-8B-like: 32 layers, 8 KV heads of 128): checks
that gather then scatter into a fresh cache is bit-identical and that gather returns while the
current stream is busy; times gather (blocks -> pinned host buffer) and scatter (back) of n
scattered blocks, in GB/s of block bytes from the call until its event completes, against one
contiguous device -> pinned host and host -> device copy of the same bytes; prints a table with
the ratios and writes bench/out/device_blocks.json. Without a CUDA device it runs the exactness
check on the CPU, says that no CUDA device was at hand, and exits 0.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from pdd.benchkit.progress import add_quiet_option
from pdd.benchkit.report import save_report
from shared.kv.device_blocks import DeviceBlocks

OUT = "bench/out/device_blocks.json"
# (layout, dtype, block_size, blocks gathered): ~256 MiB a copy, and a small one
CASES = [
    ("NHD", torch.bfloat16, 16, 128),
    ("NHD", torch.bfloat16, 16, 8),
    ("NHD", torch.float16, 128, 16),
    ("HND", torch.bfloat16, 16, 128),
    ("NHD", torch.float32, 16, 64),
]
LAYERS, HEADS, HEAD_DIM = 32, 8, 128
CACHE_TOKENS = {"cuda": 32768, "cpu": 1024}  # tokens a layer's cache holds
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def random_cache(layout: str, dtype: torch.dtype, block_size: int, layers: int, device: str) -> list:
    blocks = CACHE_TOKENS[device] // block_size
    dims = (block_size, HEADS) if layout == "NHD" else (HEADS, block_size)
    shape = (2, blocks, *dims, HEAD_DIM)
    info = torch.iinfo(BITS[dtype])
    return [
        torch.randint(info.min, info.max, shape, dtype=BITS[dtype], device=device).view(dtype)
        for _ in range(layers)
    ]


def exact(layout: str, dtype: torch.dtype, block_size: int, n: int, layers: int, device: str) -> bool:
    """gather then scatter into a zeroed cache: the blocks' bits, and nothing else written."""
    src = random_cache(layout, dtype, block_size, layers, device)
    ids = random.Random(n).sample(range(src[0].shape[1]), n)
    copier = DeviceBlocks(layout)
    got = copier.gather(src, ids)
    got.wait()
    dst = [torch.zeros_like(t) for t in src]
    copier.scatter(got.host, dst, ids).wait()
    bits = BITS[dtype]
    ok = all(torch.equal(s[:, ids].view(bits), d[:, ids].view(bits)) for s, d in zip(src, dst, strict=True))
    written = sum(int(torch.count_nonzero(d.view(bits))) for d in dst)
    got.release()
    return ok and written == int(sum(torch.count_nonzero(s[:, ids].view(bits)) for s in src))


def _median_s(fn, reps: int) -> float:
    fn()
    fn()  # first calls make streams, buffers and staging
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_case(layout: str, dtype: torch.dtype, block_size: int, n: int, layers: int, reps: int) -> dict:
    src = random_cache(layout, dtype, block_size, layers, "cuda")
    ids = random.Random(n).sample(range(src[0].shape[1]), n)
    copier = DeviceBlocks(layout)
    nbytes = layers * 2 * n * block_size * HEADS * HEAD_DIM * dtype.itemsize
    launch: list[float] = []

    def gather() -> None:
        t0 = time.perf_counter()
        copy = copier.gather(src, ids)
        launch.append(time.perf_counter() - t0)
        copy.wait()
        copy.release()

    host = copier.gather(src, ids)
    host.wait()

    def scatter() -> None:
        copier.scatter(host.host, src, ids, wait=False).wait()

    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()

    def d2h() -> None:
        with torch.cuda.stream(stream):
            pinned.copy_(flat, non_blocking=True)
        stream.synchronize()

    def h2d() -> None:
        with torch.cuda.stream(stream):
            flat.copy_(pinned, non_blocking=True)
        stream.synchronize()

    gbs = {
        name: nbytes / _median_s(fn, reps) / 1e9
        for name, fn in [("gather", gather), ("scatter", scatter), ("d2h", d2h), ("h2d", h2d)]
    }
    return {
        "layout": layout,
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": block_size,
        "blocks": n,
        "mib": nbytes / 2**20,
        **{f"{k}_gbs": v for k, v in gbs.items()},
        "gather_ratio": gbs["gather"] / gbs["d2h"],
        "scatter_ratio": gbs["scatter"] / gbs["h2d"],
        "gather_launch_ms": statistics.median(launch) * 1e3,
    }


def gather_does_not_wait(layers: int) -> bool:
    """A gather returns while the current stream is still busy, and sees what it queued."""
    src = random_cache("NHD", torch.bfloat16, 16, layers, "cuda")
    copier = DeviceBlocks()
    warm = copier.gather(src, [1])  # streams, buffer and staging made now: allocating may wait
    warm.wait()
    warm.release()
    torch.cuda._sleep(500_000_000)  # ~0.3 s of work on the current stream
    for t in src:
        t[:, 3].fill_(5.0)
    copy = copier.gather(src, [3])
    busy = not torch.cuda.current_stream().query()
    copy.wait()
    return busy and bool((copy.host == 5.0).all())


def table(result: dict) -> None:
    print(f"\n{result['device']}: {result['layers']} layers, {HEADS} KV heads x {HEAD_DIM}")
    print(
        f"{'layout':>6} {'dtype':>8} {'bs':>4} {'blocks':>6} {'MiB':>7} {'gather':>8} {'d2h':>8} {'ratio':>6} "
        f"{'scatter':>8} {'h2d':>8} {'ratio':>6} {'launch ms':>9}"
    )
    for r in result["cases"]:
        print(
            f"{r['layout']:>6} {r['dtype']:>8} {r['block_size']:>4} {r['blocks']:>6} {r['mib']:>7.1f} "
            f"{r['gather_gbs']:>8.1f} {r['d2h_gbs']:>8.1f} {r['gather_ratio']:>6.2f} "
            f"{r['scatter_gbs']:>8.1f} {r['h2d_gbs']:>8.1f} {r['scatter_ratio']:>6.2f} {r['gather_launch_ms']:>9.2f}"
        )
    print("(GB/s of block bytes; ratio: against the contiguous copy of the same bytes)")
    print(
        f"exact: {result['exact']}   gather returned while the current stream was busy: {result['no_stall']}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdd bench device_blocks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 layers, fewer repetitions")
    add_quiet_option(p)  # it draws no bars; accepted as every bench's
    a = p.parse_args(argv)
    layers = 4 if a.quick else LAYERS
    if not torch.cuda.is_available():
        ok = all(exact(lay, dt, bs, min(n, 8), 2, "cpu") for lay, dt, bs, n in CASES)
        print(f"CPU exactness check (gather then scatter, {len(CASES)} cases): {'ok' if ok else 'FAILED'}")
        print("no CUDA device was at hand: nothing timed, nothing written")
        return 0 if ok else 1
    t0 = time.perf_counter()
    ok = all(exact(lay, dt, bs, n, layers, "cuda") for lay, dt, bs, n in CASES)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "quick": a.quick,
        "layers": layers,
        "exact": ok,
        "no_stall": gather_does_not_wait(layers),
        "cases": [time_case(*case, layers, 5 if a.quick else 20) for case in CASES],
    }
    result["wall_s"] = time.perf_counter() - t0
    save_report(result, OUT, table=table)
    return 0 if ok and result["no_stall"] else 1


if __name__ == "__main__":
    sys.exit(main())
