//! Several replicas' syncs against one in-memory etcd that keeps the JSON gateway's semantics
//! (leases that lapse on the clock and take their keys along, compare-and-swap on mod revisions,
//! the quirks `gateway` reads), on a deterministic clock: the grants in etcd never sum past a
//! pod's budget, credit moves to whoever needs it, a replica cut off falls back, a lapsed one's
//! grant is reclaimed only after the grace and handed out only once a scrape has read the engine.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use crate::admission::forecast::Headroom;
use crate::config::Config;
use crate::pods::scrape::Call;
use crate::replicas::share;
use crate::replicas::sync::{PodView, Sync};
use crate::stats::{Fixed, Stats};
use crate::store::fake_host::{FakeHost, FakeVm};
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde_json::{json, Value};
use std::collections::BTreeMap;

const POD: &str = "10.0.0.1:8000";
const BUDGET: u64 = 3_000;

#[derive(Default)]
struct FakeEtcd {
    kvs: BTreeMap<String, (Vec<u8>, i64, i64)>,
    revision: i64,
    leases: BTreeMap<i64, (u64, u64)>,
    next_lease: i64,
    down: bool,
    /// Every compaction asked for (when, to which revision), in order; one at or below the last
    /// is refused, as etcd does.
    compactions: Vec<(u64, i64)>,
    /// The revision at each call (when, revision).
    revisions: Vec<(u64, i64)>,
}

fn text(v: &Value) -> String {
    String::from_utf8(STANDARD.decode(v.as_str().unwrap_or("")).unwrap()).unwrap()
}

fn int(v: &Value) -> i64 {
    v.as_str()
        .map_or_else(|| v.as_i64().unwrap(), |s| s.parse().unwrap())
}

impl FakeEtcd {
    fn expire(&mut self, now: u64) {
        let gone: Vec<i64> = self
            .leases
            .iter()
            .filter(|(_, &(until, _))| until <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.leases.remove(&id);
            self.kvs.retain(|_, (_, _, lease)| *lease != id);
        }
    }

    /// Answers one call; `None` while etcd is down (Envoy then reports no response).
    fn handle(&mut self, path: &str, body: &[u8], now: u64) -> Option<Vec<u8>> {
        if self.down {
            return None;
        }
        self.expire(now);
        self.revisions.push((now, self.revision));
        let req: Value = serde_json::from_slice(body).unwrap();
        let header = json!({ "revision": self.revision.to_string() });
        let out = match path {
            "/v3/lease/grant" => {
                self.next_lease += 1;
                let ttl = req["TTL"].as_u64().unwrap();
                self.leases
                    .insert(self.next_lease, (now + ttl * 1_000, ttl));
                json!({ "header": header, "ID": self.next_lease.to_string(), "TTL": ttl.to_string() })
            }
            "/v3/lease/keepalive" => {
                let id = int(&req["ID"]);
                match self.leases.get_mut(&id) {
                    Some((until, ttl)) => {
                        *until = now + *ttl * 1_000;
                        json!({ "result": { "header": header, "ID": id.to_string(), "TTL": ttl.to_string() } })
                    }
                    None => json!({ "result": { "header": header, "ID": id.to_string() } }),
                }
            }
            "/v3/kv/range" => {
                let (from, to) = (text(&req["key"]), text(&req["range_end"]));
                let kvs: Vec<Value> = self
                    .kvs
                    .range(from..to)
                    .map(|(k, (v, rev, _))| {
                        json!({ "key": STANDARD.encode(k), "value": STANDARD.encode(v),
                                "mod_revision": rev.to_string() })
                    })
                    .collect();
                json!({ "header": header, "kvs": kvs })
            }
            "/v3/kv/txn" => {
                let holds = req["compare"].as_array().unwrap().iter().all(|c| {
                    let have = self.kvs.get(&text(&c["key"])).map_or(0, |(_, rev, _)| *rev);
                    have == int(&c["mod_revision"])
                });
                if !holds {
                    // The gateway leaves `succeeded` out when it is false.
                    json!({ "header": header })
                } else {
                    self.revision += 1;
                    for op in req["success"].as_array().unwrap() {
                        if let Some(put) = op.get("request_put") {
                            let lease = put.get("lease").map_or(0, int);
                            if lease != 0 && !self.leases.contains_key(&lease) {
                                return Some(
                                    br#"{"error":"etcdserver: requested lease not found","code":5}"#
                                        .to_vec(),
                                );
                            }
                            let value = STANDARD.decode(put["value"].as_str().unwrap()).unwrap();
                            self.kvs
                                .insert(text(&put["key"]), (value, self.revision, lease));
                        } else {
                            self.kvs.remove(&text(&op["request_delete_range"]["key"]));
                        }
                    }
                    json!({ "header": { "revision": self.revision.to_string() }, "succeeded": true })
                }
            }
            "/v3/kv/compaction" => {
                let revision = int(&req["revision"]);
                if self
                    .compactions
                    .last()
                    .is_some_and(|&(_, last)| revision <= last)
                {
                    return Some(
                        br#"{"error":"etcdserver: mvcc: required revision has been compacted","code":11}"#
                            .to_vec(),
                    );
                }
                assert!(revision <= self.revision, "compacted past the present");
                self.compactions.push((now, revision));
                json!({ "header": header })
            }
            other => panic!("unexpected path {other}"),
        };
        Some(out.to_string().into_bytes())
    }

