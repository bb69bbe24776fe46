"""Helpers for kvgate's fault, hostile-input and soak runs (tests/e2e/test_faults.py,
tests/e2e/test_hostile.py, scripts/soak.py): what the VM exposes about its health and memory,
pool gauges that must drain to zero, raw-socket clients that misbehave on purpose, a sim pod
that can be restarted on the same port, and an Envoy whose listener (with kvgate's config) comes
from a watched file (LDS), so a new plugin configuration can be pushed while traffic flows."""

import gzip
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

from harness import Envoy, Sim, envoy_config, free_port, kvgate_gauges, request, wait_for


# ---------------------------------------------------------------------------------------------
# Health of the filter's VMs
# ---------------------------------------------------------------------------------------------

# Envoy 1.40 exposes, for a Wasm plugin with vm_id `kvgate`: wasm.kvgate.vm_reload{,_success,
# _failure,_backoff} (reloads after a VM failed, with `failure_policy: FAIL_RELOAD`), and for the
# runtime: wasm.envoy.wasm.runtime.v8.{created,active} and wasm.wasm_vm_count. Only the last is
# asserted exactly: each VM sets `v8.active` to the count it read when it started or stopped
# (Envoy's `RuntimeStatsHandler::onEvent`, `active_.set(active_wasms++)`), so workers starting
# their VMs at once leave it short by the last writer's lag (seen reading 4 of 6 in one CI run).
VM_STATS = ("wasm.kvgate.vm_reload", "wasm.kvgate.vm_reload_failure", "wasm.wasm_vm_count",
            "wasm.envoy.wasm.runtime.v8.created", "wasm.envoy.wasm.runtime.v8.active")

BAD_LOG = re.compile(r"panicked|\[critical\]|Function: \S+ failed|Uncaught|RuntimeError|"
                     r"stack overflow|out of bounds memory|Plugin configured to fail closed", re.IGNORECASE)


def vm_stats(envoy) -> dict:
    st = envoy.stats("wasm")
    return {k: st.get(k) for k in VM_STATS}


def bad_log_lines(envoy) -> list:
    return [l for l in envoy.logs().splitlines() if BAD_LOG.search(l)]


def assert_vm_alive(envoy, before=None, expected=None):
    """No panic or critical line in Envoy's log (lines matching the regex `expected` aside), the
    documented number of live VMs (one per worker, the main thread's and the base VM:
    docs/reliability.md), unchanged since `before` (a vm_stats() taken earlier), and Envoy still
    running. (kvgate runs with fail_open off, so Envoy never reloads a failed VM: a failure shows
    in the log and the VM count, not in the reload counters.)"""
    assert envoy.proc.poll() is None, "envoy exited:\n" + envoy.logs()[-3000:]
    bad = [l for l in bad_log_lines(envoy) if not (expected and re.search(expected, l))]
    assert not bad, "VM trouble in envoy's log:\n" + "\n".join(bad[:20])
    now = vm_stats(envoy)
    vms = envoy.concurrency + 2
    assert now["wasm.wasm_vm_count"] == vms, (vms, now)
    if before is not None:
        assert now["wasm.wasm_vm_count"] == before["wasm.wasm_vm_count"], (before, now)
    return now


# ---------------------------------------------------------------------------------------------
# Pool gauges
# ---------------------------------------------------------------------------------------------

def pool(envoy) -> dict:
    """Sums of kvgate's per-pod gauges, and the queue length."""
    st = envoy.stats("wasmcustom.kvgate")
    out = {"reserved_tokens": 0, "in_flight": 0, "active_blocks": 0}
    for name, v in st.items():
        for k in out:
            if name.startswith("wasmcustom.kvgate.pod.") and name.endswith("." + k):
                out[k] += v
    out["queue_length"] = st.get("wasmcustom.kvgate.queue.length", 0)
    return out


def drained(envoy, timeout=6.0):
    """Waits (a few ticks) for reserved tokens, in-flight entries, active blocks and the line to
    be exactly zero; returns (ok, last values per pod)."""
    def zero():
        p = pool(envoy)
        return all(v == 0 for v in p.values()) and bool(kvgate_gauges(envoy, "reserved_tokens"))

    ok = bool(wait_for(zero, timeout=timeout, interval=0.2))
    detail = {k: kvgate_gauges(envoy, k) for k in ("reserved_tokens", "in_flight", "active_blocks")}
    detail["queue_length"] = pool(envoy)["queue_length"]
    return ok, detail


