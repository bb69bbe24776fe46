#!/usr/bin/env python3
"""kvgate soak: sim pods behind a real Envoy (--concurrency 4) with kvgate, mixed traffic at a
bounded rate for the given time, sampled every ~10 s; prints a table and a verdict.

    .venv/bin/python scripts/soak.py                 # 2 minutes
    .venv/bin/python scripts/soak.py --minutes 30

Traffic (weights in MIX): streaming and non-streaming chat and completions, multi-turn sessions
(x-session-id), shared system prompts (prefix affinity), the same system prompts under each
tenant's cache salt (`x-cache-salt`), Responses API conversations chained by
`previous_response_id` (the stored responses' table), Anthropic Messages, SGLang's `/generate` and
vLLM's `/inference/v1/generate` (their own meters), unique prompts, priorities through GIE
objectives (critical / standard / sheddable batch), tenants, client aborts mid-stream and while
queued, oversize bodies (413) and malformed JSON (400). Every 60 s a burst of long requests fills
the pool so the line and the wake-up path are exercised too.

Samples: process RSS, each Wasm VM's linear memory (from /proc/<pid>/smaps: Envoy 1.40 has no
per-VM memory stat), tcmalloc's allocated bytes (admin /memory), reserved tokens, in-flight
entries, active blocks, queue length, and answers by status in the interval.

Verdict (exit 1 if any fails): memory flat (the last quarter's mean RSS and total Wasm memory
within --mem-tolerance of the second quarter's; counted for runs of 10 minutes or more, since
the prefix index fills for routing.prefixTtlMs, and shown as information for shorter ones),
reservations, in-flight entries, active blocks and the line back to exactly zero after traffic
stops, no request past its client timeout, no VM panic / reload, and a final request still
routed by kvgate."""

import argparse
import collections
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests/e2e"))

from bodies import MODEL, group_ids  # noqa: E402
from harness import Sim, default_plugin_config, kvgate_envoy, posted, request, responses_call  # noqa: E402
from robustness import (abort_after, abort_stream, assert_vm_alive, bad_log_lines, drained,  # noqa: E402
                        pool, rss_kib, vm_stats, wasm_memories)

MIX = [  # (kind, weight)
    ("session_stream", 22), ("group_chat", 18), ("unique_stream", 14), ("unique_completion", 12),
    ("abort_streaming", 8), ("abort_early", 4), ("oversize", 3), ("malformed", 3), ("get_models", 2),
    ("salted_chat", 6), ("responses_turn", 6), ("messages", 4), ("sglang_generate", 4), ("tokens_generate", 3),
]
OBJECTIVES = [("critical", 10), ("standard", 55), ("batch", 15), (None, 20)]
CLIENT_TIMEOUT = 30.0


def plugin_config(overrides=()):
    cfg = default_plugin_config()
    cfg["maxBodyBytes"] = 65536
    cfg["admission"] = {"objectives": {"critical": 10, "standard": 0, "batch": -1},
                        "maxWaitMs": 8000, "maxQueue": 200}
    for item in overrides:
        key, _, value = item.partition("=")
        *path, last = key.split(".")
        node = cfg
        for k in path:
            node = node.setdefault(k, {})
        node[last] = json.loads(value)
    return cfg


