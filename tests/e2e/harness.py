"""Processes for kvgate's end-to-end tests, demo and benchmarks: a real Envoy loading the built
kvgate.wasm (config derived from envoy/envoy.yaml), kvgate-sim pods, and small helpers for HTTP on
loopback. Everything started here is stopped by the context managers, even when a test fails."""

import contextlib
import json
import os
import random
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import http.client
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
WASM = Path(os.environ.get("KVGATE_WASM", ROOT / "target/wasm32-wasip1/release/kvgate.wasm"))
SIM_BIN = Path(os.environ.get("KVGATE_SIM_BIN", ROOT / "target/tools/kvgate-sim"))
ENVOY_BIN = Path(os.environ.get("KVGATE_ENVOY_BIN", ROOT / ".venv/bin/envoy"))
ENVOY_YAML = ROOT / "envoy/envoy.yaml"
# Where the tests and the benchmark ask kvgate for its status page (`statusPath`, off by default).
STATUS_PATH = "/kvgate/status"


def _probe() -> socket.socket:
    """A socket to test a port with as the servers the tests start will bind it: with
    SO_REUSEADDR (Envoy, Rust's and Go's listeners all set it), so a port whose only users are
    closed connections in TIME_WAIT counts as free. Without it, after a burst of a thousand
    requests (over 10,000 sockets in TIME_WAIT for a minute) runs of free ports grew too rare to
    find and the next server could not start."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return s


def _ephemeral_range() -> tuple:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


# Ports for the servers the tests start are handed out below the kernel's ephemeral range and
# never twice in one process. A port the kernel chose (bind to 0) lies in the ephemeral range,
# so between the probe closing it and the server binding it any outgoing connection could take
# it as its local port: a CI run lost a test to exactly that ("cannot bind 127.0.0.1:39947:
# Address already in use" from an Envoy started a moment after its port was probed).
_LOW, _HIGH = 10000, min(32768, _ephemeral_range()[0]) - 1
_cursor = [_LOW + (os.getpid() * 7919) % (_HIGH - _LOW)]
_cursor_lock = threading.Lock()


def _bindable(p: int) -> bool:
    with _probe() as s:
        try:
            s.bind(("127.0.0.1", p))
            return True
        except OSError:
            return False


def free_ports(n: int) -> int:
    """A base port with n consecutive free ports after it, none of them handed out before by this
    process and none in the range the kernel picks outgoing connections' ports from."""
    with _cursor_lock:
        for _ in range(_HIGH - _LOW):
            base = _cursor[0]
            if base + n > _HIGH:
                _cursor[0] = _LOW
                continue
            _cursor[0] = base + n
            if all(_bindable(p) for p in range(base, base + n)):
                return base
    raise RuntimeError("no run of free ports")


def free_port() -> int:
    return free_ports(1)


