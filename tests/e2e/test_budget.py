"""The budget is a promise both ways, in a real Envoy at --concurrency 1, 2 and 4 in front of two
kvgate-sim pods of 256 KV blocks (4,096 tokens each), with more streaming chat clients than the
pool holds: sampled through the run, a pod's forecast (what admission keeps within the budget)
never passes its budget and kvgate's predicted blocks never pass the pod's blocks (without
max_tokens, not unless the engine itself is full: `check_promise`); with max_tokens on every
request the engine never preempts; without it (long-tailed answers drawn by
the simulator) it preempts at most a sliver of what round robin does, answers that do not
stream too (counted as the engine makes them); and the pods' KV is used, not left idle.
Everything returns to zero afterwards."""

import json
import math
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import (STATUS_PATH, Envoy, Sim, baseline_envoy, default_plugin_config, envoy_config, free_port,
                     kvgate_envoy, kvgate_gauges, kvgate_stat, preemptions, request, stream, wait_for)

from robustness import assert_drained

from bodies import MODEL, WORDS, grouped_chat, unshared_chat
BLOCKS, BLOCK = 256, 16
SMALL_KV = ["--time-scale", "10", "--num-gpu-blocks", str(BLOCKS)]
# estimator.promptSpread's default (docs/configuration.md): the margin on every prompt until the
# model is calibrated.
PROMPT_SPREAD = 0.1
# Common English words: about one token each, so the estimate is right from the first request.



def answer(port, path, body):
    """A request whose answer does not stream, reported as `stream` reports one (its status and
    usage)."""
    r = request(port, "POST", path, body, timeout=120.0)
    return {"status": r.status, "usage": r.json().get("usage") if r.status == 200 else None}


def run(envoy, sim, max_tokens, clients, requests, sample_kvgate=True, words=300, streams=True):
    """Sends the requests (prompts of about `words` tokens) from `clients` closed-loop clients,
    streaming unless `streams` is off, while sampling the pods and kvgate's gauges; returns the
    answers and the samples."""
    samples, stop = [], threading.Event()

    def sampler():
        while not stop.is_set():
            pods = [sim.stats(i) for i in range(sim.pods)]
            gauges = {k: kvgate_gauges(envoy, k)
                      for k in ("reserved_tokens", "budget_tokens", "active_blocks", "in_flight", "relief_percent")} \
                if sample_kvgate else {}
            samples.append((pods, gauges))
            time.sleep(0.05)

    thread = threading.Thread(target=sampler)
    thread.start()
    send = stream if streams else answer
    try:
        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(lambda i: send(envoy.port, "/v1/chat/completions", unshared_chat(i, max_tokens, words)),
                                    range(requests)))
    finally:
        stop.set()
        thread.join()
    return answers, samples


def timed_run(envoy, sim, clients, requests, sample_kvgate, words=300, streams=True):
    """`run` without max_tokens, every answer a 200; returns its answers, its samples and what it
    did: the engines' preemptions, the pool's mean KV use while busy, output tokens a second."""
    started = time.monotonic()
    answers, samples = run(envoy, sim, None, clients, requests, sample_kvgate=sample_kvgate, words=words,
                           streams=streams)
    elapsed = time.monotonic() - started
    assert all(a["status"] == 200 for a in answers)
    return answers, samples, {
        "preemptions": preemptions(sim), "kv_used": round(mean_kv_used(samples), 2),
        "output_per_s": round(sum(a["usage"]["completion_tokens"] for a in answers) / elapsed)}


def against_round_robin(sim_args, clients, requests, concurrency=2, on_kvgate=None, **run_args):
    """`timed_run` through plain round robin, then through kvgate (at `concurrency` workers), each on
    fresh pods of `sim_args`; returns what each did. `on_kvgate(envoy, sim, answers, samples)`, when
    given, checks kvgate's run while its Envoy is up (its gauges sampled for it), and what it
    returns is added to the result."""
    out = {}
    for name in ("round_robin", "kvgate"):
        with Sim(pods=2, args=sim_args) as sim:
            ctx = baseline_envoy(sim.endpoints) if name == "round_robin" else \
                kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=concurrency)
            check = on_kvgate if name == "kvgate" else None
            with ctx as envoy:
                answers, samples, out[name] = timed_run(envoy, sim, clients, requests,
                                                        sample_kvgate=check is not None, **run_args)
                if check:
                    out.update(check(envoy, sim, answers, samples) or {})
    return out


def mean_kv_used(samples, pod=None):
    """The pool's mean KV use over the samples taken while it was busy (of pod `pod` alone, given
    its index), each pod's use as a share of its own blocks."""
    busy = [[p for i, p in enumerate(s) if pod in (None, i)] for s, _ in samples if any(p["running"] for p in s)]
    return sum(sum(p["kv_blocks_used"] / p["num_gpu_blocks"] for p in s) / len(s) for s in busy) / max(1, len(busy))


def delivery_lag(answers):
    """How many tokens the engine may be ahead of what Envoy has handed kvgate: what it streams
    while a stream stalls on its way through Envoy, the median stream's longest stall (as its
    client saw it) over the median time a token takes."""
    streams = [a for a in answers if a["status"] == 200 and a["chunks"] > 1]
    token = statistics.median((a["total"] - a["ttft"]) / (a["chunks"] - 1) for a in streams)
    return math.ceil(statistics.median(a["stall"] for a in streams) / token)


