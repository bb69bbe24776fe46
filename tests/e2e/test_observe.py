"""The safe rollout in a real Envoy (--concurrency 4) in front of two kvgate-sim pods with a small
KV cache: with `routing.mode` and `admission.mode` `observe`, kvgate decides and accounts every
request but acts on nothing — Envoy's balancer picks the host (kvgate's pick is counted against
it), nothing waits or is refused at twice the pool's capacity (so the pods preempt, as without
kvgate), what enforcement would have done is reported in stats and headers — and every pod's
reservations end at exactly zero, accounted on the pod that really served each request."""

import collections
from concurrent.futures import ThreadPoolExecutor

from harness import Sim, default_plugin_config, kvgate_envoy, kvgate_gauges, kvgate_stat, stream, wait_for

from bodies import unshared_completion

SMALL_KV = ["--time-scale", "10", "--num-gpu-blocks", "256"]
REQUESTS, CLIENTS = 72, 24


def observing():
    cfg = default_plugin_config()
    cfg["debugHeaders"] = True
    cfg["routing"] = {**cfg.get("routing", {}), "mode": "observe"}
    cfg["admission"] = {**cfg.get("admission", {}), "mode": "observe",
                        "objectives": {"standard": 0, "batch": -1}}
    return cfg


def test_observe_mode_decides_and_reports_but_acts_on_nothing():
    with Sim(pods=2, args=SMALL_KV) as sim, kvgate_envoy(sim.endpoints, observing()) as envoy:
        # About twice what the pool holds (the same load test_admission queues without a
        # preemption); every third request sheddable.
        def send(i):
            objective = "batch" if i % 3 == 0 else "standard"
            return stream(envoy.port, "/v1/completions", unshared_completion(i),
                          headers={"x-gateway-inference-objective": objective})

        with ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(send, range(REQUESTS)))

        assert [a["status"] for a in answers] == [200] * REQUESTS, "nothing waits or is refused"
        assert kvgate_stat(envoy, "admission.queued") == 0
        assert kvgate_stat(envoy, "admission.shed") == 0
        would_wait, would_shed = kvgate_stat(envoy, "observe.would_wait"), kvgate_stat(envoy, "observe.would_shed")
        assert would_wait > 0 and would_shed > 0, (would_wait, would_shed)
        observed = [a["headers"].get("x-kvgate-observed", "") for a in answers]
        assert sum("would-wait" in o for o in observed) == would_wait, observed
        assert sum("would-shed" in o for o in observed) == would_shed, observed
        preempted = sum(sim.stats(i)["preemptions"] for i in range(2))
        assert preempted > 0, "admission only observed: the pods ran past their KV, as without kvgate"

        # Envoy's balancer chose every host; kvgate counted each answer against its pick and
        # accounted the request where it ran.
        same, other = kvgate_stat(envoy, "observe.routing_same"), kvgate_stat(envoy, "observe.routing_other")
        assert same + other == REQUESTS and other > 0, (same, other)
        assert kvgate_stat(envoy, "route.rerouted") == 0, "Envoy's choice is not a failed pick"
        assert sum("pick=" in o for o in observed) == other
        served = collections.Counter(a["headers"]["x-kvgate-pod"] for a in answers)
        finished = {f"127.0.0.1:{port}": sim.stats(i)["finished"] for i, port in enumerate(sim.ports)}
        assert served == finished, (served, finished)
        assert min(finished.values()) >= REQUESTS // 3, "round robin spreads them"
        assert all(v == 1 for v in kvgate_gauges(envoy, "healthy").values()), "no pick marked down"

        assert wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values())
                        and all(v == 0 for v in kvgate_gauges(envoy, "in_flight").values()), timeout=5), \
            (kvgate_gauges(envoy, "reserved_tokens"), kvgate_gauges(envoy, "in_flight"))