    /// Every replica's grant on the pod.
    fn grants(&self) -> BTreeMap<String, u64> {
        let prefix = format!("/kvgate/pod/{POD}/grant/");
        self.kvs
            .iter()
            .filter_map(|(k, (v, _, _))| {
                let replica = k.strip_prefix(&prefix)?;
                let value: Value = serde_json::from_slice(v).ok()?;
                Some((replica.to_string(), value["grant"].as_u64()?))
            })
            .collect()
    }
}

/// One Envoy replica: its own shared data, its config and its sync.
struct Replica {
    _host: FakeHost,
    vm: FakeVm,
    cfg: Config,
    sync: Sync,
    stats: Stats,
    in_use: u64,
    demand: u64,
    /// The size of the request at the head of its line (0: none, or credit asked in small steps).
    unit: u64,
    /// Its scrapes read the engine's KV at every tick (the default); off, the last reading stays.
    scraping: bool,
    kv_read_ms: Option<u64>,
    /// The pod's budget as its scrapes corrected it (the engine's KV no replica explains taken
    /// off).
    budget: u64,
    /// Calls sent to etcd so far.
    calls: usize,
}

impl Replica {
    fn new(name: &str, now: u64) -> Self {
        let host = FakeHost::new();
        host.set_now_ms(now);
        let mut cfg = Config::default();
        cfg.etcd.cluster = "etcd".into();
        cfg.etcd.replica_id = name.into();
        cfg.etcd.max_replicas = 4;
        cfg.etcd.lease_ttl_seconds = 3;
        cfg.etcd.reclaim_grace_ms = 2_000;
        cfg.etcd.sync_interval_ms = 500;
        Self {
            vm: host.vm(),
            _host: host,
            cfg,
            sync: Sync::default(),
            stats: Stats::default(),
            in_use: 0,
            demand: 0,
            unit: 0,
            scraping: true,
            kv_read_ms: None,
            budget: BUDGET,
            calls: 0,
        }
    }

    /// One tick: the calls due, each answered by `etcd` (with every grant checked against the
    /// budget after each answer), until the sync has nothing more to send.
    fn tick(&mut self, etcd: &mut FakeEtcd, now: u64) {
        self.vm.host().set_now_ms(now);
        if self.scraping {
            self.kv_read_ms = Some(now);
        }
        // Its line waits while it asks for more than its requests hold.
        let waiting = self.demand > self.in_use;
        let mut calls = self.sync.due(&self.vm, &self.cfg, || waiting).unwrap();
        while let Some(call) = calls.pop() {
            self.calls += 1;
            let answer = etcd.handle(&call.path, call.body.as_deref().unwrap_or(b""), now);
            calls.extend(self.answer(answer.as_deref()));
            let sum: u64 = etcd.grants().values().sum();
            assert!(sum <= BUDGET, "grants {:?} pass the budget", etcd.grants());
        }
    }

    /// Hands the sync etcd's answer (`None`: no response); returns the calls that follow.
    fn answer(&mut self, body: Option<&[u8]>) -> Vec<Call> {
        let views = [PodView {
            pod: POD.into(),
            budget: Some(self.budget),
            in_use: self.in_use,
            block_tokens: 16,
            demand: self.demand,
            unit: self.unit,
            explained: self.in_use,
            kv_read_ms: self.kv_read_ms,
        }];
        let status = body.map(|_| 200);
        self.sync
            .on_response(
                &self.vm,
                &self.cfg,
                &mut self.stats,
                &views,
                status,
                body.unwrap_or(b""),
            )
            .unwrap()
    }

    /// What admission would let this replica reserve on the pod now.
    fn cap(&self) -> u64 {
        share::cap(&self.vm, &self.cfg, POD, Some(BUDGET)).unwrap()
    }

    fn counted(&mut self, name: Fixed) -> u64 {
        self.stats.take_count(name)
    }
}

fn run(replicas: &mut [Replica], etcd: &mut FakeEtcd, from: u64, to: u64) {
    let mut now = from;
    while now < to {
        for r in replicas.iter_mut() {
            r.tick(etcd, now);
        }
        now += 250;
    }
}

