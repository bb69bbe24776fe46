"""The cache-pressure cell of bench/run.py served through several Envoy + kvgate replicas in front of
the same pods: how far each replica's prefix index drifts from the engines' real caches.

Each replica's kvgate keeps its own approximate index of what every pod's prefix cache holds, fed
only by the requests that replica routes. With R replicas an index sees 1/R of the inserts, so it
believes blocks survive longer than they do in the engine. Per run (fresh pods, fresh replicas,
everything stopped after) this measures:

- the engines' real prefix-cache hit rate over all pods (the simulator's admitted hit / query
  tokens, as bench/run.py reports it) and its ceiling (`ideal`: an unbounded cache shared by every
  pod);
- each replica's predicted hit rate, `kvgate.prefix.blocks_matched / blocks_total`, and all of
  them pooled (`pred − engine`: how much the indexes overestimate);
- TTFT mean / p50 / p90 over every request of every load generator, requests ok / failed, the
  pods' preemptions, the wall time; and any per-pod kvgate gauge whose name contains `index`
  (e.g. `index_capacity_percent`, if the build has it);
- each replica's syncs, and the CPU seconds etcd and each Envoy used over the load;
- the pool's use, sampled every 0.5 s past the first 5 s: the KV the engines' running requests
  hold and the tokens all replicas reserved, each against the pods' budgets.

for R in --replicas, for each --wasm build alternated within each round (A, B, A, B, ...).

The pool and the workload are bench/run.py's `cache_pressure` cell, read from it (FULL, sp_args,
sim_stats), so they cannot drift: 8 pods of 1024 blocks at --time-scale 1, 96 groups, system prompt
2048 tokens, question 256, output 64, Poisson 60 req/s in total for 30 s, TTFT objective 500 ms.
Each replica runs the shipped plugin config (replicas.replica_config, through replicas.fleet, 2
Envoy workers like the main benchmark on this 2-core machine), by default sharing budgets through
a real etcd; `--kvgate-config` is deep-merged into it.

One kvgate-bench per replica, concurrently, each at rate/R against its replica's listener. What the
generator allows (bench/src/workload.rs, checked with `kvgate-bench plan`):

- A group's system prompt depends only on `--seed` and the group index, a question's text only on
  (seed, group, question index). A different seed gives entirely different groups, so every
  process gets the SAME seed and the same --groups / --system-tokens: every replica sees every
  group, byte for byte.
- The send order is a seeded shuffle of the (group, question) list and the arrival offsets a
  seeded Poisson stream, with no separate seed for either. So process k asks for `--questions`
  Q + k (Q as sp_args computes it for rate/R): the shuffle of a longer list is a different order
  (the extra k × 96 jobs only lengthen the list; --max-duration stops every process after the
  same number of seconds). Process 0's arguments are exactly sp_args(cell, rate/R, seed), so
  R = 1 is the main benchmark's cell. In tiny runs (rate/R × duration ≤ 96, so Q = 1) process 0
  sends every group at most once and its replica rightly predicts no hit at all.
- The arrival OFFSETS are still identical across processes (same seed, same rate): started together,
  the R streams would send in lockstep, R requests at the same instant. Process k is therefore
  started k × --stagger seconds (0.5 s, ~15 mean gaps at 30 req/s) after process 0, which
  decorrelates the streams below that time scale; the first and last (R − 1) × stagger seconds
  run below the full rate.
- Question texts repeat across processes: (group g, question q) for q < Q is sent once by EVERY
  process (at different times), whereas at R = 1 each is sent once. So at R > 1 a request can also
  hit on its question blocks, and the ceiling (`ideal`) is a little higher than at R = 1; compare
  engine hits against `ideal` of the same R, not across R alone.

Run (it takes about 50 s a run; nothing is built, the binaries must exist):

    .venv/bin/python tests/e2e/replicas_cache_bench.py --wasm old=/tmp/kvgate-old.wasm \\
        new=target/wasm32-wasip1/release/kvgate.wasm --replicas 1,2,3 --rounds 3 --out results.json

Each --wasm is copied when the script starts, so a rebuild during the run does not mix builds."""

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import harness  # noqa: E402
import replicas  # noqa: E402
from harness import Sim, preemptions  # noqa: E402
from replicas import Etcd  # noqa: E402