def assert_drained(envoy, timeout=6.0):
    ok, detail = drained(envoy, timeout)
    assert ok, f"kvgate's accounting did not return to zero: {detail}"


# ---------------------------------------------------------------------------------------------
# Clients that misbehave
# ---------------------------------------------------------------------------------------------

def raw_post(port, path, body: bytes, headers=None, chunked=False, content_type="application/json"):
    """Opens a connection and sends a POST; returns the socket (the caller reads or drops it)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    hdrs = {"host": "kvgate", **({"content-type": content_type} if content_type else {}), **(headers or {})}
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    if chunked:
        head += "transfer-encoding: chunked\r\n\r\n"
        s.sendall(head.encode())
        for i in range(0, len(body), 1000):
            piece = body[i:i + 1000]
            s.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        s.sendall(b"0\r\n\r\n")
    elif "content-length" in hdrs:
        s.sendall(head.encode() + b"\r\n" + body)  # a declared length of the caller's choosing
    else:
        s.sendall(head.encode() + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    return s


def read_response(s, timeout=30.0):
    """Reads an HTTP/1.1 response off a raw socket: (status, headers, body). Handles
    content-length and chunked bodies; stops at EOF."""
    s.settimeout(timeout)
    f = s.makefile("rb")
    status_line = f.readline()
    if not status_line:
        return None, {}, b""
    status = int(status_line.split()[1])
    headers = {}
    while True:
        line = f.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    body = b""
    if "content-length" in headers:
        body = f.read(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int(f.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                f.readline()
                break
            body += f.read(size)
            f.readline()
    return status, headers, body


def abort_stream(port, body, headers=None, read_bytes=600, path="/v1/completions", timeout=20.0):
    """Starts a streaming request, reads about `read_bytes` of the response (so it is streaming
    from a pod), then closes the connection. Returns the response head it saw, or None."""
    s = raw_post(port, path, json.dumps(dict(body, stream=True)).encode(), headers)
    try:
        s.settimeout(timeout)
        got = b""
        while len(got) < read_bytes:
            piece = s.recv(4096)
            if not piece:
                break
            got += piece
            head, sep, _ = got.partition(b"\r\n\r\n")
            if sep and not head.startswith(b"HTTP/1.1 200"):
                break  # a local answer (429, 503, 413...): nothing streams
        return got.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    finally:
        s.close()


def abort_after(port, body, delay, headers=None, path="/v1/completions"):
    """Sends a request and disconnects after `delay` seconds without reading (e.g. while queued)."""
    s = raw_post(port, path, json.dumps(body).encode(), headers)
    time.sleep(delay)
    s.close()


def stream_outcome(port, path, body, headers=None, timeout=20.0):
    """A streaming request read to its end, never raising: status, the pod kvgate named, whether
    the stream completed ([DONE]), content chunks, total seconds, and the error if it broke."""
    import http.client
    body = dict(body, stream=True, stream_options={"include_usage": True})
    out = {"status": None, "pod": None, "done": False, "chunks": 0, "error": None}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        out["status"], out["pod"] = r.status, r.getheader("x-kvgate-pod")
        out["headers"] = {k.lower(): v for k, v in r.getheaders()}
        if r.status != 200:
            out["body"] = r.read()
        else:
            for raw in r:
                line = raw.strip()
                if line == b"data: [DONE]":
                    out["done"] = True
                    break
                if line.startswith(b"data:") and b'"choices":[]' not in line:
                    out["chunks"] += 1
    except Exception as e:  # noqa: BLE001 - a broken stream is an outcome here
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        out["total"] = time.perf_counter() - t0
    return out


def pick_of(ranking):
    """The pod kvgate picked: the first in its ranking header (debugHeaders) with room.
    `x-kvgate-pod` cannot say it: it names the pod that answered, after Envoy's retries moved a
    failed pick."""
    return next(e.split(" ")[0] for e in ranking.split(", ") if not e.endswith(" full"))


def timed(fn, *a, **kw):
    t0 = time.perf_counter()
    try:
        out = fn(*a, **kw)
    except Exception as e:  # noqa: BLE001 - a failed request is an outcome here
        out = e
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# A pod that can be killed and restarted on the same port
# ---------------------------------------------------------------------------------------------

class Pod(Sim):
    """One kvgate-sim pod in its own process, restartable on the same port."""

    def __init__(self, args=(), port=None):
        super().__init__(pods=1, args=args)
        if port is not None:
            self.base_port = port

    @property
    def addr(self):
        return f"127.0.0.1:{self.base_port}"

    def kill(self):
        """SIGKILL: connections are reset mid-stream, nothing is flushed."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self):
        self.kill()
        deadline = time.time() + 10
        while True:  # the port may linger a moment after the kill
            try:
                return self.__enter__()
            except (RuntimeError, TimeoutError):
                if time.time() > deadline:
                    raise
                time.sleep(0.2)


