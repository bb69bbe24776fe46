#!/usr/bin/env python3
"""What one proxy-wasm host call costs in this Envoy (V8), by kind: the overhead benchmark's floor
filter (bench/floor) makes COUNT extra calls of one kind per request, and the Envoy process's CPU
per request is compared with the bare floor's, in the same run. Each front is an Envoy with one
worker in front of `kvgate-bench echo`, 16 closed-loop clients sending 4 KB chat bodies (the
overhead benchmark's 16-client cell); fronts interleaved, a different order each round; the
median of the rounds.

    .venv/bin/python scripts/host_call_cost.py                 # every kind, 20 calls, 3 rounds
    .venv/bin/python scripts/host_call_cost.py --kinds get-data,header --count 40 --rounds 5

Prints, per kind, the CPU per request with and without the calls and the cost of one call (µs),
with each round's figure. The kinds are bench/floor's: `get-missing` (a shared-data read that
returns nothing), `get-data` (one that returns a 256-byte value: the host first calls into the VM
for memory to copy it to), `set`, `header` (a request header set), `header-missing` (a read of a
header the request does not carry), `clock`, `histogram`. BENCHMARKS.md, 2026-11-26."""

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests/e2e"))

import run as bench  # noqa: E402
from harness import Envoy, free_port  # noqa: E402

KINDS = ["get-missing", "get-data", "set", "header", "header-missing", "clock", "histogram"]
BODY = 4096
CLIENTS = 16
SECONDS = 3


def cpu_per_request(config, out):
    """Envoy's CPU µs per request with the floor configured by `config` (None: the bare floor)."""
    with bench.Echo() as echo:
        cfg = bench.envoy_config(free_port(), free_port(), echo.endpoints, wasm=str(bench.FLOOR_WASM))
        if config is not None:
            hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            wasm = next(f for f in hcm["http_filters"] if f["name"] == "kvgate")["typed_config"]["config"]
            wasm["configuration"]["value"] = config
        with Envoy(cfg, concurrency=1) as envoy:
            base = ["--workload", "fixed", "--requests", 1, "--repeat", "--body-bytes", BODY, "--output-tokens", 1,
                    "--arrival", "closed", "--concurrency", CLIENTS, "--no-stream", "--timeout", 30]
            bench.run_bench(envoy.port, base + ["--max-duration", 1], out / "warmup", 60)
            cpu0 = bench.process_cpu_s(envoy.proc.pid)
            s = bench.run_bench(envoy.port, base + ["--max-duration", SECONDS], out / "measured", 60)["overall"]
            return 1e6 * (bench.process_cpu_s(envoy.proc.pid) - cpu0) / s["ok"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    kinds = a.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        sys.exit(f"unknown kinds {unknown}; known: {KINDS}")
    bench.ensure_binaries()
    out = ROOT / "target/host-call-cost"
    out.mkdir(parents=True, exist_ok=True)
    fronts = [None] + kinds
    cpu = {f: [] for f in fronts}
    for r in range(a.rounds):
        for front in fronts[r % len(fronts):] + fronts[:r % len(fronts)]:
            cpu[front].append(cpu_per_request(None if front is None else f"{front} {a.count}", out))
    bare = statistics.median(cpu[None])
    print(f"{'kind':>12} {'CPU µs/request':>15} {'µs a call':>10}   rounds (µs/request)")
    print(f"{'(floor)':>12} {bare:>15.1f} {'':>10}   {' '.join(f'{x:.1f}' for x in cpu[None])}")
    for k in kinds:
        m = statistics.median(cpu[k])
        print(f"{k:>12} {m:>15.1f} {(m - bare) / a.count:>10.2f}   {' '.join(f'{x:.1f}' for x in cpu[k])}")


if __name__ == "__main__":
    main()