def check_promise(samples, bounded, delivered_lag, ports=None, blocks=None):
    """At every sample kvgate's predicted blocks fit the pod; with every answer's length bounded,
    the pod's forecast stays within its budget too (an exact bound only falls as requests end;
    without one, a request that outlives its expected length raises the forecast after the fact,
    which the headroom is there for).

    Without a bound (`ports`: the pods' ports, for their engines' samples), answers that outlive
    the headroom can take the pod's real demand past its blocks: the engine meets it by preempting,
    which the caller bounds, and kvgate's prediction rightly says so; a request the engine has just
    ended and kvgate not yet released also counts for a few milliseconds. So there a prediction
    past the pod's blocks must come with the engine itself nearly full (90 % of its blocks) at that
    sample; kvgate predicting a full pod that its engine does not see nearly full would be a
    miscount. (Held to the pod's blocks alone, this check failed one CI run in about thirty: 278
    blocks predicted on the 256-block pod.) Until the model is calibrated kvgate holds each prompt
    at `1 + estimator.promptSpread` (0.1) of its estimate, a deliberate margin over the engine's
    count, so a full pod as kvgate predicts it may be an engine at 1/1.1 of that: "nearly full" is
    90 % of that. (Against 90 % of the pod's blocks, one CI run of 2026-12-02 failed with 257
    blocks predicted while the engine held 223, its 240 requests' first wave still uncalibrated.)

    The forecast is read from the requests' entries, which trail their streams: an entry is
    written at its output's block boundaries, so up to a block (less a token) behind what kvgate
    has seen, and kvgate sees a stream only as Envoy hands it over, up to `delivered_lag` tokens
    behind the engine at a stream's worst moment, typically (`delivery_lag`). The forecast read from the entries is the true one with
    each request's trajectory shifted later by its lag, at most the lag above it for each request
    in flight. That holds at the sample and at the last admission, whose check (exact: the router
    fuzz target asserts it) also read lagged entries, so the sampled forecast is within the lag x
    (in flight now + in flight at that admission) of the budget; the pod's most in flight in the
    run stands for the latter.

    Counting the lag once, this check failed about one run in ten at --concurrency 1 by up to 126
    tokens; counting it twice but as the entries' block alone, in 1 of 32 sessions of the test on
    the build before 2026-11-27 and 3 of 51 after, by 21-60 tokens, with the engine never
    preempting. At this test's --time-scale 10 a token takes 0.64 ms, and each stream's longest
    stall on its way to the client was 3-17 ms (median 3.3-6.9 ms in a run): 5-11 tokens a
    request that the block alone left out."""
    nominal, most = {}, {}
    for _, g in samples:
        for pod, budget in g["budget_tokens"].items():
            # The engine's feedback only lowers a budget after the fact: the promise made at
            # admission is against the budget as it was, the highest seen.
            nominal[pod] = max(nominal.get(pod, 0), budget)
        for pod, n in g["in_flight"].items():
            most[pod] = max(most.get(pod, 0), n)
    assert nominal and all(nominal.values()), "the gauges were never sampled"
    for _, g in samples:
        for pod, reserved in g["reserved_tokens"].items():
            lag = (BLOCK - 1 + delivered_lag) * (g["in_flight"].get(pod, 0) + most.get(pod, 0))
            assert not bounded or reserved <= nominal[pod] + lag, (pod, reserved, nominal[pod], lag)
    index = {f"127_0_0_1_{p}": i for i, p in enumerate(ports or [])}
    size = {pod: blocks[i] for pod, i in index.items()} if blocks else {}
    for k, (_, g) in enumerate(samples):
        for pod, predicted in g["active_blocks"].items():
            held = size.get(pod, BLOCKS)
            # The gauge is written at its worker's tick (every 250 ms), so it may show the pod as
            # it was up to a tick before the engine's sample: the engine's fullest over the last
            # half second of samples is what it is held to. (Against the same sample alone, this
            # failed one CI run in about thirty: 265 blocks predicted while the engine, sampled
            # just then, held 201, at this test's ten-fold clock ~400 tokens a request a tick.)
            recent = [s[index[pod]]["kv_blocks_used"] for s, _ in samples[max(0, k - 10):k + 1]] \
                if pod in index else []
            engine = max(recent) if recent else None
            assert predicted <= held or (engine is not None and engine >= 0.9 * held / (1 + PROMPT_SPREAD)), \
                f"kvgate predicts {predicted} blocks on a {held}-block pod {pod} (its engine: {engine})"


@pytest.mark.parametrize("concurrency", [1, 2, 4])
@pytest.mark.parametrize("max_tokens,clients,requests", [(300, 48, 144), (1000, 24, 36)])
def test_with_max_tokens_the_engine_never_preempts(concurrency, max_tokens, clients, requests):
    with Sim(pods=2, args=SMALL_KV) as sim, \
            kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=concurrency) as envoy:
        answers, samples = run(envoy, sim, max_tokens, clients, requests)
        assert all(a["status"] == 200 and a["chunks"] == max_tokens for a in answers), \
            [a["status"] for a in answers if a["status"] != 200]
        used, lag = mean_kv_used(samples), delivery_lag(answers)
        print(f"max_tokens {max_tokens}, concurrency {concurrency}: preemptions {preemptions(sim)}, "
              f"peak blocks {max(sim.stats(i)['peak_kv_blocks_used'] for i in range(2))}, mean KV used {used:.2f}, "
              f"delivery lag {lag} tokens")
        assert preemptions(sim) == 0
        check_promise(samples, bounded=True, delivered_lag=lag)
        # Used, not left idle: requests of ~360 prompt tokens and exactly max_tokens answers fill
        # a pod in lockstep cohorts, so about 60 % on average (the peak is the budget); 50-52 %
        # on a machine whose streams reached kvgate up to 98 tokens behind the engine (2026-12-07),
        # each cohort's room refilled that much later.
        assert used >= 0.40, used
        assert wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values()), timeout=5)


@pytest.mark.parametrize("concurrency", [1, 2])
def test_pods_of_two_sizes_are_each_held_to_their_own_kv(concurrency):
    """A pool of two GPU sizes (one pod with three times the other's KV, as an 80 GB card beside a
    smaller one): each pod's budget is its own capacity, so the small pod is never pushed past its
    KV while the large one takes the rest, and neither is left idle. Round robin would send both
    the same share and preempt on the small one."""
    sizes = [384, 128]
    with Sim(pods=2, args=[*SMALL_KV, "--pod-blocks", ",".join(map(str, sizes))]) as sim, \
            kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=concurrency) as envoy:
        answers, samples = run(envoy, sim, 300, 32, 96)
        assert all(a["status"] == 200 and a["chunks"] == 300 for a in answers), \
            [a["status"] for a in answers if a["status"] != 200]
        used = [mean_kv_used(samples, pod) for pod in range(2)]
        peaks = [sim.stats(i)["peak_kv_blocks_used"] for i in range(2)]
        served = [sim.stats(i)["finished"] for i in range(2)]
        lag = delivery_lag(answers)
        print(f"concurrency {concurrency}: preemptions {preemptions(sim)}, peak blocks {peaks} of {sizes}, "
              f"mean KV used {[round(u, 2) for u in used]}, served {served}, delivery lag {lag} tokens")
        assert preemptions(sim) == 0
        check_promise(samples, bounded=True, delivered_lag=lag, ports=sim.ports, blocks=sizes)
        # The budgets follow the pods' sizes: the large pod serves more, both run well filled.
        assert served[0] > 1.5 * served[1], served
        assert min(used) >= 0.35, used
        assert wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values()), timeout=5)


