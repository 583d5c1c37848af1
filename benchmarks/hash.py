"""Content hash speed: simplehash of a buffer, against memory-bound anchors on the same bytes.

Usage: python benchmarks/hash.py [--size 1G] [--repeats 5] [--json out.json]

Reports the median seconds (and GB/s, GB = 1e9 bytes) of simplehash in one thread and in
``os.cpu_count()`` threads, next to two anchors measured in the same run on the same
buffer: copying it into a preallocated buffer (numpy ``copyto``, the memory bandwidth a
read-and-write pass gets) and ``zlib.crc32`` (the standard library's checksum).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy

from pccl_trio._bench import parse_size
from pccl_trio.ops import simplehash


def median_seconds(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1G")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    size = parse_size(args.size)
    data = numpy.random.default_rng(0).integers(0, 256, size, dtype=numpy.uint8)
    target = numpy.empty_like(data)
    target[:] = 0  # touch it once, outside the timing
    threads = os.cpu_count() or 1
    rows = {
        "copyto (anchor)": median_seconds(lambda: numpy.copyto(target, data), args.repeats),
        "zlib.crc32 (anchor)": median_seconds(lambda: zlib.crc32(data), args.repeats),
        "simplehash, 1 thread": median_seconds(lambda: simplehash(numpy, data), args.repeats),
        f"simplehash, {threads} threads": median_seconds(
            lambda: simplehash(numpy, data, threads=threads), args.repeats
        ),
    }
    anchor = rows["copyto (anchor)"]
    print(f"{size} bytes, median of {args.repeats}")
    for name, seconds in rows.items():
        print(f"{name:<24} {seconds:.3f} s  {size / seconds / 1e9:5.2f} GB/s  "
              f"{anchor / seconds:.2f}x copyto")
    if args.json:
        args.json.write_text(json.dumps({"size": size, "seconds": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
