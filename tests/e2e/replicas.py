"""Several Envoy + kvgate replicas in front of the same kvgate-sim pods, sharing budgets through a
real etcd (Debian's etcd-server, installed by build.sh), for test_replicas.py and the heavier
measurement in replicas_bench.py: the etcd process, a fleet of replicas, the issue's 2x overload
spread over them while every replica's status page, etcd's grants and the pods are sampled."""

import base64
import contextlib
import http.client
import json
import itertools
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from harness import (STATUS_PATH, default_plugin_config, envoy_config, free_port, kvgate_gauges, request, stop,
                     stream, wait_port, Envoy, wait_for)

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
    plugin["statusPath"] = STATUS_PATH
    if etcd is not None:
        # etcd's history compacted every second: every replicas test runs with it.
        plugin["etcd"] = {"cluster": "etcd", "maxReplicas": 3, "leaseTtlSeconds": 2, "reclaimGraceMs": 1000,
                          "syncIntervalMs": 250, "timeoutMs": 500, "compactionIntervalMs": 1000, **etcd}
    return plugin


@contextlib.contextmanager
def fleet(sim, etcd_port, n=3, etcd=None, concurrency=2, etcd_ports=None, metrics=None, routing=None):
    """`n` Envoy + kvgate replicas in front of `sim`'s pods, named by their node ids, each with a
    cluster reaching etcd over HTTP/1.1 (at `etcd_ports[i]` when given, e.g. through a `Cut`);
    `etcd=None` runs them independently; `metrics` and `routing` are merged into their sections."""
    with contextlib.ExitStack() as stack:
        envoys = []
        for i in range(n):
            port = etcd_ports[i] if etcd_ports else etcd_port
            plugin = replica_config(etcd_port, f"replica-{i}", etcd)
            plugin["metrics"] = {**plugin.get("metrics", {}), **(metrics or {})}
            plugin["routing"] = {**plugin.get("routing", {}), **(routing or {})}
            cfg = envoy_config(free_port(), free_port(), sim.endpoints, plugin)
            cfg["node"] = {"id": f"replica-{i}", "cluster": "kvgate-gateway"}
            cfg["static_resources"]["clusters"].append({
                "name": "etcd", "type": "STATIC", "connect_timeout": "0.25s",
                "load_assignment": {"cluster_name": "etcd", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                                  "port_value": port}}}}]}]}})
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


def status(envoy):
    """The replica's status page: each pod's line, by pod segment (127_0_0_1_<port>). One read
    from shared data, so a replica's reservations and grant there are of one moment (its gauges
    are published on a tick, and read one admin call each)."""
    page = request(envoy.port, "GET", STATUS_PATH, timeout=2).json()
    return {segment(p["pod"]): p for p in page["pods"]}


def segment(pod):
    """A pod's address as kvgate's stat names and these tests key it (127_0_0_1_<port>)."""
    return pod.replace(".", "_").replace(":", "_")


class Cut:
    """A TCP relay between one replica and etcd that the test can cut: `cut` closes its listener
    and every connection (the replica's calls fail at once, as with a network partition that
    refuses), `mend` listens again on the same port."""

    def __init__(self, upstream_port):
        self.upstream, self.port = upstream_port, free_port()
        self.lock, self.conns, self.listener = threading.Lock(), [], None
        self.mend()

    def mend(self):
        listener = socket.create_server(("127.0.0.1", self.port))
        with self.lock:
            self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener):
        while True:
            try:
                down, _ = listener.accept()
            except OSError:
                return
            with self.lock:
                if listener is not self.listener:
                    # Accepted as the cut came: refused.
                    down.close()
                    return
                try:
                    up = socket.create_connection(("127.0.0.1", self.upstream))
                except OSError:
                    down.close()
                    continue
                self.conns += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self):
        with self.lock:
            listener, self.listener = self.listener, None
            conns, self.conns = self.conns, []
        if listener is None:
            return
        # Shut down first: a close alone does not wake the thread blocked in accept, which would
        # take one more connection (and Envoy keeps its connections alive).
        for c in [listener, *conns]:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cut()


def grants_by_replica(etcd):
    """Each pod's grants in etcd, by replica: one range, so of one revision."""
    out = {}
    for key, value in etcd.keys().items():
        if "/grant/" in key:
            parts = key.split("/")
            out.setdefault(segment(parts[3]), {})[parts[5]] = json.loads(value)["grant"]
    return out


def grants(etcd):
    """Each pod's grants in etcd, summed over the replicas: one range, so of one revision."""
    return {pod: sum(by_replica.values()) for pod, by_replica in grants_by_replica(etcd).items()}