# bench/run.py defines the cell; loaded as a module (its main() is not run).
_spec = importlib.util.spec_from_file_location("bench_run", harness.ROOT / "bench/run.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

CELL = bench.FULL["cache_pressure"]
TIME_SCALE = bench.FULL["time_scale"]
PODS = bench.FULL["pods"]


def deep_merge(base, override):
    out = dict(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@contextlib.contextmanager
def fleet(sim, etcd, r, wasm, shared, prefix, override):
    """replicas.fleet with this run's wasm build and plugin overrides. fleet builds every replica's
    config through replicas.replica_config and replicas.envoy_config, which take neither, so both
    are swapped while the fleet starts (its configs are built then) and put back at once."""
    orig_cfg, orig_envoy = replicas.replica_config, replicas.envoy_config
    with contextlib.ExitStack() as stack:
        replicas.replica_config = lambda *a, **k: deep_merge(orig_cfg(*a, **k), override)
        replicas.envoy_config = functools.partial(orig_envoy, wasm=str(wasm))
        try:
            # maxReplicas: fleet's 3, or R if more (a replica cut off from etcd admits budget / it).
            sharing = {"keyPrefix": prefix, "maxReplicas": max(3, r)} if shared else None
            port = etcd.port if etcd else harness.free_port()  # fleet always adds an etcd cluster
            envoys = stack.enter_context(replicas.fleet(sim, port, n=r, etcd=sharing))
        finally:
            replicas.replica_config, replicas.envoy_config = orig_cfg, orig_envoy
        yield envoys


def load_args(rate, seed, k):
    """Process k's kvgate-bench arguments: the cell at `rate`, `--questions` raised by k (a different
    send order over the same groups; see the docstring)."""
    args = [str(a) for a in bench.sp_args(CELL, rate, seed)]
    i = args.index("--questions") + 1
    args[i] = str(int(args[i]) + k)
    return args


def run_load(envoys, rate, seed, stagger, raw):
    """One kvgate-bench per replica, concurrently, process k started k × stagger s after the first.
    Returns every request's record and each process's summary."""
    procs = []
    try:
        for k, envoy in enumerate(envoys):
            if k:
                time.sleep(stagger)
            base = raw / f"replica{k}"
            argv = [str(bench.BENCH_BIN), "run", "--url", f"http://127.0.0.1:{envoy.port}", "--model", bench.MODEL,
                    "--out", f"{base}.jsonl", "--summary", f"{base}.summary.json", *load_args(rate, seed, k)]
            procs.append((base, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                 text=True)))
        records, summaries = [], []
        deadline = time.time() + CELL["duration"] + 200
        for k, (base, p) in enumerate(procs):
            _, err = p.communicate(timeout=max(1, deadline - time.time()))
            if p.returncode != 0:
                raise RuntimeError(f"kvgate-bench {k} failed: {err.strip()[-500:]}")
            summaries.append(json.loads(Path(f"{base}.summary.json").read_text())["overall"])
            with open(f"{base}.jsonl") as f:
                records += [dict(json.loads(line), replica=k) for line in f if line.strip()]
        return records, summaries
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def percentile(sorted_v, q):
    """Linear interpolation between closest ranks, as kvgate-bench's summary computes it."""
    if not sorted_v:
        return None
    pos = q / 100 * (len(sorted_v) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(sorted_v) - 1)
    return sorted_v[lo] + (sorted_v[hi] - sorted_v[lo]) * (pos - lo)


def kvgate_side(envoy):
    """One replica's prefix counters, its predicted hit rate and its per-pod `index` gauges."""
    s = envoy.stats("wasmcustom.kvgate.")
    matched = s.get("wasmcustom.kvgate.prefix.blocks_matched", 0)
    total = s.get("wasmcustom.kvgate.prefix.blocks_total", 0)
    index = {}
    for name, v in s.items():
        parts = name.split(".")
        # wasmcustom.kvgate.pod.<ip_port>.<gauge>
        if len(parts) > 4 and parts[2] == "pod" and "index" in ".".join(parts[4:]):
            index.setdefault(parts[3], {})[".".join(parts[4:])] = v
    return {"blocks_matched": matched, "blocks_total": total, "predicted": matched / total if total else None,
            "index_gauges": index,
            "counters": {k.replace("wasmcustom.kvgate.", ""): v for k, v in s.items() if ".pod." not in k}}


class PoolSampler(bench.Sampler):
    """Summed over the pods, each 0.5 s: the KV the engines' running requests hold, the tokens
    every replica has reserved, and the pods' budgets (each pod's highest on any replica), in
    tokens. A prefix two replicas' requests share on a pod is held once by the engine but
    reserved by each replica (each counts its own requests' blocks); this shows what that and
    the forecast's headroom leave unused."""

    def __init__(self, sim, envoys):
        super().__init__()
        self.sim, self.envoys = sim, envoys

    def sample(self):
        engine = sum(self.sim.stats(i)["kv_blocks_used"] for i in range(self.sim.pods)) * bench.BLOCK_TOKENS
        reserved = sum(sum(harness.kvgate_gauges(e, "reserved_tokens").values()) for e in self.envoys)
        budgets = {}
        for e in self.envoys:
            for pod, v in harness.kvgate_gauges(e, "budget_tokens").items():
                budgets[pod] = max(budgets.get(pod, 0), v)
        return engine, reserved, sum(budgets.values())


def pool_use(samples, skip_s=5):
    """Means over the samples past the first `skip_s` s: (engine ÷ budget, reserved ÷ budget,
    engine ÷ reserved); None without samples."""
    kept = [x for t, x in samples if t >= skip_s and x[2] > 0]
    if not kept:
        return None
    engine, reserved, budget = (sum(x[i] for x in kept) for i in range(3))
    return {"engine_of_budget": engine / budget, "reserved_of_budget": reserved / budget,
            "engine_of_reserved": engine / reserved if reserved else None}


def one_run(label, wasm, r, etcd, prefix, a, override, raw):
    t0 = time.time()
    sim_args = ["--time-scale", str(TIME_SCALE), "--seed", "0", "--num-gpu-blocks", str(CELL["num_gpu_blocks"])]
    with Sim(pods=PODS, args=sim_args) as sim:
        with fleet(sim, etcd, r, wasm, etcd is not None, prefix, override) as envoys:
            # CPU seconds over the load: what sharing costs etcd and the replicas (their syncs).
            pids = [etcd.proc.pid if etcd else None] + [e.proc.pid for e in envoys]
            cpu0 = [bench.process_cpu_s(pid) for pid in pids]
            with PoolSampler(sim, envoys) as pool:
                records, summaries = run_load(envoys, CELL["rate"] / r, a.seed, a.stagger, raw)
            cpu = [bench.process_cpu_s(pid) - c for pid, c in zip(pids, cpu0)]
            bench.wait_idle(sim)
            sides = [kvgate_side(e) for e in envoys]
        st = bench.sim_stats(sim)
        pre = preemptions(sim)
    ok = [x for x in records if x["status"] == 200 and not x.get("error")]
    ttft = sorted(1000 * x["ttft"] for x in ok if x.get("ttft") is not None)
    matched, total = sum(s["blocks_matched"] for s in sides), sum(s["blocks_total"] for s in sides)
    # Where each group's requests went (the simulator's x-sim-pod header): how many pods computed
    # it, and the share of requests on its most used pod, over all replicas and per replica.
    spread = group_spread(ok)
    return {"build": label, "replicas": r, "engine_hit": st["hit_rate"], "ideal_hit": st["ideal_hit_rate"],
            "predicted": [s["predicted"] for s in sides],
            "predicted_all": matched / total if total else None,
            "ttft_mean": sum(ttft) / len(ttft) if ttft else None, "ttft_p50": percentile(ttft, 50),
            "ttft_p90": percentile(ttft, 90), "goodput": sum(t <= CELL["ttft_slo_ms"] for t in ttft),
            "requests": len(records), "ok": len(ok), "failed": len(records) - len(ok), "preemptions": pre,
            "pods_per_group": spread[0], "main_pod_share": spread[1],
            "pods_per_group_per_replica": [group_spread([x for x in ok if x["replica"] == k])[0] for k in range(r)],
            "etcd_cpu_s": cpu[0] if etcd else None, "envoy_cpu_s": cpu[1:], "pool": pool_use(pool.samples),
            "syncs": [s["counters"].get("replicas.syncs") for s in sides],
            "wall_s": time.time() - t0, "sim": st, "kvgate": sides, "load": summaries}


def group_spread(records):
    """(pods a group's requests went to, share of requests on their group's most used pod)."""
    by = {}
    for x in records:
        if x.get("pod") is not None:
            by.setdefault(x.get("tags", {}).get("group"), []).append(x["pod"])
    if not by:
        return None, None
    pods = sum(len(set(v)) for v in by.values()) / len(by)
    main = sum(max(v.count(p) for p in set(v)) for v in by.values()) / sum(len(v) for v in by.values())
    return pods, main


def pct(x):
    return "—" if x is None else f"{100 * x:.1f}"


def ms(x):
    return "—" if x is None else f"{x:.0f}"


def span(vals, f):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "—"
    lo, hi = f(min(vals)), f(max(vals))
    return lo if lo == hi else f"{lo}–{hi}"


def report(runs):
    print("\n| build | R | round | engine hits % (ideal) | predicted % per replica | pred − engine (pp) | "
          "TTFT mean / p90 ms | ok / sent | preemptions | syncs per replica | CPU s: etcd / Envoys | "
          "KV held ÷ budget | reserved ÷ budget | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for x in runs:
        if "error" in x:
            print(f"| {x['build']} | {x['replicas']} | {x['round']} | FAILED: {x['error'][:80]} |")
            continue
        gap = None if x["predicted_all"] is None else 100 * (x["predicted_all"] - x["engine_hit"])
        print(f"| {x['build']} | {x['replicas']} | {x['round']} | {pct(x['engine_hit'])} ({pct(x['ideal_hit'])}) | "
              f"{' / '.join(pct(p) for p in x['predicted'])} | {'—' if gap is None else f'{gap:+.1f}'} | "
              f"{ms(x['ttft_mean'])} / {ms(x['ttft_p90'])} | {x['ok']}/{x['requests']} | {x['preemptions']} | "
              f"{' / '.join(str(n) for n in x['syncs'])} | "
              f"{'—' if x['etcd_cpu_s'] is None else round(x['etcd_cpu_s'], 1)} / "
              f"{' + '.join(f'{c:.1f}' for c in x['envoy_cpu_s'])} | "
              f"{pct(x['pool'] and x['pool']['engine_of_budget'])} | {pct(x['pool'] and x['pool']['reserved_of_budget'])} | "
              f"{x['wall_s']:.0f} |")
    for x in runs:
        for k, side in enumerate(x.get("kvgate", [])):
            if side["index_gauges"]:
                print(f"  {x['build']} R={x['replicas']} round {x['round']} replica {k} index gauges: "
                      + ", ".join(f"{pod} {g}={v}" for pod, gs in sorted(side["index_gauges"].items())
                                  for g, v in sorted(gs.items())))
    print("\nOver rounds (min–max):\n")
    print("| build | R | runs | engine hits % | ideal % | predicted % (all replicas) | TTFT mean ms | TTFT p90 ms "
          "| ok | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    keys = list(dict.fromkeys((x["build"], x["replicas"]) for x in runs))
    for build, r in keys:
        rs = [x for x in runs if x["build"] == build and x["replicas"] == r and "error" not in x]
        if not rs:
            print(f"| {build} | {r} | 0 | | | | | | | |")
            continue
        print(f"| {build} | {r} | {len(rs)} | {span([x['engine_hit'] for x in rs], pct)} | "
              f"{span([x['ideal_hit'] for x in rs], pct)} | {span([x['predicted_all'] for x in rs], pct)} | "
              f"{span([x['ttft_mean'] for x in rs], ms)} | {span([x['ttft_p90'] for x in rs], ms)} | "
              f"{span([x['ok'] for x in rs], str)} | {span([x['preemptions'] for x in rs], str)} |")


def snapshot(specs, into):
    """[(label, copied path, sha256)] for `--wasm [LABEL=]PATH ...`."""
    out = []
    for i, spec in enumerate(specs):
        label, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        path = Path(path)
        if not path.is_file():
            sys.exit(f"no wasm at {path} (this script builds nothing)")
        label = label or path.stem
        if label in (lbl for lbl, _, _ in out):
            label = f"{label}#{i}"
        copy = into / f"{i}-{path.name}"
        shutil.copy(path, copy)
        out.append((label, copy, hashlib.sha256(copy.read_bytes()).hexdigest()))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wasm", nargs="+", default=[str(harness.WASM)], metavar="[LABEL=]PATH",
                    help="kvgate builds to alternate (default: the harness's)")
    ap.add_argument("--replicas", default="1,2", help="comma-separated replica counts (default 1,2)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--rate", type=float, default=CELL["rate"], help="total requests/s over all replicas")
    ap.add_argument("--duration", type=float, default=CELL["duration"], help="seconds of load")
    ap.add_argument("--seed", type=int, default=1, help="the load's seed (bench/run.py's default)")
    ap.add_argument("--stagger", type=float, default=0.5, help="seconds between the load generators' starts")
    ap.add_argument("--etcd", action=argparse.BooleanOptionalAction, default=True,
                    help="share budgets through etcd (default) or run the replicas independently")
    ap.add_argument("--kvgate-config", metavar="JSON", default="{}", help="deep-merged into the plugin config")
    ap.add_argument("--out", metavar="FILE.json", help="write every run's results here")
    a = ap.parse_args()
    CELL.update(rate=a.rate, duration=a.duration)
    counts = [int(x) for x in a.replicas.split(",") if x.strip()]
    override = json.loads(a.kvgate_config)
    for b in (harness.SIM_BIN, bench.BENCH_BIN, harness.ENVOY_BIN):
        if not Path(b).exists():
            sys.exit(f"missing {b} (this script builds nothing)")
    # SIGTERM as an exception, so that every context manager stops its processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    tmp = Path(tempfile.mkdtemp(prefix="kvgate-cachebench-"))
    runs = []
    try:
        builds = snapshot(a.wasm, tmp)
        for label, _, sha in builds:
            print(f"build {label}: sha256 {sha[:16]}", file=sys.stderr)
        with Etcd() if a.etcd else contextlib.nullcontext() as etcd:
            n = 0
            for rnd in range(a.rounds):
                for r in counts:
                    for label, wasm, _ in builds:
                        n += 1
                        raw = tmp / f"run{n}"
                        raw.mkdir()
                        print(f"[{time.strftime('%H:%M:%S')}] round {rnd + 1}/{a.rounds} R={r} {label}",
                              file=sys.stderr, flush=True)
                        prefix = f"/cachebench-{os.getpid()}-{n}"
                        try:
                            x = one_run(label, wasm, r, etcd, prefix, a, override, raw)
                        except (KeyboardInterrupt, SystemExit):
                            raise
                        except Exception as e:  # noqa: BLE001
                            x = {"build": label, "replicas": r, "error": str(e)[-800:]}
                            print(f"  FAILED: {e}", file=sys.stderr)
                        x["round"] = rnd + 1
                        runs.append(x)
                        if "error" not in x:
                            print(f"  engine {pct(x['engine_hit'])}% predicted "
                                  f"{'/'.join(pct(p) for p in x['predicted'])}% ttft mean {ms(x['ttft_mean'])} ms "
                                  f"ok {x['ok']}/{x['requests']} pods a group {x['pods_per_group'] or 0:.2f} "
                                  f"on its main pod {100 * (x['main_pod_share'] or 0):.0f}% "
                                  f"(per replica {'/'.join(f'{p or 0:.2f}' for p in x['pods_per_group_per_replica'])})", file=sys.stderr, flush=True)
    finally:
        if a.out and runs:
            Path(a.out).write_text(json.dumps(
                {"cell": CELL, "time_scale": TIME_SCALE, "pods": PODS, "seed": a.seed, "stagger": a.stagger,
                 "etcd": a.etcd, "kvgate_config": override,
                 "builds": {lbl: {"path": spec, "sha256": sha} for (lbl, _, sha), spec in zip(builds, a.wasm)},
                 "runs": runs}, indent=1, default=str))
        shutil.rmtree(tmp, ignore_errors=True)
    report(runs)


if __name__ == "__main__":
    main()
