"""Three Envoy + kvgate replicas sharing two kvgate-sim pods' budgets through a real etcd
(issue 15): the issue's 2x overload spread over them never preempts and the replicas'
reservations on a pod never sum past its budget, with credit moving at the busy pace; etcd killed mid-run and restarted, requests keep
flowing within the fallback and the grants come back; a client sending straight to a pod shrinks
what the replicas admit there within a scrape; prefix groups meet on one pod through any replica,
and a prompt sent through one replica is known cached by the others, with etcd's history
compacted by one replica; a replica killed has its grants reclaimed after its lease and the grace, and one cut off
from etcd while its requests stream has them counted by the others after the reclaim; a replica
whose requests are larger than the busy ones' is not starved of credit. The independent-replicas
comparison and the latency numbers are in replicas_bench.py (BENCHMARKS.md)."""

import base64
import itertools
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from bodies import MODEL, group_chat, unshared_completion
from harness import Sim, kvgate_stat, preemptions, request, responses_call, stream, wait_for
from replicas import (SMALL_KV, Cut, Etcd, budgets, check_promise, fleet, grants, grants_by_replica, overload,
                      status)

LEASE_S, GRACE_S, SCRAPE_S = 2, 1, 1.0


@pytest.fixture(scope="module")
def etcd():
    with Etcd() as e:
        yield e


@pytest.fixture(scope="module")
def pool(etcd):
    """Two small pods and three replicas sharing their budgets; the last test kills a replica."""
    with Sim(pods=2, args=SMALL_KV) as sim, fleet(sim, etcd.port, etcd={}) as envoys:
        yield sim, envoys


def check(sim, answers, samples, base_preemptions=0):
    assert all(a["status"] == 200 and a["chunks"] == 300 for a in answers), [a["status"] for a in answers]
    assert preemptions(sim) == base_preemptions
    check_promise(samples)


def test_three_replicas_under_twice_the_pool_never_preempt_nor_pass_a_budget(pool, etcd):
    sim, envoys = pool
    syncs, t0 = [kvgate_stat(e, "replicas.syncs") for e in envoys], time.time()
    answers, samples = overload(sim, envoys, etcd=etcd)
    took = time.time() - t0
    check(sim, answers, samples)
    served = Counter(a["headers"].get("x-kvgate-pod") for a in answers)
    assert len(served) == 2, served
    # While lines wait, credit moves at the busy pace (busySyncIntervalMs, 100 ms), not every
    # syncIntervalMs (250 ms here: 4 syncs a second).
    rates = [(kvgate_stat(e, "replicas.syncs") - s) / took for e, s in zip(envoys, syncs)]
    print(f"syncs a second under overload: {rates}")
    assert min(rates) > 5, rates


def test_etcd_killed_mid_run_and_restarted(pool, etcd):
    sim, envoys = pool
    before = preemptions(sim)
    out = {}

    def fault(finished):
        wait_for(lambda: finished() >= 16, timeout=60, interval=0.02)
        etcd.kill()
        out["killed_at"] = finished()
        # Long enough for every replica to fall back (two syncs and a timeout: 1 s).
        wait_for(lambda: all(kvgate_stat(e, "replicas.in_contact") == 0 for e in envoys), timeout=5)
        out["fell_back"] = all(kvgate_stat(e, "replicas.in_contact") == 0 for e in envoys)
        out["finished_while_down"] = finished()
        t0 = time.time()
        etcd.start()
        out["restart_s"] = round(time.time() - t0, 2)
        out["restarted_at"] = finished()

    answers, samples = overload(sim, envoys, requests=144, during=fault, after=24, etcd=etcd)
    print("etcd fault:", out)
    check(sim, answers, samples, before)
    assert out["fell_back"]
    # Requests kept finishing while etcd was down, and after it came back mid-run (the load goes
    # on for 24 requests past the restart, which a CI machine's etcd once took the whole run to
    # finish). Not also during its start: a quick start finished none, and a CI run failed on that.
    assert out["killed_at"] < out["finished_while_down"] <= out["restarted_at"] < len(answers), out
    syncs = [kvgate_stat(e, "replicas.syncs") for e in envoys]
    assert wait_for(lambda: all(kvgate_stat(e, "replicas.in_contact") == 1 for e in envoys)
                    and all(kvgate_stat(e, "replicas.syncs") > s for e, s in zip(envoys, syncs)), timeout=10)
    # The grants are back in etcd, summing to at most each pod's budget (as derived from its
    # capacity: the engine's feedback may have lowered it since, which each replica's admission
    # applies at once by scaling its grant, before the next sync rewrites them).
    back, budget = grants(etcd), max(budgets(samples).values())
    assert len(back) == 2 and all(0 < g <= budget for g in back.values()), (back, budget)


