"""The replicas' measurements for BENCHMARKS.md (issue 15), heavier than CI's test_replicas.py:

1. The issue's 2x overload (two pods of 256 blocks, 72 streaming completions of ~350 prompt
   tokens with max_tokens 300 from 24 clients) through three replicas budgeting independently,
   through three sharing budgets through etcd, and through one replica: preemptions, the pods'
   peak KV, and the most the replicas' reservations on one pod summed past its budget.
2. The added latency per request with etcd on: light load (short completions, 6 clients over
   three replicas) with budgets shared and independent, and how many requests waited at all.

Run: .venv/bin/python tests/e2e/replicas_bench.py [--runs N]"""

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bodies import tagged_completion  # noqa: E402
from harness import Sim, kvgate_stat, preemptions, request  # noqa: E402
from replicas import SMALL_KV, Etcd, fleet, overload, peak_sum_reserved, worst_excess  # noqa: E402


def overload_run(etcd, n, shared, prefix):
    with Sim(pods=2, args=SMALL_KV) as sim:
        with fleet(sim, etcd.port, n=n, etcd={"keyPrefix": prefix} if shared else None) as envoys:
            t0 = time.time()
            answers, samples = overload(sim, envoys)
            wall = time.time() - t0
            excess, budgets = worst_excess(samples)
            return {"ok": sum(a["status"] == 200 for a in answers), "preemptions": preemptions(sim),
                    "peak_blocks": max(sim.stats(i)["peak_kv_blocks_used"] for i in range(sim.pods)),
                    "peak_reserved": peak_sum_reserved(samples), "budget": max(budgets.values()),
                    "excess": excess, "e2e_p50": statistics.median(a["total"] for a in answers), "wall": wall}


def latency_run(etcd, shared, prefix, requests=300, clients=6):
    with Sim(pods=2) as sim:
        with fleet(sim, etcd.port, n=3, etcd={"keyPrefix": prefix} if shared else None) as envoys:
            def one(i):
                t0 = time.perf_counter()
                r = request(envoys[i % 3].port, "POST", "/v1/completions", tagged_completion(f"lat{i}", max_tokens=4))
                assert r.status == 200, r.body
                return time.perf_counter() - t0

            with ThreadPoolExecutor(clients) as p:
                list(p.map(one, range(30)))  # warm-up: calibration, connections
            queued0 = sum(kvgate_stat(e, "admission.queued") for e in envoys)
            syncs0 = sum(kvgate_stat(e, "replicas.syncs") for e in envoys)
            t0 = time.time()
            with ThreadPoolExecutor(clients) as p:
                lat = sorted(p.map(one, range(requests)))
            wall = time.time() - t0
            return {"p50_ms": 1000 * lat[len(lat) // 2], "p99_ms": 1000 * lat[int(len(lat) * 0.99)],
                    "queued": sum(kvgate_stat(e, "admission.queued") for e in envoys) - queued0,
                    "requests": requests,
                    "syncs_per_s": (sum(kvgate_stat(e, "replicas.syncs") for e in envoys) - syncs0) / wall}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = {"three independent": [], "three sharing through etcd": [], "one replica": []}
    lat = {"etcd off": [], "etcd on": []}
    with Etcd() as etcd:
        for run in range(args.runs):
            rows["three independent"].append(overload_run(etcd, 3, False, None))
            rows["three sharing through etcd"].append(overload_run(etcd, 3, True, f"/bench{run}"))
            rows["one replica"].append(overload_run(etcd, 1, False, None))
            lat["etcd off"].append(latency_run(etcd, False, None))
            lat["etcd on"].append(latency_run(etcd, True, f"/lat{run}"))
            print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    print(f"Overload, {args.runs} runs each (min–max):\n")
    print("| replicas | answered | preemptions | peak KV blocks (of 256) | peak Σ reserved on a pod "
          "(budget) | worst Σ reserved − budget | e2e p50 (s) |")
    print("|---|---|---|---|---|---|---|")

    def span(rs, k, fmt="{:.0f}"):
        lo, hi = min(r[k] for r in rs), max(r[k] for r in rs)
        return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}–{fmt.format(hi)}"

    for name, rs in rows.items():
        print(f"| {name} | {span(rs, 'ok')}/72 | {span(rs, 'preemptions')} | {span(rs, 'peak_blocks')} | "
              f"{span(rs, 'peak_reserved')} ({rs[0]['budget']}) | {span(rs, 'excess')} | "
              f"{span(rs, 'e2e_p50', '{:.2f}')} |")
    print(f"\nLight load through three replicas, {args.runs} runs each (min–max):\n")
    print("| budgets | latency p50 (ms) | p99 (ms) | requests that waited | etcd txns/s (all replicas) |")
    print("|---|---|---|---|---|")
    for name, rs in lat.items():
        print(f"| {name} | {span(rs, 'p50_ms', '{:.1f}')} | {span(rs, 'p99_ms', '{:.1f}')} | "
              f"{span(rs, 'queued')}/{rs[0]['requests']} | {span(rs, 'syncs_per_s', '{:.1f}')} |")


if __name__ == "__main__":
    main()