/// Replicas asking for `demands`, synced against a fresh etcd until `until`.
fn synced(demands: &[u64], until: u64) -> (FakeEtcd, Vec<Replica>) {
    let mut etcd = FakeEtcd::default();
    let mut rs: Vec<Replica> = (0..demands.len())
        .map(|i| Replica::new(&format!("r{i}"), 0))
        .collect();
    for (r, &d) in rs.iter_mut().zip(demands) {
        r.demand = d;
    }
    run(&mut rs, &mut etcd, 0, until);
    (etcd, rs)
}

#[test]
fn busy_replicas_converge_to_equal_grants_that_never_sum_past_the_budget() {
    let (_, unsynced) = synced(&[5_000], 0);
    assert_eq!(unsynced[0].cap(), 0, "nothing before the first sync");
    let (etcd, rs) = synced(&[5_000; 3], 5_000);
    let grants = etcd.grants();
    assert_eq!(grants.len(), 3);
    assert!(grants.values().all(|&g| g == BUDGET / 3), "{grants:?}");
    assert!(rs.iter().all(|r| r.cap() == BUDGET / 3));
}

#[test]
fn a_sync_that_would_change_nothing_in_etcd_writes_nothing() {
    let (mut etcd, mut rs) = synced(&[2_000, 2_000], 3_000);
    let settled = etcd.revision;
    let syncs = rs[0].counted(crate::stats::REPLICAS_SYNCS);
    // Settled (the lines and grants as etcd holds them): a sync is its read, and no txn.
    let calls = rs[0].calls;
    run(&mut rs, &mut etcd, 3_000, 4_000);
    assert_eq!(etcd.revision, settled, "a settled fleet rewrote etcd");
    assert!(rs[0].calls > calls, "it still read");
    assert!(
        syncs > 0 && rs[0].counted(crate::stats::REPLICAS_SYNCS) > 0,
        "counted as syncs"
    );
    // Replica 0's requests grow: one txn, writing its grant key and nothing else.
    rs[0].in_use = 700;
    let key = format!("/kvgate/pod/{POD}/grant/r0");
    let before: Vec<(String, i64)> = etcd.kvs.iter().map(|(k, v)| (k.clone(), v.1)).collect();
    run(&mut rs, &mut etcd, 4_000, 4_500);
    assert_eq!(etcd.revision, settled + 1);
    let moved: Vec<&String> = before
        .iter()
        .filter(|(k, rev)| etcd.kvs.get(k).map(|v| v.1) != Some(*rev))
        .map(|(k, _)| k)
        .collect();
    assert_eq!(moved, [&key]);
}

#[test]
fn an_idle_replica_gives_its_credit_back_to_a_busy_one() {
    let (mut etcd, mut rs) = synced(&[2_000, 2_000], 3_000);
    assert_eq!(etcd.grants().values().sum::<u64>(), BUDGET);
    assert!(
        rs.iter_mut().all(|r| r.sync.take_grew()),
        "both grew from 0"
    );
    assert!(!rs[0].sync.take_grew(), "asked once");
    // Replica 1's requests hold 400 and nothing waits there: it keeps those, 0 grows.
    rs[1].demand = 400;
    rs[1].in_use = 400;
    rs[0].demand = 5_000;
    run(&mut rs, &mut etcd, 3_000, 6_000);
    let g = etcd.grants();
    // The spare credit is split evenly on top of both demands: 400 + 0 and 2 600 + 0.
    assert_eq!((g["r0"], g["r1"]), (2_600, 400), "{g:?}");
    // Only the replica whose grant grew has its line woken (`Gate::on_call_response`).
    assert!(rs[0].sync.take_grew());
    assert!(!rs[1].sync.take_grew());
    // Replica 1 never went below what it had reserved.
    assert!(rs[1].cap() >= 400);
}

