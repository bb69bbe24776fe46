"""Cost-aware admission inside a real Envoy (--concurrency 4) in front of kvgate-sim pods with a
small KV cache: no preemptions at twice the pool's capacity, priority bands, shedding, fairness
between tenants, the session boost, timeouts, a full queue, disconnects and upstream resets — and
every pod's reserved tokens back to exactly zero afterwards."""

import json
import socket
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from harness import (STATUS_PATH, Sim, access_log_lines, baseline_envoy, default_plugin_config, kvgate_envoy, kvgate_gauges,
                     preemptions, request, sdk_call, stream, wait_for)

from bodies import MODEL, unshared_completion
# Two pods of 256 blocks × 16 tokens = 4096 tokens of KV each.
SMALL_KV = ["--time-scale", "10", "--num-gpu-blocks", "256"]


def config(**admission):
    cfg = default_plugin_config()
    cfg["admission"] = {"objectives": {"critical": 10, "standard": 0, "batch": -1}, **admission}
    return cfg


def reserved_zero(envoy):
    return wait_for(lambda: (g := kvgate_gauges(envoy, "reserved_tokens")) and all(v == 0 for v in g.values())
                    and all(v == 0 for v in kvgate_gauges(envoy, "in_flight").values()), timeout=5)


def test_twice_capacity_preempts_without_kvgate_and_never_with_it():
    """~800-token requests on pods holding ~5 each; 24 concurrent = about twice the pool."""
    out = {}
    for name in ("round_robin", "kvgate"):
        with Sim(pods=2, args=SMALL_KV) as sim:
            ctx = kvgate_envoy(sim.endpoints, config()) if name == "kvgate" else baseline_envoy(sim.endpoints)
            with ctx as envoy:
                with ThreadPoolExecutor(24) as pool:
                    rs = list(pool.map(lambda i: stream(envoy.port, "/v1/completions", unshared_completion(i)), range(72)))
                assert all(r["status"] == 200 and r["chunks"] == 300 for r in rs), [r["status"] for r in rs]
                out[name] = {"preemptions": preemptions(sim),
                             "peak_kv_blocks": max(sim.stats(i)["peak_kv_blocks_used"] for i in range(2)),
                             "e2e_p50_s": round(statistics.median(r["total"] for r in rs), 2)}
                if name == "kvgate":
                    assert reserved_zero(envoy)
    print("2x capacity:", out)
    # Round robin does preempt here: 14, 27 and 28 times in three runs on a slow machine
    # (2026-12-07), where the suite's first run of this test failed once, unexplained.
    assert out["round_robin"]["preemptions"] >= 3
    assert out["kvgate"]["preemptions"] == 0