@pytest.mark.parametrize("concurrency", [1, 2, 4])
def test_a_gateway_started_under_load_admits_from_its_first_request(concurrency):
    """A restart behind a load balancer: 48 clients send the moment Envoy's listener opens, before
    kvgate has discovered or scraped a pod. Every request still goes through admission (none is
    sent on unrouted, outside every budget) and, all with max_tokens, the engine never preempts.
    Before (2026-11-27): the pod set was unknown for the first ~1.5 s, all 48 went to Envoy's round
    robin unadmitted, 10-11 ran on each pod where 6 fit, and the pods preempted 16-18 times."""
    with Sim(pods=2, args=SMALL_KV) as sim:
        cfg = envoy_config(free_port(), free_port(), sim.endpoints, default_plugin_config())
        with Envoy(cfg, concurrency=concurrency) as envoy:
            with ThreadPoolExecutor(48) as pool:
                answers = list(pool.map(
                    lambda i: stream(envoy.port, "/v1/chat/completions", unshared_chat(i, 200)), range(48)))
            assert all(a["status"] == 200 and a["chunks"] == 200 for a in answers), \
                [a["status"] for a in answers if a["status"] != 200]
            stats = envoy.stats("wasmcustom.kvgate.route")
            first = min(a["ttft"] for a in answers)
            print(f"concurrency {concurrency}: {stats}, preemptions {preemptions(sim)}, first token {first:.3f} s")
            assert stats.get("wasmcustom.kvgate.routed") == 48, stats
            assert stats.get("wasmcustom.kvgate.route.unrouted", 0) == 0, stats
            assert preemptions(sim) == 0
            assert wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values()), timeout=5)


def test_a_gateway_started_in_front_of_running_engines_expects_their_answers_length():
    """A gateway (re)started, or a replica added, in front of engines that have been answering the
    model: before kvgate has learned a length from answers of its own, a request without
    max_tokens is expected to run as long as the engines' finished answers did (vLLM's
    `request_generation_tokens`, scraped), not the configured prior's 256, which sized a first
    wave of answers of mean 512 for half of what it would hold (BENCHMARKS.md, *The first
    answers' lengths*). Fewer probes than `minSamples`: nothing of kvgate's own is learned."""
    with Sim(pods=2, args=["--time-scale", "20", "--output-len-mean", "600"]) as sim:
        cfg = envoy_config(free_port(), free_port(), sim.endpoints, default_plugin_config())
        with Envoy(cfg, concurrency=2) as envoy:
            probes = []

            def expected():
                r = request(envoy.port, "POST", "/v1/chat/completions", unshared_chat(len(probes), None, 20))
                assert r.status == 200, r.body[:200]
                probes.append(int(r.headers["x-kvgate-output-tokens"]))
                return probes[-1]

            assert 200 <= expected() <= 300, probes
            with ThreadPoolExecutor(20) as pool:
                direct = list(pool.map(
                    lambda i: request(sim.ports[i % 2], "POST", "/v1/chat/completions",
                                      unshared_chat(1000 + i, None, 20)), range(40)))
            assert all(r.status == 200 for r in direct)
            engines = statistics.mean(r.json()["usage"]["completion_tokens"] for r in direct)
            assert wait_for(lambda: expected() >= 0.8 * engines, timeout=8, interval=1.0), (engines, probes)
            assert probes[-1] <= 1.25 * engines, (engines, probes)
            print(f"engines' mean {engines:.0f}; kvgate's expected output, probe by probe: {probes}")


def test_without_max_tokens_preemptions_are_a_sliver_of_round_robins():
    """Long-tailed answers (the simulator's lognormal, mean 256): no bound is known, so the forecast
    keeps headroom from the learned distribution; round robin on the same pool preempts freely.
    The other half of the promise, in issue 13's own regime (two 4,096-token pods, 48 clients, no
    max_tokens): the pool's KV is used and its work stays near round robin's. Measured 2026-11-26:
    in this test's 240 requests kvgate did 1.02-1.05x round robin's output tokens per second (round
    robin's preemptions weigh most in so short a run); over 960 requests, 0.86x, KV 72-73 % used
    against 87-88 % (BENCHMARKS.md); at the issue's filing, 0.50x and 42 %."""
    def held(envoy, sim, answers, samples):
        check_promise(samples, bounded=False, delivered_lag=delivery_lag(answers), ports=sim.ports)
        assert wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values()), timeout=5)
        return {"relief_percent": max(max(g["relief_percent"].values(), default=0) for _, g in samples)}

    out = against_round_robin(SMALL_KV, 48, 240, concurrency=4, on_kvgate=held)
    print("without max_tokens:", out)
    # Round robin preempts freely here: 117-151 times where its clients fill the pods (KV 0.87),
    # 22-43 on a machine whose 48 Python clients kept them half full (KV 0.42-0.45, three runs on
    # 2026-12-07). Any of these is far above the sliver kvgate is held to below; ten only checks
    # that the run preempts at all.
    assert out["round_robin"]["preemptions"] >= 10
    # A preemption or two is this run's noise (240 requests; round robin's 117-137): kvgate made
    # 0-2 in each of 20 runs on one machine (2026-12-04), and 3 once in CI against round robin's
    # 126, past 2 % of it. Three or 2 %, whichever is more, still fails a forecast that preempts
    # like round robin.
    assert out["kvgate"]["preemptions"] <= max(3, 0.02 * out["round_robin"]["preemptions"]), out
    # Bounds below what is measured (KV 0.69-0.73, 1.02-1.05x), so that a loaded CI machine does not
    # fail them, and far above the 42 % and 0.50x that the issue started from. A machine too slow
    # to fill the pods at all (round robin's own KV 0.47 in one CI run) is held to round robin's.
    assert out["kvgate"]["kv_used"] >= min(0.6, 0.8 * out["round_robin"]["kv_used"]), out
    assert out["kvgate"]["output_per_s"] >= 0.7 * out["round_robin"]["output_per_s"], out


def test_a_fresh_pools_first_wave_is_held_to_what_a_wrong_guess_would_take():
    """A fresh pool (nothing learned, engines that have answered nothing) and 96 clients at once,
    without max_tokens, whose answers run 1,600 tokens on average: the first wave is admitted on
    the output prior's guess, 256, before any answer has ended. Taken as known
    (`estimator.outputPriorSpread` 0), the wave is sized for answers a sixth as long and the
    engines preempt; with the guess's error counted once over the requests admitted on it (0.5,
    the default) and kept while the lengths learned pass the guess, they preempt far less.
    One wave's count swings with the lengths drawn, so three pairs, interleaved, each arm on fresh
    pods, and the sums compared. Measured 2026-12-04 (twelve pairs): 63-163 preemptions against
    36-71, and in each of four triples 224-409 against 154-195. (At 800 tokens the two arms were
    4-52 against 1-20 a pair, too close for one pair, or three, to tell apart every time; at 500
    neither preempted.)"""
    out = {0.0: [], 0.5: []}
    for _ in range(3):
        for spread in out:
            cfg = default_plugin_config()
            cfg["estimator"] = dict(cfg.get("estimator", {}), outputPriorSpread=spread)
            with Sim(pods=2, args=["--time-scale", "10", "--num-gpu-blocks", "512", "--output-len-mean", "1600"]) as sim, \
                    kvgate_envoy(sim.endpoints, cfg, concurrency=2) as envoy:
                with ThreadPoolExecutor(96) as pool:
                    answers = list(pool.map(
                        lambda i: stream(envoy.port, "/v1/chat/completions", unshared_chat(i, None, 60)), range(96)))
                assert all(a["status"] == 200 for a in answers), [a["status"] for a in answers if a["status"] != 200]
                out[spread].append(preemptions(sim))
    print("first waves of long answers, preemptions by the guess's spread:", out)
    assert sum(out[0.0]) >= 60, out
    assert sum(out[0.5]) < sum(out[0.0]), out