#[test]
fn a_request_admitted_while_etcd_answers_stays_covered_by_the_grant_given_back() {
    let (mut etcd, mut rs) = synced(&[2_000, 2_000], 3_000);
    assert_eq!(etcd.grants()["r1"], 1_500);
    // Replica 1's view of its pod says nothing is held and nothing waits, so it gives its credit
    // back to replica 0, which asks for all of it; but a request of 1 000 tokens was admitted on
    // the pod after the view was taken, while etcd answered the range read.
    rs[1].demand = 0;
    rs[0].demand = 5_000;
    let admitted = crate::pods::record::RequestEntry {
        id: 7,
        expires_ms: u64::MAX,
        held_tokens: 1_000,
        bounded: true,
        left: 100,
        outlook: [255; crate::estimate::output_dist::HORIZON_STEPS.len()],
        ..Default::default()
    };
    crate::pods::record::modify(&rs[1].vm, POD, |rec| {
        rec.entries.push(admitted);
        Some(())
    })
    .unwrap();
    let held = crate::pods::record::read(&rs[1].vm, POD).unwrap().forecast(
        None,
        Headroom::uniform(0.0),
        16,
        crate::pods::record::At::UNTIMED,
    );
    assert!(held >= 1_000, "{held}");
    // Another worker of replica 1 read the pod's record (and the share's grant) just before the
    // sync: the sync's write of the record bumps its version, so that worker's compare-and-swap
    // fails and it reads the lowered grant.
    let (_, seen) = crate::pods::record::read_versioned(&rs[1].vm, POD).unwrap();
    run(&mut rs, &mut etcd, 3_000, 6_000);
    let g = etcd.grants();
    // It covers the request, and the block its forecast may still rise by as its entry is
    // rewritten.
    assert!(
        g["r1"] >= held + 16,
        "the grant covers the request: {g:?}, held {held}"
    );
    assert!(g["r1"] < 1_500, "and the rest went back: {g:?}");
    assert_eq!(g.values().sum::<u64>(), BUDGET, "{g:?}");
    let mine = share::read(&rs[1].vm, POD).unwrap().unwrap();
    assert_eq!(mine.published, g["r1"], "the share knows what etcd holds");
    // It asks for nothing, so its share is a sliver: it admits nothing more until the request
    // ends, and etcd holds the request's credit for it meanwhile.
    assert!(rs[1].cap() < held, "{}", rs[1].cap());
    let (_, now) = crate::pods::record::read_versioned(&rs[1].vm, POD).unwrap();
    assert_ne!(seen.cas, now.cas, "the sync fenced the record");
}

#[test]
fn a_replica_whose_next_request_is_larger_gets_credit_from_replicas_that_refill_theirs() {
    // Replicas 0 and 1 run 600-token requests, one ending on each every second, and admit the
    // next from their lines whenever their cap has room (between syncs, as admission does);
    // replica 2's next request takes 1 000 tokens, and it holds nothing there. Before a
    // starved replica had the split start from nothing, 0 and 1 kept what they held (the whole
    // pod) and 2 waited for ever.
    let mut etcd = FakeEtcd::default();
    let mut rs: Vec<Replica> = (0..3).map(|i| Replica::new(&format!("r{i}"), 0)).collect();
    for r in &mut rs[..2] {
        (r.demand, r.unit) = (5_000, 600);
    }
    let admit = |r: &mut Replica| {
        while r.in_use + r.unit <= r.cap() && r.unit > 0 {
            r.in_use += r.unit;
        }
    };
    let mut admitted_at = None;
    for now in (0..20_000).step_by(250) {
        if now == 3_000 {
            assert_eq!(rs[0].in_use + rs[1].in_use, BUDGET, "0 and 1 fill the pod");
            (rs[2].demand, rs[2].unit) = (1_000, 1_000);
        }
        for (k, r) in rs.iter_mut().enumerate() {
            if k < 2 && now % 1_000 == 0 && r.in_use > 0 {
                r.in_use -= 600;
            }
            if k < 2 || admitted_at.is_none() {
                admit(r);
            }
        }
        if admitted_at.is_none() && rs[2].in_use > 0 {
            admitted_at = Some(now);
        }
        for r in rs.iter_mut() {
            r.tick(&mut etcd, now);
        }
    }
    let waited = admitted_at.map(|t| t - 3_000);
    // 2 needs the credit of two of the others' requests, which end one a second on each, and
    // their credit goes to 2 at the next syncs.
    assert!(waited.is_some_and(|w| w <= 2_500), "waited {waited:?} ms");
    // 0 and 1 kept admitting meanwhile, within what 2 left.
    assert!(rs[0].in_use + rs[1].in_use >= BUDGET - 1_000 - 600);
}

#[test]
fn a_replica_that_came_late_to_a_busy_pod_is_brought_to_an_even_share() {
    // Replica 0 runs 500-token requests and has filled the pod (six of them) before replica 1's
    // line starts; 1 gets one request's credit as 0's first request ends. Then both lines wait,
    // one request ends on each replica every second, and each admits the next from its line
    // whenever its cap has room (between syncs, as admission does). Before a replica owed a
    // request had the split start from nothing, each refilled what ended on it: 0 kept five
    // requests to 1's one for as long as both lines waited.
    let mut etcd = FakeEtcd::default();
    let mut rs: Vec<Replica> = (0..2).map(|i| Replica::new(&format!("r{i}"), 0)).collect();
    (rs[0].demand, rs[0].unit) = (9_000, 500);
    let admit = |r: &mut Replica| {
        while r.unit > 0 && r.in_use + r.unit <= r.cap() {
            r.in_use += r.unit;
        }
    };
    let mut held = Vec::new();
    for now in (0..20_000).step_by(250) {
        if now == 2_000 {
            assert_eq!(rs[0].in_use, BUDGET, "0 fills the pod");
            (rs[1].demand, rs[1].unit) = (9_000, 500);
        }
        for r in rs.iter_mut() {
            if now % 1_000 == 0 && r.in_use > 0 && now >= 2_000 {
                r.in_use -= 500;
            }
            admit(r);
        }
        for r in rs.iter_mut() {
            r.tick(&mut etcd, now);
        }
        assert!(etcd.grants().values().sum::<u64>() <= BUDGET);
        held.push((now, rs[0].in_use, rs[1].in_use));
    }
    // Within a few of 0's requests' ends, the two hold three requests each, and keep it.
    let even = held
        .iter()
        .find(|&&(_, a, b)| a == 1_500 && b == 1_500)
        .map(|&(t, _, _)| t);
    assert!(even.is_some_and(|t| t <= 6_000), "{held:?}");
    let last = &held[held.len() - 20..];
    assert!(
        last.iter().all(|&(_, a, b)| a.abs_diff(b) <= 500),
        "{last:?}"
    );
}