def test_traffic_straight_to_a_pod_shrinks_what_the_replicas_admit_there_within_a_scrape(pool):
    sim, envoys = pool
    target = sim.ports[0]
    segment = f"127_0_0_1_{target}"

    def at_rest():
        # Nothing in flight through any replica, and all three showing one budget, as the
        # same scrape of an idle pod gives: the tests before leave requests ending and
        # budgets their feedback lowered (3 283 of 3 891 seen), and from there the shrink to
        # below 80 % took two scrapes.
        lines = [status(e)[segment] for e in envoys]
        budgets = {line["budgetTokens"] for line in lines}
        return all(line["inFlight"] == 0 for line in lines) and len(budgets) == 1 and budgets.pop()

    first = wait_for(at_rest, timeout=10)
    time.sleep(1.2 * SCRAPE_S)
    nominal = wait_for(at_rest, timeout=10)
    assert first and nominal, "the pod did not come to rest"
    stop, started = threading.Event(), []

    def bypass():
        # Two long completions at a time, sent to the pod directly: about 170 of its 256 blocks.
        def one(i):
            while not stop.is_set():
                started.append(time.time())
                stream(target, "/v1/completions", unshared_completion(f"direct{i}-{len(started)}", max_tokens=1000))
        with ThreadPoolExecutor(2) as p:
            list(p.map(one, range(2)))

    t = threading.Thread(target=bypass)
    t.start()
    try:
        # From when the pod first holds the bypass's KV, each replica's scrapes of it, up to the
        # one that shows its budget shrunk (read on the status pages: the gauges add a tick's
        # lag). A scrape is told apart by when it was taken: the page's lastScrapeAgeMs puts it
        # between the clock before the read and after it, less the age, and two readings of one
        # scrape give overlapping spans (scrapes are a second apart). A fixed window did not: a
        # loaded CI machine's reads varied by more than its 0.3 s, and one scrape counted twice.
        wait_for(lambda: sim.stats(0)["kv_blocks_used"] > 64, timeout=10, interval=0.02)
        seen = time.time()
        taken, shrunk, readings = [[] for _ in envoys], [None] * len(envoys), [[] for _ in envoys]
        while None in shrunk and time.time() < seen + 5:
            for i, e in enumerate(envoys):
                if shrunk[i] is None:
                    before, line = time.time(), status(e)[segment]
                    now, age = time.time(), line["lastScrapeAgeMs"] / 1000
                    # The age is whole milliseconds.
                    at = (before - age - 0.002, now - age + 0.002)
                    if at[0] > seen and all(at[0] > t[1] or at[1] < t[0] for t in taken[i]):
                        taken[i].append(at)
                        # What each scrape read, for a failure to say why the budget held.
                        readings[i].append({"s": round(at[0] - seen, 2), **{k: line.get(k) for k in (
                            "budgetTokens", "unexplainedTokens", "remoteTokens", "kvUsage", "capacityTokens",
                            "heldTokens", "inFlight")}})
                    if line["budgetTokens"] < nominal * 0.8:
                        shrunk[i] = (len(taken[i]), round(now - seen, 2))
            time.sleep(0.02)
        # Each replica scrapes the pod itself and caps its grant by its own view of the budget,
        # which keeps shrinking as the bypass grows; the pages are read one after another, so
        # the grants are held against the largest budget any replica showed around them (read
        # against one replica's, read after them, a scrape between the reads failed the check).
        lines = [status(e)[segment] for e in envoys]
        after = [status(e)[segment] for e in envoys]
        budget = max(line["budgetTokens"] for line in lines + after)
        caps = [line["grantTokens"] for line in lines]
        print(f"bypass: budget {nominal} -> {budget}, (scrapes, s) {shrunk}; what the replicas may reserve {caps}")
        print("each replica's scrapes from the moment the pod held the bypass's KV:", readings)
        if None in shrunk:
            # What a replica that did not shrink shows now, and whether it scraped at all.
            for i, e in enumerate(envoys):
                line = status(e)[segment]
                print(f"replica {i}: {line}; scrapes ok {kvgate_stat(e, 'scrape.ok')}, "
                      f"failed {kvgate_stat(e, 'scrape.errors')}")
        assert None not in shrunk, "the budget did not shrink"
        # Each scrape shrinks the budget by all the KV it read there, kvgate's requests holding
        # none: the budget a scrape leaves is at most the pod's capacity less what it read (the
        # utilisation target and the backoff take more). Judged on
        # what each scrape read, not on how many came before the shrink: the bypass's two streams
        # end and start again together, so a scrape taken just after holds their prompts only (a
        # CI run read 0.19 of the pod then, and its budget rightly stayed above 80 %).
        for r in itertools.chain(*readings):
            assert r["inFlight"] == 0 and r["remoteTokens"] == 0, r
            assert r["budgetTokens"] <= r["capacityTokens"] - int(r["kvUsage"] * r["capacityTokens"]), r
        assert sum(caps) <= budget + len(envoys), "the grants scale down with the budget at once"
        # kvgate keeps admitting on the pod, within what is left.
        answers, samples = overload(sim, envoys, requests=24, clients=12)
        assert all(a["status"] == 200 for a in answers)
        peak = max(sum(page[segment]["reservedTokens"] for page in s["replicas"]) for s in samples)
        assert peak <= nominal * 0.8, peak
    finally:
        stop.set()
        t.join()