def test_short_answers_fill_the_pod():
    """Prompts of about 100 tokens and answers of 32 on average (no max_tokens) on pods of the same
    size, at the simulator's own pace: each request is its prompt and little more, so a pod runs a
    couple of dozen at once, and its forecast's headroom for their lengths is small. Their chance
    of running thousands of tokens more is nil; a forecast that rounded it up to 1 in 255 held a
    variance of thousands of tokens for that tail and kept such pods half full (BENCHMARKS.md,
    *Short answers*)."""
    out = against_round_robin(["--num-gpu-blocks", str(BLOCKS), "--output-len-mean", "32"], 64, 640, words=80)
    print("short answers:", out)
    assert out["kvgate"]["preemptions"] <= max(2, 0.02 * out["round_robin"]["preemptions"]), out
    # Measured 2026-11-30 (prompts of about 100 tokens): with the chance rounded up, KV 0.39 and
    # 0.62x round robin's output; rounded to the nearest, 0.64 and 0.89x (round robin 0.77-0.78,
    # 40-42 preemptions). Bounds between the two, with room for a loaded CI machine.
    assert out["kvgate"]["kv_used"] >= 0.65 * out["round_robin"]["kv_used"], out
    assert out["kvgate"]["output_per_s"] >= 0.75 * out["round_robin"]["output_per_s"], out


def test_answers_that_do_not_stream_are_held_too():
    """Answers that do not stream (a batch client's; most SDKs' default) give kvgate no token before
    they end: such a request's entry grows at its pod's pace instead (the test below), and what the
    engine holds beyond kvgate's entries comes off the budget at each scrape (`feedback`), so the
    pool still stays within its KV, and is used. Issue 13's small pool at the simulator's own
    pace, no max_tokens."""
    out = against_round_robin(["--num-gpu-blocks", str(BLOCKS)], 48, 192, streams=False)
    print("answers that do not stream:", out)
    # Measured 2026-11-30: with entries that held their prompts until the answer came, kvgate 2
    # preemptions against round robin's 126, 0.86x its output; grown at the pod's pace, 0 against
    # 120, 0.91x. What the pace misses is corrected a scrape late.
    assert out["round_robin"]["preemptions"] >= 50, out
    assert out["kvgate"]["preemptions"] <= 0.05 * out["round_robin"]["preemptions"], out
    assert out["kvgate"]["output_per_s"] >= 0.65 * out["round_robin"]["output_per_s"], out


def held(envoy):
    """The tokens kvgate's entries hold on the gateway's one pod, from its status page."""
    return request(envoy.port, "GET", STATUS_PATH).json()["pods"][0]["heldTokens"]


def held_while(envoy, sim, send, body):
    """Sends `body` with `send` (`stream` or `answer`) through the gateway to its one pod, sampling
    every 0.1 s while it runs (the tokens kvgate's entries hold there, the engine's KV in tokens,
    and the pod's stream lag as the status page shows it); returns the answer, the (held, KV)
    samples and the lags."""
    out, samples, lags = {}, [], []
    worker = threading.Thread(target=lambda: out.update(send(envoy.port, "/v1/chat/completions", body)))
    worker.start()
    while worker.is_alive():
        pod = request(envoy.port, "GET", STATUS_PATH).json()["pods"][0]
        samples.append((pod["heldTokens"], sim.stats(0)["kv_blocks_used"] * BLOCK))
        lags.append(pod["streamLagTokens"])
        time.sleep(0.1)
    worker.join()
    return out, samples, lags


def assert_follows(samples):
    """Mid-answer (the middle third of the samples) kvgate's count follows the engine's KV: within
    a quarter of it and three blocks (an entry moves a block at a time, on a tick for an answer
    that does not stream)."""
    middle = samples[len(samples) // 3: 2 * len(samples) // 3]
    assert middle and all(abs(h - e) <= 0.25 * e + 3 * BLOCK for h, e in middle), middle


def test_an_answer_that_does_not_stream_is_counted_as_the_engine_makes_it():
    """While an answer that does not stream runs, its entry grows on the tick at the pod's pace
    (`Router::grow_unseen`): what kvgate says the pod's requests hold follows the engine's KV, not
    the prompt alone until the answer comes. One pod at the simulator's own pace (a GPU's: about 35
    tokens a sequence between two ticks), its pace learned from a few streams first."""
    cfg = dict(default_plugin_config(), statusPath=STATUS_PATH)
    with Sim(pods=1, args=["--num-gpu-blocks", "1024"]) as sim, \
            kvgate_envoy(sim.endpoints, cfg, concurrency=1) as envoy:
        for i in range(3):
            # The pace needs 256 tokens made between two scrapes (`pods::pace::MIN_TOKENS`), and a
            # scrape after them: until then an answer's entry stays at its prompt.
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda j: stream(envoy.port, "/v1/chat/completions", unshared_chat(j, 200, 50)),
                              range(8)))
            time.sleep(1.2)
            out, samples, lags = held_while(envoy, sim, answer, unshared_chat(1000 + i, 800, 50))
            if max(h for h, _ in samples) - min(h for h, _ in samples if h) >= 8 * BLOCK:
                break
        print(f"non-streamed answer, try {i + 1}, (kvgate held, engine KV) tokens:", samples)
        assert out.get("status") == 200 and out["usage"]["completion_tokens"] == 800, out
        assert_follows(samples)
        assert set(lags) == {None}, f"an answer that does not stream shows no lag: {lags}"
        assert wait_for(lambda: held(envoy) == 0, timeout=5)


@pytest.mark.parametrize("engine, chunks", [(["--stream-interval", "4"], 25), (["--reasoning-share", "0.75"], 100)],
                         ids=["four-tokens-a-chunk", "reasoning"])