def test_priority_bands_and_shedding():
    with Sim(pods=2, args=SMALL_KV) as sim, kvgate_envoy(sim.endpoints, config()) as envoy:
        # Fill the pool with long standard requests, then keep a standard backlog waiting.
        results = {"critical": [], "standard": [], "batch": []}
        lock = threading.Lock()

        def send(kind, i):
            # Distinct first words per class and request: no two requests share a prefix, so the
            # TTFT comparison measures the line, not caching.
            r = stream(envoy.port, "/v1/completions", unshared_completion(f"{kind}{i}", max_tokens=1000),
                       {"x-gateway-inference-objective": kind})
            with lock:
                results[kind].append(r)

        threads = [threading.Thread(target=send, args=("standard", i)) for i in range(24)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the standard backlog is queued now
        more = [threading.Thread(target=send, args=("critical", i)) for i in range(4)]
        more += [threading.Thread(target=send, args=("batch", i)) for i in range(4)]
        for t in more:
            t.start()
        for t in threads + more:
            t.join(120)
        ttft = {k: statistics.mean(r["ttft"] for r in v if r["status"] == 200) for k, v in results.items()
                if any(r["status"] == 200 for r in v)}
        print("TTFT by class (s):", {k: round(v, 3) for k, v in ttft.items()},
              "batch statuses:", sorted(r["status"] for r in results["batch"]))
        assert all(r["status"] == 200 for r in results["critical"] + results["standard"])
        assert all(r["status"] == 429 for r in results["batch"]), "sheddable refused while saturated"
        assert ttft["critical"] < ttft["standard"] / 2
        assert reserved_zero(envoy)


SEATS = 8


def critical_request(envoy, j):
    return stream(envoy.port, "/v1/completions", unshared_completion(f"critical{j}", max_tokens=16),
                  {"x-gateway-inference-objective": "critical"})


def overload_of_engines_out_of_seats(label, cfg, critical_phase):
    """Two pods whose engines run out of seats before KV (`--max-num-seqs 8` on pods of 2,048
    blocks: small requests on a large card) behind kvgate with `cfg`, 48 clients flooding standard
    requests of 1,000 tokens; `critical_phase(sim, envoy)` sends ten critical requests meanwhile
    and returns them with the engines' waiting counts it sampled. Held to its seats, an engine has
    one request waiting (and for a moment two: an answer's seat is freed in kvgate as its last
    chunk passes, and the request sent into it can reach the engine before the engine's next step
    takes the one waiting), a critical request waits for about one answer to end (0.55 s:
    the standard answers start and end in cohorts), and the pods stay as busy (16 answers of
    1,000 tokens running, ~0.65 s each)."""
    with Sim(pods=2, args=["--time-scale", "10", "--max-num-seqs", str(SEATS)]) as sim, \
            kvgate_envoy(sim.endpoints, cfg) as envoy:
        stop, served, lock = threading.Event(), [], threading.Lock()

        def flood(i):
            k = 0
            while not stop.is_set():
                r = stream(envoy.port, "/v1/completions", unshared_completion(f"standard{i}x{k}", max_tokens=1000),
                           {"x-gateway-inference-objective": "standard"})
                with lock:
                    served.append(r["status"])
                k += 1

        threads = [threading.Thread(target=flood, args=(i,)) for i in range(48)]
        for t in threads:
            t.start()
        try:
            critical, waiting = critical_phase(sim, envoy)
            finished_before = sum(sim.stats(i)["finished"] for i in range(2))
            time.sleep(2)
            per_s = (sum(sim.stats(i)["finished"] for i in range(2)) - finished_before) / 2
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        ttft = sorted(r["ttft"] for r in critical if r["status"] == 200)
        print(f"{label}: critical TTFT median {statistics.median(ttft) * 1000:.0f} ms, max {ttft[-1] * 1000:.0f} ms; "
              f"engines' waiting at most {max(waiting)}; {per_s:.1f} answers/s")
        assert len(ttft) == 10 and all(s == 200 for s in served), Counter(served)
        assert max(waiting) <= 2, waiting
        assert statistics.median(ttft) < 1.0, ttft
        assert per_s >= 16, per_s
        assert reserved_zero(envoy)


def test_pods_whose_engines_run_out_of_seats_first_keep_the_line_in_kvgate():
    """Engines whose running limit binds before their KV queue the overload themselves, first
    come first served, where kvgate's budget never fills: a critical request then waits behind
    every standard one sent before it. kvgate learns each engine's seats from its queue
    (`engine_seats`) and holds the pod to them and one more, so the overload waits in kvgate's
    line, where the critical request goes first, and the pods stay as busy."""
    def once_learned(sim, envoy):
        # Two scrapes a second apart that show the queue; a loaded machine's clients, slow to
        # read their streams, keep fewer requests in the engines, and it may take longer.
        assert wait_for(lambda: list(kvgate_gauges(envoy, "engine_seats").values()) == [SEATS] * 2, timeout=30), \
            kvgate_gauges(envoy, "engine_seats")
        time.sleep(1.5)  # the engines' queues drain into their seats
        waiting, critical = [], []
        for j in range(10):
            waiting.append(max(sim.stats(i)["waiting"] for i in range(2)))
            critical.append(critical_request(envoy, j))
            time.sleep(0.1)
        return critical, waiting

    # Behind the engines' own queues (16 a pod, ~0.65 s an answer at 8 a time) a critical
    # request waited 1.9 s (main before the seats, 2026-12-07).
    overload_of_engines_out_of_seats(f"seats learned {SEATS}", config(), once_learned)


def test_seats_stated_in_the_configuration_hold_the_pods_from_the_first_request():
    """With the engines' limit stated (`admission.engineSeats`), the pods are held to it from the
    overload's first request: nothing queues in the engines while kvgate learns it, and a critical
    request sent in the overload's first second goes ahead of the standard ones."""
    def at_once(sim, envoy):
        assert list(kvgate_gauges(envoy, "engine_seats").values()) == [SEATS] * 2
        critical, waiting, lock = [], [], threading.Lock()

        def send(j):
            r = critical_request(envoy, j)
            with lock:
                critical.append(r)

        # Sent while a learned limit would still be unknown (two scrapes a second apart), the
        # engines sampled meanwhile.
        sent = []
        for j in range(10):
            time.sleep(0.1)
            sent.append(threading.Thread(target=send, args=(j,)))
            sent[-1].start()
            waiting.append(max(sim.stats(i)["waiting"] for i in range(2)))
        for t in sent:
            t.join(60)
        return critical, waiting

    # Learned instead (`engineSeats` 0), the same critical requests waited behind the engines'
    # own queues of 16–20 until the limit was known: median 0.6–1.4 s (2026-12-07).
    overload_of_engines_out_of_seats(f"seats stated {SEATS}", config(engineSeats=SEATS), at_once)


def test_a_full_line_gives_a_critical_request_the_place_of_its_last_standard_one():
    """With the line at `admission.maxQueue`, a standard newcomer is refused (429), but a critical
    one takes the place of the last standard request waiting, which is answered 429 at once (not
    503 at its deadline), and the critical request is served."""
    with Sim(pods=2, args=SMALL_KV) as sim, \
            kvgate_envoy(sim.endpoints, config(maxQueue=4, maxWaitMs=20000)) as envoy:
        results, lock = {}, threading.Lock()

        def send(name, kind):
            # ~2,350 tokens: one a pod, each running ~1.4 s.
            r = stream(envoy.port, "/v1/completions", unshared_completion(name, max_tokens=2000),
                       {"x-gateway-inference-objective": kind})
            with lock:
                results[name] = dict(r, at=time.monotonic())

        standard = [threading.Thread(target=send, args=(f"standard{i}", "standard")) for i in range(8)]
        for t in standard:
            t.start()
            time.sleep(0.02)
        # Two running, four waiting, and the rest refused: the line is full.
        assert wait_for(lambda: sum(r["status"] == 429 for r in results.values()) == 2, timeout=2), results
        sent = time.monotonic()
        critical = threading.Thread(target=send, args=("critical", "critical"))
        critical.start()
        assert wait_for(lambda: sum(r["status"] == 429 for r in results.values()) == 3, timeout=2), \
            "nobody gave the critical request its place"
        critical.join(120)
        for t in standard:
            t.join(120)
        statuses = {n: r["status"] for n, r in results.items()}
        (name, r), = [(n, r) for n, r in results.items() if r["status"] == 429 and r["at"] > sent]
        print(f"statuses {statuses}; displaced {name} after {r['at'] - sent:.2f} s: {r['body'][:100]!r}")
        assert b"higher priority" in r["body"] and "retry-after" in r["headers"]
        assert results["critical"]["status"] == 200
        # The critical request went first: with the first room, which the two running requests
        # free at about the same time (so one of the three standard ones left waiting may start
        # with it), and before the other two.
        first_token = {n: q["at"] - q["total"] + q["ttft"] for n, q in results.items() if q["status"] == 200}
        assert sum(t > first_token["critical"] for t in first_token.values()) >= 2, first_token
        assert sorted(statuses.values()) == [200] * 6 + [429] * 3, statuses
        assert reserved_zero(envoy)


def test_flooding_tenant_does_not_starve_the_other():
    with Sim(pods=2, args=SMALL_KV) as sim, kvgate_envoy(sim.endpoints, config()) as envoy:
        flood_done = []

        def flood(i):
            r = stream(envoy.port, "/v1/completions", unshared_completion(i, max_tokens=400),
                       {"x-gateway-inference-fairness-id": "flood"})
            flood_done.append(time.time())
            return r

        with ThreadPoolExecutor(80) as pool, ThreadPoolExecutor(4) as quiet_pool:
            floods = [pool.submit(flood, i) for i in range(80)]
            time.sleep(0.5)
            quiet = [quiet_pool.submit(stream, envoy.port, "/v1/completions", unshared_completion(500 + i, max_tokens=400),
                                       {"x-gateway-inference-fairness-id": "quiet"}) for i in range(4)]
            quiet_r = [f.result() for f in quiet]
            flood_r = [f.result() for f in floods]
        assert all(r["status"] == 200 for r in quiet_r + flood_r)
        wait = lambda r: int(r["headers"].get("x-kvgate-queue-ms", "0"))
        quiet_wait = max(wait(r) for r in quiet_r)
        flood_waits = sorted(wait(r) for r in flood_r)
        # One request's own service time: its time at the pod, not its wait in the line (a
        # median of total times would include the wait, and be about half a full drain).
        service = statistics.median(r["total"] * 1000 - wait(r) for r in flood_r)
        print(f"quiet tenant: longest queue wait {quiet_wait} ms; flood tenant: median wait "
              f"{flood_waits[len(flood_waits) // 2]} ms, p90 {flood_waits[int(0.9 * len(flood_waits))]} ms; "
              f"one request's service time {service:.0f} ms")
        # The quiet tenant waits at most for running requests to end (about one service time),
        # not behind the flood's backlog, as it would in a FIFO line.
        assert quiet_wait <= 2 * service
        assert quiet_wait * 3 < flood_waits[int(0.9 * len(flood_waits))]
        assert reserved_zero(envoy)


def test_session_boost_shortens_follow_up_waits():
    """Sessions of short turns under a steady background load: with the boost, a follow-up turn
    goes ahead of non-boosted requests in its band."""
    waits = {}
    for boost in (0, 60000):
        with Sim(pods=2, args=SMALL_KV) as sim, kvgate_envoy(sim.endpoints, config(sessionBoostMs=boost)) as envoy:
            stop = time.time() + 6
            follow_up_waits = []

            def background(i):
                while time.time() < stop:
                    # Long answers: the backlog is seconds deep (short ones drained it in a
                    # quarter of a second, within the noise of the comparison).
                    stream(envoy.port, "/v1/completions", unshared_completion(10_000 + i, max_tokens=1000))

            def session(s):
                # A conversation's long context: a small turn fits into any room a finished
                # request leaves and passes the backlog by backfill (`admission.backfillPasses`),
                # boost or not.
                history = f"session {s} " + "context words " * 500
                for turn in range(4):
                    body = {"model": MODEL, "max_tokens": 20,
                            "messages": [{"role": "user", "content": history + f" turn {turn}"}]}
                    r = request(envoy.port, "POST", "/v1/chat/completions", body, {"x-session-id": f"s{s}"})
                    assert r.status == 200, r.body
                    if turn > 0:
                        follow_up_waits.append(int(r.headers.get("x-kvgate-queue-ms", "0")))
                    history += " answer " + r.json()["choices"][0]["message"]["content"]

            # About three times what the pool holds, so a backlog stands in the line throughout.
            with ThreadPoolExecutor(48) as pool:
                bg = [pool.submit(background, i) for i in range(42)]
                time.sleep(0.5)
                sessions = [pool.submit(session, s) for s in range(4)]
                for f in sessions + bg:
                    f.result()
            waits[boost] = statistics.mean(follow_up_waits)
            assert reserved_zero(envoy)
    print(f"mean follow-up queue wait: without boost {waits[0]:.0f} ms, with boost {waits[60000]:.0f} ms")
    # A boosted turn still waits for budget to free, but not behind the backlog.
    assert waits[60000] < 0.7 * waits[0]


def test_timeout_503_full_queue_429_and_disconnects_leave_nothing_reserved(tmp_path):
    """Past `maxQueue` 429, past `maxWaitMs` 503, a client that leaves the line or a stream
    leaves nothing reserved; the access log says why of each (`reason=`), with the request's
    model and estimate and how long it waited."""
    cfg = config(maxWaitMs=800, maxQueue=4, budgetTokens=1000)
    log = tmp_path / "access.log"
    with Sim(pods=2, args=SMALL_KV) as sim, kvgate_envoy(sim.endpoints, cfg, access_log=log) as envoy:
        # Occupy the pool: one long stream per pod, each reserving (nearly) a whole budget.
        holders = [threading.Thread(target=stream, args=(envoy.port, "/v1/completions", unshared_completion(i, max_tokens=3000)),
                                    daemon=True) for i in range(2)]
        for t in holders:
            t.start()
        time.sleep(0.5)
        counters = lambda: {k.rsplit(".", 1)[1]: v for k, v in envoy.stats("wasmcustom.kvgate.admission").items()}
        c0 = counters()
        with ThreadPoolExecutor(8) as pool:
            waiting = [pool.submit(request, envoy.port, "POST", "/v1/completions", unshared_completion(100 + i, max_tokens=10))
                       for i in range(6)]
            answers = [f.result() for f in waiting]
        got = sorted(r.status for r in answers)
        statuses = {s: got.count(s) for s in got}
        print("queued requests' answers:", statuses)
        assert statuses.get(429, 0) >= 2, "beyond maxQueue: 429"
        assert statuses.get(503, 0) >= 1, "past maxWaitMs: 503"
        assert all("retry-after" in r.headers for r in answers if r.status == 503), \
            [(r.status, r.headers) for r in answers]
        delta = lambda name, before: counters().get(name, 0) - before.get(name, 0)
        assert delta("queued", c0) == statuses[503] and delta("timed_out", c0) == statuses[503], counters()
        assert delta("queue_full", c0) == statuses[429], counters()
        # A client that disconnects while queued.
        c1 = counters()
        s = socket.create_connection(("127.0.0.1", envoy.port))
        body = json.dumps(unshared_completion(300, max_tokens=10)).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_for(lambda: delta("queued", c1) == 1, timeout=2), "the late request was queued"
        s.close()
        assert wait_for(lambda: delta("abandoned", c1) == 1, timeout=2), "it left the line when its client did"
        # A client that disconnects mid-stream (the upstream stream is reset).
        s = socket.create_connection(("127.0.0.1", envoy.port))
        body = json.dumps(dict(unshared_completion(301, max_tokens=2000), stream=True)).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.3)
        s.close()
        for t in holders:
            t.join(120)
        assert reserved_zero(envoy), kvgate_gauges(envoy, "reserved_tokens")
        queue_len = envoy.stats("wasmcustom.kvgate.queue.length").get("wasmcustom.kvgate.queue.length")
        assert queue_len == 0
        assert wait_for(lambda: len(access_log_lines(log)) >= 10, timeout=5), log.read_text()
    lines = access_log_lines(log)
    reasons = [(status, f.get("reason")) for status, f, _ in lines if f]
    assert reasons.count((429, "rate_limit_exceeded")) == statuses[429], lines
    assert reasons.count((503, "service_unavailable")) == statuses[503], lines
    # The one that left the line (and the streaming one, when the holders still held the pool).
    assert reasons.count((0, "client_left")) in (1, 2), lines
    for status, f, _ in lines:
        if f and f.get("reason") in ("service_unavailable", "client_left"):
            assert f["model"] and int(f["cost"]) > 0 and int(f["queue_ms"]) >= 0, f
        if f and f.get("reason") == "service_unavailable":
            assert int(f["queue_ms"]) >= 800, f
    # The holders' lines: what the engine counted beside the estimate.
    served = [f for status, f, _ in lines if status == 200 and f and "used_output_tokens" in f]
    assert len(served) >= 2 and all(int(f["used_prompt_tokens"]) > 0 for f in served), lines