/// Two replicas whose lines both wait (each holds 1 500 and asks for 2 000), then replica 1's
/// requests end (it holds 500 and nothing waits there): how long until replica 0, still waiting,
/// has more credit, with ticks every 20 ms and `busySyncIntervalMs` `busy_ms`.
fn ms_until_credit_moves(busy_ms: u64) -> u64 {
    let mut etcd = FakeEtcd::default();
    let mut rs: Vec<Replica> = (0..2).map(|i| Replica::new(&format!("r{i}"), 0)).collect();
    for r in &mut rs {
        r.cfg.etcd.busy_sync_interval_ms = busy_ms;
        (r.in_use, r.demand) = (1_500, 2_000);
    }
    let tick_all = |rs: &mut [Replica], etcd: &mut FakeEtcd, from: u64, to: u64| {
        for now in (from..to).step_by(20) {
            for r in rs.iter_mut() {
                r.tick(etcd, now);
            }
        }
    };
    tick_all(&mut rs, &mut etcd, 0, 3_000);
    assert_eq!(etcd.grants()["r0"], 1_500);
    (rs[1].in_use, rs[1].demand) = (500, 500);
    for t in (3_000..10_000).step_by(20) {
        tick_all(&mut rs, &mut etcd, t, t + 20);
        if etcd.grants()["r0"] > 1_500 {
            return t + 20 - 3_000;
        }
    }
    panic!("credit never moved")
}

#[test]
fn an_unreachable_etcd_is_retried_at_the_slow_pace_even_while_a_line_waits() {
    let mut etcd = FakeEtcd::default();
    let mut r = Replica::new("r0", 0);
    (r.in_use, r.demand) = (1_000, 5_000);
    let tick = |r: &mut Replica, etcd: &mut FakeEtcd, from: u64, to: u64| {
        let before = r.calls;
        for now in (from..to).step_by(20) {
            r.tick(etcd, now);
        }
        r.calls - before
    };
    // Reachable, with its line waiting: a sync every 100 ms (its read at least: nothing changes,
    // so no txn after the first), a renewal every third of the TTL.
    let synced = tick(&mut r, &mut etcd, 0, 2_000);
    assert!(synced >= 20, "{synced} calls in 2 s");
    etcd.down = true;
    let failed = tick(&mut r, &mut etcd, 2_000, 4_000);
    assert!(failed <= 5, "{failed} calls in 2 s to an unreachable etcd");
    etcd.down = false;
    let back = tick(&mut r, &mut etcd, 4_000, 6_000);
    assert!(back >= 20, "{back} calls in 2 s once it answers again");
}

#[test]
fn while_a_line_waits_credit_moves_at_the_busy_pace() {
    let busy = ms_until_credit_moves(100);
    let idle = ms_until_credit_moves(0);
    // The holder shrinks at its next sync, the waiter grows at its own: two busy intervals.
    assert!(busy <= 220, "{busy} ms at the busy pace");
    assert!(idle > 220, "{idle} ms every 500 ms");
}