def test_a_stream_is_counted_in_tokens_however_the_engine_writes_them(engine, chunks):
    """An engine that streams several tokens a chunk (SGLang's `--stream-interval`, speculative
    decoding's accepted tokens): the tokens a piece carries are learned from the streams' usage
    (`calibration`), and each piece counts that many in its entry, which follows the engine's KV.
    Counted a token a piece, the entry held a quarter of the answer. A reasoning model behind vLLM's
    reasoning parser streams most of its answer as `delta.reasoning` (vLLM PR 27752's name): counted
    as pieces like its text. Before, the entry held the prompt alone through the reasoning, and each
    piece of the answer after it counted the four tokens a piece learned from usage. The pod's
    stream lag (`forecast::Lag`) is at least what a chunk brings: four tokens, and one."""
    cfg = dict(default_plugin_config(), statusPath=STATUS_PATH)
    with Sim(pods=1, args=["--num-gpu-blocks", "1024", *engine]) as sim, \
            kvgate_envoy(sim.endpoints, cfg, concurrency=1) as envoy:
        # The model's first `estimator.minSamples` (20) answers teach it, read a second later.
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda j: stream(envoy.port, "/v1/chat/completions", unshared_chat(j, 100, 50)),
                                    range(24)))
        assert all(a["status"] == 200 and a["chunks"] == chunks for a in answers), answers[0]
        time.sleep(1.5)
        out, samples, lags = held_while(envoy, sim, stream, unshared_chat(1000, 800, 50))
        print(f"{' '.join(engine)}: (kvgate held, engine KV) tokens:", samples, "lags:", lags)
        assert out.get("status") == 200 and out["usage"]["completion_tokens"] == 800, out
        assert_follows(samples)
        seen = [lag for lag in lags if lag is not None]
        assert seen and min(seen) >= 100 // chunks, lags
        assert wait_for(lambda: held(envoy) == 0, timeout=5)


def test_answers_held_on_by_ignore_eos_are_forecast_to_their_limit():
    """Benchmark clients (`vllm bench serve`, genai-perf) send `ignore_eos`: the engine runs each
    answer to its `max_tokens`, whatever the model would say. The model's own answers, learned
    first, are short (the simulator's, mean 64); forecast by them, a burst of answers held to 600
    tokens each was admitted several times over what the pod holds, and it preempted. Read as
    running to their limit, they fit, and teach no length: the model's short answers stay learned."""
    cfg = dict(default_plugin_config(), statusPath=STATUS_PATH)
    sim_args = ["--num-gpu-blocks", "1024", "--output-len-mean", "64", "--eos-before-max-tokens"]
    with Sim(pods=1, args=sim_args) as sim, kvgate_envoy(sim.endpoints, cfg, concurrency=2) as envoy:
        with ThreadPoolExecutor(8) as pool:
            learned = list(pool.map(lambda j: stream(envoy.port, "/v1/chat/completions", unshared_chat(j, 600, 50)),
                                    range(40)))
        assert all(a["status"] == 200 for a in learned), learned[0]
        time.sleep(1.5)
        bodies = [dict(unshared_chat(100 + j, 600, 50), ignore_eos=True) for j in range(48)]
        with ThreadPoolExecutor(len(bodies)) as pool:
            held_on = list(pool.map(lambda b: stream(envoy.port, "/v1/chat/completions", b), bodies))
        lengths = [a["usage"]["completion_tokens"] for a in held_on if a["status"] == 200]
        print(f"ignore_eos: {len(lengths)} answered, preemptions {preemptions(sim)}, "
              f"learned answers' mean {statistics.mean(a['usage']['completion_tokens'] for a in learned):.0f}")
        assert lengths == [600] * len(bodies)
        assert preemptions(sim) == 0
        # The model's lengths were not taught by them: a plain request is still expected short.
        plain = request(envoy.port, "POST", "/v1/chat/completions", unshared_chat(999, None, 50))
        assert plain.status == 200 and int(plain.headers["x-kvgate-output-tokens"]) < 200, plain.headers


@pytest.mark.parametrize("concurrency", [2, 4])
def test_a_burst_of_shared_prefixes_is_counted_in_full_however_the_workers_interleave(concurrency):
    """The `burst` benchmark's shape, smaller: requests of a few groups, each group sharing a
    3,000-token system prompt, all sent at once through several Envoy workers to pods that hold
    about half of them. A group's prefix is held once on a pod, and one in-flight request counts
    it in the pod's record while the others lean on it; when that request ends first, one leaning
    on it takes it on, whichever worker ends it. Sampled while the pods are full, the KV the engine
    holds never runs past what kvgate's records hold (and the forecast's block of slack a request)
    by half a prefix. Before the records said who counts a prefix, a worker could lean a new
    request on one another worker had just finished (its finish not yet in the pick log), and
    nobody counted the prefix the engine held: here the pods ran 1.6–5.6k tokens past the records
    (4 of 4 runs failed) and preempted now and then; in the burst benchmark 3–7k. (Preemptions are printed, not
    asserted: once in 44 runs with the fix the pods preempted while the accounting held,
    docs/limitations.md.)"""
    cfg = default_plugin_config()
    cfg["statusPath"] = STATUS_PATH
    groups, per_group, max_tokens, system_words = 8, 50, 64, 3000
    gaps, stop = {}, threading.Event()
    with Sim(pods=4, args=["--num-gpu-blocks", "1024"]) as sim, \
            kvgate_envoy(sim.endpoints, cfg, concurrency=concurrency) as envoy:
        port_of = {f"127.0.0.1:{p}": i for i, p in enumerate(sim.ports)}

        def sampler():
            # The engine read just before and just after kvgate's records: what it held
            # throughout (the smaller of the two) was dispatched before the records were read and
            # ended after, so the records must count it.
            while not stop.is_set():
                before = [sim.stats(i) for i in range(sim.pods)]
                status = request(envoy.port, "GET", STATUS_PATH).json()
                after = [sim.stats(i) for i in range(sim.pods)]
                for pod in status["pods"]:
                    i = port_of[pod["pod"]]
                    if min(before[i]["running"], after[i]["running"]) >= 8:
                        engine = BLOCK * min(before[i]["kv_blocks_used"], after[i]["kv_blocks_used"])
                        slack = BLOCK * pod["inFlight"]
                        gaps.setdefault(pod["pod"], []).append(engine - pod["heldTokens"] - slack)
                time.sleep(0.02)

        thread = threading.Thread(target=sampler)
        thread.start()
        try:
            bodies = [grouped_chat(g, g * per_group + q, max_tokens, system_words=system_words, question_words=100)
                      for q in range(per_group) for g in range(groups)]
            with ThreadPoolExecutor(len(bodies)) as pool:
                answers = list(pool.map(lambda b: stream(envoy.port, "/v1/chat/completions", b), bodies))
        finally:
            stop.set()
            thread.join()
        assert all(a["status"] == 200 and a["chunks"] == max_tokens for a in answers), \
            [a["status"] for a in answers if a["status"] != 200]
        # A tenth of the samples may catch a request between the engine's two reads and the
        # record's: the 90th percentile of every pod's samples together (a slow machine samples
        # each pod full only 5–10 times, 27–44 samples in all in some runs, where a pod's own
        # 90th percentile is its highest sample; a slower one 18, 2026-12-07: 12 or more still
        # leave the 90th percentile below the highest sample).
        every = sorted(x for g in gaps.values() for x in g)
        p90 = every[int(0.9 * len(every))] if every else None
        print(f"concurrency {concurrency}: preemptions {preemptions(sim)}, samples {len(every)}, "
              f"engine beyond kvgate's records (p90, tokens) {p90}, each pod's highest "
              f"{ {pod: max(g) for pod, g in gaps.items()} }")
        assert len(every) >= 12 and len(gaps) == sim.pods, gaps
        assert p90 < system_words // 2, gaps
        assert wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values()), timeout=5)