def sim_fault(port, **fault):
    r = request(port, "POST", "/sim/fault", fault)
    assert r.status == 200, r.body
    return r


# ---------------------------------------------------------------------------------------------
# Envoy with its listener from a watched file (LDS), so kvgate's config can change live
# ---------------------------------------------------------------------------------------------

class LdsEnvoy(Envoy):
    """envoy/envoy.yaml with the listener moved to `dynamic_resources.lds_config` read from a
    file Envoy watches. `push(plugin_config)` writes a new listener (same name, new kvgate
    configuration) and renames it over the watched path: Envoy drains the old listener and
    starts new filter chains with the new plugin configuration."""

    def __init__(self, upstreams, plugin_config, concurrency=4, log_level="warning", version=0):
        cfg = envoy_config(free_port(), free_port(), upstreams, plugin_config)
        self.listener = cfg["static_resources"].pop("listeners")[0]
        self.dir = Path(tempfile.mkdtemp(prefix="kvgate-lds-"))
        self.lds_path = self.dir / "lds.json"
        self.version = version
        self._write(plugin_config)
        cfg["node"] = {"id": "kvgate-test", "cluster": "kvgate-test"}
        cfg["dynamic_resources"] = {"lds_config": {"resource_api_version": "V3", "path_config_source": {
            "path": str(self.lds_path), "watched_directory": {"path": str(self.dir)}}}}
        # Envoy() reads the listener port from static_resources; keep a copy for that only.
        super().__init__(dict(cfg, static_resources=dict(cfg["static_resources"], listeners=[self.listener])),
                         concurrency=concurrency, log_level=log_level)
        self.config = cfg

    def _listener_with(self, plugin_config):
        listener = json.loads(json.dumps(self.listener))
        listener["@type"] = "type.googleapis.com/envoy.config.listener.v3.Listener"
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        kv = next(f for f in hcm["http_filters"] if f["name"] == "kvgate")
        kv["typed_config"]["config"]["configuration"]["value"] = json.dumps(plugin_config)
        return listener

    def _write(self, plugin_config):
        doc = {"version_info": str(self.version), "resources": [self._listener_with(plugin_config)]}
        tmp = self.dir / f".lds-{self.version}.json"
        tmp.write_text(json.dumps(doc))
        os.rename(tmp, self.lds_path)

    def push(self, plugin_config, timeout=15.0):
        """Pushes a new plugin configuration; returns once Envoy reports the update (or raises)."""
        before = self.lds_counts()
        self.version += 1
        self._write(plugin_config)
        ok = wait_for(lambda: self.lds_counts() != before, timeout=timeout, interval=0.1)
        assert ok, f"no LDS update within {timeout}s: {before}"
        return self.lds_counts()

    def __exit__(self, exc_type, *exc):
        super().__exit__(exc_type, *exc)
        if exc_type is None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def lds_counts(self):
        st = self.stats("listener_manager.lds")
        return (st.get("listener_manager.lds.update_success", 0), st.get("listener_manager.lds.update_rejected", 0))

    def listener_version(self):
        r = request(self.admin_port, "GET", "/config_dump?resource=dynamic_listeners")
        return r.json()


# ---------------------------------------------------------------------------------------------
# Memory of the process and of each Wasm VM
# ---------------------------------------------------------------------------------------------

