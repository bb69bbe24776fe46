"""End-to-end checks of kvgate-sim, the vLLM-compatible pod simulator.

Starts the built binary (KVGATE_SIM_BIN, default target/tools/kvgate-sim; build it with
`cargo build -p kvgate-sim --profile tools`) on free loopback ports and checks prefix-cache reuse
and its TTFT effect, queueing and preemption under KV pressure, the Prometheus exposition, the
endpoints peer routers call, and a one-pod saturation curve. Standard library only, plus
prometheus_client for parsing the metrics text. --time-scale keeps the whole file well under a
minute; latencies below are converted back to simulated seconds where stated.
"""

import http.client
import json
import math
import random
import subprocess
import tempfile
import threading
import time

import pytest

from harness import SIM_BIN, free_ports
from bodies import MODEL

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu river "
         "mountain cloud stone garden window lantern harbor meadow canyon glacier ember willow "
         "falcon copper marble thunder velvet orchard compass").split()


# ------------------------------------------------------------------ helpers

class SimProc:
    """kvgate-sim on consecutive loopback ports; ready once every pod printed its listening line."""

    def __init__(self, *args, pods=1):
        self.pods = pods
        self.args = [str(a) for a in args]
        self.proc = None
        self.base = None

    def port(self, i=0):
        return self.base + i

    def __enter__(self):
        if not SIM_BIN.exists():
            pytest.fail(f"{SIM_BIN} not found: build it with `cargo build -p kvgate-sim --profile tools`")
        self.stderr = tempfile.TemporaryFile()
        for _attempt in range(3):
            self.base = free_ports(self.pods)
            self.proc = subprocess.Popen(
                [str(SIM_BIN), "--pods", str(self.pods), "--base-port", str(self.base),
                 "--host", "127.0.0.1", *self.args],
                stdout=subprocess.PIPE, stderr=self.stderr)
            ready = threading.Event()
            seen = []

            def pump(out=self.proc.stdout):
                for line in out:  # keep draining so the child never blocks on stdout
                    if b"listening on" in line:
                        seen.append(line)
                        if len(seen) == self.pods:
                            ready.set()

            threading.Thread(target=pump, daemon=True).start()
            deadline = time.time() + 20
            while time.time() < deadline and not ready.is_set() and self.proc.poll() is None:
                ready.wait(0.05)
            if ready.is_set():
                return self
            self._stop()  # port race or crash: retry on other ports
        self.stderr.seek(0)
        raise RuntimeError("kvgate-sim did not start: " + self.stderr.read().decode(errors="replace"))

    def _stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __exit__(self, *exc):
        self._stop()
        self.stderr.close()


class Resp:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)


def call(port, method, path, body=None, headers=None, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        hdrs = {"content-type": "application/json", **(headers or {})}
        conn.request(method, path, data, hdrs)
        r = conn.getresponse()
        return Resp(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


def stream(port, path, body, headers=None, timeout=120):
    """POST a streaming request; returns dict(ttft, e2e, chunks, usage, finish, text, status, pod)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    out = {"ttft": None, "chunks": 0, "usage": None, "finish": None, "text": "", "done": False}
    try:
        conn.request("POST", path, json.dumps(body).encode(),
                     {"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        out["status"], out["pod"] = r.status, r.getheader("x-sim-pod")
        if r.status != 200:
            out["error"] = r.read()
            return out
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                out["done"] = True
                break
            chunk = json.loads(payload)
            if chunk.get("usage") and not chunk["choices"]:
                out["usage"] = chunk["usage"]
                continue
            choice = chunk["choices"][0]
            piece = choice.get("text")
            if piece is None:
                piece = choice.get("delta", {}).get("content") or ""
            if piece:
                if out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - t0
                out["chunks"] += 1
                out["text"] += piece
            if choice.get("finish_reason"):
                out["finish"] = choice["finish_reason"]
    finally:
        conn.close()
    out["e2e"] = time.perf_counter() - t0
    return out


def words(n, rng):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prom(port):
    """Parse /metrics into {family name: family} with prometheus_client's text parser."""
    parser = pytest.importorskip(
        "prometheus_client.parser",
        reason="prometheus_client is not importable (pip install prometheus_client) - "
               "skipping the Prometheus-format checks")
    r = call(port, "GET", "/metrics")
    assert r.status == 200
    return {f.name: f for f in parser.text_string_to_metric_families(r.body.decode())}


def metric(port, name, **labels):
    """A sample's value from /metrics without prometheus_client (exact sample name + label match)."""
    text = call(port, "GET", "/metrics").body.decode()
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name + "{"):
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    raise KeyError((name, labels))


def sample(families, name, sample_name=None, **labels):
    fam = families[name]
    for s in fam.samples:
        if (sample_name is None or s.name == sample_name) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, sample_name, labels))