def test_a_killed_replicas_grants_are_reclaimed_after_its_lease_and_the_grace(pool, etcd):
    sim, envoys = pool
    assert wait_for(lambda: sum("/grant/replica-2" in k for k in etcd.keys()) == 2, timeout=5)
    envoys[2].__exit__(None, None, None)
    killed = time.time()
    gone = wait_for(lambda: not any("/grant/replica-2" in k for k in etcd.keys()), timeout=15, interval=0.05)
    took = time.time() - killed
    print(f"replica killed: grants reclaimed after {took:.2f} s (lease {LEASE_S} s + grace {GRACE_S} s)")
    assert gone
    # Not before its lease could lapse (renewed every third of it), nor long after lease + grace.
    assert LEASE_S / 2 + GRACE_S <= took <= LEASE_S + GRACE_S + 1.5
    assert sum(kvgate_stat(e, "replicas.reclaimed") for e in envoys[:2]) >= 1
    assert wait_for(lambda: all(kvgate_stat(e, "replicas.live") == 2 for e in envoys[:2]), timeout=5)


def keep_busy(envoys, first, halt, answers):
    """Sends completions of max_tokens 200 through replicas 0 and 1 in turn until `halt` is set,
    appending each answer (`stream`'s) to `answers`."""
    for i in itertools.count(first):
        if halt.is_set():
            return
        answers.append(stream(envoys[i % 2].port, "/v1/completions", unshared_completion(i, max_tokens=200)))