def prompt_errors(envoy, sent, learn, pause):
    """Sends each (kind, path, body) in turn, a short answer each, and returns per kind the
    relative error of kvgate's prompt estimate against the engine's `usage`, past the first
    `learn` requests (what calibration learns from)."""
    errors = {}
    for i, (kind, path, body) in enumerate(sent):
        r = request(envoy.port, "POST", path, dict(body, model=MODEL, max_tokens=4))
        assert r.status == 200, r.body
        truth = r.json()["usage"]["prompt_tokens"]
        if i >= learn:
            errors.setdefault(kind, []).append(abs(int(r.headers["x-kvgate-prompt-tokens"]) - truth) / truth)
        time.sleep(pause)
    return errors


def test_a_vision_models_images_and_text_are_each_estimated_by_what_they_take():
    """An image takes what the model's processor makes of it (the simulator's here: 1,200
    tokens), not the configured `nonTextPartTokens` (512). Calibration learns a model's part cost
    from the usage of requests with parts, and its text scale from text-only requests alone:
    taught by both, the scale took an image's 700 tokens past the configured cost for the few
    words of text asked about it (clamped at ten times), and text-only prompts were estimated at
    over four times their size, a pod's budget spent on KV they never took."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    system = "You are a careful assistant who answers questions about databases. " * 6
    with Sim(pods=1, args=["--time-scale", "50", "--media-part-tokens", "1200"]) as sim, \
            kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=1) as envoy:
        sent = []
        for i in range(80):
            if i % 2:
                kind, messages = "image", [{"role": "user", "content": [
                    {"type": "text", "text": f"What is in picture {i}?"}, image]}]
            else:
                kind, messages = "text", [{"role": "system", "content": system},
                                          {"role": "user", "content": f"Question {i}: how large a connection pool?"}]
            sent.append((kind, "/v1/chat/completions", {"messages": messages}))
        errors = prompt_errors(envoy, sent, learn=60, pause=0.03)
        print({k: f"max {max(v):.1%}" for k, v in errors.items()})
        assert max(errors["text"]) < 0.05 and max(errors["image"]) < 0.05, errors


def test_chat_and_completions_prompts_are_each_estimated_with_their_own_template():
    """The engine wraps a chat prompt in its chat template, whose fixed part every prompt pays
    (the simulator's ChatML turn and generation prompt), and takes a completions prompt as it
    is. One model served both ways: calibration fits each kind on its own. Fitted as one line
    to the mix, a short completions prompt was over-counted by part of the template and a short
    chat prompt under-counted by the rest."""
    words = "the database keeps a pool of connections open for each worker thread".split()
    with Sim(pods=1, args=["--time-scale", "50"]) as sim, \
            kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=1) as envoy:
        sent = []
        for i in range(160):
            # 4 to 400 words, each size for both kinds in turn.
            n = int(4 * 100 ** ((i // 2) % 9 / 8))
            text = f"Question {i}: " + " ".join(words[(i + j) % len(words)] for j in range(n))
            if i % 2:
                sent.append(("completions", "/v1/completions", {"prompt": text}))
            else:
                sent.append(("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}))
        errors = prompt_errors(envoy, sent, learn=100, pause=0.02)
        print({k: f"median {statistics.median(v):.1%}, max {max(v):.1%}" for k, v in errors.items()})
        assert all(statistics.median(v) < 0.05 and max(v) < 0.15 for v in errors.values()), errors


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_each_applications_answers_are_expected_at_their_own_length(api):
    """One model behind two applications, each its system prompt: a classifier answering in about
    8 tokens and a writer in about 400 (the simulator told each length, as the benchmark's
    `apps` cells do). Their system prompts open with the same house rules, longer than a prefix
    block, then each application's own instructions, and end with the user's profile, as one
    organisation's applications do: no two requests' system prompts are alike. The model's
    lengths are their mixture; once each application has answered sixteen times, a request of
    each is expected near its own answers' length (`estimator.templateLengths`,
    `estimate::templates`: a template is the system prompt, or where system prompts end apart
    the longest head of it an application's requests share, not their first block nor the house
    rules), and with it off at the mixture's. On four Envoy workers: each streamed about four of
    each application's answers, fewer than the eight a template needs, so this holds only as the
    workers learn together (the model's shared record).

    `completions`: the same conversations sent to /v1/completions, rendered through Llama 3's
    chat template by the client, as applications that template their prompts themselves do.
    The prompt has no turns to tell the application's part from the user's, and its first block
    is the template's markers, alike in every application's: it goes by heads of its text. One
    without `max_tokens` is expected at the API's default of 16 tokens, where the engine stops it."""
    house = " ".join(WORDS[(j * 11) % len(WORDS)] for j in range(40))

    def app(name, i):
        system = f"{house}. " + f"You are the {name}. " * 16 + f"The user: customer {i}, plan {i % 3}."
        user = f"question {i}: " + " ".join(WORDS[(i + j * 7) % len(WORDS)] for j in range(30))
        if api == "completions":
            turn = "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>"
            # With a limit, as such clients set one: without, the engine stops at 16 tokens.
            return {"model": MODEL, "max_tokens": 600,
                    "prompt": "<|begin_of_text|>" + turn.format("system", system)
                    + turn.format("user", user) + "<|start_header_id|>assistant<|end_header_id|>\n\n"}
        return {"model": MODEL, "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": user}]}

    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"

    def run(on):
        cfg = default_plugin_config()
        cfg["estimator"] = dict(cfg.get("estimator", {}), templateLengths=on)
        with Sim(pods=1, args=["--time-scale", "10"]) as sim, \
                kvgate_envoy(sim.endpoints, cfg, concurrency=4) as envoy:
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(
                    lambda i: stream(envoy.port, path, app("classifier" if i % 2 else "writer", i),
                                     headers={"x-sim-output-tokens": str(6 + i % 5 if i % 2 else 380 + i % 41)}),
                    range(32)))
            assert all(a["status"] == 200 for a in answers), answers[0]
            # Each worker's answers reach the model's record at its next tick (250 ms), and a
            # worker reads the record again a second after its last read: a margin over both.
            time.sleep(2.5)
            expected = {name: int(request(envoy.port, "POST", path, app(name, 999))
                                  .headers["x-kvgate-output-tokens"]) for name in ("classifier", "writer")}
            if api == "completions":
                # Without `max_tokens` the engine stops at 16, the API's default, whatever the
                # writer's answers run to.
                unbounded = {k: v for k, v in app("writer", 998).items() if k != "max_tokens"}
                expected["default"] = int(request(envoy.port, "POST", path, unbounded)
                                          .headers["x-kvgate-output-tokens"])
            print(f"{api}, templateLengths {on}: expected {expected}")
            return expected

    on, off = run(True), run(False)
    assert on["classifier"] <= 30 and 300 <= on["writer"] <= 550, on
    assert on.get("default", 0) <= 16 and off.get("default", 0) <= 16, (on, off)
    # Off: each at the model's mixture, far from its own application's length. (The two
    # requests may go to two workers, whose reads of the record and answers in flight differ:
    # 186 and 223 in one run, so not equal.)
    assert off["classifier"] > 100 and off["writer"] < 300, off