def show(capsys, text):
    with capsys.disabled():
        print("\n" + text, flush=True)


# ------------------------------------------------------------------ tests

def test_repeated_prompt_hits_prefix_cache(capsys):
    """The same long prompt twice: the second reuses all full blocks but the last token and its
    time to first token is a small fraction of the first."""
    scale = 2.0
    rng = random.Random(1)
    prompt = "Document 1. " + words(6000, rng)
    with SimProc("--time-scale", scale) as sim:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
        first = stream(sim.port(), "/v1/completions", body)
        second = stream(sim.port(), "/v1/completions", body)
        for r in (first, second):
            assert r["status"] == 200 and r["done"] and r["pod"] == "0"
            assert r["chunks"] == 4 and r["finish"] == "length"
        p = first["usage"]["prompt_tokens"]
        assert p > 5000 and second["usage"]["prompt_tokens"] == p
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        # Full 16-token blocks only, and the last prompt token is always recomputed.
        assert cached == (p - 1) // 16 * 16, (cached, p)
        ratio = second["ttft"] / first["ttft"]
        show(capsys, f"repeat-prompt: {p} prompt tokens, cached {cached}; TTFT first "
                     f"{first['ttft'] * scale * 1000:.1f} ms, second {second['ttft'] * scale * 1000:.1f} ms "
                     f"(simulated); ratio {ratio:.3f}")
        assert ratio < 0.2
        assert metric(sim.port(), "vllm:prefix_cache_queries_total") == 2 * p
        assert metric(sim.port(), "vllm:prefix_cache_hits_total") == cached
        stats = call(sim.port(), "GET", "/sim/stats").json()
        assert stats["request_cache_hits"] == 1 and stats["request_cache_misses"] == 1
        assert stats["prefix_cache_hit_tokens"] == cached