def overload(sim, envoys, requests=72, clients=24, during=None, after=0, etcd=None):
    """The issue's overload: `requests` streaming completions (~350 prompt tokens, max_tokens 300)
    from `clients` closed-loop clients spread evenly over the replicas, while the pods, every
    replica's status page and (given `etcd`) the grants there are sampled. `during(progress)`
    runs in its own thread (a fault to inject); with `after`, the clients go on past `requests`
    until `during` has returned and `after` more requests have finished, so the fault's end is
    always followed by traffic however long it took (a CI machine's etcd once took the whole run
    to restart)."""
    samples, halt = [], threading.Event()
    lock, answers, finished, fault_over = threading.Lock(), {}, [0], []
    sent = itertools.count()

    def sampler():
        while not halt.is_set():
            try:
                samples.append({"pods": [sim.stats(i) for i in range(sim.pods)],
                                "replicas": [status(e) for e in envoys],
                                "grants": reachable(etcd)})
            except (OSError, http.client.HTTPException):
                # A server killed mid-answer (the faults the tests inject) cuts a read short.
                pass
            time.sleep(0.05)

    def reachable(etcd):
        # etcd may be down (a fault the test injects): the replicas' pages are still sampled.
        try:
            return grants(etcd) if etcd is not None else None
        except (OSError, ValueError, http.client.HTTPException):
            return None

    def more(i):
        if i < requests:
            return True
        with lock:
            return bool(after) and (not fault_over or finished[0] < fault_over[0] + after)

    def client():
        while more(i := next(sent)):
            r = stream(envoys[i % len(envoys)].port, "/v1/completions", unshared_completion(i))
            with lock:
                answers[i] = r
                finished[0] += 1

    def fault():
        try:
            during(lambda: finished[0])
        finally:
            with lock:
                fault_over.append(finished[0])

    threads = [threading.Thread(target=sampler)]
    if during is not None:
        threads.append(threading.Thread(target=fault))
    for t in threads:
        t.start()
    try:
        with ThreadPoolExecutor(clients) as pool:
            for f in [pool.submit(client) for _ in range(clients)]:
                f.result()
    finally:
        halt.set()
        for t in threads:
            t.join()
    return [answers[i] for i in sorted(answers)], samples


def budgets(samples):
    """Each pod's budget: the highest any replica's page showed (as test_budget.py reads it)."""
    nominal = {}
    for sample in samples:
        for page in sample["replicas"]:
            for pod, line in page.items():
                nominal[pod] = max(nominal.get(pod, 0), line["budgetTokens"] or 0)
    return nominal


def held(line):
    """A replica's reservations on a pod as its page shows them, less two blocks per request in
    flight: one its entry's `held` may lag its output by (entries are written at block
    boundaries), and one the forecast may rise by as those entries are rewritten, with no
    request admitted (a block per other request in flight where every token arrives on its own:
    the forecast's own test; chunks Envoy hands over together make the steps coarser: these runs
    saw reservations pass a grant shrunk to them by 42 tokens with two in flight)."""
    return line["reservedTokens"] - (2 * BLOCK - 1) * line["inFlight"]


def worst_excess(samples):
    """The most the replicas' reservations on one pod summed past the pod's budget, over every
    sample. The pages are read one replica after another, a few milliseconds apart, so this is a
    measurement, not the invariant: credit a replica gave back between two reads counts twice.
    `check_promise` asserts the invariant exactly."""
    nominal = budgets(samples)
    worst = max(sum(held(page[pod]) for page in s["replicas"]) - budget
                for s in samples for pod, budget in nominal.items())
    return worst, nominal


def check_promise(samples):
    """The replicas' budget promise, each part from a read of one moment: every replica's
    reservations on a pod within the grant etcd holds for it there (its page's
    `syncedGrantTokens`), and the grants in etcd summing to at most the pod's budget (one range).
    Their sum then stays within the budget at every instant, which reads of several replicas a
    few milliseconds apart cannot show directly."""
    nominal = budgets(samples)
    over_grant = [(pod, held(line), line["syncedGrantTokens"]) for s in samples for page in s["replicas"]
                  for pod, line in page.items() if held(line) > line["syncedGrantTokens"]]
    assert not over_grant, f"a replica's reservations passed its grant (pod, held, grant): {over_grant[:5]}"
    sums = [s["grants"] for s in samples if s["grants"]]
    assert sums, "etcd's grants were never read"
    over_budget = [(pod, g, nominal[pod]) for sum_ in sums for pod, g in sum_.items() if g > nominal.get(pod, 0)]
    assert not over_budget, f"etcd's grants summed past a budget (pod, grants, budget): {over_budget[:5]}"


def peak_sum_reserved(samples):
    return max(sum(page[pod]["reservedTokens"] for page in s["replicas"])
               for s in samples for pod in s["replicas"][0])