class Traffic:
    def __init__(self, port, seed=1):
        self.port = port
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = collections.Counter()   # since the last sample
        self.total = collections.Counter()
        self.slowest = 0.0
        self.sessions = {}                    # session id -> history text
        self.responses = {}                   # conversation -> its last stored response's id
        self.n = 0

    def record(self, outcome, elapsed):
        with self.lock:
            self.counts[outcome] += 1
            self.total[outcome] += 1
            self.slowest = max(self.slowest, elapsed)

    def take_counts(self):
        with self.lock:
            c, self.counts = self.counts, collections.Counter()
            return c

    def headers(self, rng):
        h = {"x-gateway-inference-fairness-id": f"tenant{rng.randrange(6)}"}
        obj = rng.choices([o for o, _ in OBJECTIVES], [w for _, w in OBJECTIVES])[0]
        if obj:
            h["x-gateway-inference-objective"] = obj
        return h

    def one(self, kind, i):
        rng = random.Random(i * 7919 + 17)
        h = self.headers(rng)
        t0 = time.perf_counter()
        try:
            outcome = self._send(kind, i, rng, h)
        except Exception as e:  # noqa: BLE001
            outcome = f"timeout:{kind}" if "timed out" in str(e) else f"error:{kind}:{type(e).__name__}"
        self.record(outcome, time.perf_counter() - t0)

    def _send(self, kind, i, rng, h):
        p = self.port
        if kind == "session_stream":
            sid = f"s{rng.randrange(40)}"
            with self.lock:
                history = self.sessions.get(sid, f"conversation {sid}: " + "background facts " * 60)
            body = {"model": MODEL, "max_tokens": rng.choice([16, 32, 64]),
                    "messages": [{"role": "user", "content": history + f" question {i}?"}]}
            r = stream_status(p, "/v1/chat/completions", body, dict(h, **{"x-session-id": sid}))
            if r == 200:
                with self.lock:
                    # Bounded history: conversations restart after ~20 turns.
                    if len(history) < 6000:
                        self.sessions[sid] = history + f" question {i}? answer."
                    else:
                        self.sessions.pop(sid, None)
            return r
        if kind == "group_chat":
            g = rng.randrange(12)
            body = {"model": MODEL, "max_tokens": rng.choice([8, 32, 128]),
                    "messages": [{"role": "system", "content": f"[group {g}] " + "policy clause " * 300},
                                 {"role": "user", "content": f"q{i}"}]}
            return request(p, "POST", "/v1/chat/completions", body, h, timeout=CLIENT_TIMEOUT).status
        if kind == "salted_chat":
            # One application's prompt under each tenant's salt: as many cache namespaces as tenants.
            g = rng.randrange(4)
            body = {"model": MODEL, "max_tokens": rng.choice([8, 32]),
                    "messages": [{"role": "system", "content": f"[app {g}] " + "house rule " * 250},
                                 {"role": "user", "content": f"q{i}"}]}
            salted = dict(h, **{"x-cache-salt": f"tenant-{rng.randrange(24)}"})
            if rng.random() < 0.5:
                return stream_status(p, "/v1/chat/completions", body, salted)
            return request(p, "POST", "/v1/chat/completions", body, salted, timeout=CLIENT_TIMEOUT).status
        if kind == "responses_turn":
            # Conversations restart after a few turns; a follow-up names its stored predecessor.
            conv = rng.randrange(30)
            with self.lock:
                previous = self.responses.pop(conv, None)
            body = {"model": MODEL, "input": f"conversation {conv} turn {i}: " + "context " * 80,
                    "max_output_tokens": rng.choice([16, 48]), "stream": rng.random() < 0.5}
            if previous:
                body["previous_response_id"] = previous
            status, _, rid, _ = responses_call(p, body, h, timeout=CLIENT_TIMEOUT)
            if status == 200 and rid and rng.random() < 0.75:
                with self.lock:
                    self.responses[conv] = rid
            return status
        if kind == "messages":
            body = {"model": MODEL, "max_tokens": rng.choice([16, 64]),
                    "system": f"[assistant {rng.randrange(6)}] " + "be precise " * 150,
                    "messages": [{"role": "user", "content": f"m{i} " + "detail " * rng.randrange(5, 60)}]}
            if rng.random() < 0.5:
                return stream_status(p, "/v1/messages", body, h, end=b"message_stop", usage=False)
            return request(p, "POST", "/v1/messages", body, h, timeout=CLIENT_TIMEOUT).status
        if kind == "sglang_generate":
            body = {"text": f"<|user|> g{i} " + "token budget " * rng.randrange(20, 200),
                    "sampling_params": {"max_new_tokens": rng.choice([16, 64, 160])}}
            if rng.random() < 0.5:
                return stream_status(p, "/generate", body, h, usage=False)
            return request(p, "POST", "/generate", body, h, timeout=CLIENT_TIMEOUT).status
        if kind == "tokens_generate":
            ids = group_ids(rng.randrange(5), i, shared=300, own=rng.randrange(10, 200))
            body = {"model": MODEL, "token_ids": ids, "sampling_params": {"max_tokens": rng.choice([16, 64])}}
            if rng.random() < 0.5:
                return stream_status(p, "/inference/v1/generate", body, h)
            return request(p, "POST", "/inference/v1/generate", body, h, timeout=CLIENT_TIMEOUT).status
        if kind == "unique_stream":
            body = {"model": MODEL, "prompt": f"unique {i} " + "lorem ipsum " * rng.randrange(20, 400),
                    "max_tokens": rng.choice([32, 128, 400])}
            return stream_status(p, "/v1/completions", body, h)
        if kind == "unique_completion":
            body = {"model": MODEL, "prompt": f"plain {i} " + "dolor sit " * rng.randrange(10, 300),
                    "max_tokens": rng.choice([8, 64, 256])}
            return request(p, "POST", "/v1/completions", body, h, timeout=CLIENT_TIMEOUT).status
        if kind == "abort_streaming":
            body = {"model": MODEL, "prompt": f"abort {i} " + "x y " * 100, "max_tokens": 2000}
            head = abort_stream(p, body, h, read_bytes=rng.choice([200, 1500, 5000]), timeout=CLIENT_TIMEOUT)
            status = head.split(" ", 2)[1] if head.startswith("HTTP/") else "none"
            return "aborted" if status == "200" else f"aborted:{status}"
        if kind == "abort_early":
            body = {"model": MODEL, "prompt": f"early {i} " + "x y " * 300, "max_tokens": 500}
            abort_after(p, body, rng.choice([0.0, 0.02, 0.2]), h)
            return "aborted"
        if kind == "oversize":
            body = {"model": MODEL, "prompt": "z" * 70000, "max_tokens": 4}
            return request(p, "POST", "/v1/completions", body, h, timeout=CLIENT_TIMEOUT).status
        if kind == "malformed":
            return request(p, "POST", "/v1/chat/completions", b'{"model": "m", "messages": [', h,
                           timeout=CLIENT_TIMEOUT).status
        if kind == "get_models":
            return request(p, "GET", "/v1/models", None, timeout=CLIENT_TIMEOUT).status
        raise ValueError(kind)

    def burst(self, pool_, n=40):
        for j in range(n):
            body = {"model": MODEL, "prompt": f"burst {self.n}-{j} " + "lorem ipsum " * 300, "max_tokens": 1500}
            h = {"x-gateway-inference-fairness-id": f"burst{j % 3}"}
            pool_.submit(self._burst_one, body, h)

    def _burst_one(self, body, h):
        t0 = time.perf_counter()
        try:
            outcome = stream_status(self.port, "/v1/completions", body, h)
        except Exception as e:  # noqa: BLE001
            outcome = "timeout:burst" if "timed out" in str(e) else f"error:burst:{type(e).__name__}"
        self.record(outcome, time.perf_counter() - t0)