def test_multi_turn_chat_reuses_previous_turn():
    """A follow-up turn (earlier messages + the assistant's answer) hits the blocks of the first
    turn's prompt and of the generated answer, as vLLM's prefix cache would."""
    rng = random.Random(2)
    msgs = [{"role": "system", "content": "You are terse. " + words(300, rng)},
            {"role": "user", "content": [{"type": "text", "text": "Summarize: " + words(400, rng)}]}]
    with SimProc("--time-scale", 10) as sim:
        t1 = stream(sim.port(), "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 64})
        assert t1["status"] == 200 and t1["chunks"] == 64
        p1 = t1["usage"]["prompt_tokens"]
        msgs2 = msgs + [{"role": "assistant", "content": t1["text"]},
                        {"role": "user", "content": "And in one word?"}]
        t2 = stream(sim.port(), "/v1/chat/completions", {"model": MODEL, "messages": msgs2, "max_tokens": 4})
        cached = t2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (p1 + 64 - 1) // 16 * 16 - 16, (cached, p1)
        assert cached < t2["usage"]["prompt_tokens"]
        # The render endpoint returns exactly the token ids the server counts.
        rendered = call(sim.port(), "POST", "/v1/chat/completions/render",
                        {"model": MODEL, "messages": msgs2}).json()
        assert len(rendered["token_ids"]) == t2["usage"]["prompt_tokens"]
        tok = call(sim.port(), "POST", "/tokenize", {"model": MODEL, "messages": msgs2}).json()
        assert tok["tokens"] == rendered["token_ids"] and tok["count"] == len(tok["tokens"])


def test_kv_pressure_queues_and_preempts():
    """A small KV cache (64 blocks of 16 tokens): requests wait for blocks, decode growth
    over-admits and preempts (recompute), and everything still completes and frees its blocks."""
    rng = random.Random(3)
    n, out_tokens = 12, 120
    with SimProc("--time-scale", 4, "--num-gpu-blocks", 64) as sim:
        port = sim.port()
        seen = {"waiting": 0.0, "running": 0.0, "usage": 0.0}
        stop = threading.Event()

        def poll():
            while not stop.is_set():
                for key, name in (("waiting", "vllm:num_requests_waiting"),
                                  ("running", "vllm:num_requests_running"),
                                  ("usage", "vllm:kv_cache_usage_perc")):
                    seen[key] = max(seen[key], metric(port, name))
                time.sleep(0.005)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        results = [None] * n
        prompts = [f"Request {i}: " + words(180, rng) for i in range(n)]

        def one(i):
            # No limit (null): a completions request without `max_tokens` stops at 16, as vLLM's.
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": None}
            results[i] = stream(port, "/v1/completions", body, {"x-sim-output-tokens": str(out_tokens)})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stop.set()
        poller.join(5)
        for r in results:
            assert r and r["status"] == 200 and r["done"], r
            assert r["chunks"] == out_tokens and r["finish"] == "stop"
        assert seen["waiting"] > 0, seen
        assert 0 < seen["usage"] <= 1.0
        preemptions = metric(port, "vllm:num_preemptions_total")
        assert preemptions > 0
        assert metric(port, "vllm:request_success_total", finished_reason="stop") == n
        assert metric(port, "vllm:generation_tokens_total") >= n * out_tokens
        stats = call(port, "GET", "/sim/stats").json()
        assert stats["preemptions"] == preemptions
        assert 0 < stats["peak_kv_blocks_used"] <= 64
        assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
        print(f"kv pressure: max waiting {seen['waiting']:.0f}, max running {seen['running']:.0f}, "
              f"preemptions {preemptions:.0f}, peak blocks {stats['peak_kv_blocks_used']}")

        # Requests that can never fit get vLLM-style 400s.
        big = call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": words(1500, rng), "max_tokens": 8})
        assert big.status == 400 and big.json()["error"]["type"] == "BadRequestError"
        assert big.headers["x-sim-pod"] == "0"


def test_context_limits_and_disconnect_abort():
    rng = random.Random(4)
    with SimProc("--max-model-len", 2048, "--time-scale", 1) as sim:
        port = sim.port()
        r = call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": words(2500, rng)})
        assert r.status == 400 and "maximum context length" in r.json()["error"]["message"]
        r = call(port, "POST", "/v1/chat/completions",
                 {"model": MODEL, "messages": [{"role": "user", "content": words(1000, rng)}], "max_tokens": 1500})
        assert r.status == 400 and r.json()["error"]["code"] == 400
        r = call(port, "POST", "/v1/completions", {"model": "other-model", "prompt": "hi"})
        assert r.status == 404 and r.json()["error"]["type"] == "NotFoundError"
        # A client that goes away mid-generation is aborted in the engine: its blocks are freed.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/completions",
                     json.dumps({"model": MODEL, "prompt": words(500, rng), "stream": True, "max_tokens": None}),
                     {"content-type": "application/json", "x-sim-output-tokens": "1000"})
        resp = conn.getresponse()
        assert resp.status == 200
        resp.fp.readline()
        assert call(port, "GET", "/sim/stats").json()["running"] == 1
        conn.sock.close()
        conn.close()
        deadline = time.time() + 5
        while time.time() < deadline:
            s = call(port, "GET", "/sim/stats").json()
            if s["aborted"] == 1:
                break
            time.sleep(0.02)
        assert s["aborted"] == 1 and s["running"] == 0 and s["kv_blocks_used"] == 0, s


