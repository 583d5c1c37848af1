"""Shared-state sync between real processes: a joiner fed by two founders, one of which
is SIGKILLed while the joiner syncs."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from .conftest import LineReader, Processes

PROGRAM = str(Path(__file__).with_name("shared_state_program.py"))


async def start(processes: Processes, address: str, role: str, megabytes: int) -> LineReader:
    process = await processes.start(PROGRAM, address, role, "--founders", "2",
                                    "--megabytes", str(megabytes))
    return LineReader(process)


@pytest.mark.parametrize("kill", [False, True], ids=["clean", "sigkill_a_founder"])
async def test_joiner_gets_the_state_or_keeps_its_own(processes: Processes, kill: bool) -> None:
    """Whenever the founder dies (before the vote, mid-transfer, after), the joiner ends
    with either the founders' exact state at revision 1, or its own zeros at revision 0:
    never a mix."""
    megabytes = 128
    with trio.fail_after(240):
        _master, address = await processes.master()
        founders = [await start(processes, address, "founder", megabytes) for _ in range(2)]
        digests = {(await f.wait_for(lambda r: r["event"] == "ready"))["digest"] for f in founders}
        assert len(digests) == 1
        joiner = await start(processes, address, "joiner", megabytes)
        begin = await joiner.wait_for(lambda r: r["event"] == "begin")
        if kill:  # once it has sent its first frame to the joiner
            await founders[0].wait_for(lambda r: r["event"] == "serving")
            founders[0].process.kill()
        result = await joiner.wait_for(lambda r: r["event"] == "synced")
        survivor = await founders[1].wait_for(lambda r: r["event"] == "synced")
        assert survivor["ok"], survivor
        if result["ok"]:
            assert result["digest"] in digests and result["revision"] == 1, result
            assert result["rx"] == megabytes << 20
        else:
            assert kill, result
            assert result["digest"] == begin["zeros"] and result["revision"] == 0, result
        if not kill:
            other = await founders[0].wait_for(lambda r: r["event"] == "synced")
            assert other["ok"] and other["tx"] + survivor["tx"] == megabytes << 20