#[test]
fn two_replicas_growing_from_the_same_read_cannot_both_take_the_free_credit() {
    let (mut etcd, mut rs) = synced(&[500, 500, 2_000], 2_000);
    // r2 goes idle and gives most of its credit back: 1 334 is free.
    rs[2].demand = 0;
    run(&mut rs[2..], &mut etcd, 2_000, 2_500);
    assert_eq!(etcd.grants().values().sum::<u64>(), 500 + 500 + 666);
    // r0 and r1 both want 1 000 more, from the same read: together they would pass the budget.
    rs[0].demand = 5_000;
    rs[1].demand = 5_000;
    let now = 2_750;
    for r in &mut rs {
        r.vm.host().set_now_ms(now);
    }
    // Each runs its sync up to its txn (a renewal and the range read answered), so both read
    // the same state before either txn reaches etcd.
    let txns: Vec<Call> = rs[..2]
        .iter_mut()
        .map(|r| {
            let mut calls = r.sync.due(&r.vm, &r.cfg, || false).unwrap();
            loop {
                let call = calls.pop().unwrap();
                if call.path == "/v3/kv/txn" {
                    break call;
                }
                let a = etcd.handle(&call.path, call.body.as_deref().unwrap(), now);
                calls = r.answer(a.as_deref());
            }
        })
        .collect();
    for (r, t) in rs.iter_mut().zip(&txns) {
        let a = etcd.handle(&t.path, t.body.as_deref().unwrap(), now);
        r.answer(a.as_deref());
    }
    // r0 took all the free credit (r1 had asked for 500 when last published); r1's txn failed.
    let g = etcd.grants();
    assert_eq!((g["r0"], g["r1"]), (1_834, 500), "{g:?}");
    assert_eq!(g.values().sum::<u64>(), BUDGET);
    assert_eq!(rs[1].counted(crate::stats::REPLICAS_CONFLICTS), 1);
    // Once r1's demand is published, the split evens out (r2 asks for nothing).
    run(&mut rs, &mut etcd, 3_000, 6_000);
    let g = etcd.grants();
    assert_eq!((g["r0"], g["r1"], g["r2"]), (1_500, 1_500, 0), "{g:?}");
}

#[test]
fn cut_off_from_etcd_a_replica_falls_back_and_recovers_when_etcd_returns() {
    let (mut etcd, mut rs) = synced(&[5_000, 100], 3_000);
    let grant = etcd.grants()["r0"];
    assert!(grant > BUDGET / 4);
    assert_eq!(rs[0].cap(), grant);
    etcd.down = true;
    // Within two syncs and a timeout it still trusts its grant; after that, a quarter of the
    // budget at most (maxReplicas 4).
    run(&mut rs, &mut etcd, 3_000, 4_000);
    assert_eq!(rs[0].cap(), grant);
    run(&mut rs, &mut etcd, 4_000, 5_500);
    assert_eq!(rs[0].cap(), BUDGET / 4);
    assert_eq!(rs[1].cap(), etcd.grants()["r1"].min(BUDGET / 4));
    assert!(rs[0].counted(crate::stats::REPLICAS_ERRORS) > 0);
    etcd.down = false;
    run(&mut rs, &mut etcd, 5_500, 7_000);
    assert_eq!(rs[0].cap(), etcd.grants()["r0"], "in contact again");
    assert!(rs[0].cap() > BUDGET / 4);
}

#[test]
fn a_lapsed_replicas_grant_counts_for_the_grace_and_is_then_reclaimed() {
    let (mut etcd, mut rs) = synced(&[5_000; 3], 3_000);
    assert_eq!(etcd.grants()["r2"], BUDGET / 3);
    // r2 dies at 3 000: its lease (3 s, renewed every second) lapses between 5 000 and 6 000;
    // the others see it gone from then and reclaim 2 s later.
    let dead = rs.pop().unwrap();
    run(&mut rs, &mut etcd, 3_000, 6_750);
    assert_eq!(
        etcd.grants().get("r2"),
        Some(&(BUDGET / 3)),
        "still counted in the grace"
    );
    run(&mut rs, &mut etcd, 7_500, 10_000);
    let g = etcd.grants();
    assert!(!g.contains_key("r2"), "{g:?}");
    assert_eq!(g["r0"] + g["r1"], BUDGET - BUDGET % 2, "{g:?}");
    let reclaimed: u64 = rs
        .iter_mut()
        .map(|r| r.counted(crate::stats::REPLICAS_RECLAIMED))
        .sum();
    assert_eq!(reclaimed, 1);
    drop(dead);
}

#[test]
fn a_reclaimed_grant_is_handed_out_only_once_a_scrape_has_read_the_engine_since() {
    // r2 is cut off from etcd at 3 000 but alive: its requests hold its whole grant, and it
    // admits within its fallback meanwhile. Its lease lapses, the others reclaim its grant past
    // the grace, while their scrapes read nothing new (a slow metrics interval).
    let (mut etcd, mut rs) = synced(&[5_000; 3], 3_000);
    let held = etcd.grants()["r2"];
    let cut_off = rs.pop().unwrap();
    for r in rs.iter_mut() {
        r.scraping = false;
    }
    run(&mut rs, &mut etcd, 3_000, 10_000);
    let g = etcd.grants();
    assert!(!g.contains_key("r2"), "reclaimed: {g:?}");
    assert!(
        g["r0"] + g["r1"] + held <= BUDGET,
        "the cut-off replica's requests are still counted: {g:?}"
    );
    let ghosts = |r: &Replica| share::read(&r.vm, POD).unwrap().unwrap().ghost_tokens;
    assert!(
        rs.iter().all(|r| ghosts(r) == held),
        "each replica's share shows the grant it holds out (the ghost_tokens gauge)"
    );
    // A scrape reads the engine: r2's requests are KV no live replica explains, off the budget.
    for r in rs.iter_mut() {
        r.scraping = true;
        r.budget = BUDGET - held;
    }
    run(&mut rs, &mut etcd, 10_000, 11_000);
    let g = etcd.grants();
    assert!(g["r0"] + g["r1"] <= BUDGET - held, "{g:?}");
    assert!(rs.iter().all(|r| ghosts(r) == 0), "and lets it go");
    // The requests end: the engine's KV shows the room, and the others grow into it.
    for r in rs.iter_mut() {
        r.budget = BUDGET;
    }
    run(&mut rs, &mut etcd, 11_000, 12_000);
    let g = etcd.grants();
    assert_eq!(g["r0"] + g["r1"], BUDGET - BUDGET % 2, "{g:?}");
    drop(cut_off);
}