def test_metrics_exposition_and_fault_injection():
    """/metrics parses with prometheus_client and carries vLLM's names, types and labels."""
    parser = pytest.importorskip(
        "prometheus_client.parser",
        reason="prometheus_client is not importable (pip install prometheus_client)")
    with SimProc("--time-scale", 10, pods=2) as sim:
        for port in (sim.port(0), sim.port(1)):
            stream(port, "/v1/chat/completions",
                   {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
            r = call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2})
            assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 2
        fams = prom(sim.port(1))
        labels = {"model_name": MODEL, "engine": "0"}
        gauges = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc"]
        counters = ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"]
        for g in gauges:
            assert fams[g].type == "gauge", g
            assert sample(fams, g, **labels) >= 0
        for c in counters:
            assert fams[c].type == "counter", c
            assert all(s.name == c + "_total" and s.labels["engine"] == "0" for s in fams[c].samples), c
        info = fams["vllm:cache_config_info"]
        assert info.type == "gauge" and info.samples[0].value == 1
        assert info.samples[0].labels["block_size"] == "16"
        assert info.samples[0].labels["num_gpu_blocks"] == "2048"
        ttft = fams["vllm:time_to_first_token_seconds"]
        assert ttft.type == "histogram"
        les = [s.labels["le"] for s in ttft.samples if s.name.endswith("_bucket")]
        assert les[:4] == ["0.001", "0.005", "0.01", "0.02"] and les[-1] == "+Inf"
        assert sample(fams, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 2
        assert sample(fams, "vllm:generation_tokens", **labels) == 5
        assert sample(fams, "vllm:request_success", finished_reason="length") == 2

        # Fault injection changes only that pod's /metrics.
        port = sim.port(0)
        assert call(port, "POST", "/sim/fault", {"metrics": "500"}).status == 200
        assert call(port, "GET", "/metrics").status == 500
        assert call(sim.port(1), "GET", "/metrics").status == 200
        call(port, "POST", "/sim/fault", {"metrics": "garbage"})
        bad = call(port, "GET", "/metrics")
        assert bad.status == 200
        with pytest.raises(Exception):
            list(parser.text_string_to_metric_families(bad.body.decode(errors="replace")))
        call(port, "POST", "/sim/fault", {"metrics": "slow", "metricsDelayMs": 300})
        t0 = time.perf_counter()
        assert call(port, "GET", "/metrics").status == 200
        assert time.perf_counter() - t0 >= 0.3
        assert call(port, "POST", "/sim/fault", {"metrics": "ok"}).json() == {
            "metrics": "ok", "metricsDelayMs": 0, "retrieveDelayMs": 0}
        assert call(port, "GET", "/metrics").status == 200
        # A slow store: the retrieval of a stored response waits, whether it finds one or not.
        call(port, "POST", "/sim/fault", {"retrieveDelayMs": 300})
        t0 = time.perf_counter()
        assert call(port, "GET", "/v1/responses/resp_nowhere").status == 404
        assert time.perf_counter() - t0 >= 0.3
        assert call(port, "POST", "/sim/fault", {"retrieveDelayMs": 0}).json()["retrieveDelayMs"] == 0


def test_peer_router_endpoints():
    with SimProc("--time-scale", 10, pods=2) as sim:
        port = sim.port(1)
        h = call(port, "GET", "/health")
        assert h.status == 200 and h.body == b"" and h.headers["x-sim-pod"] == "1"
        models = call(port, "GET", "/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == MODEL
        assert models["data"][0]["max_model_len"] == 32768
        tok = call(port, "POST", "/tokenize", {"model": MODEL, "prompt": "Hello world, hello world"}).json()
        assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 32768
        rendered = call(port, "POST", "/v1/completions/render",
                        {"model": MODEL, "prompt": "Hello world, hello world"}).json()
        assert isinstance(rendered, list) and rendered[0]["token_ids"] == tok["tokens"]
        assert rendered[0]["request_id"].startswith("cmpl-")
        ids = call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": tok["tokens"], "max_tokens": 1}).json()
        assert ids["usage"]["prompt_tokens"] == tok["count"]
        assert call(port, "POST", "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == "Hello world, hello world"
        load = call(port, "GET", "/get_load").json()
        assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 0 and "num_tokens" in load[0]
        info = call(port, "GET", "/server_info").json()
        assert info["model_path"] == MODEL and info["page_size"] == 16 and info["port"] == port
        mi = call(port, "GET", "/model_info").json()
        assert mi["is_generation"] is True and mi["tokenizer_path"] == MODEL
        assert call(port, "GET", "/nope").status == 404


def test_served_names_adapters_and_unknown_models():
    """Several base names and LoRA adapters on one pod: /v1/models lists them as vLLM does,
    requests for any of them are served, load/unload answer with vLLM's bodies and codes, and a
    model the pod does not serve gets vLLM's 404."""
    chat = json.dumps({"name": "chat", "path": "/adapters/chat", "base_model_name": "base-b"})
    with SimProc("--time-scale", 10, "--served-model-name", "base-a", "base-b", "--enable-lora",
                 "--max-loras", 2, "--lora-modules", "sql=/adapters/sql", chat) as sim:
        port = sim.port()
        cards = call(port, "GET", "/v1/models").json()["data"]
        assert [c["id"] for c in cards] == ["base-a", "base-b", "sql", "chat"]
        for c in cards[:2]:
            assert (c["root"], c["parent"], c["max_model_len"]) == (MODEL, None, 32768)
        assert (cards[2]["root"], cards[2]["parent"], cards[2]["max_model_len"]) == ("/adapters/sql", "base-a", None)
        assert (cards[3]["root"], cards[3]["parent"]) == ("/adapters/chat", "base-b")
        assert all(c["object"] == "model" and c["owned_by"] == "vllm" for c in cards)

        for model in ("base-a", "base-b", "sql", "chat"):
            r = call(port, "POST", "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 2})
            assert r.status == 200 and r.json()["model"] == model, (model, r.body)
        r = call(port, "POST", "/v1/chat/completions",
                 {"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 404
        assert r.json()["error"] == {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                                     "param": None, "code": 404}

        load = {"lora_name": "new", "lora_path": "/adapters/new"}
        r = call(port, "POST", "/v1/load_lora_adapter", load)
        assert r.status == 200 and r.body == b"Success: LoRA adapter 'new' added successfully."
        new = call(port, "GET", "/v1/models").json()["data"][-1]
        assert (new["id"], new["root"], new["parent"]) == ("new", "/adapters/new", "base-a")
        assert call(port, "POST", "/v1/completions", {"model": "new", "prompt": "x", "max_tokens": 1}).status == 200
        again = call(port, "POST", "/v1/load_lora_adapter", load)
        assert again.status == 400 and again.json()["error"]["type"] == "InvalidUserInput"
        assert again.json()["error"]["message"] == "The lora adapter 'new' has already been loaded."
        missing = call(port, "POST", "/v1/load_lora_adapter", {"lora_name": "x"})
        assert missing.status == 400
        assert missing.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."

        r = call(port, "POST", "/v1/unload_lora_adapter", {"lora_name": "new"})
        assert r.status == 200 and r.body == b"Success: LoRA adapter 'new' removed successfully."
        gone = call(port, "POST", "/v1/unload_lora_adapter", {"lora_name": "new"})
        assert gone.status == 404 and gone.json()["error"]["type"] == "NotFoundError"
        assert gone.json()["error"]["message"] == "The lora adapter 'new' cannot be found."
        assert call(port, "POST", "/v1/completions", {"model": "new", "prompt": "x"}).status == 404
        assert "new" not in [c["id"] for c in call(port, "GET", "/v1/models").json()["data"]]
        assert call(port, "GET", "/v1/load_lora_adapter").status == 405

    with SimProc("--time-scale", 10) as sim:
        r = call(sim.port(), "POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"})
        assert r.status == 400 and r.json()["error"]["message"] == "LoRA is not enabled."
        assert metric(sim.port(), "vllm:lora_requests_info", max_lora="0") > 0


def _latest_lora_info(port):
    fams = prom(port)
    series = fams["vllm:lora_requests_info"].samples
    assert all(set(s.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"} for s in series)
    return max(series, key=lambda s: s.value)


def test_lora_requests_info_shows_running_and_waiting_adapters():
    """With one adapter slot, a request for a second adapter waits while the first runs; the
    newest `vllm:lora_requests_info` series (value = Unix time it was set) says so."""
    with SimProc("--time-scale", 1, "--enable-lora", "--max-loras", 1,
                 "--lora-modules", "x=/adapters/x", "y=/adapters/y") as sim:
        port = sim.port()
        results = {}

        def run(model, tokens):
            results[model] = stream(port, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": None},
                                    {"x-sim-output-tokens": str(tokens)})

        first = threading.Thread(target=run, args=("x", 150))
        first.start()
        deadline = time.time() + 5
        while call(port, "GET", "/sim/stats").json()["running"] == 0 and time.time() < deadline:
            time.sleep(0.005)
        second = threading.Thread(target=run, args=("y", 5))
        second.start()
        seen = None
        deadline = time.time() + 5
        while time.time() < deadline:
            latest = _latest_lora_info(port)
            if latest.labels["waiting_lora_adapters"] == "y":
                seen = latest
                break
            time.sleep(0.01)
        assert seen is not None, "y never showed as waiting"
        assert seen.labels["running_lora_adapters"] == "x" and seen.labels["max_lora"] == "1"
        assert abs(seen.value - time.time()) < 60
        first.join(30)
        second.join(30)
        assert results["x"]["done"] and results["y"]["done"]
        # y only ran once x had finished and freed the slot.
        assert results["y"]["e2e"] > results["x"]["e2e"] * 0.5
        idle = _latest_lora_info(port)
        assert (idle.labels["running_lora_adapters"], idle.labels["waiting_lora_adapters"]) == ("", "")
        assert idle.value >= seen.value


def test_non_resident_adapter_pays_a_load_before_its_first_token(capsys):
    """One adapter slot and host cache: switching adapters loads the new one (40 ms + 3 ms
    simulated by default) before its first step, so its TTFT is longer than a repeat request for
    the adapter already loaded."""
    rng = random.Random(16)
    with SimProc("--time-scale", 1, "--enable-lora", "--max-loras", 1,
                 "--lora-modules", "a=/adapters/a", "b=/adapters/b") as sim:
        port = sim.port()
        # b was loaded last at start, so a is not resident: a, a, b, b, a, a alternate cold and warm.
        cold, warm = [], []
        for i, model in enumerate(["a", "a", "b", "b", "a", "a"]):
            r = stream(port, "/v1/completions", {"model": model, "prompt": words(200, rng), "max_tokens": 2})
            assert r["status"] == 200 and r["done"]
            (cold if i % 2 == 0 else warm).append(r["ttft"])
        stats = call(port, "GET", "/sim/stats").json()
        assert stats["lora_loads"] == 3 and stats["loras_active"] == ["a"]
    cold.sort()
    warm.sort()
    gap = cold[1] - warm[1]
    show(capsys, f"adapter switch: TTFT median cold {cold[1] * 1000:.1f} ms, warm {warm[1] * 1000:.1f} ms")
    assert 0.025 < gap < 0.1, (cold, warm)


def _run_rate(port, rate_virtual, scale, n, prompt_words, out_tokens, seed):
    """Open-loop Poisson arrivals at `rate_virtual` simulated req/s. Returns measured numbers in
    simulated time."""
    rng = random.Random(seed)
    prompts = [f"Session {seed}-{i}: " + words(prompt_words, rng) for i in range(n)]
    gaps = [rng.expovariate(rate_virtual * scale) for _ in range(n)]
    results = [None] * n
    starts = [0.0] * n

    def one(i):
        starts[i] = time.perf_counter()
        results[i] = stream(port, "/v1/completions", {"model": MODEL, "prompt": prompts[i], "max_tokens": None},
                            {"x-sim-output-tokens": str(out_tokens)})
        results[i]["end"] = time.perf_counter()

    threads = []
    t = time.perf_counter()
    for i in range(n):
        t += gaps[i]
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(i,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(120)
    ok = [r for r in results if r and r.get("status") == 200 and r["done"]]
    assert len(ok) == n, [r for r in results if not (r and r.get("done"))][:2]
    first, last_arrival = min(starts), max(starts)
    last_done = max(r["end"] for r in ok)
    offered = (n - 1) / (last_arrival - first) / scale if n > 1 else rate_virtual
    throughput = n / (last_done - first) / scale
    ttfts = sorted(r["ttft"] * scale for r in ok)
    return {
        "rate": rate_virtual,
        "offered": offered,
        "throughput": throughput,
        "tokens_per_s": throughput * out_tokens,
        "ttft_mean": sum(ttfts) / n,
        "ttft_p50": ttfts[n // 2],
        "ttft_p90": ttfts[min(n - 1, int(math.ceil(0.9 * n)) - 1)],
    }


def test_saturation_curve(capsys):
    """One pod under increasing offered load: throughput follows the load, then plateaus at the
    pod's capacity while TTFT grows. Prompts of ~4k tokens, 32 output tokens each."""
    scale = 5.0
    rates = [1.0, 2.0, 4.0, 6.0, 9.0, 14.0]  # simulated requests per second
    rows = []
    with SimProc("--time-scale", scale) as sim:
        for k, rate in enumerate(rates):
            n = max(10, int(rate * 2.0 * scale))
            rows.append(_run_rate(sim.port(), rate, scale, n, prompt_words=3300, out_tokens=32, seed=100 + k))
        stats = call(sim.port(), "GET", "/sim/stats").json()
    lines = ["saturation curve (one pod, simulated time; prompts ~4k tokens, 32 output tokens):",
             f"{'rate req/s':>10} {'offered':>8} {'thruput':>8} {'out tok/s':>9} {'TTFT mean':>10} "
             f"{'TTFT p50':>9} {'TTFT p90':>9}"]
    for r in rows:
        lines.append(f"{r['rate']:>10.1f} {r['offered']:>8.2f} {r['throughput']:>8.2f} {r['tokens_per_s']:>9.0f} "
                     f"{r['ttft_mean'] * 1000:>8.0f}ms {r['ttft_p50'] * 1000:>7.0f}ms {r['ttft_p90'] * 1000:>7.0f}ms")
    lines.append(f"(prefix-cache hit tokens {stats['prefix_cache_hit_tokens']}, preemptions {stats['preemptions']}, "
                 f"clock resyncs {stats['clock_resyncs']})")
    show(capsys, "\n".join(lines))
    thr = [r["throughput"] for r in rows]
    # Below capacity the pod keeps up with the measured offered load...
    for r in rows[:2]:
        assert abs(r["throughput"] / r["offered"] - 1) < 0.3, r
    # ...throughput does not fall as load rises, and flattens at the top...
    for a, b in zip(thr, thr[1:]):
        assert b > 0.8 * a, thr
    assert thr[2] > 1.5 * thr[0], thr
    assert abs(thr[-1] - thr[-2]) / thr[-1] < 0.25, thr
    assert thr[-1] < 0.8 * rows[-1]["offered"], rows[-1]
    # ...while time to first token grows once the pod saturates.
    assert rows[-1]["ttft_mean"] > 3 * rows[0]["ttft_mean"], [r["ttft_mean"] for r in rows]
    assert rows[-1]["ttft_mean"] > rows[-2]["ttft_mean"] > rows[0]["ttft_mean"]
