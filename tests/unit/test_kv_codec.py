"""The WAN KV codecs: round trip, the error bound each promises, and the bytes they put on the wire."""

from __future__ import annotations

import pytest
import torch

from shared.kv.codec import CODECS, EXACT, bytes_ratio, decode, encode, layer_bytes, round_trip

LOSSY = [c for c in CODECS if c != EXACT]
SHAPE = (3, 2, 5, 16, 2, 16)  # [L, 2, n, block_size, kv_heads, head_dim]


def kv_of(seed: int = 0, dtype: torch.dtype = torch.float32, shape=SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[1, 0, 2] *= 50.0  # runs of very different magnitude: the scale is per run
    x[2, 1, 4, :, 1] = 0.0  # an all-zero run
    return x.to(dtype)


def scales(codec: str, x: torch.Tensor) -> torch.Tensor:
    """Each element's scale, broadcast to x's shape."""
    top = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}[codec]
    s = x.float().abs().amax(dim=(3, 5), keepdim=True) / top
    return s.expand_as(x)


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_keeps_shape_and_dtype(codec: str, dtype: torch.dtype) -> None:
    x = kv_of(1, dtype)
    enc = encode(codec, x)
    assert enc.data.dtype == torch.uint8 and enc.data.is_contiguous()
    assert tuple(enc.data.shape) == (SHAPE[0], layer_bytes(codec, SHAPE, dtype))
    y = decode(codec, enc.data, enc.shape, enc.dtype)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(decode(codec, enc.data.reshape(-1), SHAPE, dtype), y)  # flat bytes too
    assert torch.equal(y[2, 1, 4, :, 1], torch.zeros_like(y[2, 1, 4, :, 1]))  # zeros stay zeros


def test_exact_is_the_tensor_itself() -> None:
    x = kv_of(2)
    assert round_trip(EXACT, x) is x
    assert bytes_ratio(EXACT, SHAPE, torch.float32) == 1.0
    assert layer_bytes(EXACT, SHAPE, torch.bfloat16) == x[0].numel() * 2
    with pytest.raises(ValueError):
        encode(EXACT, x)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_integer_codecs_err_by_at_most_half_a_step(codec: str) -> None:
    x = kv_of(3)
    err = (round_trip(codec, x) - x).abs()
    assert (err <= scales(codec, x) * (0.5 + 1e-5)).all()


def test_fp8_errs_by_at_most_half_an_ulp() -> None:
    x = kv_of(4)
    err = (round_trip("fp8", x) - x).abs()
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value; below 2^-6 (subnormal) the
    # step is 2^-9 of the scale.
    bound = x.abs() * 2**-4 + scales("fp8", x) * 2**-10
    assert (err <= bound * (1 + 1e-5)).all()


@pytest.mark.parametrize("codec, rel", [("int8", 0.01), ("fp8", 0.04), ("int4", 0.2)])
def test_relative_rms_error_is_small(codec: str, rel: float) -> None:
    """On Gaussian KV, the quality each codec trades for its bytes."""
    x = torch.randn(4, 2, 8, 16, 4, 64, generator=torch.Generator().manual_seed(5))
    y = round_trip(codec, x)
    assert ((y - x).norm() / x.norm()).item() < rel


def test_wire_bytes_ratio() -> None:
    shape = (8, 2, 4, 16, 4, 64)  # the small preset's blocks
    # A value in 1 byte (int4: half), plus one fp32 scale per block_size x head_dim = 1024 values.
    assert bytes_ratio("int8", shape, torch.float32) == pytest.approx(4 / (1 + 4 / 1024))
    assert bytes_ratio("fp8", shape, torch.bfloat16) == pytest.approx(2 / (1 + 4 / 1024))
    assert bytes_ratio("int4", shape, torch.float32) == pytest.approx(4 / (0.5 + 4 / 1024))
    kv = torch.randn(shape)
    for codec in LOSSY:
        assert kv.nbytes / encode(codec, kv).nbytes == pytest.approx(bytes_ratio(codec, shape, torch.float32))


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV codec"):
        encode("zstd", kv_of())
    with pytest.raises(ValueError, match="even"):
        encode("int4", torch.randn(1, 2, 1, 16, 1, 3))
    with pytest.raises(ValueError):
        encode("int8", torch.randn(2, 16, 4))


def test_a_decoded_group_says_what_it_took_on_the_wire() -> None:
    from shared.kv.codec import mark_wire, wire_nbytes, wire_ratio

    x = kv_of(6)
    assert wire_nbytes(x) == x.nbytes and wire_ratio(x) == 1.0  # unmarked: its own size
    enc = encode("int8", x)
    y = mark_wire(decode("int8", enc.data, enc.shape, enc.dtype), enc.nbytes)
    assert wire_nbytes(y) == enc.nbytes
    part = y[:, :, :2]  # what a receiver keeps of it, the ratio read off the whole group
    assert wire_nbytes(part, wire_ratio(y)) == round(enc.nbytes * 2 / SHAPE[2])
