from enum import Enum, auto

import pytest

from shared.serving.state_machine import IllegalTransition, StateMachine, table_of


class Door(Enum):
    OPEN = auto()
    CLOSED = auto()
    GONE = auto()


TABLE = table_of(Door, OPEN=("CLOSED", "GONE"), CLOSED=("OPEN", "GONE"), GONE=())


def test_allowed_moves_happen() -> None:
    sm = StateMachine(Door.OPEN, TABLE)
    sm.to(Door.CLOSED)
    sm.to(Door.OPEN)
    assert sm.state is Door.OPEN and sm.is_in(Door.OPEN, Door.GONE) and not sm.is_in(Door.CLOSED)


def test_illegal_moves_raise_and_leave_the_state() -> None:
    sm = StateMachine(Door.OPEN, TABLE)
    with pytest.raises(IllegalTransition, match="OPEN -> OPEN"):
        sm.to(Door.OPEN)
    sm.to(Door.GONE)
    for target in Door:
        with pytest.raises(IllegalTransition):
            sm.to(target)
    assert sm.state is Door.GONE


def test_table_names_must_exist() -> None:
    with pytest.raises(KeyError):
        table_of(Door, OPEN=("AJAR",))


def test_finish_moves_to_the_final_state_once() -> None:
    sm = StateMachine(Door.OPEN, TABLE)
    assert sm.finish(Door.GONE) and sm.state is Door.GONE
    assert not sm.finish(Door.GONE)  # a second ending changes nothing
    with pytest.raises(IllegalTransition):  # an ending the table does not allow still raises
        StateMachine(Door.GONE, {Door.GONE: frozenset()}).finish(Door.CLOSED)
