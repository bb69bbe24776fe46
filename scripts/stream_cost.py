#!/usr/bin/env python3
"""What kvgate costs on a streamed answer, in Envoy's CPU: chat is mostly streamed, a token per
server-sent event, and each event is a response-body callback in which kvgate reads its chunk,
counts its text and, at each KV block boundary, grows the request's entry in the pod's record.
Fronts: Envoy alone (round robin); the overhead benchmark's floor (bench/floor), bare and reading
each response chunk into the VM (`response-body 1`: what any filter that meters a stream must
do); and Envoy with kvgate (each `--wasm` given, default the build's). One worker each, in front
of kvgate-sim pods running at real speed; closed-loop streaming clients send one 4 KB chat body
with `max_tokens` (generated in full); Envoy's process CPU per request. Fronts interleaved, a
different order each round; the median of the rounds.

    .venv/bin/python scripts/stream_cost.py                        # 2 pods, 200 clients, 256 tokens
    .venv/bin/python scripts/stream_cost.py --wasm A.wasm,B.wasm --rounds 5 --clients 400

Prints each front's CPU per request (µs) with each round's figure, and what it adds per request
and per streamed token to Envoy alone. BENCHMARKS.md, 2026-11-27."""

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests/e2e"))

import contextlib  # noqa: E402

import run as bench  # noqa: E402
import harness  # noqa: E402
from harness import Envoy, Sim, free_port  # noqa: E402

FLOORS = {"floor": None, "floor-reading": "response-body 1"}


@contextlib.contextmanager
def front_at(front, endpoints, out):
    """One worker's Envoy for `front`: "envoy", a floor (`FLOORS`) or a kvgate build's path."""
    if front in FLOORS:
        cfg = bench.envoy_config(free_port(), free_port(), endpoints, wasm=str(bench.FLOOR_WASM))
        if FLOORS[front] is not None:
            hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            wasm = next(f for f in hcm["http_filters"] if f["name"] == "kvgate")["typed_config"]["config"]
            wasm["configuration"]["value"] = FLOORS[front]
        with Envoy(cfg, concurrency=1) as envoy:
            yield envoy.port, envoy
        return
    if front != "envoy":
        bench.WASM_SNAPSHOT = front
    name = "envoy" if front == "envoy" else "kvgate"
    with bench.target(name, endpoints, "stream", str(out), {}, concurrency=1) as (port, envoy):
        yield port, envoy


def cpu_per_request(front, a, out):
    """Envoy's CPU µs per request, and requests measured, with `front` in front of the pods."""
    sim_args = ["--time-scale", "1.0", "--num-gpu-blocks", str(a.blocks)]
    with Sim(pods=a.pods, args=sim_args) as sim:
        with front_at(front, sim.endpoints, out) as (port, envoy):
            base = ["--workload", "fixed", "--requests", 1, "--repeat", "--body-bytes", 4096,
                    "--output-tokens", a.tokens, "--arrival", "closed", "--concurrency", a.clients,
                    "--timeout", 120]
            bench.run_bench(port, base + ["--max-duration", 3], out / "warmup", 120)
            cpu0 = bench.process_cpu_s(envoy.proc.pid)
            s = bench.run_bench(port, base + ["--max-duration", a.seconds], out / "measured", 300)["overall"]
            return 1e6 * (bench.process_cpu_s(envoy.proc.pid) - cpu0) / s["ok"], s["ok"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wasm", default=str(harness.WASM), help="comma-separated kvgate builds")
    ap.add_argument("--pods", type=int, default=2)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=20000, help="KV blocks per pod (room for every client)")
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    bench.ensure_binaries()
    out = ROOT / "target/stream-cost"
    out.mkdir(parents=True, exist_ok=True)
    fronts = ["envoy", *FLOORS, *a.wasm.split(",")]
    cpu = {f: [] for f in fronts}
    for r in range(a.rounds):
        for front in fronts[r % len(fronts):] + fronts[:r % len(fronts)]:
            us, n = cpu_per_request(front, a, out)
            bench.log(f"round {r + 1}: {front}: {us:.0f} µs a request ({n} requests)")
            cpu[front].append(us)
    alone = statistics.median(cpu["envoy"])
    print(f"{'front':>40} {'CPU µs/request':>15} {'adds':>8} {'µs a token':>10}   rounds")
    for f in fronts:
        m = statistics.median(cpu[f])
        added = "" if f == "envoy" else f"{m - alone:>8.0f} {(m - alone) / a.tokens:>10.2f}"
        print(f"{f[-40:]:>40} {m:>15.0f} {added:>19}   {' '.join(f'{x:.0f}' for x in cpu[f])}")


if __name__ == "__main__":
    main()