def test_a_replica_cut_off_from_etcd_has_its_requests_counted_after_its_grant_is_reclaimed():
    """Replica 2 is cut off from etcd while two long answers stream through it; its lease lapses
    and the others reclaim its grants, while their lines wait for credit. They must not hand its
    credit out before a scrape has read the engine holding its requests (docs/design.md, *What
    a deleted grant leaves behind*): here the replicas scrape only at start, so at every sample
    after the reclaim the others' grants in etcd, plus the grant replica 2 last held there, stay
    within the pod's budget. Mended, replica 2 is granted again.

    The pods run at --time-scale 0.5, so replica 2's answers of 800 tokens outlast its lease
    (2 s) and the grace (1 s) by seconds. Before ghosts, the others' grants took the whole budget
    at the reclaim, past it by all replica 2 had held (its grant, a third of the budget or more)."""
    with Etcd() as etcd, Cut(etcd.port) as cut, \
            Sim(pods=2, args=["--time-scale", "0.5", "--num-gpu-blocks", "256"]) as sim, \
            fleet(sim, etcd.port, etcd={}, etcd_ports=[etcd.port, etcd.port, cut.port],
                  metrics={"intervalMs": 60_000, "staleAfterMs": 120_000}) as envoys:
        halt, samples, answers = threading.Event(), [], []

        def load(k):
            # The live replicas' lines wait: they ask for credit, and would take the reclaimed.
            keep_busy(envoys, 1000 + k * 1000, halt, answers)

        def long(i):
            return stream(envoys[2].port, "/v1/completions", unshared_completion(i, max_tokens=800))

        def sample():
            while not halt.is_set():
                try:
                    samples.append((time.time(), grants_by_replica(etcd), [status(e) for e in envoys]))
                except (OSError, ValueError):
                    pass
                time.sleep(0.05)

        with ThreadPoolExecutor(20) as pool:
            try:
                loads = [pool.submit(load, k) for k in range(12)]
                longs = [pool.submit(long, i) for i in range(2)]
                assert wait_for(lambda: sum(p["inFlight"] for p in status(envoys[2]).values()) > 0, timeout=10), \
                    status(envoys[2])
                sampler = pool.submit(sample)
                cut.cut()
                cut_at = time.time()
                long_answers = [f.result() for f in longs]
            finally:
                halt.set()
            for f in loads + [sampler]:
                f.result()
        assert all(a["status"] == 200 and a["chunks"] == 800 for a in long_answers), long_answers
        assert answers and all(a["status"] == 200 for a in answers), Counter(a["status"] for a in answers)
        nominal = {pod: max(page[pod]["budgetTokens"] for _, _, pages in samples for page in pages)
                   for pod in samples[0][2][2]}
        last_grant, checked, reclaimed_at, shown = {}, 0, {}, set()
        for at, by_pod, (p0, p1, p2) in samples:
            for pod, by_replica in by_pod.items():
                if "replica-2" in by_replica:
                    last_grant[pod] = by_replica["replica-2"]
                    continue
                reclaimed_at.setdefault(pod, round(at - cut_at, 2))
                # What each live replica holds out of the split, on its status page (each holds
                # it from its own sync after the deletion: a sample may come between).
                if all(page[pod]["ghostTokens"] == last_grant.get(pod) for page in (p0, p1)):
                    shown.add(pod)
                if p2[pod]["inFlight"] == 0:
                    continue
                # Reclaimed, with replica 2's requests still there.
                others = by_replica.get("replica-0", 0) + by_replica.get("replica-1", 0)
                checked += 1
                assert others + last_grant[pod] <= nominal[pod], \
                    (round(at - cut_at, 2), pod, by_replica, last_grant[pod], nominal[pod])
        print(f"cut off: reclaimed {reclaimed_at} s after the cut; {checked} samples after, with replica 2's "
              f"requests in flight; its last grants {last_grant}, budgets {nominal}; ghosts shown on {shown}")
        assert checked >= 5, checked
        assert shown == set(reclaimed_at), "the live replicas' pages show the reclaimed grants held out"
        # Mended: replica 2 reaches etcd again and holds grants there.
        cut.mend()
        assert wait_for(lambda: all("replica-2" in g for g in grants_by_replica(etcd).values())
                        and kvgate_stat(envoys[2], "replicas.in_contact") == 1, timeout=10), grants_by_replica(etcd)


