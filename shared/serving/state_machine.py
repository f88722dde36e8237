"""A request's lifecycle as an explicit state machine: an Enum of states, a table of the
allowed moves, and one place that performs them. An illegal move raises, so a protocol bug
shows up where it happens instead of as a request that hangs."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Generic, TypeVar

S = TypeVar("S", bound=Enum)


class IllegalTransition(RuntimeError):
    pass


class StateMachine(Generic[S]):
    def __init__(self, initial: S, allowed: Mapping[S, frozenset[S]]) -> None:
        self.state = initial
        self._allowed = allowed

    def to(self, new: S) -> None:
        if new not in self._allowed.get(self.state, frozenset()):
            raise IllegalTransition(f"{type(new).__name__}: {self.state.name} -> {new.name}")
        self.state = new

    def finish(self, final: S) -> bool:
        """Move to the final state, once: False if it is there already (a request ends once,
        however many events ask)."""
        if self.state is final:
            return False
        self.to(final)
        return True

    def is_in(self, *states: S) -> bool:
        return self.state in states

    def __repr__(self) -> str:
        return f"StateMachine({self.state.name})"


def table_of(states: type[S], **table: tuple[str, ...]) -> dict[S, frozenset[S]]:
    """{state: allowed next states} from names: table_of(St, A=("B",), B=()) ."""
    return {states[name]: frozenset(states[n] for n in nxt) for name, nxt in table.items()}