def stop(proc) -> None:
    """Terminates a process started here, killing it if it does not stop in 10 s."""
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_port(port: int, timeout: float = 30.0, proc=None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open")


class Response:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = {k.lower(): v for k, v in headers}
        self.body = body

    def json(self):
        return json.loads(self.body)


def request(port, method, path, body=None, headers=None, timeout=60.0) -> Response:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        hdrs = {"content-type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        conn.request(method, path, body=data, headers=hdrs)
        r = conn.getresponse()
        return Response(r.status, r.getheaders(), r.read())
    finally:
        conn.close()


def sdk_call(port, path, body, max_retries=2):
    """One call made as OpenAI's Python SDK makes it (openai-python `_base_client.py`, and
    Anthropic's SDK alike): on 408, 409, 429 or 5xx it tries again at most `max_retries` times (2
    by default), after the answer's `retry-after-ms`, else its `retry-after`, when that is within
    (0, 60] s, else after 0.5 s × 2^n (at most 8 s) less up to a quarter. Returns the last status,
    the attempts made and the waits it was told."""
    told = []
    for attempt in range(max_retries + 1):
        r = request(port, "POST", path, body, timeout=120)
        if not (r.status in (408, 409, 429) or r.status >= 500) or attempt == max_retries:
            return r.status, attempt + 1, told
        after = None
        for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
            try:
                after = float(r.headers[name]) * scale
                break
            except (KeyError, ValueError):
                pass
        if after is not None and 0 < after <= 60:
            told.append(after)
        else:
            after = min(0.5 * 2 ** attempt, 8.0) * (1 - 0.25 * random.random())
        time.sleep(after)


def responses_call(port, body, headers=None, timeout=60):
    """POSTs a Responses API request (streamed when `body` says so); returns the status, the pod
    that answered, the response's id and its usage (from `response.completed` when streamed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/responses", body=json.dumps(body).encode(),
                     headers={"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        pod, raw = r.getheader("x-sim-pod"), r.read()
        if r.status != 200:
            return r.status, pod, None, None
        if not body.get("stream"):
            answer = json.loads(raw)
            return r.status, pod, answer["id"], answer["usage"]
        for line in raw.decode().splitlines():
            if line.startswith("data: ") and '"response.completed"' in line:
                done = json.loads(line[6:])["response"]
                return r.status, pod, done["id"], done["usage"]
        return r.status, pod, None, None
    finally:
        conn.close()


def envoy_config(listen_port, admin_port, upstreams, plugin_config=None, wasm=WASM, with_kvgate=True,
                 lb_policy=None, yaml_path=ENVOY_YAML, access_log=None):
    """envoy/envoy.yaml (or a variant) with its ports, pods, plugin config and wasm path replaced;
    `access_log`: a file Envoy logs each request to, a line of its `(status, kvgate's report, kvgate's
    reason)` as `access_log_lines` reads them."""
    cfg = yaml.safe_load(Path(yaml_path).read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen_port}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    kv = next(f for f in filters if f["name"] == "kvgate")
    if access_log is not None:
        hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(access_log),
            "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}}}]
    if with_kvgate:
        wasm_cfg = kv["typed_config"]["config"]
        wasm_cfg["vm_config"]["code"]["local"]["filename"] = str(wasm)
        if plugin_config is not None:
            wasm_cfg["configuration"]["value"] = json.dumps(plugin_config)
    else:
        filters.remove(kv)
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "models")
    if "load_assignment" in cluster:
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in upstreams
        ]
    if lb_policy is not None:
        cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": lb_policy}]}
    for c in cfg["static_resources"]["clusters"]:
        if c["name"] == "kvgate_admin":
            c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
                "port_value"] = admin_port
    return cfg


# The operators docs/operations.md (*Access logs*) shows, tab-separated.
ACCESS_LOG_FORMAT = "%RESPONSE_CODE%\t%FILTER_STATE(wasm.kvgate:PLAIN)%\t%RESP(x-kvgate-reason)%\n"


def access_log_lines(path):
    """Each logged request's (status, kvgate's report as a dict, or None, kvgate's reason or None)."""
    out = []
    for line in Path(path).read_text().splitlines():
        status, report, reason = line.split("\t")
        fields = None if report == "-" else dict(shlex_pairs(report))
        out.append((int(status), fields, None if reason == "-" else reason))
    return out


def shlex_pairs(line):
    """`key=value` pairs of a logfmt line, a value in double quotes with `\\` escapes."""
    for token in shlex.split(line, posix=True):
        key, _, value = token.partition("=")
        yield key, value


def default_plugin_config(yaml_path=ENVOY_YAML):
    """The plugin configuration envoy/envoy.yaml (or a variant) ships with."""
    cfg = yaml.safe_load(Path(yaml_path).read_text())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    kv = next(f for f in hcm["http_filters"] if f["name"] == "kvgate")
    return json.loads(kv["typed_config"]["config"]["configuration"]["value"])


ROUND_ROBIN = {
    "name": "envoy.load_balancing_policies.round_robin",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"},
}
LEAST_REQUEST = {
    "name": "envoy.load_balancing_policies.least_request",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"},
}


class Envoy:
    def __init__(self, config, concurrency=4, log_level="warning"):
        self.config = config
        self.concurrency = concurrency
        self.log_level = log_level
        self.port = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
        self.admin_port = config["admin"]["address"]["socket_address"]["port_value"]
        self.proc = None
        self.log_path = None
        self.workdir = None

    def __enter__(self):
        self.workdir = d = tempfile.mkdtemp(prefix="kvgate-envoy-")
        path = Path(d) / "envoy.json"
        path.write_text(json.dumps(self.config))
        self.log_path = Path(d) / "envoy.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(ENVOY_BIN), "-c", str(path), "--concurrency", str(self.concurrency),
             "--disable-hot-restart", "-l", self.log_level, "--log-format", "[%l] %v",
             # An access log a test reads is written out within 0.2 s, not Envoy's 10.
             "--file-flush-interval-msec", "200"],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_port(self.admin_port, 60, self.proc)
            deadline = time.time() + 60
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError("envoy exited:\n" + self.logs())
                try:
                    if request(self.admin_port, "GET", "/ready", timeout=2).status == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.1)
            wait_port(self.port, 30, self.proc)
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stats(self, prefix="") -> dict:
        r = request(self.admin_port, "GET", "/stats?format=json&filter=" + prefix)
        out = {}
        for s in r.json().get("stats", []):
            if "value" in s:
                out[s["name"]] = s["value"]
        return out

    def __exit__(self, exc_type, *exc):
        stop(self.proc)
        self.log.close()
        # Its configuration and log are kept for a test that failed, and said where.
        if exc_type is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            print(f"envoy's configuration and log kept in {self.workdir}")


