#!/usr/bin/env python3
"""kvgate's memory at fleet size: each Wasm VM's linear memory and Envoy's RSS with many pods and
their prefix caches indexed. Starts `kvgate-bench echo` pods (they report a million KV blocks
each, so only the blocks sent bound the index), a real Envoy with kvgate (its shipped
configuration, `--concurrency 2`: every worker keeps a replica of the index), sends unique
prompts of about 1,000 blocks until each pod has been sent `--blocks` blocks on average, waits for
the workers' replicas to catch up through the pick log, and reads /proc (robustness.wasm_memories).

    .venv/bin/python scripts/fleet_memory.py                          # 16 and 64 pods, 0/10k/30k blocks
    .venv/bin/python scripts/fleet_memory.py --pods 16 --blocks 30000

Prints one row per case: pods, blocks per pod, the largest VM's linear memory, the VMs' total,
Envoy's RSS, and Envoy's RSS without kvgate's traffic (the same Envoy, idle, right after start)."""

import argparse
import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/e2e"))

from harness import default_plugin_config, free_port, kvgate_envoy, request, wait_port  # noqa: E402
from robustness import rss_kib, wasm_memories  # noqa: E402

BENCH = ROOT / "target/tools/kvgate-bench"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# Characters per block as kvgate cuts them before it knows the tokenizer (4 per token, 16 tokens).
BLOCK_CHARS = 64
PROMPT_BLOCKS = 1000
WORDS = "cache prefix model token server route block tensor layer batch decode prefill".split()


def prompt(rng):
    out, n = [], 0
    while n < PROMPT_BLOCKS * BLOCK_CHARS:
        w = rng.choice(WORDS) + str(rng.randrange(10 ** 6))
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def case(pods, blocks, workers, rng):
    ports = [free_port() for _ in range(pods)]
    procs = [subprocess.Popen([str(BENCH), "echo", "--port", str(p)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for p in ports]
    try:
        for p, proc in zip(ports, procs):
            wait_port(p, 10, proc)
        with kvgate_envoy([("127.0.0.1", p) for p in ports], default_plugin_config(), concurrency=workers) as e:
            idle_rss = rss_kib(e.proc.pid)
            n = (pods * blocks + PROMPT_BLOCKS - 1) // PROMPT_BLOCKS

            def send(_):
                body = {"model": MODEL, "max_tokens": 1,
                        "messages": [{"role": "user", "content": prompt(rng)}]}
                return request(e.port, "POST", "/v1/chat/completions", body=body).status

            with ThreadPoolExecutor(8) as ex:
                statuses = list(ex.map(send, range(n)))
            # Every worker replays the others' picks on its tick (250 ms) and on its requests.
            time.sleep(2.0)
            mems = wasm_memories(e.proc.pid)
            return {"pods": pods, "blocks_per_pod": blocks, "requests": n,
                    "ok": sum(s == 200 for s in statuses),
                    "vm_max_mib": max(m[0] for m in mems) / 1024, "vm_total_mib": sum(m[0] for m in mems) / 1024,
                    "vms": len(mems), "rss_mib": rss_kib(e.proc.pid) / 1024, "idle_rss_mib": idle_rss / 1024}
    finally:
        for proc in procs:
            proc.terminate()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", default="16,64")
    ap.add_argument("--blocks", default="0,10000,30000", help="prefix blocks indexed per pod")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    rng = random.Random(7)
    rows = []
    print(f"{'pods':>5} {'blocks/pod':>10} {'requests':>8} {'ok':>6} {'VM max MiB':>10} {'VMs total':>9} "
          f"{'RSS MiB':>8} {'idle RSS':>8}")
    for pods in map(int, a.pods.split(",")):
        for blocks in map(int, a.blocks.split(",")):
            r = case(pods, blocks, a.workers, rng)
            rows.append(r)
            print(f"{r['pods']:>5} {r['blocks_per_pod']:>10} {r['requests']:>8} {r['ok']:>6} {r['vm_max_mib']:>10.1f} "
                  f"{r['vm_total_mib']:>9.1f} {r['rss_mib']:>8.1f} {r['idle_rss_mib']:>8.1f}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