def stream_status(port, path, body, headers, end=b"[DONE]", usage=True):
    """A streaming request read to the end; returns the status (or 'truncated': a 200 whose
    stream lacks `end`, its last event). `usage`: ask for the OpenAI usage chunk (APIs of other
    shapes take no `stream_options`)."""
    body = dict(body, stream=True, **({"stream_options": {"include_usage": True}} if usage else {}))
    with posted(port, path, body, headers, timeout=CLIENT_TIMEOUT) as r:
        data = r.read()
        return "truncated" if r.status == 200 and end not in data else r.status


def sample(envoy, t0, counts):
    mems = wasm_memories(envoy.proc.pid)
    mem_alloc = int(request(envoy.admin_port, "GET", "/memory").json().get("allocated", 0))
    st = envoy.stats("wasmcustom.kvgate")
    return {
        "t": round(time.time() - t0),
        "rss_mib": rss_kib(envoy.proc.pid) / 1024,
        "wasm_kib": [m[0] for m in mems],
        "wasm_total_mib": sum(m[0] for m in mems) / 1024,
        "wasm_rss_mib": sum(m[1] for m in mems) / 1024,
        "heap_mib": mem_alloc / 2**20,
        **pool(envoy),
        "admitted": st.get("wasmcustom.kvgate.admission.admitted", 0),
        "queued": st.get("wasmcustom.kvgate.admission.queued", 0),
        "counts": dict(counts),
    }