class Sim:
    """kvgate-sim serving `pods` pods on consecutive loopback ports."""

    def __init__(self, pods=4, args=()):
        self.pods = pods
        self.args = list(args)
        self.base_port = free_ports(pods)
        self.proc = None

    @property
    def ports(self):
        return [self.base_port + i for i in range(self.pods)]

    @property
    def endpoints(self):
        return [("127.0.0.1", p) for p in self.ports]

    def __enter__(self):
        self.proc = subprocess.Popen(
            [str(SIM_BIN), "--pods", str(self.pods), "--base-port", str(self.base_port),
             "--host", "127.0.0.1", *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            for p in self.ports:
                wait_port(p, 30, self.proc)
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def stats(self, i):
        return request(self.ports[i], "GET", "/sim/stats").json()

    def __exit__(self, *exc):
        stop(self.proc)


class StubUpstream:
    """An instantly answering OpenAI-ish upstream that echoes what it received, for tests that
    need no simulator. `received` holds what clients sent through Envoy; kvgate's own host-side
    calls (the /metrics and /v1/models scrapes, which name the pod in x-envoy-original-dst-host,
    a header kvgate strips from clients) go to `scrapes`: on a slow machine the first scrape can
    land inside a test, and it is not client traffic."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        received = self.received = []
        scrapes = self.scrapes = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in two writes: with Nagle on, the second waits for the
            # first's delayed ACK, 40 ms a request.
            disable_nagle_algorithm = True

            def do_POST(self):
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n)
                own = "x-envoy-original-dst-host" in self.headers
                (scrapes if own else received).append((self.path, dict(self.headers), body))
                out = json.dumps({"object": "chat.completion", "choices": [{"message": {"content": "ok"}}],
                                  "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
                                  "echo_headers": dict(self.headers)}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def baseline_envoy(upstreams, lb_policy=ROUND_ROBIN, concurrency=4):
    """The same Envoy without kvgate, balancing with `lb_policy`."""
    return Envoy(envoy_config(free_port(), free_port(), upstreams, with_kvgate=False, lb_policy=lb_policy),
                 concurrency=concurrency)


@contextlib.contextmanager
def kvgate_envoy(upstreams, plugin_config=None, concurrency=4, **kw):
    cfg = envoy_config(free_port(), free_port(), upstreams, plugin_config, **kw)
    with Envoy(cfg, concurrency=concurrency, log_level=os.environ.get("ENVOY_LOG", "warning")) as envoy:
        if (plugin_config or {}).get("discovery", {}).get("adminCluster"):
            # Discovery and a first scrape take a tick or two; tests start from a known pool whose
            # capacities are known (before its first scrape a pod takes one request at a time).
            wait_for(lambda: len(kvgate_gauges(envoy, "healthy")) >= len(upstreams), timeout=10)
            if (plugin_config or {}).get("metrics", {}).get("cluster"):
                wait_for(lambda: envoy.stats("wasmcustom.kvgate.scrape.ok").get("wasmcustom.kvgate.scrape.ok", 0)
                         >= len(upstreams), timeout=10)
        yield envoy


def preemptions(sim):
    """The preemptions of every pod of `sim` so far."""
    return sum(sim.stats(i)["preemptions"] for i in range(sim.pods))


def on_their_pod(placed):
    """Of `(group, pod)` pairs, the share placed on their group's most used pod."""
    groups = {}
    for group, pod in placed:
        groups.setdefault(group, []).append(pod)
    placed = sum(map(len, groups.values()))
    return sum(max(map(pods.count, set(pods))) for pods in groups.values()) / placed


@contextlib.contextmanager
def posted(port, path, body, headers=None, timeout=120.0):
    """POSTs `body` as JSON and yields the response, to be read as it comes; the connection is
    closed after."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        hdrs = {"content-type": "application/json"}
        hdrs.update(headers or {})
        conn.request("POST", path, body=json.dumps(body).encode(), headers=hdrs)
        yield conn.getresponse()
    finally:
        conn.close()


DONE = object()


def sse_data(r):
    """The `data:` events of a server-sent stream, each parsed, up to `data: [DONE]` (yielded as
    `DONE`)."""
    for raw in r:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield DONE
            return
        yield json.loads(data)


def stream(port, path, body, headers=None, timeout=120.0):
    """POSTs a streaming request; returns status, headers, time to first token, total time,
    number of chunks with text (answer or reasoning), the longest gap between two of them
    (`stall`) and the usage chunk."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    with posted(port, path, body, headers, timeout) as r:
        result = {"status": r.status, "headers": {k.lower(): v for k, v in r.getheaders()},
                  "ttft": None, "chunks": 0, "stall": 0.0, "usage": None}
        last = 0.0  # when the last chunk with text came (set by the first, which sets the TTFT)
        if r.status != 200:
            result["body"] = r.read()
            result["total"] = time.perf_counter() - t0
            return result
        for chunk in sse_data(r):
            if chunk is DONE:
                break
            if chunk.get("usage"):
                result["usage"] = chunk["usage"]
            for c in chunk.get("choices", []):
                delta = c.get("delta") or {}
                piece = c.get("text") or delta.get("content") or delta.get("reasoning")
                if piece:
                    now = time.perf_counter() - t0
                    if result["ttft"] is None:
                        result["ttft"] = now
                    else:
                        result["stall"] = max(result["stall"], now - last)
                    last = now
                    result["chunks"] += 1
        result["total"] = time.perf_counter() - t0
        return result


def stat(envoy, name) -> int:
    """One of Envoy's stats by its full name: 0 until it is first set."""
    return envoy.stats(name).get(name, 0)


def kvgate_stat(envoy, name) -> int:
    """One of kvgate's stats, by its name under `wasmcustom.kvgate.`."""
    return stat(envoy, "wasmcustom.kvgate." + name)


def kvgate_gauges(envoy, suffix):
    """kvgate's per-pod gauges of one kind (e.g. active_blocks), by pod segment."""
    out = {}
    for name, value in envoy.stats("wasmcustom.kvgate.pod").items():
        if name.endswith("." + suffix):
            out[name.split(".")[3]] = value
    return out


def wait_for(predicate, timeout=10.0, interval=0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = predicate()
        if v:
            return v
        time.sleep(interval)
    return predicate()