def streamed_with_gauges(envoy, path, bodies, clients=24):
    """Streams `bodies` to `path` from `clients` closed-loop clients while sampling kvgate's gauges
    every 50 ms; returns the answers and the samples (in `check_promise`'s form)."""
    samples, stop = [], threading.Event()

    def sampler():
        while not stop.is_set():
            samples.append((None, {k: kvgate_gauges(envoy, k)
                                   for k in ("reserved_tokens", "budget_tokens", "active_blocks", "in_flight")}))
            time.sleep(0.05)

    thread = threading.Thread(target=sampler)
    thread.start()
    try:
        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(lambda b: stream(envoy.port, path, b), bodies))
    finally:
        stop.set()
        thread.join()
    return answers, samples


def test_several_answers_on_one_prompt_are_forecast_and_learned_as_answers():
    """A request for `n` answers (parallel sampling) runs as `n` sequences on its prompt, each
    growing a token a step, and reports their tokens together. Learned from their usage, the
    model's answers were taken to be `n` times as long; forecast as one answer growing a token a
    step, a mix of four-answer and one-answer requests with `max_tokens` was admitted past the
    pod, which preempted."""
    cfg = dict(default_plugin_config(), statusPath=STATUS_PATH)
    with Sim(pods=1, args=SMALL_KV + ["--output-len-mean", "64"]) as sim, \
            kvgate_envoy(sim.endpoints, cfg, concurrency=2) as envoy:
        # Learned from plain answers first, then from answers in eights.
        with ThreadPoolExecutor(4) as pool:
            plain = list(pool.map(lambda j: stream(envoy.port, "/v1/chat/completions", unshared_chat(j, None, 50)),
                                  range(40)))
            eights = list(pool.map(
                lambda j: stream(envoy.port, "/v1/chat/completions", dict(unshared_chat(100 + j, None, 50), n=8)),
                range(40)))
        assert all(a["status"] == 200 for a in plain + eights), (plain + eights)[0]
        one = statistics.mean(a["usage"]["completion_tokens"] for a in plain)
        eight = statistics.mean(a["usage"]["completion_tokens"] for a in eights)
        assert eight > 5 * one, (one, eight)
        time.sleep(1.5)
        expected = lambda body: int(request(envoy.port, "POST", "/v1/chat/completions", body)
                                    .headers["x-kvgate-output-tokens"])
        alone, as_eight = expected(unshared_chat(999, None, 50)), expected(dict(unshared_chat(998, None, 50), n=8))
        print(f"answers: one {one:.0f} tokens, eight {eight:.0f}; expected {alone} and {as_eight}")
        assert alone < 2.5 * one, "one answer is expected as one answer's length"
        assert 5 * alone <= as_eight <= 12 * alone, "eight answers as eight"
    # Four answers of 100 beside one answer of 100, on prompts of about 330 tokens, more than the
    # pod holds at once: at their 100th step the first hold 730 tokens each, the second 430.
    with Sim(pods=1, args=SMALL_KV) as sim, kvgate_envoy(sim.endpoints, cfg, concurrency=2) as envoy:
        bodies = [dict(unshared_chat(2000 + j, 100), n=4 if j % 2 else 1) for j in range(72)]
        mixed, samples = streamed_with_gauges(envoy, "/v1/chat/completions", bodies)
        assert all(a["status"] == 200 for a in mixed), [a for a in mixed if a["status"] != 200][:1]
        assert [a["usage"]["completion_tokens"] for a in mixed] == [400 if j % 2 else 100 for j in range(72)]
        print(f"mixed: preemptions {preemptions(sim)}, peak {sim.stats(0)['peak_kv_blocks_used']} blocks, "
              f"most in flight {max(sum(g['in_flight'].values()) for _, g in samples)}")
        assert preemptions(sim) == 0
        check_promise(samples, bounded=True, delivered_lag=delivery_lag(mixed))


def test_a_batch_of_prompts_is_forecast_as_every_answer():
    """A completions `prompt` that is a list of prompts is a batch: the engine answers each one as
    a request of its own and sums their usage. Reserved as one prompt's answers, batches of four
    with `max_tokens` beside single prompts were admitted past the pod, which preempted."""
    cfg = dict(default_plugin_config(), statusPath=STATUS_PATH)
    prompt = lambda j, k, words: unshared_chat(4 * j + k, None, words)["messages"][0]["content"]
    # Batches of four prompts of about 80 tokens and single prompts of about 330, answers of 100
    # each, more than the pod holds at once: at their 100th step a batch holds 720 tokens, a single
    # prompt 430 (as `n` = 4 answers do in the test above).
    bodies = [{"model": MODEL, "max_tokens": 100,
               "prompt": [prompt(j, k, 80) for k in range(4)] if j % 2 else prompt(j, 0, 330)}
              for j in range(72)]
    with Sim(pods=1, args=SMALL_KV) as sim, kvgate_envoy(sim.endpoints, cfg, concurrency=2) as envoy:
        answers, samples = streamed_with_gauges(envoy, "/v1/completions", bodies)
        assert all(a["status"] == 200 for a in answers), [a for a in answers if a["status"] != 200][:1]
        assert [a["usage"]["completion_tokens"] for a in answers] == [400 if j % 2 else 100 for j in range(72)]
        print(f"batches: preemptions {preemptions(sim)}, peak {sim.stats(0)['peak_kv_blocks_used']} blocks, "
              f"most in flight {max(sum(g['in_flight'].values()) for _, g in samples)}")
        assert preemptions(sim) == 0
        check_promise(samples, bounded=True, delivered_lag=delivery_lag(answers))
        assert wait_for(lambda: sum(kvgate_gauges(envoy, "reserved_tokens").values()) == 0, timeout=10)


def eds_envoy_config(plugin, eds_path):
    """envoy/envoy.yaml with its model cluster fed by EDS from a file, as a control plane (Istio's,
    Kubernetes' endpoints) feeds it: the pool changes under a running Envoy when the file is
    replaced."""
    cfg = envoy_config(free_port(), free_port(), [], plugin)
    cfg["node"] = {"id": "kvgate-test", "cluster": "kvgate-test"}  # EDS asks for a node
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "models")
    del cluster["load_assignment"]
    cluster["type"] = "EDS"
    cluster["eds_cluster_config"] = {"eds_config": {"path_config_source": {"path": str(eds_path)},
                                                    "resource_api_version": "V3"}}
    return cfg