def fmt_counts(c):
    return " ".join(f"{k}:{v}" for k, v in sorted(c.items(), key=lambda kv: str(kv[0])))


def print_row(s, header=False):
    if header:
        print(f"{'t(s)':>5} {'rss MiB':>8} {'wasm MiB':>8} {'wasm rss':>8} {'heap MiB':>8} {'reserved':>8} "
              f"{'inflight':>8} {'queue':>5}  answers in interval", flush=True)
    print(f"{s['t']:>5} {s['rss_mib']:>8.1f} {s['wasm_total_mib']:>8.2f} {s['wasm_rss_mib']:>8.2f} "
          f"{s['heap_mib']:>8.1f} {s['reserved_tokens']:>8} {s['in_flight']:>8} {s['queue_length']:>5}  "
          f"{fmt_counts(s['counts'])}", flush=True)


def quarter_means(samples, key):
    n = len(samples)
    q = max(n // 4, 1)
    second = samples[q:2 * q] or samples[:1]
    last = samples[n - q:]
    mean = lambda xs: sum(x[key] for x in xs) / len(xs)
    return mean(second), mean(last)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--rate", type=float, default=12.0, help="requests per second (bounded)")
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4, help="Envoy worker threads")
    ap.add_argument("--sample-every", type=float, default=10.0)
    ap.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts; 0 = none")
    ap.add_argument("--mem-tolerance", type=float, default=0.10, help="allowed growth, last vs second quarter")
    ap.add_argument("--memory-verdict", choices=["auto", "on", "off"], default="auto",
                    help="count the memory criteria in the exit code; auto: only for runs of at least "
                         "10 minutes (routing.prefixTtlMs: the prefix index fills for that long)")
    ap.add_argument("--json", help="write the samples and verdict here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a plugin config key, e.g. --set routing.podCapacityBlocks=512")
    args = ap.parse_args()

    sim_args = ["--time-scale", "20", "--num-gpu-blocks", "512", "--seed", "7"]
    duration = args.minutes * 60
    with Sim(pods=args.pods, args=sim_args) as sim, \
            kvgate_envoy(sim.endpoints, plugin_config(args.set), concurrency=args.concurrency) as envoy:
        vm0 = vm_stats(envoy)
        print(f"soak: {args.minutes} min, {args.rate} req/s, {args.pods} pods, envoy pid {envoy.proc.pid} "
              f"--concurrency {args.concurrency}, {len(wasm_memories(envoy.proc.pid))} wasm memories; "
              f"VM stats {vm0}; plugin config {json.dumps(plugin_config(args.set))}", flush=True)
        traffic = Traffic(envoy.port)
        kinds, weights = [k for k, _ in MIX], [w for _, w in MIX]
        samples = []
        t0 = time.time()
        next_sample = t0 + args.sample_every
        next_burst = t0 + args.burst_every if args.burst_every else float("inf")
        skipped = 0
        print_row(sample(envoy, t0, {}), header=True)
        with ThreadPoolExecutor(48) as workers, ThreadPoolExecutor(48) as bursts:
            i = 0
            while time.time() - t0 < duration:
                tick = t0 + i / args.rate
                delay = tick - time.time()
                if delay > 0:
                    time.sleep(delay)
                # Bounded: never more than ~2 s of work outstanding.
                if workers._work_queue.qsize() > 2 * args.rate:
                    skipped += 1
                else:
                    workers.submit(traffic.one, traffic.rng.choices(kinds, weights)[0], i)
                i += 1
                now = time.time()
                if now >= next_burst:
                    traffic.n += 1
                    traffic.burst(bursts)
                    next_burst += args.burst_every
                if now >= next_sample:
                    s = sample(envoy, t0, traffic.take_counts())
                    samples.append(s)
                    print_row(s)
                    next_sample += args.sample_every
            print(f"traffic stopped after {i} scheduled ({skipped} skipped, pool busy); waiting for "
                  "in-flight requests", flush=True)
        end = sample(envoy, t0, traffic.take_counts())
        print_row(end)
        ok_zero, detail = drained(envoy, timeout=8)

        # A normal request still routes after all of it.
        r = request(envoy.port, "POST", "/v1/chat/completions",
                    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "still there?"}]})
        routed = r.status == 200 and "x-kvgate-pod" in r.headers
        bad = bad_log_lines(envoy)
        vm1 = vm_stats(envoy)
        try:
            assert_vm_alive(envoy, vm0)
            vm_ok = True
        except AssertionError as e:
            vm_ok, vm_err = False, str(e)

        verdict = {}
        rss2, rss4 = quarter_means(samples, "rss_mib")
        w2, w4 = quarter_means(samples, "wasm_total_mib")
        memory_counts = args.memory_verdict == "on" or (args.memory_verdict == "auto" and args.minutes >= 10)
        memory = {"rss_flat": rss4 <= rss2 * (1 + args.mem_tolerance),
                  "wasm_flat": w4 <= w2 * (1 + args.mem_tolerance)}
        if memory_counts:
            verdict.update(memory)
        verdict["drained_to_zero"] = ok_zero
        verdict["no_timeouts"] = not any(str(k).startswith("timeout") for k in traffic.total)
        verdict["no_client_errors"] = not any(str(k).startswith("error:") for k in traffic.total)
        verdict["vm_alive"] = vm_ok and not bad
        verdict["still_routes"] = routed
        totals = dict(traffic.total)
        print()
        print(f"answers over the run: {fmt_counts(traffic.total)}; slowest request {traffic.slowest:.1f} s "
              f"(client timeout {CLIENT_TIMEOUT:.0f} s)")
        print(f"memory: RSS second quarter {rss2:.1f} MiB -> last quarter {rss4:.1f} MiB ({(rss4 / rss2 - 1):+.1%}); "
              f"wasm linear memory {w2:.2f} -> {w4:.2f} MiB ({(w4 / w2 - 1):+.1%}); "
              f"per VM at the end (KiB): {end['wasm_kib']}")
        print(f"after traffic: {detail}")
        print(f"VM stats before {vm0} after {vm1}; bad log lines: {len(bad)}")
        print(f"final request: {r.status} via {r.headers.get('x-kvgate-pod')}")
        if not memory_counts:
            print("memory (informational: a run under 10 minutes is still warming up, the prefix index fills "
                  "for routing.prefixTtlMs):", " ".join(f"{k}={'ok' if v else 'growing'}" for k, v in memory.items()))
        print("verdict:", " ".join(f"{k}={'PASS' if v else 'FAIL'}" for k, v in verdict.items()))
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "samples": samples, "end": end,
                                                   "totals": {str(k): v for k, v in totals.items()},
                                                   "drain": detail, "vm_before": vm0, "vm_after": vm1,
                                                   "bad_log_lines": bad[:50], "memory": memory,
                                                   "verdict": verdict}, indent=1))
        if not vm_ok:
            print(vm_err)
        return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
