"""Ports handed to other processes lie below the ephemeral range and are never handed out twice."""

from __future__ import annotations

import socket

import pytest

import shared.ports
from shared.ports import HIGH, LOW, free_port, free_port_block


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_ports_lie_below_the_ephemeral_range_and_are_not_repeated() -> None:
    assert HIGH <= _ephemeral_low()
    ports = [free_port() for _ in range(200)]
    bases = [free_port_block(8) for _ in range(20)]
    handed = ports + [b + i for b in bases for i in range(8)]
    assert len(set(handed)) == len(handed)
    assert all(LOW <= p < HIGH for p in handed)


def test_a_bound_port_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    held = socket.socket()
    try:
        taken, other = free_port(), free_port()
        held.bind(("127.0.0.1", taken))
        shared.ports._handed_out -= {taken, other}  # as if another process had bound `taken`
        picks = iter([taken, other])
        monkeypatch.setattr(shared.ports.random, "randrange", lambda *_: next(picks))
        assert free_port() == other
    finally:
        held.close()


def test_many_single_ports_leave_room_for_long_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared.ports, "_handed_out", set())  # this test's own allocations only
    singles = [free_port() for _ in range(500)]
    blocks = [free_port_block(110) for _ in range(50)]
    assert len(set(singles)) == 500 and len(set(blocks)) == 50
