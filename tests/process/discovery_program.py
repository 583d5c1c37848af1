"""Discovery in a process of its own, for ``test_discovery_namespaces.py``.

``discovery_program.py peers STEPS_JSON`` runs each step of a JSON list in turn and
prints one JSON line per step:

* ``{"do": "connect", "run": R, "secret": S, "timeout": T}``: ``Communicator(discover=R)``
  with run secret S and ``discovery_timeout`` T; prints the master it joined and the
  world size, or the error;
* ``{"do": "list", "run": R, "secret": S, "timeout": T}``: ``list_masters(R)``; prints
  the instance names and addresses.

``discovery_program.py hostile RUN TAG HOST PORT`` advertises, with zeroconf itself,
three broken masters (a TXT record whose length runs past its end, run RUN with a
protocol version that is not a number, run RUN at a loopback address only) and a copy
of the advertisement of RUN's master with tag TAG, at HOST:PORT, whose instance name
sorts before any real master's; prints ``registered`` once every advertisement is
announced and waits for stdin to close.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import trio

import pccl_trio as pccl
from pccl_trio._core.discovery import SERVICE_TYPE, build_txt
from pccl_trio._core.messages import PROTOCOL_VERSION


async def step(spec: dict[str, Any]) -> dict[str, Any]:
    config = pccl.Config(run_secret=spec["secret"], discovery_timeout=spec["timeout"])
    started = time.monotonic()
    if spec["do"] == "list":
        masters = await pccl.list_masters(spec["run"], config=config)
        return {"do": "list", "masters": [[m.instance, m.address] for m in masters],
                "seconds": time.monotonic() - started}
    try:
        async with pccl.Communicator(discover=spec["run"], config=config) as comm:
            found = time.monotonic() - started
            world = comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
            return {"do": "connect", "master": comm.master_address, "world": world, "seconds": found}
    except pccl.PCCLError as exc:
        return {"do": "connect", "error": type(exc).__name__, "message": str(exc)}


async def peers(steps: list[dict[str, Any]]) -> None:
    for spec in steps:
        print(json.dumps(await step(spec)), flush=True)


async def hostile(run: str, tag: str, host: str, port: int) -> None:
    import asyncio

    import zeroconf
    from zeroconf.asyncio import AsyncZeroconf

    zc = AsyncZeroconf(interfaces=zeroconf.InterfaceChoice.All, ip_version=zeroconf.IPVersion.V4Only)
    def txt(*strings: bytes) -> bytes:
        return b"".join(bytes([len(string)]) + string for string in strings)

    named = f"run={run}".encode()
    adverts = [
        ("hostile-truncated", b"\x09run=x", host, 9),
        ("hostile-proto", txt(b"proto=x", named), host, 9),
        ("hostile-loopback", txt(named, f"proto={PROTOCOL_VERSION}".encode()), "127.0.0.1", 9),
        (f"{run}--copycat", build_txt(run, tag=tag), host, port),
    ]
    infos = [
        zeroconf.ServiceInfo(
            SERVICE_TYPE, f"{instance}.{SERVICE_TYPE}", port=at, properties=text,
            parsed_addresses=[address], server=f"{instance}.{SERVICE_TYPE}",
        )
        for instance, text, address, at in adverts
    ]
    # All at once (each registration announces itself for most of a second), and
    # without probing: faster.
    announced = [await zc.async_register_service(info, cooperating_responders=True) for info in infos]
    await asyncio.gather(*announced)
    print("registered", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await asyncio.gather(*[await zc.async_unregister_service(info) for info in infos])
    await zc.async_close()


if __name__ == "__main__":
    if sys.argv[1] == "hostile":
        import asyncio

        asyncio.run(hostile(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
    else:
        trio.run(peers, json.loads(sys.argv[2]))