def test_a_burst_past_a_full_line_is_served_to_clients_that_retry_as_the_sdks_do():
    """Five times what the pool and its line hold, at once, from clients that retry as OpenAI's
    SDK does: refused for a full line, each is told when a place will be free for it
    (`Retry-After`, one admission apart after the line has drained), so its two retries are
    not spent on a line as full as it left it."""
    cfg = config(maxQueue=8, maxWaitMs=30_000)
    burst = 60
    with Sim(pods=2, args=SMALL_KV) as sim, kvgate_envoy(sim.endpoints, cfg) as envoy:
        t0 = time.time()
        with ThreadPoolExecutor(burst) as pool:
            calls = [pool.submit(sdk_call, envoy.port, "/v1/completions", unshared_completion(500 + i, max_tokens=1000))
                     for i in range(burst)]
            done = [f.result() for f in calls]
        took = time.time() - t0
        statuses = [s for s, _, _ in done]
        served = statuses.count(200)
        attempts = sum(a for _, a, _ in done)
        told = sorted(x for _, _, t in done for x in t)
        print(f"burst of {burst}: {served} served in {took:.1f} s, {attempts} attempts, "
              f"statuses {sorted(set(statuses))}, told to wait {len(told)} times, "
              f"median {statistics.median(told) if told else 0:.2f} s, longest {max(told, default=0):.2f} s")
        # Without a Retry-After (2026-12-06, the build before): 20 of 60 served, the other 40
        # gave up after retrying at 0.5 and 1 s into a line as full as they left it.
        assert served >= 0.9 * burst, (served, sorted(set(statuses)))
        assert all(1.0 <= x <= 30.0 for x in told), told
        assert reserved_zero(envoy)
        assert preemptions(sim) == 0


