#!/usr/bin/env python3
"""kvgate's benchmark: the same seeded workloads against Envoy + kvgate and its peers (Envoy round
robin, Envoy least-request, sglang-router, vllm-router), each in front of fresh kvgate-sim pods,
plus a filter-overhead benchmark in front of an instantly answering upstream.

    python bench/run.py --full          all workloads, all targets (about 35-45 min on 2 cores)
    python bench/run.py --demo          kvgate vs Envoy round robin, short shared-prefix run (~1 min)

Writes results/<timestamp>/ (report.md, results.json, PNG plots, raw per-request JSON lines, logs);
--full also copies the report into BENCHMARKS.md. Methodology: docs/benchmarks.md.
Every process started here is stopped on exit, on errors and on Ctrl-C.
"""

import argparse
import contextlib
import copy
import hashlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/e2e"))

import harness  # noqa: E402
from harness import (LEAST_REQUEST, ROUND_ROBIN, STATUS_PATH, Envoy, Sim, default_plugin_config,  # noqa: E402
                     envoy_config, free_port, kvgate_envoy, request, wait_port)

VENV = ROOT / ".venv"
PY = VENV / "bin/python"
# bench/floor: stop at headers, buffer and read the body, set one header (the overhead floor).
FLOOR_WASM = ROOT / "target/wasm32-wasip1/release/kvgate_floor.wasm"
BENCH_BIN = Path(os.environ.get("KVGATE_BENCH_BIN", ROOT / "target/tools/kvgate-bench"))
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# Peers, pinned to the versions this benchmark was written against (override with env vars).
PEER_PACKAGES = {
    "sglang-router": os.environ.get("KVGATE_BENCH_SGLANG_ROUTER", "sglang-router==0.3.2"),
    "vllm-router": os.environ.get("KVGATE_BENCH_VLLM_ROUTER", "vllm-router==0.1.17"),
}
PLOT_PACKAGES = ["matplotlib"]

# Envoy gets as many workers as the machine has cores, like the peers' tokio runtimes.
ENVOY_CONCURRENCY = max(1, os.cpu_count() or 2)

MIXED_OBJECTIVES = {"critical": 10, "standard": 0, "batch": -1}

# ----------------------------------------------------------------------------------------------
# Workloads. Times are wall seconds; the simulator runs at TIME_SCALE (1 = real time).

FULL = {
    "time_scale": 1.0,
    "pods": 8,
    "shared_prefix": {
        "groups": 29, "system_tokens": 2048, "question_tokens": 256, "output_tokens": 64,
        "rates": [30, 60, 90], "main_rate": 60, "duration": 20, "ttft_slo_ms": 200, "api": "chat",
        # The groups are tenants of one application: one system prompt, each group's cache kept
        # apart by the engine under its `x-cache-salt` header (vLLM's), as a gateway sets it.
        "salted": False,
    },
    "multi_turn": {
        "sessions": 200, "turns": 5, "system_tokens": 300, "first_tokens": 1500,
        "followup_tokens": 100, "output_tokens": 100, "think_mean": 1.0, "rate": 10,
        "duration": 40, "ttft_slo_ms": 200,
    },
    "mixed": {
        "long_fraction": 0.15, "short_prompt": "64,512", "short_output": "16,128",
        "long_prompt": "3000,6000", "long_output": "256,512", "overload": 2.0, "duration": 20,
        "ttft_slo_ms": 1000, "calibration_s": 15, "calibration_concurrency": 256,
        # The engines' running limit (`--max-num-seqs`; 0: the simulator's 256): set below what
        # their KV holds, the pool runs out of seats before it runs out of KV.
        "max_num_seqs": 0,
    },
    "hot_prefix": {
        "system_tokens": 2048, "question_tokens": 256, "output_tokens": 256, "rate": 20, "duration": 20,
        "ttft_slo_ms": 200,
    },
    # Prefixes whose working set is 1.5x the whole pool's KV (12x one pod's), near saturation (at 60
    # req/s round robin's TTFT runs to seconds; at 40 every router keeps up): a
    # router that splits a group over several pods, or sends it where its copy was evicted,
    # computes it again and evicts another group's.
    "cache_pressure": {
        "num_gpu_blocks": 1024, "groups": 96, "system_tokens": 2048, "question_tokens": 256,
        "output_tokens": 64, "rate": 60, "duration": 30, "ttft_slo_ms": 500, "api": "chat", "salted": False,
    },
    "burst": {
        "groups": 10, "questions": 100, "system_tokens": 2048, "question_tokens": 256,
        "output_tokens": 64, "ttft_slo_ms": 2000,
    },
    "chat": {
        "num_gpu_blocks": 1024, "prompt_tokens": "200,3000", "unbounded_fraction": 0.5, "max_tokens": "128,1024",
        "clients": 200, "duration": 30, "warmup": 5,
        # Seconds the pods first serve the same traffic directly (0: fresh pods): a gateway started
        # in front of engines that have been answering the model, as after a restart.
        "warm_s": 0,
        # Goodput at two TTFT objectives: interactive, and patient (a closed loop at twice the pool's
        # capacity queues every request somewhere, so which one a router wins depends on the bar).
        "ttft_slos_ms": [1000, 5000],
        # Applications behind the model (0: none): each its system prompt and its answers' lengths,
        # lognormal with medians `app_spread` apart (σ of their logs) and `app_answer_spread`
        # within one; the load generator draws each answer's length and tells the simulator. Each
        # system prompt is `app_opening_words` all of them share, then `app_prompt_words` of its own,
        # then `app_context_words` of the request's own (a user's profile, retrieved passages).
        "apps": 0, "app_spread": 1.0, "app_answer_spread": 0.5, "app_opening_words": 0, "app_prompt_words": 120,
        "app_context_words": 0,
        # How requests are sent (`API_ARGS`).
        "api": "chat",
        # Each pod's KV blocks, one per pod (empty: every pod `num_gpu_blocks`): a pool of two GPU
        # sizes, or of engines started with two `--gpu-memory-utilization`s.
        "pod_blocks": [],
        # Headers every request carries (name → value), e.g. a time-to-first-token objective
        # (`{"x-slo-ttft-ms": "1000"}`, which kvgate reads with `admission.ttftObjectiveHeader`).
        "headers": {},
    },
    # The chat workload with max_tokens on every request, kvgate at each Envoy worker count.
    "chat_bounded": {"envoy_concurrency": [1, 2, 4]},
    # Short answers without max_tokens (classification, extraction, short turns): each request is
    # its prompt and little more, a pod runs a couple of dozen at once, and two small pods keep the
    # pool KV-bound at a request rate this machine's load generator and proxy still drive.
    "chat_short": {
        "pods": 2, "num_gpu_blocks": 256, "prompt_tokens": "50,150", "output_len_mean": 32,
        "unbounded_fraction": 1.0, "max_tokens": "16,64", "clients": 120, "duration": 30, "warmup": 5, "warm_s": 0,
        "ttft_slos_ms": [1000, 5000], "apps": 0, "app_spread": 1.0, "app_answer_spread": 0.5,
        "app_opening_words": 0, "app_prompt_words": 120, "app_context_words": 0, "api": "chat", "pod_blocks": [],
    },
    # Many LoRA adapters of one base model, more than the pool's adapter slots (pods × maxLoras).
    "lora": {
        "adapters": 32, "zipf": 1.0, "max_loras": 2, "prompt_tokens": "200,600", "output_tokens": 64,
        "rate": 24, "duration": 20, "ttft_slo_ms": 200,
    },
    "overhead": {"bodies": [4096, 262144], "seconds": 3, "concurrency": [1, 16], "repeats": 3},
}

DEMO = {
    "time_scale": 1.0,
    "pods": 8,
    "shared_prefix": dict(FULL["shared_prefix"], rates=[60], main_rate=60, duration=15),
}

# kvgate.wasm as it was when the run started (copied into the results directory), so that a
# rebuild during the run does not mix two builds in one report.
WASM_SNAPSHOT = None
# The simulator's KV block size (its default, which every cell runs with).
BLOCK_TOKENS = 16

ALL_TARGETS = ["kvgate", "envoy-rr", "envoy-lr", "sglang-router", "vllm-router"]
# kvgate with adapter affinity off (the lora workload's own baseline).
NO_AFFINITY = {"models": {"adapterLoadCost": 0, "adapterSlotCost": 0}}
PEERS = ["envoy-rr", "envoy-lr", "sglang-router", "vllm-router"]


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


# ----------------------------------------------------------------------------------------------
# Set-up: Python packages, binaries, versions, machine.

