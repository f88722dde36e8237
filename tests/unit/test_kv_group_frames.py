"""The sub-frames of one KV group: headers, byte ranges and checksums, without a connection."""

import pytest
import torch

from shared.kv import client
from shared.kv.checksum import DEFAULT_ALGO, checksum, frame_algo
from shared.kv.client import _Layers


def test_a_group_is_cut_along_layers_and_only_the_first_frame_carries_the_hashes(monkeypatch) -> None:
    kv = torch.arange(4 * 2 * 1 * 2 * 1 * 4, dtype=torch.float32).reshape(4, 2, 1, 2, 1, 4)
    monkeypatch.setattr(client, "SUBFRAME_BYTES", 2 * kv[0].numel() * kv.element_size())  # 2 layers a frame
    layers = _Layers.of(kv)
    frames = list(layers.frames({"kind": "blocks"}, {"hashes": [7]}, layers.ranges(), "crc32"))
    assert [h["layers"] for h, _ in frames] == [[0, 2], [2, 4]]
    assert [h.get("hashes") for h, _ in frames] == [[7], None]
    assert b"".join(bytes(d) for _, d in frames) == bytes(layers.data)
    for header, data in frames:
        assert header["kind"] == "blocks" and header["nbytes"] == len(data)
        assert header["csum"] == ["crc32", checksum("crc32", data)]


def test_a_piece_starting_past_layer_zero_gets_no_first_fields() -> None:
    kv = torch.zeros(3, 2, 1, 2, 1, 4)
    layers = _Layers.of(kv)
    (header, data), *_ = layers.frames({"kind": "piece"}, {"hashes": [1]}, layers.ranges(1, 3), "none")
    assert header["layers"][0] == 1 and "hashes" not in header
    assert len(data) == 2 * kv[0].numel() * kv.element_size()


def test_frames_go_unchecksummed_only_on_a_sealed_stream_unless_one_is_asked_for() -> None:
    assert frame_algo(None, sealed=True) == "none"  # AES-GCM tags prove every record
    assert frame_algo(None, sealed=False) == DEFAULT_ALGO
    assert frame_algo("crc32", sealed=True) == "crc32"
    with pytest.raises(ValueError, match="checksum must be one of"):
        frame_algo("md5", sealed=False)
