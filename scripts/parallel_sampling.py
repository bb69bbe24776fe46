#!/usr/bin/env python3
"""Requests for several answers (`n`, parallel sampling) on a KV-bound pool, through round robin
and through kvgate builds, in the same run: two kvgate-sim pods of 256 KV blocks (4,096 tokens)
at a ten-fold clock, 32 closed-loop streaming clients sending chat requests of about 330 prompt
tokens without `max_tokens` (the simulator's long-tailed lengths, mean 256 an answer), every
other one asking for N answers. Fronts interleaved, a different order each round; the median
of the rounds, with each round's figure.

    .venv/bin/python scripts/parallel_sampling.py                          # the build, N 4
    .venv/bin/python scripts/parallel_sampling.py --wasm old=/tmp/old.wasm --wasm new=target/...
    .venv/bin/python scripts/parallel_sampling.py --answers 1 --requests 600 --rounds 5

Prints per front: output tokens a second (and ÷ round robin), the engines' preemptions, TTFT
mean, and the pool's mean KV use and running sequences while busy. BENCHMARKS.md, 2026-12-01."""

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/e2e"))

from bodies import unshared_chat  # noqa: E402
from harness import WASM, Sim, baseline_envoy, default_plugin_config, kvgate_envoy, stream  # noqa: E402

BLOCKS = 256
SIM = ["--time-scale", "10", "--num-gpu-blocks", str(BLOCKS)]
PODS = 2
CLIENTS = 32


def run(front, wasm, requests, answers):
    """One front's run on fresh pods: what it did."""
    with Sim(pods=PODS, args=SIM) as sim:
        ctx = baseline_envoy(sim.endpoints) if wasm is None else \
            kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=2, wasm=wasm)
        with ctx as envoy:
            bodies = [dict(unshared_chat(5000 + j, None), n=answers) if j % 2 else unshared_chat(5000 + j, None)
                      for j in range(requests)]
            busy, stop = [], threading.Event()

            def sampler():
                while not stop.is_set():
                    pods = [sim.stats(i) for i in range(PODS)]
                    if any(p["running"] for p in pods):
                        busy.append((sum(p["kv_blocks_used"] for p in pods) / (BLOCKS * PODS),
                                     sum(p["running"] for p in pods)))
                    time.sleep(0.05)

            thread = threading.Thread(target=sampler)
            thread.start()
            started = time.monotonic()
            try:
                with ThreadPoolExecutor(CLIENTS) as pool:
                    answered = list(pool.map(lambda b: stream(envoy.port, "/v1/chat/completions", b), bodies))
            finally:
                elapsed = time.monotonic() - started
                stop.set()
                thread.join()
            ok = [a for a in answered if a["status"] == 200]
            assert len(ok) == requests, f"{front}: {requests - len(ok)} requests failed: {answered[0]}"
            return {
                "tok_s": sum(a["usage"]["completion_tokens"] for a in ok) / elapsed,
                "preemptions": sum(sim.stats(i)["preemptions"] for i in range(PODS)),
                "ttft_ms": 1000 * statistics.mean(a["ttft"] for a in ok),
                "kv": statistics.mean(k for k, _ in busy),
                "running": statistics.mean(r for _, r in busy),
            }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wasm", action="append", default=[], metavar="LABEL=PATH",
                   help="a kvgate build to measure (repeatable; default: the build, as kvgate)")
    p.add_argument("--answers", type=int, default=4, help="n of every other request")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    builds = [(w.split("=", 1)[0], Path(w.split("=", 1)[-1])) for w in a.wasm] or [("kvgate", WASM)]
    fronts = [("round robin", None), *builds]
    got = {name: [] for name, _ in fronts}
    for r in range(a.rounds):
        order = fronts[r % len(fronts):] + fronts[:r % len(fronts)]
        for name, wasm in order:
            got[name].append(run(name, wasm, a.requests, a.answers))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got[name][-1].items()),
                  flush=True)
    base = statistics.median(x["tok_s"] for x in got["round robin"])
    print(f"\n{a.requests} requests, every other for {a.answers} answers; medians of {a.rounds} rounds (each round's)")
    print("| front | tok/s (÷ round robin) | preemptions | TTFT mean ms | KV used | running |")
    print("|---|---|---|---|---|---|")
    for name, runs in got.items():
        def col(key, form):
            each = ", ".join(form(x[key]) for x in runs)
            return f"{form(statistics.median(x[key] for x in runs))} ({each})"

        ratio = statistics.median(x["tok_s"] for x in runs) / base
        print(f"| {name} | {col('tok_s', lambda v: f'{v:,.0f}')} {ratio:.2f}× | {col('preemptions', lambda v: f'{v:.0f}')} "
              f"| {col('ttft_ms', lambda v: f'{v:.0f}')} | {col('kv', lambda v: f'{100 * v:.0f} %')} "
              f"| {col('running', lambda v: f'{v:.1f}')} |")


if __name__ == "__main__":
    main()
