"""Several Envoy + kvgate replicas in front of the same kvgate-sim pods, sharing budgets through a
real etcd (Debian's etcd-server, installed by build.sh), for test_replicas.py and the heavier
measurement in replicas_bench.py: the etcd process, a fleet of replicas, the issue's 2x overload
spread over them while every replica's gauges and the pods are sampled."""

import base64
import contextlib
import itertools
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from harness import (default_plugin_config, envoy_config, free_port, kvgate_gauges, request, stop, stream,
                     wait_port, Envoy, wait_for)

from bodies import unshared_completion

# Two pods of 256 blocks x 16 tokens = 4096 tokens of KV each (the pool).
SMALL_KV = ["--time-scale", "10", "--num-gpu-blocks", "256"]
BLOCK = 16


class Etcd:
    """A one-member etcd on loopback. `kill` and `start` again keep its data directory, as a
    crashed and restarted member would."""

    def __init__(self):
        self.port, self.peer_port = free_port(), free_port()
        self.dir = tempfile.mkdtemp(prefix="kvgate-etcd-")
        self.proc = None

    def start(self):
        url, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [shutil.which("etcd") or "etcd", "--name", "kvgate-test", "--data-dir", self.dir,
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvgate-test={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, 30, self.proc)
        wait_for(lambda: self.healthy(), timeout=15)
        return self

    def healthy(self):
        try:
            return request(self.port, "GET", "/health", timeout=2).json().get("health") == "true"
        except (OSError, ValueError):
            return False

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def keys(self, prefix="/kvgate/"):
        """Every key under `prefix` with its value as text (a replica's placements are binary)."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        r = request(self.port, "POST", "/v3/kv/range",
                    {"key": base64.b64encode(prefix.encode()).decode(),
                     "range_end": base64.b64encode(end.encode()).decode()})
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode(errors="replace")
                for kv in r.json().get("kvs", [])}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        stop(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


def replica_config(etcd_port, node_id, etcd=None):
    """The shipped plugin config with the etcd section on (None: an independent replica)."""
    plugin = default_plugin_config()
    if etcd is not None:
        # etcd's history compacted every second: every replicas test runs with it.
        plugin["etcd"] = {"cluster": "etcd", "maxReplicas": 3, "leaseTtlSeconds": 2, "reclaimGraceMs": 1000,
                          "syncIntervalMs": 250, "timeoutMs": 500, "compactionIntervalMs": 1000, **etcd}
    return plugin


@contextlib.contextmanager
def fleet(sim, etcd_port, n=3, etcd=None, concurrency=2):
    """`n` Envoy + kvgate replicas in front of `sim`'s pods, named by their node ids, each with a
    cluster reaching etcd over HTTP/1.1; `etcd=None` runs them independently."""
    with contextlib.ExitStack() as stack:
        envoys = []
        for i in range(n):
            plugin = replica_config(etcd_port, f"replica-{i}", etcd)
            cfg = envoy_config(free_port(), free_port(), sim.endpoints, plugin)
            cfg["node"] = {"id": f"replica-{i}", "cluster": "kvgate-gateway"}
            cfg["static_resources"]["clusters"].append({
                "name": "etcd", "type": "STATIC", "connect_timeout": "0.25s",
                "load_assignment": {"cluster_name": "etcd", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                                  "port_value": etcd_port}}}}]}]}})
            envoys.append(stack.enter_context(_started(cfg, concurrency, len(sim.endpoints))))
        if etcd is not None:
            # An idle fleet's steady state: every replica holds a share of every pod's budget (the
            # first to sync took all the spare credit; the others' shares come as it gives back).
            wait_for(lambda: all(len(g := kvgate_gauges(e, "grant_tokens")) == len(sim.endpoints)
                                 and min(g.values()) > 0 for e in envoys), timeout=15)
        yield envoys


@contextlib.contextmanager
def _started(cfg, concurrency, pods):
    with Envoy(cfg, concurrency=concurrency) as envoy:
        wait_for(lambda: len(kvgate_gauges(envoy, "healthy")) >= pods, timeout=10)
        wait_for(lambda: envoy.stats("wasmcustom.kvgate.scrape.ok").get("wasmcustom.kvgate.scrape.ok", 0) >= pods,
                 timeout=10)
        yield envoy


def gauges(envoy):
    return {k: kvgate_gauges(envoy, k) for k in ("reserved_tokens", "budget_tokens", "in_flight", "grant_tokens")}


def overload(sim, envoys, requests=72, clients=24, during=None):
    """The issue's overload: `requests` streaming completions (~350 prompt tokens, max_tokens 300)
    from `clients` closed-loop clients spread evenly over the replicas, while the pods and every
    replica's gauges are sampled. `during(progress)` runs in its own thread (a fault to inject)."""
    samples, halt = [], threading.Event()
    done = itertools.count()
    finished = [0]

    def sampler():
        while not halt.is_set():
            try:
                samples.append(([sim.stats(i) for i in range(sim.pods)], [gauges(e) for e in envoys]))
            except OSError:
                pass
            time.sleep(0.05)

    def one(i):
        envoy = envoys[i % len(envoys)]
        r = stream(envoy.port, "/v1/completions", unshared_completion(i))
        finished[0] = next(done) + 1
        return r

    threads = [threading.Thread(target=sampler)]
    if during is not None:
        threads.append(threading.Thread(target=during, args=(lambda: finished[0],)))
    for t in threads:
        t.start()
    try:
        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(one, range(requests)))
    finally:
        halt.set()
        for t in threads:
            t.join()
    return answers, samples


def preemptions(sim):
    return sum(sim.stats(i)["preemptions"] for i in range(sim.pods))


def worst_excess(samples):
    """The most the replicas' reservations on one pod summed past the pod's budget, over every
    sample (the budget as each replica's gauge shows it, the highest seen, as test_budget.py
    reads it), less the block per in-flight request an entry may lag by as its output streams."""
    nominal = {}
    for _, per_replica in samples:
        for g in per_replica:
            for pod, b in g["budget_tokens"].items():
                nominal[pod] = max(nominal.get(pod, 0), b)
    worst = None
    for _, per_replica in samples:
        for pod, budget in nominal.items():
            total = sum(g["reserved_tokens"].get(pod, 0) for g in per_replica)
            lag = sum((BLOCK - 1) * g["in_flight"].get(pod, 0) for g in per_replica)
            excess = total - lag - budget
            worst = excess if worst is None else max(worst, excess)
    return worst, nominal


def peak_sum_reserved(samples):
    return max(sum(g["reserved_tokens"].get(pod, 0) for g in per_replica)
               for _, per_replica in samples for pod in per_replica[0]["reserved_tokens"])