def rss_kib(pid) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def wasm_memories(pid):
    """Each Wasm VM's linear memory, found in /proc/<pid>/smaps: V8 reserves ~8 GiB of address
    space per Wasm memory (guard regions) and commits the linear memory at its start, so every
    memory is a read-write mapping immediately followed by a huge inaccessible one. Returns a
    list of (committed KiB = the memory's current size, resident KiB). Envoy 1.40 exposes no
    per-VM memory stat; this is the closest measure (linear memory never shrinks, so growth
    shows as a larger size)."""
    maps = []
    cur = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) ", line)
            if m:
                cur = [int(m.group(1), 16), int(m.group(2), 16), m.group(3), 0]
                maps.append(cur)
            elif line.startswith("Rss:") and cur is not None:
                cur[3] = int(line.split()[1])
    out = []
    for prev, m in zip(maps, maps[1:]):
        if m[2] == "---p" and m[1] - m[0] >= (4 << 30) and prev[1] == m[0] and prev[2] == "rw-p":
            out.append(((prev[1] - prev[0]) >> 10, prev[3]))
    return out


# ---------------------------------------------------------------------------------------------
# An upstream that records everything
# ---------------------------------------------------------------------------------------------

class _Served:
    """A loopback HTTP server run in a thread for the test's length (the stub upstreams below)."""

    def _serve(self, server):
        self.server = server
        self.port = server.server_address[1]
        self.addr = f"127.0.0.1:{self.port}"
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class EchoUpstream(_Served):
    """Answers any method at once with a small OpenAI-ish JSON (usage included) and records
    (method, path, headers, body) of everything but kvgate's own /metrics and /v1/models
    scrapes (those name the pod in x-envoy-original-dst-host, which kvgate strips from clients),
    whose answer is the same JSON (an unparsable metrics page and model list). Reads chunked
    request bodies."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one(self):
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    body = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            break
                        body += self.rfile.read(size)
                        self.rfile.readline()
                else:
                    body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path != "/metrics" and "x-envoy-original-dst-host" not in self.headers:
                    received.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                out = json.dumps({"object": "chat.completion", "choices": [{"message": {"content": "ok"}}],
                                  "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = handle_one

            def log_message(self, *a):
                pass

        self._serve(ThreadingHTTPServer(("127.0.0.1", 0), Handler))


class FakePod(_Served):
    """An OpenAI-ish pod (answers completions at once) whose /metrics can misbehave:
    "ok" a small vLLM page; "truncate" headers promising 100 kB, a line, then the connection
    drops (a pod dying mid-scrape); "huge" a page of `huge_bytes` (a comment line). Its answers
    are plain JSON, or (`answer`) labelled `content-encoding: gzip`: "gzip" the answer
    gzipped, "not-gzip" the plain answer under that label, "bomb" 100 MB of spaces gzipped
    (about 100 kB) after the answer."""

    PAGE = ('vllm:num_requests_running{model_name="m",engine="0"} 0\n'
            'vllm:num_requests_waiting{model_name="m",engine="0"} 0\n'
            'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.1\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",engine="0"} 1.0\n')

    ANSWER = json.dumps({"object": "text_completion", "choices": [{"text": "ok"}],
                         "usage": {"prompt_tokens": 10, "completion_tokens": 1}}).encode()

    def __init__(self, metrics="ok", huge_bytes=40 << 20, answer="plain"):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        pod = self
        self.metrics = metrics
        body = {"plain": self.ANSWER, "not-gzip": self.ANSWER}.get(answer)
        if answer == "gzip":
            body = gzip.compress(self.ANSWER)
        elif answer == "bomb":
            body = gzip.compress(self.ANSWER + b" " * (100 << 20), 9)
        self.answer, self.answer_body = answer, body
        self.huge = None
        self.huge_bytes = huge_bytes

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                if self.path != "/metrics" or pod.metrics == "ok":
                    body = pod.PAGE.encode()
                elif pod.metrics == "truncate":
                    self.send_response(200)
                    self.send_header("content-length", "100000")
                    self.end_headers()
                    self.wfile.write(pod.PAGE.encode())
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                else:
                    if pod.huge is None:
                        pod.huge = pod.PAGE.encode() + b"# " + b"x" * pod.huge_bytes + b"\n"
                    body = pod.huge
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    self.close_connection = True

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                body = pod.answer_body
                self.send_response(200)
                self.send_header("content-type", "application/json")
                if pod.answer != "plain":
                    self.send_header("content-encoding", "gzip")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

            def handle_error(self, *a):
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, *a):
                pass  # the client (Envoy) hanging up on a huge page is expected

        self._serve(Server(("127.0.0.1", 0), Handler))