#[test]
fn a_lease_etcd_lost_is_granted_again_and_the_grants_stand_meanwhile() {
    let (mut etcd, mut rs) = synced(&[1_000], 2_000);
    let before = etcd.grants()["r0"];
    etcd.leases.clear();
    etcd.kvs.retain(|k, _| !k.contains("/alive/"));
    run(&mut rs, &mut etcd, 2_000, 5_000);
    assert!(etcd.kvs.keys().any(|k| k.ends_with("/alive/r0")));
    assert_eq!(etcd.grants()["r0"], before);
}

#[test]
fn each_replicas_picks_reach_the_others_once_and_go_with_its_lease() {
    use crate::routing::pick_log::{Dispatch, Event, PickLog};
    let (mut etcd, mut rs) = synced(&[1_000, 1_000], 1_000);
    let mut log = PickLog::start(&rs[0].vm).unwrap();
    let sent = Event::Dispatch(Dispatch {
        pod: POD.into(),
        request: 1,
        adapter: 0,
        hashes: vec![7, 8, 9],
    });
    log.publish(&rs[0].vm, 1, &sent).unwrap();
    run(&mut rs, &mut etcd, 1_000, 2_500);
    assert!(rs[0].sync.take_received().placed.is_empty(), "not its own");
    assert_eq!(
        rs[1].sync.take_received().placed,
        vec![(POD.to_string(), vec![7, 8, 9])]
    );
    run(&mut rs, &mut etcd, 2_500, 4_000);
    assert!(rs[1].sync.take_received().placed.is_empty(), "once");
    assert!(etcd.kvs.contains_key("/kvgate/placed/r0"));
    // r0 stops: its lease lapses within its TTL, and its placements go with it.
    let dead = rs.remove(0);
    run(&mut rs, &mut etcd, 4_000, 8_000);
    assert!(!etcd.kvs.contains_key("/kvgate/placed/r0"));
    drop(dead);
}

#[test]
fn a_replica_alone_writes_no_placements() {
    use crate::routing::pick_log::{Dispatch, Event, PickLog};
    let (mut etcd, mut rs) = synced(&[1_000], 1_000);
    let mut log = PickLog::start(&rs[0].vm).unwrap();
    let sent = Event::Dispatch(Dispatch {
        pod: POD.into(),
        request: 1,
        adapter: 0,
        hashes: vec![7],
    });
    log.publish(&rs[0].vm, 1, &sent).unwrap();
    run(&mut rs, &mut etcd, 1_000, 3_000);
    assert!(!etcd.kvs.keys().any(|k| k.contains("/placed/")));
    // A second replica comes up: it learns the placements kept for it (the last batches) and
    // the next ones.
    rs.push(Replica::new("r1", 3_000));
    log.publish(&rs[0].vm, 1, &sent).unwrap();
    run(&mut rs, &mut etcd, 3_000, 5_000);
    assert_eq!(
        rs[1].sync.take_received().placed,
        vec![(POD.to_string(), vec![7]); 2]
    );
}

#[test]
fn one_replica_compacts_etcds_history_to_a_revision_the_interval_old() {
    let (mut etcd, mut rs) = synced(&[1_000, 1_000], 0);
    for r in rs.iter_mut() {
        r.cfg.etcd.compaction_interval_ms = 2_000;
    }
    // Their requests come and go, so every sync writes.
    for second in 0..9 {
        rs[1].in_use = 100 * (second % 2);
        run(&mut rs, &mut etcd, second * 1_000, (second + 1) * 1_000);
    }
    let made: Vec<u64> = rs
        .iter_mut()
        .map(|r| r.counted(crate::stats::REPLICAS_COMPACTIONS))
        .collect();
    assert_eq!(made[1], 0, "only the first live replica by name compacts");
    assert!(made[0] >= 3, "{made:?}");
    // Each names a revision etcd had already reached the interval before it was asked for, and
    // each is later than the one before.
    for &(at, revision) in &etcd.compactions {
        let then = etcd
            .revisions
            .iter()
            .filter(|(t, _)| t + 2_000 <= at)
            .map(|&(_, r)| r)
            .max()
            .unwrap_or(0);
        assert!(revision <= then, "{:?}", etcd.compactions);
    }
    assert!(etcd.compactions.windows(2).all(|w| w[0].1 < w[1].1));
    assert_eq!(rs[0].counted(crate::stats::REPLICAS_ERRORS), 0);
    // Settled, they write nothing: once what was written is compacted, nothing more is asked.
    run(&mut rs, &mut etcd, 9_000, 20_000);
    let asked = etcd.compactions.len();
    run(&mut rs, &mut etcd, 20_000, 30_000);
    assert_eq!(etcd.compactions.len(), asked, "{:?}", etcd.compactions);
    assert_eq!(rs[0].counted(crate::stats::REPLICAS_ERRORS), 0);
    // Off: none.
    let (mut quiet, mut rs) = synced(&[1_000], 0);
    rs[0].cfg.etcd.compaction_interval_ms = 0;
    run(&mut rs, &mut quiet, 0, 9_000);
    assert!(quiet.compactions.is_empty());
}

