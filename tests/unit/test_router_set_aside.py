"""The router's decision about an instance a peer refused on the KV channel (pure: no NATS)."""

from services.router.core.actions import Move
from services.router.core.request_stream import RequestStream
from services.router.core.set_aside import CAUSE, SetAside
from services.router.routing.policy import RouteDecision
from shared.bus.messages import IdentityFault, Pipeline, Role

WRONG = "peer identity spiffe://pdd/dc-a/relay is not main_decode"


def _stream(rid: str, md: str, pipeline: Pipeline = Pipeline.P_MD) -> RequestStream:
    return RequestStream(rid, [1, 2, 3], RouteDecision(pipeline, 0.0, 0, 0.0), md)


def _fault(instance: str = "md-forged", role: Role = Role.MAIN_DECODE) -> IdentityFault:
    return IdentityFault(role, instance, WRONG, "p-0", "10.200.0.2:7400")


def test_a_fault_sets_the_instance_aside_once_until_it_is_another_process() -> None:
    aside = SetAside()
    got = aside.fault(_fault(), "prefill", "epoch-1", 5.0)
    assert got is not None and got.reason == WRONG and got.reporter == "prefill p-0"
    assert (Role.MAIN_DECODE, "md-forged") in aside and aside.of(Role.MAIN_DECODE) == {"md-forged"}
    assert aside.of(Role.PREFILL) == set()
    assert aside.fault(_fault(), "prefill", "epoch-1", 6.0) is None  # already aside: no second move
    assert aside.reported(Role.MAIN_DECODE, "md-forged", "epoch-1") is None  # the same process: stays
    assert aside.reported(Role.MAIN_DECODE, "md-other", "epoch-9") is None
    left = aside.reported(Role.MAIN_DECODE, "md-forged", "epoch-2")  # restarted: returns
    assert left is not None and left.reason == WRONG and "md-forged" not in aside.of(Role.MAIN_DECODE)


def test_a_fault_that_names_no_instance_sets_nothing_aside() -> None:
    aside = SetAside()  # a receiver refusing a sender whose certificate names no instance
    assert aside.fault(_fault("", Role.PREFILL), "main_decode", "", 1.0) is None
    assert not aside.instances


def test_the_requests_of_an_instance_set_aside_move_and_no_others() -> None:
    aside = SetAside()
    aside.fault(_fault(), "prefill", "e", 0.0)
    waiting = _stream("waiting", "md-forged")  # dispatching to it: its KV was refused
    producing = _stream("producing", "md-forged")
    producing.dispatched("p-0")
    producing.hand_to(Role.MAIN_DECODE, "md-forged")
    elsewhere = _stream("elsewhere", "md-0")
    elsewhere.dispatched("p-0")
    relayed = _stream("relayed", "md-forged", Pipeline.P_RLD_MD)
    relayed.dispatched("p-0")  # the relay finishes it: its MD counts as lost instead
    done = _stream("done", "md-forged")
    done.dispatched("p-0")
    done.finish()
    moves = aside.moves([waiting, producing, elsewhere, relayed, done])
    assert [m.stream.rid for m in moves] == ["waiting", "producing"]
    assert all(isinstance(m, Move) and m.cause == CAUSE and WRONG in m.why for m in moves)
    assert "main_decode md-forged was set aside" in moves[0].why