def pkg_version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def venv_version(dist):
    r = sh([str(PY), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"])
    return r.stdout.strip() if r.returncode == 0 else None


def pip_install(spec):
    """Installs `spec` into .venv; returns None or the reason it failed."""
    r = sh([str(VENV / "bin/pip"), "install", "-q", "--disable-pip-version-check", spec], timeout=900)
    if r.returncode != 0:
        return (r.stderr or r.stdout).strip().splitlines()[-1:] or ["pip failed"]
    return None


def ensure_packages(specs):
    """{dist: (version or None, error or None)}; installs what is missing."""
    out = {}
    for spec in specs:
        dist = spec.split("==")[0]
        want = spec.split("==")[1] if "==" in spec else None
        have = venv_version(dist)
        if have is None or (want and have != want):
            log(f"pip install {spec} into .venv")
            err = pip_install(spec)
            if err:
                out[dist] = (None, f"pip install {spec} failed: {' '.join(err)}")
                continue
            have = venv_version(dist)
        out[dist] = (have, None)
    return out


def ensure_binaries():
    if not harness.WASM.exists() or not harness.SIM_BIN.exists():
        log("kvgate.wasm or kvgate-sim missing: ./build.sh build")
        subprocess.run([str(ROOT / "build.sh"), "build"], check=True, cwd=ROOT)
    log("cargo build -p kvgate-bench --profile tools")
    subprocess.run(["cargo", "build", "-q", "-p", "kvgate-bench", "--profile", "tools"], check=True, cwd=ROOT)
    log("cargo build -p kvgate-floor (the overhead benchmark's floor filter)")
    subprocess.run(["cargo", "build", "-q", "-p", "kvgate-floor", "--release", "--target", "wasm32-wasip1"],
                   check=True, cwd=ROOT)


def machine_info():
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    return {"nproc": os.cpu_count(), "cpu": cpu, "memory": mem, "kernel": platform.release(),
            "python": platform.python_version(), "loadavg_at_start": os.getloadavg()}


def versions(peer_pkgs):
    def first_line(cmd):
        try:
            r = sh(cmd, timeout=30)
            return (r.stdout or r.stderr).strip().splitlines()[0]
        except Exception as e:  # noqa: BLE001
            return f"unknown ({e})"
    git = sh(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]).stdout.strip()
    dirty = sh(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src", "sim", "envoy"]).stdout.strip()
    v = {
        "kvgate": f"{git}{' + uncommitted changes in src/' if dirty else ''}",
        "kvgate.wasm": f"{harness.WASM.stat().st_size} bytes, built "
                       f"{datetime.datetime.fromtimestamp(harness.WASM.stat().st_mtime):%Y-%m-%d %H:%M}, sha256 "
                       f"{hashlib.sha256(harness.WASM.read_bytes()).hexdigest()[:16]}",
        "envoy": first_line([str(harness.ENVOY_BIN), "--version"]).split("version:")[-1].strip(),
        "kvgate-sim": first_line([str(harness.SIM_BIN), "--version"]),
        "kvgate-bench": first_line([str(BENCH_BIN), "--version"]),
        "rustc": first_line(["rustc", "--version"]),
    }
    for dist, (ver, err) in peer_pkgs.items():
        v[dist] = ver or f"unavailable: {err}"
    return v


# ----------------------------------------------------------------------------------------------
# Process control.

def _on_term(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


class Router:
    """A peer router process on loopback with its own port and metrics port."""

    def __init__(self, name, argv, port, log_dir):
        self.name, self.argv, self.port, self.log_dir = name, argv, port, log_dir
        self.proc = None

    def __enter__(self):
        self.log_path = Path(self.log_dir) / f"{self.name}.log"
        self.log = open(self.log_path, "a")
        self.log.write("$ " + " ".join(self.argv) + "\n")
        self.log.flush()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RUST_LOG="warn")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=self.log_dir)
        try:
            wait_port(self.port, 60, self.proc)
            deadline = time.time() + 60
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
                with contextlib.suppress(OSError):
                    if request(self.port, "GET", "/health", timeout=2).status == 200:
                        return self
                time.sleep(0.2)
            raise TimeoutError(f"{self.name} not healthy within 60 s")
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class Echo:
    def __init__(self):
        self.port = free_port()
        self.proc = None

    def __enter__(self):
        self.proc = subprocess.Popen([str(BENCH_BIN), "echo", "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, 10, self.proc)
        return self

    @property
    def endpoints(self):
        return [("127.0.0.1", self.port)]

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def sglang_argv(port, metrics_port, urls):
    return [str(PY), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *urls, "--policy", "cache_aware",
            "--cache-threshold", "0.3", "--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5",
            "--eviction-interval-secs", "60", "--max-tree-size", "67108864",
            "--max-concurrent-requests", "-1", "--queue-size", "100", "--queue-timeout-secs", "60",
            "--request-timeout-secs", "600", "--retry-max-retries", "5",
            "--health-check-interval-secs", "60",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), "--log-level", "warn"]


def vllm_argv(port, metrics_port, urls):
    return [str(VENV / "bin/vllm-router"), "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *urls, "--policy", "cache_aware",
            "--cache-threshold", "0.3", "--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5",
            "--eviction-interval-secs", "120", "--max-tree-size", "33554432",
            "--max-concurrent-requests", "32768", "--queue-size", "100", "--queue-timeout-secs", "60",
            "--request-timeout-secs", "600", "--retry-max-retries", "5",
            "--health-check-interval-secs", "60",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), "--log-level", "warning"]


def cli_strings():
    """How each target is started, as shown in reports (ports and pod URLs as placeholders)."""
    def show(argv):
        return " ".join(Path(a).name if a.startswith(str(ROOT)) else a for a in argv)
    return {
        "kvgate": f"Envoy --concurrency {ENVOY_CONCURRENCY} with kvgate.wasm, plugin config "
                  f"harness.default_plugin_config() (+ admission.objectives {json.dumps(MIXED_OBJECTIVES)} for mixed; "
                  f"statusPath {STATUS_PATH} but for the overhead, read every 0.5 s for how right kvgate was)"
                  + (f" merged with {json.dumps(KVGATE_OVERRIDE)}" if KVGATE_OVERRIDE else ""),
        "kvgate-no-affinity": f"kvgate as above, merged with {json.dumps(NO_AFFINITY)} (lora workload only)",
        "envoy-rr": f"Envoy --concurrency {ENVOY_CONCURRENCY}, no kvgate, load_balancing_policy round_robin",
        "envoy-lr": f"Envoy --concurrency {ENVOY_CONCURRENCY}, no kvgate, load_balancing_policy least_request",
        "sglang-router": show(sglang_argv("<port>", "<metrics-port>", ["<pod URLs>"])),
        "vllm-router": show(vllm_argv("<port>", "<metrics-port>", ["<pod URLs>"])),
    }


# --kvgate-config: JSON merged into kvgate's plugin configuration (one level of sections deep), to
# compare settings on the same workload.
KVGATE_OVERRIDE = {}


def kvgate_config(workload):
    cfg = default_plugin_config()
    if workload == "mixed":
        cfg.setdefault("admission", {})["objectives"] = dict(MIXED_OBJECTIVES)
    if workload != "overhead":
        # For `ActiveSampler`: the pods as shared data holds them at the moment it asks.
        cfg["statusPath"] = STATUS_PATH
    for key, value in KVGATE_OVERRIDE.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    return cfg


@contextlib.contextmanager
def target(name, endpoints, workload, log_dir, cli_log, concurrency=None):
    """Starts one target in front of `endpoints`; yields (port, envoy or None). `concurrency`:
    Envoy's worker count (default: one per core)."""
    urls = [f"http://{h}:{p}" for h, p in endpoints]
    workers = concurrency or ENVOY_CONCURRENCY
    if name in ("kvgate", "kvgate-no-affinity"):
        cfg = kvgate_config(workload)
        if name == "kvgate-no-affinity":
            for key, value in NO_AFFINITY.items():
                cfg.setdefault(key, {}).update(value)
        with kvgate_envoy(endpoints, cfg, concurrency=workers, wasm=str(WASM_SNAPSHOT or harness.WASM)) as e:
            yield e.port, e
    elif name == "floor":
        # The same Envoy and filter chain as kvgate's, with the least body-reading filter in its place.
        cfg = envoy_config(free_port(), free_port(), endpoints, wasm=str(FLOOR_WASM))
        with Envoy(cfg, concurrency=workers) as e:
            yield e.port, e
    elif name in ("envoy-rr", "envoy-lr", "envoy"):
        policy = LEAST_REQUEST if name == "envoy-lr" else ROUND_ROBIN
        cfg = envoy_config(free_port(), free_port(), endpoints, with_kvgate=False, lb_policy=policy)
        with Envoy(cfg, concurrency=workers) as e:
            yield e.port, e
    elif name in ("sglang-router", "vllm-router"):
        port, mport = free_port(), free_port()
        argv = (sglang_argv if name == "sglang-router" else vllm_argv)(port, mport, urls)
        with Router(name, argv, port, log_dir):
            yield port, None
    else:
        raise ValueError(name)


# ----------------------------------------------------------------------------------------------
# Running one cell: fresh pods, one target, one workload.

SIM_SUM_KEYS = ["prefix_cache_hit_tokens", "prefix_cache_query_tokens", "request_cache_hits",
                "request_cache_misses", "preemptions", "kv_evictions", "finished", "aborted", "admitted",
                "prompt_tokens", "prefill_tokens_computed", "generation_tokens", "clock_resyncs",
                "lora_loads", "lora_activations", "ideal_hit_tokens", "ideal_query_tokens"]


def sim_stats(sim):
    per = []
    for i in range(sim.pods):
        with contextlib.suppress(Exception):
            per.append(sim.stats(i))
    tot = {k: sum(p.get(k, 0) for p in per) for k in SIM_SUM_KEYS}
    tot["hit_rate"] = tot["prefix_cache_hit_tokens"] / max(1, tot["prefix_cache_query_tokens"])
    # The ceiling: every prefix computed once, in one cache of unbounded size (the simulator's).
    tot["ideal_hit_rate"] = tot["ideal_hit_tokens"] / max(1, tot["ideal_query_tokens"])
    tot["peak_kv_blocks_used"] = [p.get("peak_kv_blocks_used") for p in per]
    tot["finished_per_pod"] = [p.get("finished", 0) for p in per]
    return tot


def wait_idle(sim, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            st = [sim.stats(i) for i in range(sim.pods)]
        except Exception:  # noqa: BLE001
            return
        if all(s["running"] == 0 and s["waiting"] == 0 for s in st):
            return
        time.sleep(0.2)


def run_bench(port, args, out_base, timeout):
    argv = [str(BENCH_BIN), "run", "--url", f"http://127.0.0.1:{port}", "--model", MODEL,
            "--out", f"{out_base}.jsonl", "--summary", f"{out_base}.summary.json", *map(str, args)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"kvgate-bench failed: {err.strip()[-500:]}")
    log("    " + err.strip().splitlines()[-1] if err.strip() else "    (no output)")
    return json.loads(Path(f"{out_base}.summary.json").read_text())


def kvgate_counters(envoy):
    if envoy is None:
        return None
    with contextlib.suppress(Exception):
        s = envoy.stats("wasmcustom.kvgate")
        return {k.replace("wasmcustom.kvgate.", ""): v for k, v in s.items()
                if ".pod." not in k or k.endswith(("budget_tokens", "engine_seats"))}
    return None


def kvgate_error_medians(envoy):
    """The median of kvgate's per-answer estimate errors (`kvgate.model.<m>.{prompt,output}_error_pct`
    histograms, Envoy's cumulative P50) per model: {model: {"prompt": p50, "output": p50}}."""
    out = {}
    with contextlib.suppress(Exception):
        r = harness.request(envoy.admin_port, "GET", "/stats?format=json&filter=error_pct")
        for entry in r.json().get("stats", []):
            h = entry.get("histograms")
            if not h:
                continue
            at = h["supported_quantiles"].index(50)
            for q in h.get("computed_quantiles", []):
                name = q["name"].replace("wasmcustom.", "")
                parts = name.split(".")
                if len(parts) == 4 and parts[3].endswith("_error_pct"):
                    p50 = q["values"][at].get("cumulative")
                    out.setdefault(parts[2], {})[parts[3].split("_")[0]] = p50
    return out


def guess_floor(jsonl):
    """The least median error any single guess of an answer's length could have had on a run's
    answers, the guess chosen in hindsight and capped at each request's `max_tokens`: median over
    answers of |min(c, max_tokens) − length| ÷ length, at its best c. kvgate's output error
    (`kvgate_error_medians`) is one answer against an expected length, and answers drawn from one
    long-tailed distribution are that far apart from any one number (on the simulator's lognormal
    of σ 0.8, 49 %); what is below it needs something in each request that tells its length. In
    percent; None without answers."""
    answers = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path(jsonl).read_text().splitlines():
            r = json.loads(line)
            if r.get("status") == 200 and (r.get("completion_tokens") or 0) > 0:
                answers.append((r["completion_tokens"], r.get("max_tokens") or math.inf))
    if not answers:
        return None
    lengths = sorted(x for x, _ in answers)
    # The guesses tried: the lengths' percentiles, which bracket the best (a median of |c − x| ÷ x
    # moves only where c passes an answer's length).
    guesses = sorted({lengths[min(len(lengths) - 1, k * len(lengths) // 200)] for k in range(200)})
    return 100 * min(statistics.median(abs(min(c, m) - x) / x for x, m in answers) for c in guesses)


class Sampler:
    """Calls `sample()` every `period` s while a run is in flight: [(seconds since start, what it
    returned)]; a sample that fails is skipped."""

    def __init__(self, period=0.5):
        self.period = period
        self.samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self):
        raise NotImplementedError

    def _run(self):
        t0 = time.time()
        while not self._stop.wait(self.period):
            with contextlib.suppress(Exception):
                self.samples.append((time.time() - t0, self.sample()))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class ActiveSampler(Sampler):
    """kvgate's predicted active blocks, the engines' own KV in use as kvgate last scraped it, what
    admission's entries hold (per pod, the `active_blocks`, `engine_blocks` and `held_tokens`
    gauges, the last in blocks), and the first and the third again as the status page and
    `/sim/stats` (kv_blocks_used) give them at the moment of the sample: [(predicted, engine, held,
    predicted now, engine now, held now) per pod]. The gauges are written on kvgate's tick and the
    engine's figure at its last scrape, so comparing them counts both lags as kvgate's error."""

    def __init__(self, envoy, sim):
        super().__init__()
        self.envoy, self.sim = envoy, sim

    def sample(self):
        active = harness.kvgate_gauges(self.envoy, "active_blocks")
        engine = harness.kvgate_gauges(self.envoy, "engine_blocks")
        held = harness.kvgate_gauges(self.envoy, "held_tokens")
        page = {p["pod"].replace(".", "_").replace(":", "_"): p
                for p in request(self.envoy.port, "GET", STATUS_PATH).json()["pods"]}
        live = {f"127_0_0_1_{port}": self.sim.stats(i)["kv_blocks_used"] for i, port in enumerate(self.sim.ports)}
        return [(active[p], engine[p], held.get(p, 0) / BLOCK_TOKENS, page[p]["activeBlocks"], live[p],
                 page[p]["heldTokens"] / BLOCK_TOKENS)
                for p in active if p in engine and p in page and p in live]


class KvSampler(Sampler):
    """Every pod's KV use (`/sim/stats` kv_blocks_used ÷ num_gpu_blocks): [fraction per pod]."""

    def __init__(self, sim):
        super().__init__()
        self.sim = sim

    def sample(self):
        st = [self.sim.stats(i) for i in range(self.sim.pods)]
        return [s["kv_blocks_used"] / s["num_gpu_blocks"] for s in st]


def active_fit(samples, lo, hi, kvgate=0, engine=1):
    """One of kvgate's figures (`kvgate`: 0 its predicted active blocks, 2 admission's held tokens
    in blocks, from its gauges; 3 and 5 the same at the sample) against one of the engines'
    (`engine`: 1 their KV in use as kvgate last scraped it, 4 as it was at the sample), over the
    samples from `lo` to `hi` s where the pool is busy (the engines hold at least a tenth of what
    they did at most): (Σ kvgate ÷ Σ engine, its bias; Σ|kvgate − engine| ÷ Σ engine, which against
    the scraped figure also counts the scrape's lag). None for samples without the figures (runs
    before they were sampled)."""
    pairs = [(s[kvgate], s[engine]) for t, per_pod in samples if lo <= t <= hi
             for s in per_pod if len(s) > max(kvgate, engine)]
    peak = max((e for _, e in pairs), default=0)
    busy = [(a, e) for a, e in pairs if e >= peak / 10 and e > 0]
    total = sum(e for _, e in busy)
    if not total:
        return None
    return sum(a for a, _ in busy) / total, sum(abs(a - e) for a, e in busy) / total


def warm_pods(sim, bench_args, out_base, seconds):
    """The same traffic sent straight to each pod for `seconds` (a share of the clients each), then
    the pods left idle: a gateway started in front of engines that have served the model for a
    while. Returns the pods' counters after it, for the cell's own to be counted from."""
    clients = int(bench_args[bench_args.index("--concurrency") + 1])
    args = list(bench_args)
    args[args.index("--concurrency") + 1] = max(1, clients // sim.pods)
    args[args.index("--max-duration") + 1] = seconds
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(subprocess.Popen(
            [str(BENCH_BIN), "run", "--url", f"http://{h}:{p}", "--model", MODEL, "--out", f"{out_base}.warm{i}.jsonl",
             "--summary", f"{out_base}.warm{i}.summary.json", *map(str, args)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)) for i, (h, p) in enumerate(sim.endpoints)]
        for proc in procs:
            proc.wait(timeout=seconds + 400)
    wait_idle(sim)
    return sim_stats(sim)


def api_desc(w):
    """What a cell's description adds when its requests are not sent as chat (`API_ARGS`)."""
    return {"chat": "", "completions": "; sent to /v1/completions, rendered through Llama 3's chat template by "
            "the client", "ids": "; sent to /v1/completions as token ids (one a word of the prompt rendered "
            "through Llama 3's chat template)", "messages": "; sent to Anthropic's /v1/messages (a request "
            "without a limit of its own with max_tokens 8192)", "generate": "; sent to SGLang's native /generate, "
            "rendered through Llama 3's chat template by the client (a request without a limit of its own with "
            "max_new_tokens null)"}.get(w.get("api", "chat"), "") + salted_desc(w)


def salted_desc(w):
    """What a shared-prefix cell's description adds when its groups are tenants (`salted`)."""
    return ("; the groups are tenants of one application: every group the same system prompt, each its cache "
            "kept apart by the engine under an x-cache-salt header of its own") if w.get("salted") else ""


def warm_desc(w):
    """What a chat cell's description adds when its pods were warmed first (`warm_pods`), or its
    requests are several applications' (`apps`)."""
    warm = (f"; the pods first served the same traffic directly for {w['warm_s']} s (a gateway started in front "
            "of running engines), and the cell's preemptions are those after") if w.get("warm_s") else ""
    opening = (f"{w['app_opening_words']} words all share, then {w['app_prompt_words']} of its own"
               if w.get("app_opening_words") else f"{w.get('app_prompt_words', 120)} words")
    if w.get("app_context_words"):
        opening += f", then {w['app_context_words']} of the request's own"
    apps = (f"; each request one of {w['apps']} applications' (its system prompt in front: {opening}), its answer's length "
            f"drawn from that application's (lognormal, medians σ {w['app_spread']} apart, σ "
            f"{w['app_answer_spread']} within one, mean {w.get('output_len_mean', 256)}) and sent as "
            "x-sim-output-tokens") if w.get("apps") else ""
    return warm + apps + api_desc(w)


def run_cell(ctx, tname, wname, label, bench_args, sim_args, timeout, concurrency=None, sample_kv=False, pods=None,
             warm_s=0):
    """Fresh pods + target + workload. Returns the cell's result dict (or an error). `concurrency`:
    Envoy's workers; `sample_kv`: record the pods' KV use during the run; `pods`: the pool's size
    when the workload sets its own; `warm_s`: the pods first serve the workload directly for that
    long (`warm_pods`), and the cell's counters are what came after."""
    raw = ctx["out"] / "raw" / tname
    raw.mkdir(parents=True, exist_ok=True)
    out_base = raw / label
    log(f"  {tname:14s} {label}")
    t0 = time.time()
    kv = None
    warm = None
    try:
        with Sim(pods=pods or ctx["cfg"]["pods"], args=sim_args) as sim:
            if warm_s:
                warm = warm_pods(sim, bench_args, out_base, warm_s)
            with target(tname, sim.endpoints, wname, str(ctx["out"] / "logs"), ctx["cli"], concurrency) as (port, envoy):
                is_kvgate = tname.startswith("kvgate")
                with KvSampler(sim) if sample_kv else contextlib.nullcontext() as sampler, \
                        ActiveSampler(envoy, sim) if is_kvgate else contextlib.nullcontext() as active:
                    summary = run_bench(port, bench_args, out_base, timeout)
                kv = sampler.samples if sampler else None
                wait_idle(sim)
                counters = kvgate_counters(envoy) if is_kvgate else None
                accuracy = {"errors": kvgate_error_medians(envoy), "active": active.samples,
                            "guess_floor": guess_floor(f"{out_base}.jsonl")} if is_kvgate else None
            stats = sim_stats(sim)
            if warm:
                stats["warm"] = {k: warm[k] for k in ("preemptions", "finished")}
                stats["preemptions"] -= warm["preemptions"]
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001
        log(f"    FAILED: {e}")
        return {"error": str(e)[-800:]}
    return {"summary": summary, "sim": stats, "kvgate": counters, "raw": str(out_base.relative_to(ctx["out"])),
            "wall_s": time.time() - t0, "kv_samples": kv, "accuracy": accuracy}


# A cell's `api`: "chat", to /v1/chat/completions; "completions", to /v1/completions, each
# conversation rendered through the model's chat template by the client (as applications that
# template their prompts themselves do); "ids", the same prompts sent as token ids (a client that
# tokenizes itself); "messages", to Anthropic's /v1/messages (as agent clients send it: a request
# without a limit of its own carries a large one, as that API requires one); "generate", to SGLang's
# native /generate, rendered as for "completions" (as RL rollouts and SGLang's own clients send it).
API_ARGS = {"chat": ["--path", "/v1/chat/completions"], "completions": ["--path", "/v1/completions"],
            "ids": ["--path", "/v1/completions", "--prompt-ids"], "messages": ["--path", "/v1/messages"],
            "generate": ["--path", "/generate"]}


def api_args(w, cell):
    if w["api"] not in API_ARGS:
        raise SystemExit(f"{cell} cell api: {w['api']!r} is not one of {', '.join(API_ARGS)}")
    return API_ARGS[w["api"]]


def sp_args(w, rate, seed):
    n = int(math.ceil(rate * w["duration"]))
    questions = int(math.ceil(n / w["groups"]))
    return ["--workload", "shared-prefix", *api_args(w, "shared_prefix"), "--seed", seed, "--arrival", "poisson", "--rate", rate,
            "--groups", w["groups"], "--questions", questions, "--system-tokens", w["system_tokens"],
            "--question-tokens", w["question_tokens"], "--output-tokens", w["output_tokens"],
            "--max-duration", w["duration"], "--timeout", 120, "--ttft-slo-ms", w["ttft_slo_ms"],
            *(["--salted"] if w.get("salted") else [])]


def mt_args(w, seed):
    return ["--workload", "multi-turn", "--seed", seed, "--arrival", "poisson", "--rate", w["rate"],
            "--sessions", w["sessions"], "--turns", w["turns"], "--system-tokens", w["system_tokens"],
            "--first-tokens", w["first_tokens"], "--followup-tokens", w["followup_tokens"],
            "--output-tokens", w["output_tokens"], "--think-mean", w["think_mean"],
            "--max-duration", w["duration"], "--timeout", 120, "--ttft-slo-ms", w["ttft_slo_ms"]]


def mixed_args(w, seed, rate, requests, arrival="poisson", concurrency=8, duration=None):
    return ["--workload", "mixed", "--seed", seed, "--arrival", arrival, "--rate", rate,
            "--concurrency", concurrency, "--requests", requests, "--long-fraction", w["long_fraction"],
            "--short-prompt", w["short_prompt"], "--short-output", w["short_output"],
            "--long-prompt", w["long_prompt"], "--long-output", w["long_output"],
            "--max-duration", duration or w["duration"], "--timeout", 120, "--ttft-slo-ms", w["ttft_slo_ms"]]


def hot_args(w, seed):
    """One application's system prompt in front of every request: the prefix every pod should cache."""
    n = int(math.ceil(w["rate"] * w["duration"]))
    return ["--workload", "shared-prefix", "--seed", seed, "--arrival", "poisson", "--rate", w["rate"],
            "--groups", 1, "--questions", n, "--system-tokens", w["system_tokens"],
            "--question-tokens", w["question_tokens"], "--output-tokens", w["output_tokens"],
            "--max-duration", w["duration"], "--timeout", 120, "--ttft-slo-ms", w["ttft_slo_ms"]]


def burst_args(w, seed):
    return ["--workload", "shared-prefix", "--seed", seed, "--arrival", "burst",
            "--groups", w["groups"], "--questions", w["questions"], "--system-tokens", w["system_tokens"],
            "--question-tokens", w["question_tokens"], "--output-tokens", w["output_tokens"],
            "--max-duration", 10, "--timeout", 180, "--ttft-slo-ms", w["ttft_slo_ms"]]


def lora_sim_args(w, sim_args):
    """Pods serving the base model and every adapter, with `max_loras` adapter slots each."""
    modules = [f"lora-{k}=/adapters/lora-{k}" for k in range(w["adapters"])]
    return [*sim_args, "--enable-lora", "--max-loras", str(w["max_loras"]), "--lora-modules", *modules]


def lora_args(w, seed):
    n = int(math.ceil(w["rate"] * w["duration"]))
    return ["--workload", "lora", "--seed", seed, "--arrival", "poisson", "--rate", w["rate"], "--requests", n,
            "--adapters", w["adapters"], "--adapter-zipf", w["zipf"], "--prompt-tokens", w["prompt_tokens"],
            "--output-tokens", w["output_tokens"], "--max-duration", w["duration"], "--timeout", 120,
            "--ttft-slo-ms", w["ttft_slo_ms"]]


def chat_sim_args(w, sim_args):
    """The chat workloads' pods: smaller KV, so the pool is KV-bound at a client count this machine
    drives, and answers that may end (EOS) before their max_tokens, as on real vLLM; the answers'
    mean length where the workload sets it (the simulator's lognormal)."""
    lengths = ["--output-len-mean", str(w["output_len_mean"])] if "output_len_mean" in w else []
    sizes = ["--pod-blocks", ",".join(map(str, w["pod_blocks"]))] if w.get("pod_blocks") else []
    return [*sim_args, "--num-gpu-blocks", str(w["num_gpu_blocks"]), *sizes, "--eos-before-max-tokens", *lengths]


def chat_args(w, seed, unbounded_fraction):
    """Closed loop: `clients` workers each send their next request when the previous one ended,
    for `duration` s (the jobs repeat if they run out). With `apps` (a cell's setting), the
    requests are that many applications' (their system prompts, and their answers' lengths drawn
    per application: `app_spread` between them, `app_answer_spread` within one, mean
    `output_len_mean` or 256)."""
    apps = ["--apps", w["apps"], "--app-answer-mean", w.get("output_len_mean", 256),
            "--app-spread", w["app_spread"], "--app-answer-spread", w["app_answer_spread"],
            "--app-opening-words", w["app_opening_words"], "--app-prompt-words", w["app_prompt_words"],
            "--app-context-words", w["app_context_words"]] if w["apps"] else []
    return ["--workload", "chat", *api_args(w, "chat"), "--seed", seed, "--arrival", "closed", "--concurrency", w["clients"],
            "--repeat", "--requests", 20000, "--prompt-tokens", w["prompt_tokens"],
            "--unbounded-fraction", unbounded_fraction, "--max-tokens", w["max_tokens"],
            "--max-duration", w["duration"], "--timeout", 300, "--ttft-slo-ms", w["ttft_slos_ms"][0], *apps,
            *[a for k, v in w.get("headers", {}).items() for a in ("--header", f"{k}: {v}")]]


def steady(cell, out, w):
    """A chat cell's steady-state numbers, over the window from `warmup` s to the end of the sending
    window (the ramp-up and the final drain left out): output tokens/s (each request's tokens spread
    evenly between its first token and its end), goodput/s per TTFT objective (requests whose first
    token came within the window and within the objective), and the pods' mean KV use."""
    lo, hi = w["warmup"], w["duration"]
    tokens = 0.0
    good = dict.fromkeys(w["ttft_slos_ms"], 0)
    for line in open(Path(out) / (cell["raw"] + ".jsonl")):
        r = json.loads(line)
        if r["status"] != 200 or r.get("error") or r.get("ttft") is None:
            continue
        a, b = r["sent"] + r["ttft"], r["sent"] + r["e2e"]
        n = r.get("completion_tokens") or r.get("chunks") or 0
        if b > a:
            tokens += n * max(0.0, min(b, hi) - max(a, lo)) / (b - a)
        elif lo <= a <= hi:
            tokens += n
        for slo in good:
            good[slo] += lo <= a <= hi and 1000 * r["ttft"] <= slo
    window = [f for t, f in cell.get("kv_samples") or [] if lo <= t <= hi and f]
    kv = [sum(f) / len(f) for f in window]
    # How near each pod came to running out: a pool kept inside its KV without preemptions holds
    # the difference between its mean and its peaks free for the answers that run long.
    every = sorted(x for f in window for x in f)
    used = (cell.get("sim") or {}).get("peak_kv_blocks_used") or []
    blocks = w.get("pod_blocks") or [w["num_gpu_blocks"]] * len(used)
    peaks = [b / n for b, n in zip(used, blocks) if b is not None]
    return {"tok_s": tokens / (hi - lo), "kv_mean": sum(kv) / len(kv) if kv else None,
            "kv_p99": every[min(len(every) - 1, int(0.99 * len(every)))] if every else None,
            "kv_peak": max(peaks) if peaks else None,
            **{f"goodput_{slo}": n / (hi - lo) for slo, n in good.items()}}


def calibrate_mixed(ctx, sim_args, seed):
    """The pool's capacity for the mixed workload: completions/s of a saturating closed loop
    (Envoy least-request, fresh pods)."""
    w = ctx["cfg"]["mixed"]
    args = mixed_args(w, seed, 1, 100000, arrival="closed", concurrency=w["calibration_concurrency"],
                      duration=w["calibration_s"])
    cell = run_cell(ctx, "envoy-lr", "mixed", "mixed-calibration", args, sim_args, 300)
    if "error" in cell:
        raise RuntimeError(f"mixed calibration failed: {cell['error']}")
    s = cell["summary"]["overall"]
    # Steady-state completions per second: those ending in the last two thirds of the window (the
    # first third is the ramp-up, where short requests finish early while long ones hold the KV).
    recs = [json.loads(line) for line in open(ctx["out"] / (cell["raw"] + ".jsonl"))]
    lo, hi = w["calibration_s"] / 3, w["calibration_s"]
    done = [r for r in recs if r["status"] == 200 and lo <= r["sent"] + r["e2e"] <= hi]
    cap = len(done) / (hi - lo)
    return {"capacity_rps": cap, "closed_loop_ok_per_s": s["ok_per_s"], "concurrency": w["calibration_concurrency"],
            "cell": cell}


def process_cpu_s(pid):
    """CPU seconds (user + system, all threads) a process has used so far; 0 without one. Envoy's
    CPU per request is what a filter costs whatever else the shared machine runs: throughput
    moves with the load generator and neighbours, CPU time per request much less."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def overhead(ctx, peer_ok):
    """Envoy with and without kvgate (and the peers) in front of an instant upstream. Each front is
    measured `repeats` times, fronts interleaved (a different order each round), and the median of
    each number is reported: the machine is shared, and one slow second should not decide."""
    o = ctx["cfg"]["overhead"]
    names = ["direct", "envoy", "floor", "kvgate"] + [p for p in ("sglang-router", "vllm-router") if peer_ok.get(p)]
    raw = ctx["out"] / "raw" / "overhead"
    raw.mkdir(parents=True, exist_ok=True)
    samples = {n: {} for n in names}
    failed = {}
    for rep in range(o.get("repeats", 1)):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            if name in failed:
                continue
            try:
                with Echo() as echo:
                    if name == "direct":
                        cm = contextlib.nullcontext((echo.port, None))
                    else:
                        cm = target(name, echo.endpoints, "overhead", str(ctx["out"] / "logs"), {})
                    with cm as (port, front):
                        pid = front.proc.pid if front is not None and front.proc is not None else None
                        for body in o["bodies"]:
                            for conc in o["concurrency"]:
                                label = f"{name}-{body}-c{conc}-rep{rep}"
                                base = ["--workload", "fixed", "--requests", 1, "--repeat", "--body-bytes", body,
                                        "--output-tokens", 1, "--arrival", "closed", "--concurrency", conc,
                                        "--no-stream", "--timeout", 30]
                                # Warm-up (connections, caches, the wasm VM's JIT).
                                run_bench(port, base + ["--max-duration", 1], raw / (label + "-warmup"), 60)
                                cpu0 = process_cpu_s(pid)
                                s = run_bench(port, base + ["--max-duration", o["seconds"]], raw / label, 120)["overall"]
                                cpu = process_cpu_s(pid) - cpu0 if pid else None
                                samples[name].setdefault(f"{body}-c{conc}", []).append({
                                    "p50_ms": s["e2e_ms"]["p50"], "p99_ms": s["e2e_ms"]["p99"],
                                    "mean_ms": s["e2e_ms"]["mean"], "rps": s["ok_per_s"], "ok": s["ok"],
                                    "errors": s["errors"],
                                    "cpu_us": 1e6 * cpu / s["ok"] if cpu is not None and s["ok"] else None})
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001
                log(f"  overhead {name} FAILED: {e}")
                failed[name] = str(e)[-500:]
    res = {}
    for name in names:
        if name in failed:
            res[name] = {"error": failed[name]}
            continue
        res[name] = {}
        for key, runs in samples[name].items():
            med = {m: statistics.median(r[m] for r in runs) for m in ("p50_ms", "p99_ms", "mean_ms", "rps")}
            cpus = [r["cpu_us"] for r in runs if r.get("cpu_us") is not None]
            med["cpu_us"] = statistics.median(cpus) if cpus else None
            med["runs"] = runs
            res[name][key] = med
    return res


# ----------------------------------------------------------------------------------------------
# Report.

def fmt(x, nd=1):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{nd}f}"


def row_metrics(cell):
    s = cell["summary"]["overall"]
    sim = cell["sim"]
    share = s.get("pod_share") or {}
    total = sum(share.values()) or 1
    shares = sorted(100 * v / total for v in share.values())
    return {
        "requests": s["requests"], "ok": s["ok"], "errors": s["errors"],
        "ttft_p50": s["ttft_ms"]["p50"], "ttft_p90": s["ttft_ms"]["p90"], "ttft_p99": s["ttft_ms"]["p99"],
        "ttft_mean": s["ttft_ms"]["mean"], "itl_p50": s["itl_ms"]["p50"], "itl_p99": s["itl_ms"]["p99"],
        "e2e_p50": s["e2e_ms"]["p50"], "tok_s": s["output_tok_per_s"], "goodput": s["goodput_fraction"],
        "goodput_s": s["goodput_per_s"], "hit_rate": sim["hit_rate"], "preemptions": sim["preemptions"],
        "req_cache_hits": sim["request_cache_hits"], "req_cache_misses": sim["request_cache_misses"],
        "share_min": shares[0] if shares else None, "share_max": shares[-1] if shares else None,
        "pods_used": len(share), "clock_resyncs": sim["clock_resyncs"], "evictions": sim["kv_evictions"],
        "e2e_mean": s["e2e_ms"]["mean"], "e2e_p90": s["e2e_ms"]["p90"], "span_tok_s": s["output_tok_per_s"],
        # Closed-loop chat cells: throughput and goodput over the steady window (see steady()).
        **(cell.get("steady") or {}),
    }


# metric: (label, higher is better)
RATIO_METRICS = [("hit_rate", "hit rate", True), ("ttft_p50", "TTFT p50", False), ("ttft_mean", "TTFT mean", False),
                 ("ttft_p90", "TTFT p90", False), ("ttft_p99", "TTFT p99", False),
                 ("tok_s", "throughput", True), ("goodput", "goodput", True)]


def ratios(rows):
    """kvgate's value / the best peer's, per metric."""
    if "kvgate" not in rows:
        return {}
    out = {}
    for key, label, higher in RATIO_METRICS:
        peers = [(n, r[key]) for n, r in rows.items() if n != "kvgate" and r.get(key) is not None]
        k = rows["kvgate"].get(key)
        if not peers or k is None:
            continue
        best = max(peers, key=lambda p: p[1]) if higher else min(peers, key=lambda p: p[1])
        out[key] = {"label": label, "kvgate": k, "best_peer": best[0], "best": best[1],
                    "ratio": (k / best[1]) if best[1] else None, "higher_is_better": higher}
    return out


def errors_str(e):
    return ", ".join(f"{k}:{v}" for k, v in sorted(e.items())) or "0"


def workload_table(rows, rat):
    hdr = ("| target | ok/sent | errors | TTFT p50 | p90 | p99 | mean (ms) | ITL p50 | p99 (ms) | "
           "tok/s | goodput | hit rate | preempt | pod share min–max |")
    lines = [hdr, "|" + "---|" * 14]
    for n, r in rows.items():
        lines.append(
            f"| {n} | {r['ok']}/{r['requests']} | {errors_str(r['errors'])} | {fmt(r['ttft_p50'])} | "
            f"{fmt(r['ttft_p90'])} | {fmt(r['ttft_p99'])} | {fmt(r['ttft_mean'])} | {fmt(r['itl_p50'], 2)} | "
            f"{fmt(r['itl_p99'], 2)} | {fmt(r['tok_s'], 0)} | {100 * r['goodput']:.1f}% | {100 * r['hit_rate']:.1f}% | "
            f"{r['preemptions']} | {fmt(r['share_min'])}–{fmt(r['share_max'])}% ({r['pods_used']} pods) |")
    if rat:
        def cell(k):
            x = rat.get(k)
            return f"**{x['ratio']:.2f}×**" if x and x["ratio"] is not None else "–"
        lines.append(f"| *kvgate ÷ best peer* | | | {cell('ttft_p50')} | {cell('ttft_p90')} | {cell('ttft_p99')} | {cell('ttft_mean')} | "
                     f"| | {cell('tok_s')} | {cell('goodput')} | {cell('hit_rate')} | | |")
    return "\n".join(lines)


def goodput_keys(rows):
    """The goodput_<objective ms> keys of chat rows, tightest objective first."""
    keys = {k for r in rows.values() for k in r if k.startswith("goodput_") and k[8:].isdigit()}
    return sorted(keys, key=lambda k: int(k[8:]))


def chat_table(rows):
    gk = goodput_keys(rows)
    lines = ["| target | ok/sent | errors | output tok/s | tok/s (whole span) | "
             + "".join(f"goodput ≤{int(k[8:]) / 1000:g} s (req/s) | " for k in gk)
             + "TTFT mean | p90 | p99 (ms) | e2e mean | p90 (ms) | preemptions | KV used: mean / p99 / peak |",
             "|" + "---|" * (12 + len(gk))]
    for n, r in rows.items():
        kv = " / ".join(f"{100 * r[k]:.0f}%" if r.get(k) is not None else "–" for k in ("kv_mean", "kv_p99", "kv_peak"))
        lines.append(f"| {n} | {r['ok']}/{r['requests']} | {errors_str(r['errors'])} | {fmt(r['tok_s'], 0)} | "
                     f"{fmt(r['span_tok_s'], 0)} | " + "".join(f"{fmt(r.get(k))} | " for k in gk)
                     + f"{fmt(r['ttft_mean'], 0)} | "
                     f"{fmt(r['ttft_p90'], 0)} | {fmt(r['ttft_p99'], 0)} | {fmt(r['e2e_mean'], 0)} | "
                     f"{fmt(r['e2e_p90'], 0)} | {r['preemptions']} | {kv} |")
    return "\n".join(lines)


def chat_ratio_table(rows):
    """kvgate ÷ each peer (throughput, goodput: higher is better; latencies, preemptions: lower)."""
    k = rows.get("kvgate")
    if not k:
        return ""
    metrics = ([("tok_s", "output tok/s")] + [(g, f"goodput ≤{int(g[8:]) / 1000:g} s") for g in goodput_keys(rows)]
               + [("ttft_mean", "TTFT mean"), ("ttft_p90", "TTFT p90"), ("ttft_p99", "TTFT p99"),
                  ("e2e_mean", "e2e mean"), ("e2e_p90", "e2e p90"), ("preemptions", "preemptions")])
    lines = ["| kvgate ÷ | " + " | ".join(label for _, label in metrics) + " |", "|" + "---|" * (len(metrics) + 1)]
    for n, r in rows.items():
        if n == "kvgate":
            continue
        cells = [f"{k[key] / r[key]:.2f}×" if k.get(key) is not None and r.get(key) else "–" for key, _ in metrics]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_sentence(rat):
    parts = []
    for key, v in rat.items():
        if v["ratio"] is None:
            continue
        same = abs(v["ratio"] - 1) < 0.005
        better = (v["ratio"] > 1) == v["higher_is_better"]
        word = "same" if same else ("better" if better else "worse")
        parts.append(f"{v['label']} {v['ratio']:.2f}× ({word}; best peer {v['best_peer']})")
    return "; ".join(parts)


def class_table(results_mixed):
    lines = ["| target | class | sent | ok | errors | TTFT p50 | p90 | p99 (ms) | goodput |",
             "|" + "---|" * 9]
    for n, cell in results_mixed.items():
        if "error" in cell:
            continue
        by = cell["summary"].get("by", {}).get("class", {})
        for c in ("critical", "standard", "batch"):
            s = by.get(c)
            if not s:
                continue
            lines.append(f"| {n} | {c} | {s['requests']} | {s['ok']} | {errors_str(s['errors'])} | "
                         f"{fmt(s['ttft_ms']['p50'])} | {fmt(s['ttft_ms']['p90'])} | {fmt(s['ttft_ms']['p99'])} | "
                         f"{100 * s['goodput_fraction']:.1f}% |")
    return "\n".join(lines)


def class_ratios(results_mixed):
    """Per objective: kvgate's goodput and TTFT p90 against the best peer's."""
    lines = []
    k = results_mixed.get("kvgate")
    if not k or "error" in k:
        return lines
    for c in ("critical", "standard", "batch"):
        ks = k["summary"].get("by", {}).get("class", {}).get(c)
        peers = [(n, cell["summary"]["by"]["class"][c]) for n, cell in results_mixed.items()
                 if n != "kvgate" and "error" not in cell and c in cell["summary"].get("by", {}).get("class", {})]
        if not ks or not peers:
            continue
        bg = max(peers, key=lambda p: p[1]["goodput_fraction"])
        bt = min(peers, key=lambda p: p[1]["ttft_ms"]["p90"] if p[1]["ttft_ms"]["p90"] is not None else math.inf)
        kt, pt = ks["ttft_ms"]["p90"], bt[1]["ttft_ms"]["p90"]
        lines.append(f"{c}: goodput {100 * ks['goodput_fraction']:.1f}% vs best peer {100 * bg[1]['goodput_fraction']:.1f}% "
                     f"({bg[0]}); TTFT p90 {fmt(kt)} ms vs {fmt(pt)} ms ({bt[0]})"
                     + (f" = {kt / pt:.2f}×" if kt and pt else "")
                     + (f"; refused {errors_str(ks['errors'])}" if ks["errors"] else ""))
    return lines


def tenant_table(results_mixed):
    lines = ["| target | tenant | sent | ok | TTFT p50 | p99 (ms) | output tok/s |", "|" + "---|" * 7]
    for n, cell in results_mixed.items():
        if "error" in cell:
            continue
        by = cell["summary"].get("by", {}).get("tenant", {})
        for t, s in by.items():
            lines.append(f"| {n} | {t} | {s['requests']} | {s['ok']} | {fmt(s['ttft_ms']['p50'])} | "
                         f"{fmt(s['ttft_ms']['p99'])} | {fmt(s['output_tok_per_s'], 0)} |")
    return "\n".join(lines)


def overhead_table(ov):
    if not ov:
        return "_not run_"
    lines = ["| front | body | c=1 p50 (ms) | c=1 p99 (ms) | added p50 vs direct | added p99 vs direct | "
             "c=16 req/s | req/s vs direct | c=16 front CPU µs/request |", "|" + "---|" * 9]
    bodies = sorted({k.split("-c")[0] for v in ov.values() if "error" not in v for k in v})
    direct = ov.get("direct", {})
    for name, v in ov.items():
        if "error" in v:
            lines.append(f"| {name} | – | unavailable: {v['error'][:120]} | | | | | | |")
            continue
        for b in bodies:
            c1, c16 = v.get(f"{b}-c1"), v.get(f"{b}-c16")
            d1, d16 = direct.get(f"{b}-c1"), direct.get(f"{b}-c16")
            if not c1 or not c16:
                continue
            add50 = c1["p50_ms"] - d1["p50_ms"] if d1 else None
            add99 = c1["p99_ms"] - d1["p99_ms"] if d1 else None
            rr = c16["rps"] / d16["rps"] if d16 and d16["rps"] else None
            lines.append(f"| {name} | {int(b) // 1024} KB | {fmt(c1['p50_ms'], 3)} | {fmt(c1['p99_ms'], 3)} | "
                         f"{fmt(add50, 3)} | {fmt(add99, 3)} | {fmt(c16['rps'], 0)} | {fmt(rr, 2)} | "
                         f"{fmt(c16.get('cpu_us'), 1)} |")
    # kvgate vs the same Envoy without it, and vs the floor: the least a body-reading filter does.
    kv, ev, fl = ov.get("kvgate", {}), ov.get("envoy", {}), ov.get("floor", {})
    extra = []
    if not any("error" in v for v in (kv, ev)):
        extra.append("| body | kvgate adds p50 (ms) | floor adds p50 (ms) | kvgate over floor p50 (ms) | "
                     "c=16 kvgate ÷ Envoy | c=16 floor ÷ Envoy | c=16 kvgate ÷ floor | "
                     "CPU µs/request kvgate adds | floor adds |")
        extra.append("|" + "---|" * 9)
    for b in bodies:
        if "error" in kv or "error" in ev:
            break
        k1, e1, k16, e16 = kv.get(f"{b}-c1"), ev.get(f"{b}-c1"), kv.get(f"{b}-c16"), ev.get(f"{b}-c16")
        f1, f16 = (fl.get(f"{b}-c1"), fl.get(f"{b}-c16")) if "error" not in fl else (None, None)
        if not (k1 and e1 and k16 and e16):
            continue
        fadd = f1["p50_ms"] - e1["p50_ms"] if f1 else None
        over = k1["p50_ms"] - f1["p50_ms"] if f1 else None
        frr = f16["rps"] / e16["rps"] if f16 else None
        kf = k16["rps"] / f16["rps"] if f16 and f16["rps"] else None
        # CPU per request added to Envoy's own: what the filter costs, less moved by the machine's load.
        def cpu(c):
            return c.get("cpu_us") if c else None
        kcpu = cpu(k16) - cpu(e16) if cpu(k16) is not None and cpu(e16) is not None else None
        fcpu = cpu(f16) - cpu(e16) if cpu(f16) is not None and cpu(e16) is not None else None
        extra.append(f"| {int(b) // 1024} KB | {k1['p50_ms'] - e1['p50_ms']:.3f} | {fmt(fadd, 3)} | {fmt(over, 3)} | "
                     f"{k16['rps'] / e16['rps']:.2f}× | {fmt(frr, 2)}× | {fmt(kf, 2)}× | {fmt(kcpu, 1)} | {fmt(fcpu, 1)} |")
    return "\n".join(lines) + ("\n\n" + "\n".join(extra) if extra else "")


def plots(out, results, rates_rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except Exception as e:  # noqa: BLE001
        log(f"no plots: {e}")
        return []
    colors = {"kvgate": "#d62728", "envoy-rr": "#7f7f7f", "envoy-lr": "#1f77b4", "sglang-router": "#2ca02c",
              "vllm-router": "#9467bd"}
    files = []
    panels = [(w, cells, None) for w, cells in results.items()]
    if "mixed" in results:
        panels.append(("mixed", results["mixed"], "critical"))
    for wname, cells, cls in panels:
        fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
        drew = False
        for tname, cell in cells.items():
            if "error" in cell:
                continue
            recs = [json.loads(line) for line in open(out / (cell["raw"] + ".jsonl"))]
            ttft = sorted(1000 * r["ttft"] for r in recs if r.get("ttft") is not None
                          and (cls is None or r.get("tags", {}).get("class") == cls))
            if not ttft:
                continue
            ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
            ax.plot(ttft, ys, label=f"{tname} (mean {sum(ttft) / len(ttft):.0f} ms)",
                    color=colors.get(tname), linewidth=2.2 if tname == "kvgate" else 1.5)
            drew = True
        if not drew:
            plt.close(fig)
            continue
        ax.set_xscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}")
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
            lambda x, _: f"{x:g}" if str(int(x))[0] in "25" else ""))
        ax.set_xlabel("time to first token (ms, log scale)")
        ax.set_ylabel("fraction of successful requests")
        ax.set_title(f"TTFT CDF — {wname}" + (f", objective {cls} only" if cls else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        f = out / (f"ttft_cdf_{wname}" + (f"_{cls}" if cls else "") + ".png")
        fig.savefig(f)
        plt.close(fig)
        files.append(f.name)
    if rates_rows and len(next(iter(rates_rows.values()), {})) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(12, 5), dpi=110)
        for tname, by_rate in rates_rows.items():
            rs = sorted(by_rate)
            for ax, key, title in ((axes[0], "ttft_mean", "mean TTFT"), (axes[1], "ttft_p90", "p90 TTFT")):
                ax.plot(rs, [by_rate[r][key] for r in rs], marker="o", label=tname, color=colors.get(tname),
                        linewidth=2.2 if tname == "kvgate" else 1.5)
                ax.set_title(f"shared-prefix: {title} vs offered rate")
                ax.set_xlabel("offered rate (requests/s, Poisson)")
                ax.set_ylabel("ms (log scale)")
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
                    lambda x, _: f"{x:g}" if str(int(x))[0] in "25" else ""))
                ax.grid(True, which="both", alpha=0.3)
        axes[0].legend()
        fig.tight_layout()
        f = out / "ttft_vs_rate.png"
        fig.savefig(f)
        plt.close(fig)
        files.append(f.name)
    # Hit rate and throughput per workload and target.
    names = [t for t in ALL_TARGETS if any(t in c and "error" not in c[t] for c in results.values())]
    wls = list(results)
    if names and wls:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
        width = 0.8 / len(names)
        for i, t in enumerate(names):
            hits = [100 * results[w][t]["sim"]["hit_rate"] if t in results[w] and "error" not in results[w][t] else 0
                    for w in wls]
            tput = [results[w][t]["summary"]["overall"]["output_tok_per_s"]
                    if t in results[w] and "error" not in results[w][t] else 0 for w in wls]
            xs = [j + i * width for j in range(len(wls))]
            axes[0].bar(xs, hits, width, label=t, color=colors.get(t))
            axes[1].bar(xs, tput, width, label=t, color=colors.get(t))
        for ax, title in ((axes[0], "prefix-cache hit rate (%)"), (axes[1], "output tokens/s")):
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(wls))])
            ax.set_xticklabels(wls)
            ax.set_title(title)
            ax.grid(True, axis="y", alpha=0.3)
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=len(names), fontsize=9, frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 0.93))
        f = out / "hit_rate_throughput.png"
        fig.savefig(f)
        plt.close(fig)
        files.append(f.name)
    return files


WORKLOAD_DESC = {
    "shared-prefix": "G={groups} groups × questions, system prompt {system_tokens} tokens, question {question_tokens}, "
                     "output {output_tokens}; Poisson {main_rate} req/s for {duration} s; TTFT objective {ttft_slo_ms} ms",
    "multi-turn": "{sessions} sessions × {turns} turns (history resent each turn), shared system prompt {system_tokens}, "
                  "first message {first_tokens}, follow-ups {followup_tokens}, output {output_tokens}, think time "
                  "exp(mean {think_mean} s), sessions arrive Poisson {rate}/s, x-session-id; TTFT objective {ttft_slo_ms} ms",
    "mixed": "{long_pct}% long (prompt {long_prompt}, output {long_output}) / short (prompt {short_prompt}, output "
             "{short_output}); objectives critical 20% / standard 50% / batch 30%, tenants a 75% / b 25%; Poisson at "
             "{overload}× the measured capacity ({rate:.0f} req/s) for {duration} s; TTFT objective {ttft_slo_ms} ms",
    "hot-prefix": "one system prompt of {system_tokens} tokens in front of every request, question {question_tokens}, "
                  "output {output_tokens}; Poisson {rate} req/s for {duration} s; TTFT objective {ttft_slo_ms} ms",
    "chat": "unique prompts of {prompt_tokens} tokens (log-uniform), {unbounded_pct}% of requests without max_tokens "
            "(the simulator's lognormal lengths, mean 256), the rest with max_tokens uniform in {max_tokens} and "
            "stopping at EOS before it; {clients} closed-loop clients for {duration} s; pods with {num_gpu_blocks} "
            "KV blocks and --eos-before-max-tokens; steady window from {warmup} s to {duration} s; "
            "TTFT objectives {ttft_slos_ms} ms",
    "chat-bounded": "the chat workload with max_tokens (uniform in {max_tokens}, EOS may come first) on every "
                    "request; kvgate at each Envoy --concurrency, Envoy round robin for reference; {clients} "
                    "closed-loop clients for {duration} s; pods with {num_gpu_blocks} KV blocks",
    "chat-short": "short answers without max_tokens (the simulator's lognormal lengths, mean {output_len_mean}), "
                  "unique prompts of {prompt_tokens} tokens (log-uniform); {clients} closed-loop clients for "
                  "{duration} s; {pods} pods with {num_gpu_blocks} KV blocks; steady window from {warmup} s to "
                  "{duration} s; TTFT objectives {ttft_slos_ms} ms",
    "lora": "{adapters} LoRA adapters of one base model on every pod, each pod with --max-loras {max_loras} "
            "(adapter slots) and the simulator's adapter load time (40 ms from disk, 3 ms into a slot); each request "
            "names an adapter drawn by Zipf popularity (s = {zipf}), unique prompts of {prompt_tokens} tokens "
            "(uniform), output {output_tokens}; Poisson {rate} req/s for {duration} s; TTFT objective {ttft_slo_ms} ms. "
            "kvgate-no-affinity is kvgate with models.adapterLoadCost and adapterSlotCost 0",
    "cache-pressure": "G={groups} groups × questions in random order, system prompt {system_tokens} tokens (the "
                      "groups' prefixes {pool_x:.1f}× the whole pool's KV), question {question_tokens}, output "
                      "{output_tokens}; pods with {num_gpu_blocks} KV blocks; Poisson {rate} req/s for {duration} s; "
                      "TTFT objective {ttft_slo_ms} ms",
    "burst": "{n} requests at once ({groups} groups × {questions}, system prompt {system_tokens}, question "
             "{question_tokens}, output {output_tokens}); TTFT objective {ttft_slo_ms} ms",
}


def accuracy_line(cell):
    """How right kvgate was in a kvgate cell: its estimates against `usage`, its predicted active
    blocks against the engines' KV, its predicted prefix hits against the engines' (issue 17's
    goals: median prompt error ≤ 5 %, output ≤ 35 %, active blocks within 10 %)."""
    acc = cell.get("accuracy") or {}
    parts = []
    for model, e in sorted((acc.get("errors") or {}).items()):
        if e.get("prompt") is not None and e.get("output") is not None:
            part = (f"estimate error, median over answers ({model}): prompt {e['prompt']:.1f} %, "
                    f"output {e['output']:.1f} %")
            if acc.get("guess_floor") is not None:
                part += (f" (the best any one length guessed for every answer could do, chosen in hindsight and "
                         f"capped at each max_tokens: {acc['guess_floor']:.1f} %)")
            parts.append(part)
    samples = acc.get("active") or []
    for kvgate, what, unit in ((0, "predicted active blocks", ""),
                               (2, "what admission's entries hold", f" (in {BLOCK_TOKENS}-token blocks)")):
        fit = active_fit(samples, 2.0, float("inf"), kvgate)
        if fit is None:
            continue
        part = f"{what} ÷ the engines' KV in use {fit[0]:.2f}, {100 * fit[1]:.1f} % apart{unit}"
        if kvgate == 0:
            part += (" (Σ kvgate ÷ Σ engine; Σ|kvgate − engine| ÷ Σ engine, with kvgate's tick and the "
                     "scrape's lag; 0.5 s samples while busy)")
        now = active_fit(samples, 2.0, float("inf"), kvgate + 3, engine=4)
        if now is not None:
            part += f", both read at the same moment {now[0]:.2f}, {100 * now[1]:.1f} % apart"
        parts.append(part)
    k = cell.get("kvgate") or {}
    if k.get("prefix.blocks_total"):
        predicted = k.get("prefix.blocks_matched", 0) / k["prefix.blocks_total"]
        parts.append(f"predicted prefix hits {100 * predicted:.1f} % of prompt blocks vs the engines' "
                     f"{100 * cell['sim']['hit_rate']:.1f} % of prompt tokens")
    return "; ".join(parts)


def write_report(ctx, data):
    out = ctx["out"]
    cfg = ctx["cfg"]
    L = []
    mode = "full" if ctx["full"] else "demo"
    L.append(f"# kvgate benchmark ({mode} run, {data['started']})\n")
    L.append(f"Reproduce: `python bench/run.py --{mode}` (after `./build.sh build`); methodology in "
             f"[docs/benchmarks.md](docs/benchmarks.md). Raw data: `results/{out.name}/` (results.json, per-request "
             f"JSON lines under raw/).\n")
    m = data["machine"]
    L.append("## Machine and versions\n")
    L.append(f"- {m['nproc']} cores ({m['cpu']}), {m['memory']} memory, Linux {m['kernel']}, Python {m['python']}; "
             f"load average at start {', '.join(f'{x:.1f}' for x in m['loadavg_at_start'])} (a shared machine: "
             f"other processes may have run during the benchmark)")
    for k, v in data["versions"].items():
        L.append(f"- {k}: {v}")
    L.append(f"- pool: {cfg['pods']} kvgate-sim pods (Llama-3.1-8B on H100 timing model, 2048 KV blocks × 16 tokens "
             f"per pod; the chat workloads' pods have their own size, below), `--time-scale {cfg['time_scale']:g}` (latencies are wall-clock "
             f"{'= simulated time' if cfg['time_scale'] == 1 else '= simulated / ' + format(cfg['time_scale'], 'g')}); fresh pods "
             f"for every target and workload; workload seed {ctx['seed']}")
    L.append("\nTargets:\n")
    for n in ctx["targets"]:
        if n in data["unavailable"]:
            L.append(f"- **{n}: unavailable** — {data['unavailable'][n]}")
        else:
            L.append(f"- **{n}**: `{cli_strings().get(n, '?')}`")
    # Summary of ratios.
    L.append("\n## kvgate against the best peer\n")
    L.append("Ratio = kvgate's value ÷ the best peer's value for that metric (TTFT: lower is better; hit rate, "
             "throughput, goodput: higher is better).\n")
    for w, rat in data["ratios"].items():
        if rat:
            L.append(f"- **{w}**: {ratio_sentence(rat)}")
        if w == "mixed":
            for line in class_ratios(data["results"]["mixed"]):
                L.append(f"  - {line}")
    for w, cells in data["results"].items():
        rows = {n: row_metrics(c) for n, c in cells.items() if "error" not in c}
        L.append(f"\n## {w}\n")
        desc = data["workload_desc"].get(w)
        if desc:
            L.append(desc + "\n")
        ideal = [c["sim"]["ideal_hit_rate"] for c in cells.values() if "error" not in c and "ideal_hit_rate" in c["sim"]]
        if ideal:
            L.append(f"Hit-rate ceiling (every prefix computed once, one cache of unbounded size): "
                     f"{100 * min(ideal):.1f}–{100 * max(ideal):.1f} % of prompt tokens.\n")
        if w in ("chat", "chat-bounded", "chat-short"):
            L.append(chat_table(rows))
            per_peer = chat_ratio_table(rows)
            if per_peer:
                L.append("\n" + per_peer)
        else:
            L.append(workload_table(rows, data["ratios"].get(w, {})))
        if w == "lora":
            loads = ", ".join(f"{n} {c['sim'].get('lora_loads', 0)}" for n, c in cells.items() if "error" not in c)
            L.append(f"\nAdapter loads on the pods (the simulator's count; each stalls its pod's step by the load "
                     f"time): {loads}.")
        for n, c in cells.items():
            line = accuracy_line(c) if n.startswith("kvgate") and "error" not in c else ""
            if line:
                L.append(f"\nHow right {n} was: {line}.")
        failed = {n: c["error"] for n, c in cells.items() if "error" in c}
        for n, e in failed.items():
            L.append(f"\n- {n} failed: `{e[:300]}`")
        if w == "mixed":
            L.append("\nBy objective (x-gateway-inference-objective):\n")
            L.append(class_table(cells))
            L.append("\nBy tenant (x-gateway-inference-fairness-id):\n")
            L.append(tenant_table(cells))
            kc = cells.get("kvgate", {}).get("kvgate")
            if kc:
                adm = {k: v for k, v in sorted(kc.items()) if k.startswith(("admission", "queue")) and v}
                budgets = {k: v for k, v in kc.items() if k.endswith("budget_tokens")}
                L.append(f"\nkvgate admission counters after the run: `{json.dumps(adm)}`; per-pod budget gauges: "
                         f"{sorted(set(budgets.values()))}.")
                if data.get("admission_note"):
                    L.append(f"\n**{data['admission_note']}**")
    if data.get("rates"):
        L.append("\n## shared-prefix: TTFT versus offered rate\n")
        L.append("| target | rate (req/s) | ok/sent | TTFT mean | p90 | p99 (ms) | hit rate | tok/s | goodput |")
        L.append("|" + "---|" * 9)
        for n, by_rate in data["rates"].items():
            for r in sorted(by_rate, key=float):
                x = by_rate[r]
                L.append(f"| {n} | {r} | {x['ok']}/{x['requests']} | {fmt(x['ttft_mean'])} | {fmt(x['ttft_p90'])} | "
                         f"{fmt(x['ttft_p99'])} | {100 * x['hit_rate']:.1f}% | {fmt(x['tok_s'], 0)} | "
                         f"{100 * x['goodput']:.1f}% |")
    if data.get("prefix_check"):
        L.append("\n## Do the cache-aware peers really match prefixes?\n")
        for line in data["prefix_check"]:
            L.append(f"- {line}")
    aff = affinity_lines(out, data["results"])
    if aff:
        L.append("\n## Affinity\n")
        L.append("Where related requests went (x-sim-pod response headers): a group's or a session's requests on "
                 "one pod reuse its cached prefix; spreading them trades cache hits for balance.\n")
        L.extend(f"- {line}" for line in aff)
    if ctx["full"]:
        L.append("\n## Filter overhead (instant upstream)\n")
        ov_cfg = cfg.get("overhead", {})
        L.append("Non-streaming chat requests to `kvgate-bench echo` (answers at once), closed loop: one client for "
                 f"latency, 16 concurrent clients for throughput, {ov_cfg.get('seconds')} s each after a 1 s warm-up; "
                 f"median of {ov_cfg.get('repeats', 1)} interleaved rounds. Load generator, proxy and upstream share "
                 f"the {m['nproc']} cores, so throughput is CPU-bound and comparable only between fronts. `floor` is "
                 "the same Envoy and filter chain with the least body-reading wasm filter in kvgate's place "
                 "(bench/floor: stop at headers, buffer and read the body, set one header), built like kvgate; "
                 "kvgate ÷ floor is what kvgate's own work costs. kvgate runs its shipped configuration "
                 "(envoy/envoy.yaml, `debugHeaders` on).\n")
        L.append(overhead_table(data.get("overhead")))
    if data.get("calibration"):
        c = data["calibration"]
        L.append(f"\nMixed-workload capacity calibration: Envoy least-request, closed loop with {c['concurrency']} "
                 f"clients, fresh pods: **{c['capacity_rps']:.1f} req/s** completed during the window.")
    if data["plots"]:
        L.append("\n## Plots\n")
        for p in data["plots"]:
            L.append(f"![{p}](bench/plots/{p})" if ctx.get("for_benchmarks_md") else f"![{p}]({p})")
    L.append(f"\nTotal benchmark time: {data['elapsed_min']:.1f} min.")
    notes = data.get("notes") or []
    if notes:
        L.append("\n## Notes\n")
        L.extend(f"- {n}" for n in notes)
    return "\n".join(L) + "\n"


def affinity_lines(out, results):
    """How well each target keeps related requests together: shared-prefix groups per pod, and
    multi-turn follow-ups on the pod of the previous turn (from the x-sim-pod headers)."""
    lines = []
    for w, cells in results.items():
        if w not in ("shared-prefix", "multi-turn"):
            continue
        parts = []
        for t, cell in cells.items():
            if "error" in cell:
                continue
            recs = [json.loads(line) for line in open(Path(out) / (cell["raw"] + ".jsonl"))]
            recs = [r for r in recs if r["status"] == 200 and r.get("pod") is not None]
            if not recs:
                continue
            if w == "shared-prefix":
                by = {}
                for r in recs:
                    by.setdefault(r["tags"].get("group"), []).append(r["pod"])
                pods = sum(len(set(v)) for v in by.values()) / len(by)
                main = sum(max(v.count(p) for p in set(v)) for v in by.values()) / len(recs)
                parts.append(f"{t} {pods:.1f} pods per group, {100 * main:.0f}% on the group's main pod")
            else:
                turns = {(r["job"], r["turn"]): r["pod"] for r in recs}
                pairs = [(turns[(j, k - 1)], p) for (j, k), p in turns.items() if k > 0 and (j, k - 1) in turns]
                if pairs:
                    same = sum(a == b for a, b in pairs) / len(pairs)
                    parts.append(f"{t} {100 * same:.0f}% of follow-ups on the previous turn's pod")
        if parts:
            lines.append(f"{w}: " + "; ".join(parts))
    return lines


def prefix_check_lines(results):
    lines = []
    for w, cells in results.items():
        if w not in ("shared-prefix", "multi-turn"):
            continue  # unique prompts (mixed) or prefixes that fit every pod (burst): no test of matching
        rr = cells.get("envoy-rr")
        if not rr or "error" in rr:
            continue
        for peer in ("sglang-router", "vllm-router", "kvgate"):
            c = cells.get(peer)
            if not c or "error" in c:
                continue
            h, hr = c["sim"]["hit_rate"], rr["sim"]["hit_rate"]
            rq = c["sim"]["request_cache_hits"], c["sim"]["request_cache_hits"] + c["sim"]["request_cache_misses"]
            verdict = "yes" if h > hr + 0.05 else "no clear sign"
            lines.append(f"{w}: {peer} hit rate {100 * h:.1f}% vs Envoy round robin {100 * hr:.1f}% "
                         f"(requests admitted with a cache hit: {rq[0]}/{rq[1]}) → prefix matching: {verdict}")
    return lines


# ----------------------------------------------------------------------------------------------

def smoke(cfg):
    cfg = json.loads(json.dumps(cfg))
    if "shared_prefix" in cfg:
        cfg["shared_prefix"].update(rates=[30, 60], main_rate=60, duration=4)
    if "multi_turn" in cfg:
        cfg["multi_turn"].update(sessions=12, duration=8)
    if "mixed" in cfg:
        cfg["mixed"].update(duration=4, calibration_s=4)
    if "hot_prefix" in cfg:
        cfg["hot_prefix"].update(duration=4)
    if "burst" in cfg:
        cfg["burst"].update(questions=10)
    if "cache_pressure" in cfg:
        cfg["cache_pressure"].update(duration=4)
    if "overhead" in cfg:
        cfg["overhead"].update(seconds=1, repeats=2)
    for chat in ("chat", "chat_short"):
        if chat in cfg:
            cfg[chat].update(clients=40, duration=6, warmup=2)
    if "mixed" in cfg:
        cfg["mixed"]["calibration_s"] = 6
    if "lora" in cfg:
        cfg["lora"].update(duration=4)
    return cfg


def override_cells(cfg, specs):
    """`cfg` with each `CELL.KEY=JSON` of `specs` applied (a copy: FULL and DEMO stay as defined); an
    unknown cell or key stops the run, so a typo never measures the default unnoticed."""
    cfg = copy.deepcopy(cfg)
    for spec in specs:
        name, _, value = spec.partition("=")
        cell, _, key = name.partition(".")
        if not isinstance(cfg.get(cell), dict) or key not in cfg[cell]:
            sys.exit(f"--cell {spec}: no setting {key!r} in cell {cell!r}")
        try:
            cfg[cell][key] = json.loads(value)
        except json.JSONDecodeError as e:
            sys.exit(f"--cell {spec}: the value is not JSON ({e})")
    return cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--full", action="store_true", help="all workloads, all targets, overhead; updates BENCHMARKS.md")
    g.add_argument("--demo", action="store_true", help="kvgate vs Envoy round robin, short shared-prefix run")
    g.add_argument("--rewrite-report", metavar="DIR", help="rebuild report.md and plots from DIR/results.json "
                   "(with --benchmarks-md: also BENCHMARKS.md)")
    ap.add_argument("--benchmarks-md", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--targets", help="comma-separated subset of " + ",".join(ALL_TARGETS))
    ap.add_argument("--workloads", help="comma-separated subset of shared-prefix,multi-turn,hot-prefix,"
                                        "cache-pressure,mixed,burst,chat,chat-bounded,chat-short,lora")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cell", action="append", default=[], metavar="CELL.KEY=JSON",
                    help="override one setting of a workload's cell, e.g. cache_pressure.rate=75 (the workload "
                         "past saturation); repeatable; BENCHMARKS.md is then left as it is")
    ap.add_argument("--kvgate-config", metavar="JSON", default="{}",
                    help='merged into kvgate\'s plugin config, e.g. \'{"routing": {"activeWeight": 0.5}}\'')
    ap.add_argument("--out", help="output directory (default results/<timestamp>)")
    ap.add_argument("--smoke", action="store_true", help="tiny durations, to check the machinery (not a benchmark)")
    ap.add_argument("--no-benchmarks-md", action="store_true", help="with --full: do not update BENCHMARKS.md")
    a = ap.parse_args()
    KVGATE_OVERRIDE.update(json.loads(a.kvgate_config))
    if a.rewrite_report:
        return rewrite_report(a.rewrite_report, a.benchmarks_md)

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    started = datetime.datetime.now()
    cfg = FULL if a.full else DEMO
    if a.smoke:
        cfg = smoke(cfg)
    cfg = override_cells(cfg, a.cell)
    targets = a.targets.split(",") if a.targets else (ALL_TARGETS if a.full else ["kvgate", "envoy-rr"])
    workloads = a.workloads.split(",") if a.workloads else (
        ["shared-prefix", "multi-turn", "hot-prefix", "cache-pressure", "mixed", "burst", "chat", "chat-bounded",
         "chat-short", "lora"] if a.full
        else ["shared-prefix"])
    out = Path(a.out) if a.out else ROOT / "results" / started.strftime("%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ctx = {"cfg": cfg, "out": out, "cli": {}, "full": a.full, "seed": a.seed, "targets": targets}
    log(f"results in {out}")

    ensure_binaries()
    global WASM_SNAPSHOT
    WASM_SNAPSHOT = out / "kvgate.wasm"
    shutil.copy(harness.WASM, WASM_SNAPSHOT)
    want = list(PLOT_PACKAGES)
    for t in targets:
        if t in PEER_PACKAGES:
            want.append(PEER_PACKAGES[t])
    pkgs = ensure_packages(want)
    unavailable = {}
    for t in targets:
        if t in PEER_PACKAGES:
            ver, err = pkgs.get(PEER_PACKAGES[t].split("==")[0], (None, "not installed"))
            if err:
                unavailable[t] = err
    peer_pkgs = {d: v for d, v in pkgs.items() if d != "matplotlib"}
    data = {"started": started.strftime("%Y-%m-%d %H:%M"), "seed": a.seed, "machine": machine_info(),
            "versions": versions(peer_pkgs), "config": cfg, "targets": targets, "unavailable": unavailable,
            "results": {}, "ratios": {}, "rates": {}, "notes": [], "workload_desc": {}}
    if pkgs.get("matplotlib", (None, None))[1]:
        data["notes"].append(f"plots unavailable: {pkgs['matplotlib'][1]}")
    sim_args = ["--time-scale", str(cfg["time_scale"]), "--seed", "0"]
    seed = a.seed

    def probe_peer(t):
        """Starts a peer once in front of one pod; records why it is unavailable if it cannot start."""
        if t in unavailable or t not in PEER_PACKAGES:
            return
        try:
            with Sim(pods=1, args=sim_args) as sim, target(t, sim.endpoints, "probe", str(out / "logs"), ctx["cli"]):
                pass
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001
            unavailable[t] = f"could not start: {e}"
            log(f"{t} unavailable: {e}")

    try:
        for t in targets:
            probe_peer(t)
        live = [t for t in targets if t not in unavailable]

        if "shared-prefix" in workloads:
            w = cfg["shared_prefix"]
            log(f"shared-prefix at rates {w['rates']} req/s")
            data["results"]["shared-prefix"] = {}
            for rate in w["rates"]:
                for t in live:
                    cell = run_cell(ctx, t, "shared-prefix", f"shared-prefix-r{rate}", sp_args(w, rate, seed),
                                    sim_args, w["duration"] + 200)
                    if "error" not in cell:
                        data["rates"].setdefault(t, {})[str(rate)] = row_metrics(cell)
                    if rate == w["main_rate"]:
                        data["results"]["shared-prefix"][t] = cell
            data["workload_desc"]["shared-prefix"] = WORKLOAD_DESC["shared-prefix"].format(**w) + api_desc(w)

        def every_target(name, args, timeout, **desc):
            """One cell per live target on the workload `name`, and its description."""
            log(name)
            data["results"][name] = {t: run_cell(ctx, t, name, name, args, sim_args, timeout) for t in live}
            data["workload_desc"][name] = WORKLOAD_DESC[name].format(**desc)

        if "multi-turn" in workloads:
            w = cfg["multi_turn"]
            every_target("multi-turn", mt_args(w, seed), w["duration"] + 200, **w)

        if "mixed" in workloads:
            w = cfg["mixed"]
            mixed_sim = [*sim_args, *(["--max-num-seqs", str(w["max_num_seqs"])] if w["max_num_seqs"] else [])]
            log("mixed: measuring the pool's capacity")
            cal = calibrate_mixed(ctx, mixed_sim, seed)
            data["calibration"] = {k: v for k, v in cal.items() if k != "cell"}
            rate = w["overload"] * cal["capacity_rps"]
            n = int(math.ceil(rate * w["duration"]))
            log(f"mixed at {rate:.1f} req/s ({w['overload']}× {cal['capacity_rps']:.1f})")
            data["results"]["mixed"] = {t: run_cell(ctx, t, "mixed", "mixed", mixed_args(w, seed, rate, n),
                                                    mixed_sim, w["duration"] + 300) for t in live}
            data["workload_desc"]["mixed"] = WORKLOAD_DESC["mixed"].format(
                long_pct=round(100 * w["long_fraction"]), rate=rate, **w)
            kc = data["results"]["mixed"].get("kvgate", {}).get("kvgate") or {}
            acted = sum(v for k, v in kc.items() if k.startswith("admission.") and not k.endswith("admitted")
                        and isinstance(v, (int, float)))
            budgets = [v for k, v in kc.items() if k.endswith("budget_tokens")]
            if "kvgate" in data["results"]["mixed"] and not acted and not any(budgets):
                data["admission_note"] = ("Admission did not act in this run (no request queued or refused, per-pod "
                                          "budgets 0): the admission keys were still being implemented when this ran, "
                                          "so kvgate's mixed-workload row shows routing only.")
                data["notes"].append(data["admission_note"])

        if "hot-prefix" in workloads:
            w = cfg["hot_prefix"]
            every_target("hot-prefix", hot_args(w, seed), w["duration"] + 200, **w)

        if "cache-pressure" in workloads:
            w = cfg["cache_pressure"]
            log("cache-pressure")
            data["results"]["cache-pressure"] = {
                t: run_cell(ctx, t, "cache-pressure", "cache-pressure", sp_args(w, w["rate"], seed),
                            [*sim_args, "--num-gpu-blocks", str(w["num_gpu_blocks"])], w["duration"] + 200)
                for t in live}
            data["workload_desc"]["cache-pressure"] = WORKLOAD_DESC["cache-pressure"].format(
                pool_x=w["groups"] * w["system_tokens"] / (cfg["pods"] * w["num_gpu_blocks"] * BLOCK_TOKENS), **w) \
                + api_desc(w)

        if "burst" in workloads:
            w = cfg["burst"]
            every_target("burst", burst_args(w, seed), 400, n=w["groups"] * w["questions"], **w)

        def chat_cell(t, name, unbounded, concurrency=None, w=None):
            w = w or cfg["chat"]
            label = name if concurrency is None else f"{name}-c{concurrency}"
            cell = run_cell(ctx, t, name, label, chat_args(w, seed, unbounded), chat_sim_args(w, sim_args),
                            w["duration"] + 400, concurrency=concurrency, sample_kv=True, pods=w.get("pods"),
                            warm_s=w.get("warm_s", 0))
            if "error" not in cell:
                cell["steady"] = steady(cell, out, w)
            return cell

        if "chat" in workloads:
            w = cfg["chat"]
            log("chat")
            data["results"]["chat"] = {t: chat_cell(t, "chat", w["unbounded_fraction"]) for t in live}
            data["workload_desc"]["chat"] = WORKLOAD_DESC["chat"].format(
                unbounded_pct=round(100 * w["unbounded_fraction"]), **w) + warm_desc(w)

        if "chat-bounded" in workloads:
            w = cfg["chat"]
            log("chat-bounded")
            cells = {f"kvgate --concurrency {c}": chat_cell("kvgate", "chat-bounded", 0.0, c)
                     for c in cfg["chat_bounded"]["envoy_concurrency"] if "kvgate" in live}
            if "envoy-rr" in live:
                cells["envoy-rr"] = chat_cell("envoy-rr", "chat-bounded", 0.0)
            data["results"]["chat-bounded"] = cells
            data["workload_desc"]["chat-bounded"] = WORKLOAD_DESC["chat-bounded"].format(**w) + warm_desc(w)

        if "chat-short" in workloads:
            w = cfg["chat_short"]
            log("chat-short")
            data["results"]["chat-short"] = {t: chat_cell(t, "chat-short", w["unbounded_fraction"], w=w)
                                             for t in live}
            data["workload_desc"]["chat-short"] = WORKLOAD_DESC["chat-short"].format(**w) + warm_desc(w)

        if "lora" in workloads:
            w = cfg.get("lora") or FULL["lora"]
            log("lora")
            names = ["kvgate", "kvgate-no-affinity", *(t for t in live if t in ("envoy-rr", "envoy-lr"))]
            data["results"]["lora"] = {
                t: run_cell(ctx, t, "lora", "lora", lora_args(w, seed), lora_sim_args(w, sim_args),
                            w["duration"] + 200) for t in names if t != "kvgate" or "kvgate" in live}
            data["workload_desc"]["lora"] = WORKLOAD_DESC["lora"].format(**w)

        if a.full and not a.no_overhead:
            log("filter overhead")
            data["overhead"] = overhead(ctx, {t: t in live for t in PEERS})

        for wname, cells in data["results"].items():
            rows = {n: row_metrics(c) for n, c in cells.items() if "error" not in c}
            data["ratios"][wname] = ratios(rows)
        data["prefix_check"] = prefix_check_lines(data["results"])
        resyncs = {f"{w}/{t}": c["sim"]["clock_resyncs"] for w, cells in data["results"].items()
                   for t, c in cells.items() if "error" not in c and c["sim"]["clock_resyncs"]}
        if resyncs:
            data["notes"].append("The simulator's clock fell behind wall time at times (clock_resyncs, host "
                                 f"CPU contention): {resyncs}.")
    except KeyboardInterrupt:
        log("interrupted: everything started was stopped; writing what was measured")
        data["notes"].append("interrupted before the end")
    data["plots"] = plots(out, data["results"], data["rates"])
    data["elapsed_min"] = (datetime.datetime.now() - started).total_seconds() / 60
    data["unavailable"] = unavailable
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))
    report = write_report(ctx, data)
    (out / "report.md").write_text(report)
    log(f"report: {out / 'report.md'}")
    print_summary(data)
    # A run with cells overridden measures something else than the benchmark BENCHMARKS.md reports.
    if a.full and not a.smoke and not a.no_benchmarks_md and not a.cell \
            and "interrupted before the end" not in data["notes"]:
        update_benchmarks_md(ctx, data)
    return data


# Where BENCHMARKS.md's own history starts: the separate runs of every session since the last
# full run, written by hand. A full run replaces the report above it and keeps it.
HISTORY_MARK = "\n# Earlier sessions' measurements"
HISTORY_RULE = "-" * 99


def update_benchmarks_md(ctx, data):
    """BENCHMARKS.md = this run's report, then the file's hand-written history (from
    `HISTORY_MARK`, with the rule above it) as it was; the last run's observations, written by hand
    between the two, go with that run's report. Its plots are copied to bench/plots/ (results/ is
    not checked in)."""
    plots_dir = ROOT / "bench/plots"
    plots_dir.mkdir(exist_ok=True)
    for old in plots_dir.glob("*.png"):
        old.unlink()
    for p in data["plots"]:
        shutil.copy(ctx["out"] / p, plots_dir / p)
    ctx = dict(ctx, for_benchmarks_md=True)
    path = ROOT / "BENCHMARKS.md"
    before = path.read_text() if path.exists() else ""
    at = before.find(HISTORY_MARK)
    history = ""
    if at >= 0:
        rule = before.rfind(HISTORY_RULE, 0, at)
        history = "\n" + before[rule if rule >= 0 else at + 1:]
    path.write_text(write_report(ctx, data).rstrip("\n") + "\n" + history)
    log("BENCHMARKS.md updated (plots in bench/plots/; the hand-written history below the report kept)")


def rewrite_report(out_dir, benchmarks_md):
    """Rebuilds report.md (and BENCHMARKS.md) from a run's results.json, plots included."""
    out = Path(out_dir).resolve()
    data = json.loads((out / "results.json").read_text())
    full = "overhead" in data or "burst" in data["results"]
    ctx = {"cfg": data["config"], "out": out, "cli": {}, "full": full, "seed": data.get("seed", 1),
           "targets": data["targets"]}
    data["plots"] = plots(out, data["results"], data["rates"])
    for wname, cells in data["results"].items():
        rows = {n: row_metrics(c) for n, c in cells.items() if "error" not in c}
        data["ratios"][wname] = ratios(rows)
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "report.md").write_text(write_report(ctx, data))
    log(f"report: {out / 'report.md'}")
    print_summary(data)
    if benchmarks_md:
        update_benchmarks_md(ctx, data)


def print_summary(data):
    for w, cells in data["results"].items():
        rows = {n: row_metrics(c) for n, c in cells.items() if "error" not in c}
        print(f"\n{w}")
        print(f"  {'target':14s} {'ok/sent':>10s} {'hit':>6s} {'TTFT mean':>10s} {'p90':>8s} {'tok/s':>8s} {'goodput':>8s}")
        for n, r in rows.items():
            print(f"  {n:14s} {r['ok']:>5d}/{r['requests']:<4d} {100 * r['hit_rate']:5.1f}% {fmt(r['ttft_mean']):>10s} "
                  f"{fmt(r['ttft_p90']):>8s} {fmt(r['tok_s'], 0):>8s} {100 * r['goodput']:7.1f}%")
        rat = data["ratios"].get(w)
        if rat:
            print("  kvgate ÷ best peer: " + ratio_sentence(rat))
        if w == "mixed":
            for line in class_ratios(cells):
                print("  " + line)
    for t, e in data["unavailable"].items():
        print(f"\n{t}: unavailable — {e}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