def test_a_replica_whose_requests_are_larger_is_not_starved_by_busy_ones(etcd):
    """Replicas 0 and 1 keep both pods full of short answers (max_tokens 200, twelve clients);
    replica 2 then sends two of 800. Each of the busy replicas' ended requests is followed by the
    next from its line within the grant it holds, so credit for a larger request reaches replica 2
    only because the split gives a replica holding nothing its first request before the others
    their next, and its second request asks for credit on the pod where it holds nothing
    (docs/design.md, *The split*). Before, the later of the two began 7.6-13 s after it was sent
    (a short answer streams for 2.5 s), or not before its wait ran out (CI, 2026-12-03: the
    cut-off test above failed so); now within 0.1-5.5 s (BENCHMARKS.md, *A replica starved of
    credit*)."""
    with Sim(pods=2, args=["--time-scale", "0.5", "--num-gpu-blocks", "256"]) as sim, \
            fleet(sim, etcd.port, etcd={"keyPrefix": "/kvgate-starve"}) as envoys:
        halt, answers = threading.Event(), []

        def load(k):
            keep_busy(envoys, 5000 + k * 1000, halt, answers)

        with ThreadPoolExecutor(14) as pool:
            try:
                loads = [pool.submit(load, k) for k in range(12)]
                assert wait_for(lambda: len(answers) >= 12, timeout=20), len(answers)
                longs = [pool.submit(stream, envoys[2].port, "/v1/completions",
                                     unshared_completion(100 + i, max_tokens=800)) for i in range(2)]
                long_answers = [f.result() for f in longs]
            finally:
                halt.set()
            for f in loads:
                f.result()
        assert all(a["status"] == 200 and a["chunks"] == 800 for a in long_answers), \
            [(a["status"], a.get("body")) for a in long_answers]
        waits = [round(a["ttft"], 2) for a in long_answers]
        short = statistics.median(a["total"] - a["ttft"] for a in answers if a["status"] == 200)
        print(f"replica 2's larger requests began after {waits} s; a short answer streams for {short:.2f} s")
        # Credit comes as the others' requests end below their shares: a short answer's time
        # for each of the two, with a margin.
        assert max(waits) < 3 * short, (waits, short)
        assert answers and all(a["status"] == 200 for a in answers), Counter(a["status"] for a in answers)
        assert preemptions(sim) == 0


def group_placement(envoys, first_group, groups=48, questions=6):
    """Sends each group's questions round-robin through the replicas; returns the share of
    requests that landed on their group's most used pod. Even one replica strays a little: two of
    a group's questions sent at once to two workers may each find the prompt new (the first's pick
    not yet in the shared records the second ranks on), and a question may leave its group's pod
    while another group's new prompt is being computed there; 32 groups keep that noise a few
    requests in a couple of hundred (16 left it at 0-6 of 96, either way). 48 since 2026-11-26:
    over 32, one CI run's three replicas came to 176 of 192 against one replica's 186, a request
    short of the bar, where local runs give 189-191."""
    def ask(i):
        g, q = divmod(i, questions)
        g += first_group
        r = request(envoys[i % len(envoys)].port, "POST", "/v1/chat/completions", group_chat(g, q))
        assert r.status == 200, r.body
        return g, r.headers["x-kvgate-pod"]

    with ThreadPoolExecutor(4) as p:
        picks = list(p.map(ask, range(groups * questions)))
    on_home = 0
    for g in range(first_group, first_group + groups):
        pods = Counter(pod for gg, pod in picks if gg == g)
        on_home += pods.most_common(1)[0][1]
    return on_home / len(picks)


def test_prefix_groups_meet_on_one_pod_through_any_replica(etcd):
    with Sim(pods=4) as sim:
        with fleet(sim, etcd.port, n=1, etcd=None) as one:
            alone = group_placement(one, 0)
        with fleet(sim, etcd.port, n=3, etcd={"keyPrefix": "/kvgate-groups"}) as three:
            together = group_placement(three, 100)
    print(f"prefix groups on their pod: one replica {alone:.1%}, three {together:.1%}")
    assert together >= 0.95 * alone


