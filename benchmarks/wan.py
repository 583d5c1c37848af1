"""Plain against quantized all-reduce over emulated WAN links (network namespaces + tc).

Usage (as root, with iproute2's ``ip`` and ``tc``):
    python benchmarks/wan.py [--world 3] [--rate 100mbit] [--sizes 64M] [--iters 3]
                             [--repeats 3] [--quantize uint8,uint16] [--slice-bytes 4M,1M]

Topology: one network namespace per peer and one for the master, each joined by a
veth pair to a bridge in a hub namespace (10.77.0.0/24). Every peer's link is shaped
to ``--rate`` in both directions with a token-bucket filter (tbf) on both ends of its
veth pair, as a host behind a symmetric access link would be; the master's link is
not shaped (its traffic is a few small control messages per all-reduce). This kernel
has no ``netem``, so there is no added latency: the links differ from loopback by
bandwidth alone, which is what quantization trades against.

Each repeat runs the bench driver's processes (``pccl_trio._bench``) inside the
namespaces, alternating plain float32 and each quantized variant so that drift hits
all alike. Prints the median time per all-reduce and the speed-up over plain float32.
The namespaces (named after ``--prefix``, by default unique to the process) are
removed on exit, also after an error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from pccl_trio._bench import Placement, _run_pccl, format_size, parse_size

SUBNET = "10.77.0"
MASTER_IP = f"{SUBNET}.100"


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True)


def netns(name: str, *argv: str) -> None:
    sh("ip", "netns", "exec", name, *argv)


def shape(namespace: str, device: str, rate: str) -> None:
    """A token bucket on ``device``'s egress: ``rate``, a burst of 64 KiB, and a queue
    of at most 100 ms at that rate."""
    netns(namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
          "burst", "64kb", "latency", "100ms")


class Topology:
    """The hub, the master's namespace and ``world`` peer namespaces; ``rate`` None
    leaves the links unshaped (for callers that shape them otherwise)."""

    def __init__(self, world: int, rate: str | None, prefix: str) -> None:
        self.world = world
        self.rate = rate
        self.prefix = prefix
        self.hub = f"{prefix}-hub"
        self.master = f"{prefix}-m"
        self.peers = [f"{prefix}-{i}" for i in range(world)]

    def __enter__(self) -> Topology:
        self.remove()
        try:
            sh("ip", "netns", "add", self.hub)
            netns(self.hub, "ip", "link", "add", "br0", "type", "bridge")
            netns(self.hub, "ip", "link", "set", "br0", "up")
            netns(self.hub, "ip", "link", "set", "lo", "up")
            self._attach(self.master, "m", MASTER_IP, shaped=False)
            for index, name in enumerate(self.peers):
                self._attach(name, str(index), self.peer_ip(index), shaped=self.rate is not None)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @staticmethod
    def peer_ip(index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def device(self, index: int) -> str:
        """Peer ``index``'s end of its veth pair (in its namespace)."""
        return f"wan{index}"

    def _attach(self, namespace: str, label: str, address: str, *, shaped: bool) -> None:
        inner, outer = f"wan{label}", f"hub{label}"
        sh("ip", "netns", "add", namespace)
        sh("ip", "link", "add", inner, "netns", namespace, "type", "veth", "peer", "name", outer,
           "netns", self.hub)
        netns(namespace, "ip", "addr", "add", f"{address}/24", "dev", inner)
        netns(namespace, "ip", "link", "set", inner, "up")
        netns(namespace, "ip", "link", "set", "lo", "up")
        netns(self.hub, "ip", "link", "set", outer, "master", "br0")
        netns(self.hub, "ip", "link", "set", outer, "up")
        if shaped:
            assert self.rate is not None
            shape(namespace, inner, self.rate)  # upload
            shape(self.hub, outer, self.rate)  # download

    def remove(self) -> None:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in names.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(self.prefix + "-"):
                subprocess.run(["ip", "netns", "delete", name], check=False)

    def placement(self) -> Placement:
        return Placement(
            master_prefix=("ip", "netns", "exec", self.master),
            master_listen=f"{MASTER_IP}:0",
            worker_prefixes=tuple(("ip", "netns", "exec", name) for name in self.peers),
            worker_hosts=tuple(self.peer_ip(i) for i in range(self.world)),
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--rate", default="100mbit", help="tc rate of every peer's link")
    parser.add_argument("--sizes", default="64M")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantize", default="uint8",
                        help="comma list of code dtypes to compare with plain float32")
    parser.add_argument("--algorithm", default="min_max", choices=["min_max", "zero_point_scale"])
    parser.add_argument("--protection", default="",
                        help="comma list of data protections (mac, encrypt) to compare with "
                             "a run without a secret")
    parser.add_argument("--slice-bytes", default="4M",
                        help="comma list of Config.slice_bytes; the first is the one the "
                             "other variants use, each further one is a plain variant")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--prefix", default=f"pccl-wan{os.getpid()}",
                        help="names of the namespaces (removed first if they exist)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if shutil.which("ip") is None or shutil.which("tc") is None:
        print("needs iproute2's ip and tc, and root", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    slices = [parse_size(s) for s in args.slice_bytes.split(",")]
    # (quantization, data protection, slice bytes) per variant, named after what differs.
    choices = {"none": ("none", "none", slices[0])}
    choices.update({q: (q, "none", slices[0]) for q in args.quantize.split(",") if q})
    choices.update({p: ("none", p, slices[0])
                    for p in args.protection.split(",") if p and p != "none"})
    choices.update({f"s{format_size(b).replace(' ', '')}": ("none", "none", b) for b in slices[1:]})
    variants = list(choices)
    times: dict[str, dict[int, list[float]]] = {v: {} for v in variants}
    print(f"# W={args.world}, every peer's link shaped to {args.rate} each way (tbf); "
          f"float32 SUM in place; iters={args.iters} warmup={args.warmup} "
          f"repeats={args.repeats}; quantized: {args.algorithm}", flush=True)
    with Topology(args.world, args.rate, args.prefix) as topology:
        for repeat in range(args.repeats):
            for variant in variants:
                run = argparse.Namespace(
                    iters=args.iters, warmup=args.warmup, pool=0, slice_bytes=choices[variant][2],
                    into_recv=False, timeout=args.timeout, quantize=choices[variant][0],
                    algorithm=args.algorithm,
                )
                result = _run_pccl(
                    args.world, sizes, run, topology.placement(), protection=choices[variant][1]
                )
                for size in sizes:
                    if not result[size]["ok"]:
                        raise RuntimeError(f"wrong result: {variant}, {size} bytes")
                    median = statistics.median(result[size]["times"])
                    times[variant].setdefault(size, []).append(median)
                    print(f"  repeat {repeat}: {variant:>6} {format_size(size):>8} "
                          f"{median:8.3f} s  tx {result[size]['tx_bytes'] / 1e6:8.1f} MB",
                          flush=True)
    print(f"{'size':>8} {'variant':>8} {'median s':>9} {'vs float32':>10}")
    rows = []
    for size in sizes:
        plain = statistics.median(times["none"][size])
        for variant in variants:
            median = statistics.median(times[variant][size])
            rows.append({"size": size, "variant": variant, "median_s": median,
                         "speedup": plain / median, "repeats": times[variant][size]})
            print(f"{format_size(size):>8} {variant:>8} {median:9.3f} {plain / median:9.2f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