def test_two_models_bursting_at_once_are_each_told_their_own_lines_pace():
    """Two models, each on two pods of its own, burst past their full lines at once from clients
    that retry as the SDKs do: model-a of answers ten times longer than model-b's, so its line
    drains ten times slower. Each refusal is told its own line's pace. Before (2026-12-06, one
    pace for the whole line): model-a's clients were told model-b's, came back too early, and
    21–24 of 60 gave up in four runs; model-b's last answer came 2 s later."""
    cfg = config(maxQueue=8, maxWaitMs=30_000)
    burst = {"model-a": (60, 1000), "model-b": (200, 100)}
    with Sim(pods=2, args=SMALL_KV + ["--served-model-name", "model-a"]) as a, \
            Sim(pods=2, args=SMALL_KV + ["--served-model-name", "model-b"]) as b, \
            kvgate_envoy(a.endpoints + b.endpoints, cfg) as envoy:
        listed = "wasmcustom.kvgate.models.list_ok"
        assert wait_for(lambda: envoy.stats(listed).get(listed, 0) >= 4, timeout=15)
        jobs = [(m, dict(unshared_completion(1_000 * k + i, max_tokens=n), model=m))
                for k, (m, (clients, n)) in enumerate(burst.items()) for i in range(clients)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            done = list(pool.map(lambda j: (j[0], sdk_call(envoy.port, "/v1/completions", j[1])), jobs))
        served = Counter(m for m, (status, _, _) in done if status == 200)
        told = {m: [x for k, (_, _, t) in done if k == m for x in t] for m in burst}
        print(f"served {dict(served)}; told to wait, longest s: { {m: max(t) for m, t in told.items()} }")
        for m, (clients, _) in burst.items():
            assert served[m] >= 0.9 * clients, (m, served[m])
            assert all(1.0 <= x <= 30.0 for x in told[m]), told[m]
        assert reserved_zero(envoy)
        assert preemptions(a) + preemptions(b) == 0


def _overload(refuse_late, rate=15.0, seconds=16.0, max_wait_ms=3000, headers=lambda i: None,
              max_tokens=lambda i: 1000, during=lambda envoy: None, **admission):
    """`rate` requests a second for `seconds`, each answered after 1,000 tokens (request `i` after
    `max_tokens(i)`), at two pods that serve about ten a second of those (request `i` with
    `headers(i)`; `during(envoy)` once the last is sent): each request's status, when it was
    sent and answered (s from the start), whether it was told when to come back, and how long it
    waited in kvgate's line (ms, `None` unless served); and the pods' preemptions."""
    cfg = dict(config(maxWaitMs=max_wait_ms, refuseLate=refuse_late, **admission), statusPath=STATUS_PATH)
    out = []
    with Sim(pods=2, args=SMALL_KV) as sim, kvgate_envoy(sim.endpoints, cfg) as envoy:
        start = time.time()

        def one(i):
            sent = time.time() - start
            r = request(envoy.port, "POST", "/v1/completions", unshared_completion(2_000 + i, max_tokens=max_tokens(i)),
                        headers=headers(i), timeout=120)
            queued = r.headers.get("x-kvgate-queue-ms") if r.status == 200 else None
            out.append((r.status, sent, time.time() - start, "retry-after" in r.headers,
                        None if queued is None else int(queued), i))

        with ThreadPoolExecutor(200) as pool:
            for i in range(int(rate * seconds)):
                time.sleep(max(0.0, start + i / rate - time.time()))
                pool.submit(one, i)
            during(envoy)
        assert reserved_zero(envoy), kvgate_gauges(envoy, "reserved_tokens")
        return out, preemptions(sim)


def test_a_request_the_line_cannot_serve_in_time_is_refused_at_arrival():
    """Sustained overload (about 1.5× what two pods serve) with `maxWaitMs` 3 s: with
    `refuseLate` the requests the line cannot serve in time are answered 429 at once, told when
    to come back, instead of 503 after waiting their 3 s; the pods serve as many a second.
    Measured (2026-12-07, two runs each): 503s 5 and 5 against 81 and 82 without it; 429s in 2 ms;
    9.47–9.67 served a second over the steady window either way (BENCHMARKS.md, *Refused at
    arrival*)."""
    runs = {flag: _overload(flag) for flag in (True, False)}
    summary = {}
    for flag, (out, pre) in runs.items():
        assert pre == 0, (flag, pre)
        late = [r for r in out if r[0] == 503]
        refused = [r for r in out if r[0] == 429]
        # Served a second once the overload has settled (the pace is judged after 32 admissions).
        steady = sum(1 for s, _, done, *_ in out if s == 200 and 5.0 <= done < 16.0) / 11.0
        summary[flag] = dict(served=sum(1 for r in out if r[0] == 200), late=len(late), refused=len(refused),
                             steady=round(steady, 2),
                             refused_p50_ms=round(1000 * statistics.median([d - s for _, s, d, *_ in refused]), 1)
                             if refused else None)
        assert all(has for s, _, _, has, *_ in out if s in (429, 503)), "every refusal says when to come back"
    print("refuseLate on / off:", summary)
    on, off = summary[True], summary[False]
    assert off["late"] >= 30 and off["refused"] == 0, off
    assert on["late"] <= max(10, off["late"] // 4), summary
    assert on["refused"] >= off["late"] // 2 and on["refused_p50_ms"] < 100, summary
    assert on["steady"] >= 0.9 * off["steady"], summary


def test_a_requests_own_time_to_first_token_objective_bounds_its_wait():
    """The same overload, `maxWaitMs` at its default of 30 s, and half the requests naming their
    own objective in `x-slo-ttft-ms` (2 s; `ttftObjectiveHeader` set): those are refused at once
    when the line cannot serve them within it, each one served waited less than it, and one still
    waiting at it is answered 503 then, not at 30 s; the others wait as long as the line keeps
    them, never refused. Measured (2026-12-07): of the 120 with an objective, 47 served (the
    longest wait 1.9 s), 63 refused in milliseconds, 10 answered 503 at 2 s (the first seconds,
    before 32 admissions measure the line's pace); the other 120 all served."""
    objective_ms = 2000
    out, pre = _overload(True, max_wait_ms=30_000, ttftObjectiveHeader="x-slo-ttft-ms",
                         headers=lambda i: {"x-slo-ttft-ms": str(objective_ms)} if i % 2 == 0 else None)
    assert pre == 0, pre
    mine = [r for r in out if r[5] % 2 == 0]
    others = [r for r in out if r[5] % 2 == 1]
    summary = {
        name: dict(Counter(r[0] for r in rows),
                   longest_wait_ms=max((r[4] for r in rows if r[4] is not None), default=None))
        for name, rows in (("objective", mine), ("none", others))}
    late = [done - sent for status, sent, done, *_ in mine if status == 503]
    print("own objective / none:", summary, "503 after (s):", [round(t, 2) for t in late])
    assert all(r[3] for r in out if r[0] in (429, 503)), "every refusal says when to come back"
    # Served within the objective; refused at once, or at the objective, never at 30 s.
    assert summary["objective"]["longest_wait_ms"] < objective_ms, summary
    assert summary["objective"].get(429, 0) >= 10, summary
    assert summary["objective"].get(503, 0) <= 20, summary
    assert all(t < objective_ms / 1000 + 1.0 for t in late), late
    # The others are neither refused nor held to the objective: the line keeps them.
    assert set(summary["none"]) == {200, "longest_wait_ms"}, summary


def test_a_large_request_is_judged_late_for_its_own_room():
    """The overload at 36 requests a second, half of them four times the others' cost (answers of
    1,000 tokens against 250): at the head of the line a large one waits for one pod to free its
    whole cost while small ones take what is freed before, so `refuseLate` adds to the count
    ahead what the line has learned a ticket of that size waits beyond the average, and refuses
    the large ones it cannot serve in time at arrival. Measured (2026-12-07, two runs each):
    large 172 served, 109–110 refused, 6–7 answered 503; small 287–288 served, 0–1 refused.
    Counting only the requests ahead: large 173–176 served, 52–63 refused, 51–62 answered 503
    after their 3 s; small 227–237 served, 51–61 refused (BENCHMARKS.md, *A large request's own
    wait*)."""
    paces = []
    out, pre = _overload(True, rate=36.0, max_tokens=lambda i: 1000 if i % 2 == 0 else 250,
                         during=lambda envoy: paces.extend(
                             request(envoy.port, "GET", STATUS_PATH).json()["queue"]["paces"]))
    summary = {name: dict(Counter(r[0] for r in out if r[5] % 2 == parity))
               for name, parity in (("large", 0), ("small", 1))}
    print("large / small:", summary, "preemptions:", pre, "the line's pace:", paces)
    assert pre == 0, pre
    # The status page shows what the judgement read: the two pods' pace and the slope learned,
    # a large request's 750 more tokens of cost worth more than a gap between admissions.
    assert [p["pods"] for p in paces] == [2], paces
    assert paces[0]["gapMs"] and 0.75 * paces[0]["waitMsPer1kTokens"] > paces[0]["gapMs"], paces
    large, small = summary["large"], summary["small"]
    share = {name: c.get(429, 0) / sum(c.values()) for name, c in summary.items()}
    assert share["large"] >= share["small"] + 0.15, summary
    assert large.get(503, 0) + small.get(503, 0) <= 20, summary
    assert small.get(200, 0) > large.get(200, 0), summary


def test_wake_up_latency_when_budget_frees():
    """One request at a time fits; each queued request is resumed when the previous one ends.
    kvgate measures the wake-up latency itself: from the release of budget (on any worker) to the
    admission of the woken request (on its own worker), in the host's milliseconds."""
    cfg = config(budgetTokens=1000)
    with Sim(pods=1, args=SMALL_KV) as sim, kvgate_envoy(sim.endpoints, cfg) as envoy:
        for i in range(10):
            with ThreadPoolExecutor(2) as pool:
                fa = pool.submit(request, envoy.port, "POST", "/v1/completions",
                                 unshared_completion(i, prompt_words=600, max_tokens=400))
                time.sleep(0.05)
                fb = pool.submit(request, envoy.port, "POST", "/v1/completions",
                                 unshared_completion(100 + i, prompt_words=600, max_tokens=5))
                ra, rb = fa.result(), fb.result()
            assert ra.status == rb.status == 200
            assert int(rb.headers["x-kvgate-queue-ms"]) > 0, "the second request waited"
        st = envoy.stats("wasmcustom.kvgate.admission")
        wakes = st["wasmcustom.kvgate.admission.wakes"]
        # A counter that was only ever incremented by 0 ms is never created.
        mean = st.get("wasmcustom.kvgate.admission.wake_latency_ms_total", 0) / wakes
        print(f"wake-up latency: mean {mean:.2f} ms over {wakes} wakes (millisecond clock)")
        assert wakes >= 10
        assert mean <= 5, "resumed on release, not on the 250 ms tick"