def test_a_prompt_sent_through_one_replica_is_known_cached_by_another(etcd):
    """Each replica tells the others, on its sync, where it sent prompts (replicas::placements):
    the next question of a group first sent through replica 0 finds its prefix cached on that pod
    through replica 1, whose own picks never held it."""
    with Sim(pods=4) as sim, fleet(sim, etcd.port, n=2, etcd={"keyPrefix": "/kvgate-placed"}) as two:
        first = request(two[0].port, "POST", "/v1/chat/completions", group_chat(500, 0))
        assert first.status == 200, first.body
        assert wait_for(lambda: kvgate_stat(two[1], "replicas.placements") >= 1, timeout=15)
        again = request(two[1].port, "POST", "/v1/chat/completions", group_chat(500, 1))
        assert again.status == 200, again.body
        cached, total = (int(x) for x in again.headers["x-kvgate-prefix-blocks"].split("/"))
        print(f"first through replica 0 on {first.headers['x-kvgate-pod']}; through replica 1 on "
              f"{again.headers['x-kvgate-pod']} with {cached}/{total} blocks cached")
        assert again.headers["x-kvgate-pod"] == first.headers["x-kvgate-pod"]
        assert cached > 0
        assert kvgate_stat(two[0], "replicas.placements") == 0, "its own picks are not sent back"
        # The first replica by name compacts etcd's history (each second here) up to a revision
        # read a second before: the revisions of the first syncs are gone, the current values
        # stay. A settled fleet writes nothing and leaves nothing more to compact, so prompts keep
        # coming through replica 0 (each makes it write its placements) until that is seen.
        questions = itertools.count(2)

        def first_revisions_gone():
            request(two[0].port, "POST", "/v1/chat/completions", group_chat(500, next(questions)))
            old = request(etcd.port, "POST", "/v3/kv/range",
                          {"key": base64.b64encode(b"/kvgate-placed/").decode(),
                           "range_end": base64.b64encode(b"/kvgate-placed0").decode(), "revision": "2"})
            return kvgate_stat(two[0], "replicas.compactions") >= 1 and "compacted" in old.body.decode(errors="replace")

        assert wait_for(first_revisions_gone, timeout=30, interval=0.5)
        assert kvgate_stat(two[1], "replicas.compactions") == 0
        both = [f"/kvgate-placed/placed/replica-{i}" for i in range(2)]
        assert wait_for(lambda: sorted(k for k in etcd.keys("/kvgate-placed/") if "/placed/" in k) == both,
                        timeout=5), etcd.keys("/kvgate-placed/").keys()


