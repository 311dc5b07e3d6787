"""Weight-channel throughput: a state dict published by one process, loaded by another.

The trainer side (this process) publishes ``--versions`` versions of a ``--mb`` MB fp32
state dict (24 tensors, 64 MiB buckets) to a ``WeightSubscriber`` in a spawned process
over loopback (``ipc://`` as the local scheduler uses, or ``--transport tcp``); each
version is published only after the subscriber reported the previous one loaded. Per
version: seconds from the start of ``publish`` until ``poll`` returned the whole,
verified state dict on the other side (pack, sign, send, receive, verify, materialize);
GB/s = payload bytes / those seconds. Prints every version, then the median and best.

Run: ``.venv/bin/python bench/weight_sync.py [--mb 105] [--versions 5]``.
This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.channel_auth import new_secret  # noqa: E402
from runtime.channels import free_tcp_address, ipc_address  # noqa: E402
from runtime.weight_subscriber import WeightSubscriber  # noqa: E402
from runtime.weights import WeightPublisher  # noqa: E402

N_TENSORS = 24


def _subscriber(address: str, secret: bytes, versions: int, ready, done) -> None:
    torch.set_num_threads(1)
    sub = WeightSubscriber(address, secret=secret)
    ready.put(True)
    for v in range(1, versions + 1):
        sub.wait(v, timeout_s=120)
        done.put((v, time.perf_counter()))  # CLOCK_MONOTONIC: comparable across processes on Linux
    sub.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=105.0, help="state dict size, MB (1e6 bytes)")
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel = int(args.mb * 1e6 / 4 / N_TENSORS)
    state = {f"layer{i}.weight": torch.randn(numel) for i in range(N_TENSORS)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    address = ipc_address("bench") if args.transport == "ipc" else free_tcp_address()
    secret = new_secret()
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_subscriber, args=(address, secret, args.versions, ready, done))
    proc.start()
    ready.get(timeout=60)
    pub = WeightPublisher(address, secret=secret)
    rates = []
    for v in range(1, args.versions + 1):
        start = time.perf_counter()
        pub.publish(state, v)
        _, loaded = done.get(timeout=120)
        rates.append(nbytes / 1e9 / (loaded - start))
        print(f"version {v}: {loaded - start:.3f} s, {rates[-1]:.2f} GB/s")
    pub.close()
    proc.join(timeout=30)
    print(f"{nbytes / 1e6:.0f} MB over {args.transport}: median {statistics.median(rates):.2f} GB/s, "
          f"best {max(rates):.2f} GB/s")


if __name__ == "__main__":
    main()
