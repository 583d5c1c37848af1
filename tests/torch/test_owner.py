"""``BlockingOwner``: a boundary that raises ``Rejoin`` makes the owner close the
communicator, make its replacement, connect it and run the rounds' ``join`` with it;
other errors reach the caller. The communicator is a recording double of
``pccl_trio.sync.Communicator``'s surface that the owner uses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import pccl_trio as pccl
from pccl_trio.torch._owner import BlockingOwner, Rejoin


class Recording:
    """The calls a blocking communicator received, and its replacements."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        self.peer_id: int | None = None
        self.made = 0

    def connect(self) -> None:
        self.log.append(f"{self.name}.connect")
        self.peer_id = 1

    def close(self) -> None:
        self.log.append(f"{self.name}.close")

    def replacement(self) -> Recording:
        self.made += 1
        return Recording(f"{self.name}'", self.log)

    def call_in_loop(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        coroutine = afn(self, *args)
        try:
            coroutine.send(None)  # the doubles' coroutines never suspend
        except StopIteration as done:
            return done.value
        raise AssertionError("a double's coroutine suspended")


class Rounds:
    """Rounds whose boundaries raise what the test lines up."""

    def __init__(self, log: list[str], raises: list[BaseException | None]) -> None:
        self.log, self.raises = log, raises

    async def join(self, comm: Recording) -> None:
        self.log.append(f"join({comm.name})")

    async def boundary(self, comm: Recording) -> None:
        self.log.append(f"boundary({comm.name})")
        error = self.raises.pop(0)
        if error is not None:
            raise error

    def rejoining(self) -> None:
        self.log.append("rejoining")


def test_a_kick_after_a_step_joins_again_with_a_new_communicator() -> None:
    log: list[str] = []
    comm = Recording("c", log)
    rounds = Rounds(log, [None, Rejoin(), None])
    owner = BlockingOwner(comm, rounds, "DiLoCo")  # type: ignore[arg-type]
    owner.join()
    owner.run(rounds.boundary)  # type: ignore[arg-type]
    owner.run(rounds.boundary)  # type: ignore[arg-type]
    assert log == ["c.connect", "join(c)", "boundary(c)", "boundary(c)", "c.close",
                   "c'.connect", "rejoining", "join(c')"]
    assert owner.communicator is not comm and owner.communicator.name == "c'"
    owner.run(rounds.boundary)  # type: ignore[arg-type]
    assert log[-1] == "boundary(c')"


def test_other_errors_reach_the_caller_and_a_second_join_is_refused() -> None:
    log: list[str] = []
    comm = Recording("c", log)
    rounds = Rounds(log, [pccl.MasterConnectionError("no master")])
    owner = BlockingOwner(comm, rounds, "DiLoCo")  # type: ignore[arg-type]
    owner.join()
    with pytest.raises(pccl.MasterConnectionError):
        owner.run(rounds.boundary)  # type: ignore[arg-type]
    assert owner.communicator is comm and comm.made == 0
    with pytest.raises(pccl.InvalidUsage, match="this DiLoCo joined the run already"):
        owner.join()