def test_a_lone_replica_holds_a_follow_up_only_until_etcd_says_it_is_alone(etcd):
    """A replica with etcd on, and no other replica alive: a follow-up naming a response it never
    heard of (stored before a restart, or a wrong id) waits only for the replica's next read of
    etcd (at the busy pace while it is held), which finds nobody to send a note, and then goes by
    cost to the engine's own 404. Before (2026-11-30) each was held for the whole
    etcd.followUpWaitMs (300 ms) first."""
    with Sim(pods=2, args=["--time-scale", "20"]) as sim:
        with fleet(sim, etcd.port, n=1, etcd={"keyPrefix": "/kvgate-alone"}) as (one,):
            took = []
            for i in range(8):
                started = time.monotonic()
                status, _, _, _ = responses_call(one.port, {
                    "model": MODEL, "input": "and then?", "previous_response_id": f"resp_never_{i}",
                    "max_output_tokens": 8})
                took.append(time.monotonic() - started)
                assert status == 404, status
            assert kvgate_stat(one, "stored.waited") == 8 and kvgate_stat(one, "stored.unknown") == 8
            took.sort()
            print("a lone replica's follow-ups to unknown responses took (s):", [round(t, 3) for t in took])
            assert took[len(took) // 2] < 0.15, took


def test_a_stored_responses_follow_ups_find_its_pod_through_any_replica(etcd):
    """A stored response lives in the memory of the engine that made it, and only that pod can
    answer a follow-up naming it (test_routing.py). Each replica tells the others, with its sync,
    which pod stored each response (replicas::placements), at the busy pace while any move; a
    follow-up naming one its replica has not heard of yet is held up to etcd.followUpWaitMs for
    the note. Conversations whose turns alternate between two replicas, each turn sent as soon as
    the last one's answer ended (an agent's loop), stay on one pod, every follow-up answered, and
    a `GET` of a response through the other replica finds it, also at once (held at its headers).
    With the wait off, the pods are still asked for a response no note names
    (`routing.storedLookupMs`), and every turn is found; with the asking off too, the turns whose
    note had not come yet are routed by cost, and mostly not found."""
    def conversations(envoys, count, turns):
        done, statuses = [], []
        for c in range(count):
            status, pod, rid, _ = responses_call(
                envoys[c % 2].port, {"model": MODEL, "input": f"agent {c}: plan the next step",
                                     "max_output_tokens": 8, "stream": c % 2 == 0})
            assert status == 200 and rid, (status, rid)
            pods = [pod]
            for turn in range(1, turns):
                status, pod, next_id, _ = responses_call(
                    envoys[(c + turn) % 2].port,
                    {"model": MODEL, "input": f"tool result {turn}", "max_output_tokens": 8,
                     "previous_response_id": rid, "stream": turn % 2 == 1})
                statuses.append(status)
                if status != 200:
                    break
                pods.append(pod)
                rid = next_id
            done.append((c, pods, rid))
        return done, statuses

    with Sim(pods=4, args=["--time-scale", "20"]) as sim:
        with fleet(sim, etcd.port, n=2, etcd={"keyPrefix": "/kvgate-stored"}) as two:
            done, statuses = conversations(two, 8, 4)
            assert statuses == [200] * 24, statuses
            for c, pods, last in done:
                assert len(set(pods)) == 1, pods
                got = request(two[(c + 4) % 2].port, "GET", f"/v1/responses/{last}")
                assert got.status == 200 and got.headers.get("x-sim-pod") == pods[0], got.status
            # A retrieval through the other replica as soon as the answer ended: held at its
            # headers until the note comes, then sent to the pod that stored it.
            for c in range(4):
                status, pod, rid, _ = responses_call(two[0].port, {"model": MODEL, "input": f"poll {c}",
                                                                   "max_output_tokens": 8})
                got = request(two[1].port, "GET", f"/v1/responses/{rid}")
                assert got.status == 200 and got.headers.get("x-sim-pod") == pod, (got.status, pod)
            waited = [kvgate_stat(e, "stored.waited") for e in two]
            crossed = [kvgate_stat(e, "replicas.stored") for e in two]
            unknown = [kvgate_stat(e, "stored.unknown") for e in two]
            print(f"follow-ups held for a note {waited}, notes received {crossed}, unknown {unknown}")
            assert min(crossed) >= 8 and sum(unknown) == 0
        with fleet(sim, etcd.port, n=2, etcd={"keyPrefix": "/kvgate-stored-asked", "followUpWaitMs": 0}) as two:
            _, statuses = conversations(two, 8, 4)
            asked = [kvgate_stat(e, "stored.asked") for e in two]
            print("without the wait, asking the pods:", statuses, "asked", asked)
            assert statuses == [200] * 24 and sum(asked) > 0, statuses
        with fleet(sim, etcd.port, n=2, etcd={"keyPrefix": "/kvgate-stored-nowait", "followUpWaitMs": 0},
                   routing={"storedLookupMs": 0}) as two:
            _, statuses = conversations(two, 8, 4)
            print("without the wait nor the asking:", statuses)
            assert statuses.count(404) >= 2, statuses


def test_a_replica_idle_while_another_stores_many_responses_hears_of_each(etcd):
    """Replica 0 carries 20 conversations' first turns one after another (syncing at the busy
    pace while it has stored responses to tell), while replica 1, idle, reads etcd at its slow
    pace (`etcd.syncIntervalMs`); then their second turns come through replica 1, with the pods'
    asking off, so only the notes can send them to their pods. Each is answered at once. Before
    (2026-12-01), a value carried the writer's last three batches only: replica 1 received 11-15
    of the 20 notes, and 5-7 follow-ups were answered 404 after the whole etcd.followUpWaitMs."""
    with Sim(pods=4, args=["--time-scale", "20"]) as sim:
        with fleet(sim, etcd.port, n=2, etcd={"keyPrefix": "/kvgate-idle"}, routing={"storedLookupMs": 0}) as two:
            ids = []
            for c in range(20):
                status, _, rid, _ = responses_call(two[0].port, {"model": MODEL, "input": f"agent {c}",
                                                                  "max_output_tokens": 8})
                assert status == 200 and rid, status
                ids.append(rid)
            time.sleep(1.5)
            statuses = [responses_call(two[1].port, {"model": MODEL, "input": "tool result", "max_output_tokens": 8,
                                                     "previous_response_id": rid})[0] for rid in ids]
            print("notes received", kvgate_stat(two[1], "replicas.stored"), "follow-ups", Counter(statuses))
            assert statuses == [200] * 20 and kvgate_stat(two[1], "stored.unknown") == 0, Counter(statuses)