/// Replica 0 logs a stored response at 3 s: how long until replica 1 has it, with ticks every
/// 20 ms and the default busy pace; `sought`: a request on replica 1 is held for it meanwhile.
fn ms_until_a_stored_response_crosses(sought: bool) -> u64 {
    use crate::routing::pick_log::{Event, PickLog};
    let mut etcd = FakeEtcd::default();
    let mut rs: Vec<Replica> = (0..2).map(|i| Replica::new(&format!("r{i}"), 0)).collect();
    let mut log = PickLog::start(&rs[0].vm).unwrap();
    let mut got = Vec::new();
    // Both sync at 3 s, the last tick before it is sent.
    tick_until(&mut rs, &mut etcd, &mut got, 0, 3_001, 0);
    let sent = 3_000 + 7;
    let note = Event::Stored {
        pod: POD.into(),
        id: 2,
        tokens: 300,
    };
    log.publish(&rs[0].vm, 1, &note).unwrap();
    if sought {
        crate::routing::stored::seek(&rs[1].vm, sent + 300).unwrap();
    }
    let at = tick_until(&mut rs, &mut etcd, &mut got, sent, 4_000, 2);
    assert_eq!(got, [2], "once");
    at - sent
}

/// Ticks every 20 ms from `from` until replica 1 has received stored response `id` (its time),
/// or `to`; what it received goes into `got`.
fn tick_until(
    rs: &mut [Replica],
    etcd: &mut FakeEtcd,
    got: &mut Vec<u64>,
    from: u64,
    to: u64,
    id: u64,
) -> u64 {
    for now in (from..to).step_by(20) {
        for r in rs.iter_mut() {
            r.tick(etcd, now);
        }
        assert!(rs[0].sync.take_received().stored.is_empty(), "not its own");
        got.extend(rs[1].sync.take_received().stored.iter().map(|n| n.id));
        if got.contains(&id) {
            return now;
        }
    }
    to
}

#[test]
fn a_stored_response_reaches_a_replica_holding_a_request_for_it_at_the_busy_pace() {
    let unsought = ms_until_a_stored_response_crosses(false);
    let sought = ms_until_a_stored_response_crosses(true);
    // Written at its replica's next tick (the busy pace); read at the other's next sync, slow
    // unless a request there is held for it.
    assert!((400..=520).contains(&unsought), "{unsought} ms");
    assert!(sought <= 60, "{sought} ms");
}

#[test]
fn the_replica_a_pods_split_leaves_a_request_behind_differs_between_pods_and_periods() {
    use crate::replicas::split::{fair_split, Holder};
    // Three replicas' lines wait on each of eight pods that fit five 600-token requests: two get
    // two and one gets one. Which one is their rank's, drawn per pod and per period.
    let behind = |pod: usize, now: u64| {
        let holders: Vec<Holder> = (0..3)
            .map(|i| Holder {
                demand: 9_000,
                unit: 600,
                rank: crate::replicas::sync::rank(
                    &format!("10.0.0.{pod}:8000"),
                    &format!("replica-{i}"),
                    now,
                ),
                ..Holder::default()
            })
            .collect();
        let split = fair_split(3_000, &holders);
        (0..3).filter(|&i| split[i] < 1_200).collect::<Vec<_>>()
    };
    let mut seen = std::collections::BTreeSet::new();
    for pod in 0..8 {
        let one = behind(pod, 0);
        assert_eq!(one.len(), 1, "pod {pod}: {one:?}");
        assert_eq!(behind(pod, 4_999), one, "the same for the period");
        seen.insert(one[0]);
    }
    assert_eq!(seen.len(), 3, "every replica is behind on some pod");
    let periods: std::collections::BTreeSet<_> = (0..8).map(|p| behind(0, p * 5_000)[0]).collect();
    assert!(periods.len() > 1, "and on one pod, not in every period");
}
