#!/usr/bin/env python3
"""Bursts past a full line, from clients that retry as OpenAI's and Anthropic's Python SDKs do
(`harness.sdk_call`: a 429 or 5xx retried twice, after `retry-after-ms` / `retry-after` when
within 60 s, else after about 0.5 and 1 s): how many are served, in how long, and how many times
they were refused, with each build named on the command line. Two kvgate-sim pods of 4,096
tokens of KV (`--time-scale 10`), Envoy `--concurrency 4`, `admission.maxQueue` 8; every client
sends one unshared completion at once. Builds interleaved, in a different order each round.
With `--models`, two models burst at once instead, each on two pods of its own: one of long
answers, one of short (`MODELS`), so that each line drains at its own pace.

    .venv/bin/python scripts/retry_burst.py --wasm before=/tmp/base.wasm \\
        --wasm after=target/wasm32-wasip1/release/kvgate.wasm --rounds 3

BENCHMARKS.md, *Retry-After* (2026-12-06)."""

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/e2e"))

from bodies import unshared_completion  # noqa: E402
from harness import Sim, default_plugin_config, kvgate_envoy, preemptions, sdk_call, wait_for  # noqa: E402

# (clients, max_tokens): each five and more times what the pool and its line hold at once.
BURSTS = [(60, 1000), (120, 300), (200, 100)]
# (model, clients, max_tokens), all at once: the first model's pods drain about ten times slower.
MODELS = [("model-a", 60, 1000), ("model-b", 200, 100)]
SMALL_KV = ["--time-scale", "10", "--num-gpu-blocks", "256"]


def burst(wasm, clients, max_tokens):
    cfg = default_plugin_config()
    cfg["admission"] = {"maxQueue": 8, "maxWaitMs": 30_000}
    with Sim(pods=2, args=SMALL_KV) as sim, kvgate_envoy(sim.endpoints, cfg, wasm=wasm) as envoy:
        t0 = time.time()
        with ThreadPoolExecutor(clients) as pool:
            done = list(pool.map(lambda i: sdk_call(envoy.port, "/v1/completions",
                                                    unshared_completion(9_000 + i, max_tokens=max_tokens)),
                                 range(clients)))
        took = time.time() - t0
        return {"served": sum(1 for s, _, _ in done if s == 200), "took": took,
                "attempts": sum(a for _, a, _ in done), "preemptions": preemptions(sim)}


def models_burst(wasm):
    cfg = default_plugin_config()
    cfg["admission"] = {"maxQueue": 8, "maxWaitMs": 30_000}
    with Sim(pods=2, args=SMALL_KV + ["--served-model-name", MODELS[0][0]]) as a, \
            Sim(pods=2, args=SMALL_KV + ["--served-model-name", MODELS[1][0]]) as b, \
            kvgate_envoy(a.endpoints + b.endpoints, cfg, wasm=wasm) as envoy:
        name = "wasmcustom.kvgate.models.list_ok"
        if not wait_for(lambda: envoy.stats(name).get(name, 0) >= 4, timeout=15):
            raise RuntimeError("the pods' model lists were not read")
        jobs = [(model, dict(unshared_completion(9_000 + 1_000 * k + i, max_tokens=max_tokens), model=model))
                for k, (model, clients, max_tokens) in enumerate(MODELS) for i in range(clients)]
        t0 = time.time()

        def call(job):
            status, attempts, _ = sdk_call(envoy.port, "/v1/completions", job[1])
            return job[0], status, attempts, time.time() - t0

        with ThreadPoolExecutor(len(jobs)) as pool:
            done = list(pool.map(call, jobs))
        return {model: {"served": sum(1 for m, s, _, _ in done if m == model and s == 200),
                        "took": max(t for m, _, _, t in done if m == model),
                        "attempts": sum(n for m, _, n, _ in done if m == model)}
                for model, _, _ in MODELS} | {"preemptions": preemptions(a) + preemptions(b)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wasm", action="append", required=True, help="name=path of a kvgate.wasm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", action="store_true", help="two models at once (MODELS), not BURSTS")
    args = ap.parse_args()
    builds = [w.split("=", 1) for w in args.wasm]
    if args.models:
        return report_models(builds, args.rounds)
    results = {}
    for r in range(args.rounds):
        order = builds[r % len(builds):] + builds[:r % len(builds)]
        for clients, max_tokens in BURSTS:
            for name, path in order:
                out = burst(str(Path(path).resolve()), clients, max_tokens)
                results.setdefault((clients, max_tokens, name), []).append(out)
                print(f"round {r + 1} burst {clients} × max_tokens {max_tokens} {name}: {out['served']} served "
                      f"in {out['took']:.1f} s, {out['attempts']} attempts, {out['preemptions']} preemptions",
                      flush=True)
    print("\n| burst | build | served (each round) | seconds (median) | attempts per client (median) | preemptions |")
    print("|---|---|---|---|---|---|")
    for clients, max_tokens in BURSTS:
        for name, _ in builds:
            runs = results[(clients, max_tokens, name)]
            print(f"| {clients} × `max_tokens` {max_tokens} | {name} | {' / '.join(str(x['served']) for x in runs)} "
                  f"of {clients} | {statistics.median(x['took'] for x in runs):.1f} | "
                  f"{statistics.median(x['attempts'] for x in runs) / clients:.2f} | "
                  f"{sum(x['preemptions'] for x in runs)} |")


def report_models(builds, rounds):
    results = {}
    for r in range(rounds):
        for name, path in builds[r % len(builds):] + builds[:r % len(builds)]:
            out = models_burst(str(Path(path).resolve()))
            results.setdefault(name, []).append(out)
            print(f"round {r + 1} {name}: " + ", ".join(
                f"{m} {out[m]['served']}/{c} served in {out[m]['took']:.1f} s, {out[m]['attempts']} attempts"
                for m, c, _ in MODELS) + f", {out['preemptions']} preemptions", flush=True)
    print("\n| model | build | served (each round) | seconds until its last answer (median) "
          "| attempts per client (median) | preemptions (both) |")
    print("|---|---|---|---|---|---|")
    for model, clients, max_tokens in MODELS:
        for name, _ in builds:
            runs = results[name]
            print(f"| {model}: {clients} × `max_tokens` {max_tokens} | {name} | "
                  f"{' / '.join(str(x[model]['served']) for x in runs)} of {clients} | "
                  f"{statistics.median(x[model]['took'] for x in runs):.1f} | "
                  f"{statistics.median(x[model]['attempts'] for x in runs) / clients:.2f} | "
                  f"{sum(x['preemptions'] for x in runs)} |")


if __name__ == "__main__":
    main()