def write_endpoints(eds_path, endpoints, version):
    """Replaces the EDS file at once (written beside it, then moved over it: Envoy reloads on the
    move)."""
    assignment = {"@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                  "cluster_name": "models",
                  "endpoints": [{"lb_endpoints": [
                      {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
                      for h, p in endpoints]}]}
    tmp = eds_path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version_info": str(version), "resources": [assignment]}))
    os.replace(tmp, eds_path)


def test_pods_that_join_leave_and_come_back_under_load_keep_the_budget(tmp_path):
    """The pool changes as an autoscaler and a rollout change it, through EDS under a running Envoy,
    while more clients than the pods hold keep the line full (every request with max_tokens): a
    third pod joins, then one of the first leaves the cluster with answers still streaming on it
    (the engine still serving, as a terminating pod does), then it comes back at the same address.
    The pod that joins takes requests within about two seconds (while requests wait, discovery
    runs every second); the streams on the one that leaves end whole, and it gets no request
    while it is out.

    A pod gone from Envoy's cluster is still picked until kvgate knows, and Envoy sends each such
    pick to its fallback, past that pod's budget. Before: up to a discovery interval of such picks
    (as shipped, 5 s: 13-16 picks rerouted, 9-10 preemptions); the engine's first rerouted answer
    now marks the pod down in every VM's view and asks for discovery at once, so only the picks
    made before that answer go elsewhere: at most as many as the pod was running. Outside that
    moment no engine preempts and no forecast passes its budget; everything returns to zero."""
    plugin, max_tokens = default_plugin_config(), 600
    assert "intervalMs" not in plugin["discovery"]  # as shipped: 5 s (docs/configuration.md)
    eds = tmp_path / "eds.json"
    with Sim(pods=3, args=SMALL_KV) as sim:
        a, b, c = sim.endpoints
        names = {f"{h}:{p}": i for i, (h, p) in enumerate(sim.endpoints)}
        gauge_a = f"{a[0].replace('.', '_')}_{a[1]}"
        write_endpoints(eds, [a, b], 1)
        with Envoy(eds_envoy_config(plugin, eds), concurrency=4) as envoy:
            assert wait_for(lambda: len(kvgate_gauges(envoy, "healthy")) >= 2, timeout=10)
            samples, stamps, answers, stop = [], [], [], threading.Event()
            t0 = time.monotonic()

            def sampler():
                while not stop.is_set():
                    pods = [sim.stats(i) for i in range(sim.pods)]
                    gauges = {k: kvgate_gauges(envoy, k)
                              for k in ("reserved_tokens", "budget_tokens", "active_blocks", "in_flight")}
                    gauges["rerouted"] = kvgate_stat(envoy, "route.rerouted")
                    samples.append((pods, gauges))
                    stamps.append(time.monotonic() - t0)
                    time.sleep(0.05)

            def client(k):
                i = 0
                while not stop.is_set():
                    sent = time.monotonic() - t0
                    r = stream(envoy.port, "/v1/chat/completions", unshared_chat(k * 1000 + i, max_tokens))
                    # A request waits in the line from when it is sent: its first token says
                    # when it was admitted.
                    r["started"] = sent + (r["ttft"] or 0)
                    answers.append(r)
                    i += 1

            threads = [threading.Thread(target=sampler)] + [threading.Thread(target=client, args=(k,))
                                                             for k in range(36)]
            for t in threads:
                t.start()
            try:
                time.sleep(3)
                joined = time.monotonic() - t0
                write_endpoints(eds, [a, b, c], 2)
                time.sleep(6)
                left = time.monotonic() - t0
                write_endpoints(eds, [b, c], 3)
                time.sleep(4)
                back = time.monotonic() - t0
                write_endpoints(eds, [a, b, c], 4)
                time.sleep(7)
            finally:
                stop.set()
                for t in threads:
                    t.join()
            pod_of = lambda r: names.get(r["headers"].get("x-kvgate-pod"))  # noqa: E731
            bad = [(r["status"], r.get("body")) for r in answers if r["status"] != 200 or r["chunks"] != max_tokens]
            first_on_c = min((r["started"] for r in answers if pod_of(r) == 2), default=None)
            # While requests wait (all through here) discovery runs every second, not every
            # interval; then a tick, and the VMs' read of the pool, once a second. Before: the
            # interval's phase, 2.9-3.0 s in these runs and up to 6 s.
            settle = 1.0 + 0.25 + 1.0 + 0.35
            while_out = [r["started"] for r in answers if pod_of(r) == 0 and left + 1 < r["started"] < back]
            came_back = sum(1 for r in answers if pod_of(r) == 0 and r["started"] > back + settle)
            rerouted = kvgate_stat(envoy, "route.rerouted")
            last_rerouted = max((t for t, (_, g) in zip(stamps, samples) if g["rerouted"] < rerouted), default=left)
            ran_on_a = max(g["in_flight"].get(gauge_a, 0) for _, g in samples)
            # The moment the departure costs: from it until the rerouted answers have ended.
            moment = [k for k, t in enumerate(stamps) if left <= t <= left + 2.5]
            before, after = samples[moment[0] - 1][0], samples[moment[-1]][0]
            preempted = [sum(p["preemptions"] for p in s) for s in (before, after)]
            print(f"{len(answers)} answers; pod c's first {first_on_c - joined:.2f} s after it joined; on a while "
                  f"out: {len(while_out)}, after it came back: {came_back}; rerouted {rerouted} (a ran at most "
                  f"{ran_on_a}), the last {last_rerouted - left:.2f} s after it left; preemptions {preempted[0]} before a left, {preempted[1] - preempted[0]} as it "
                  f"left, {preemptions(sim) - preempted[1]} after")
            assert not bad, bad[:5]
            assert first_on_c is not None and first_on_c - joined < settle, first_on_c - joined
            assert not while_out, (left, back, while_out)
            assert came_back > 0, "the pod that came back takes requests again"
            # The picks made before the first rerouted answer: at most the pod's room (a sample or
            # a worker's pick more on a loaded machine), over in a moment (0.20-0.23 s here; before:
            # 1.0-1.1 s when discovery came soon after, up to the interval and a second after it).
            assert rerouted <= ran_on_a + 1 and last_rerouted - left < 0.6, \
                "picks of the pod that left go elsewhere only until its first is seen"
            assert preempted[0] == 0 and preemptions(sim) == preempted[1]
            outside = [s for k, s in enumerate(samples) if k not in moment]
            check_promise(outside, bounded=True, delivered_lag=delivery_lag(answers))
            assert_drained(envoy)
