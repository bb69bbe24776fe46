//! The routing and admission state machine: several worker VMs on one in-memory host, each with
//! its own `Router`, driven by a random sequence of events: route (prompts over a small alphabet
//! so prefixes collide), grow, finish (possibly twice), rehome, clock steps, pods joining and
//! leaving through `PODS_KEY`, scrape snapshots, and the shared line's operations.
//!
//! Invariants, checked after every event: nothing panics; every pod's prefix-index share
//! (`index_check`, from counters that rise, stay or go back) stays within its bounds; every pod
//! record's reserved tokens and active blocks stay below 1e12 (a u64 that went below zero wraps far
//! above); entries are unique by request id, and a request has at most one entry across all pods; a
//! finished request has no entry anywhere; a routed request's entry reserves its estimate; with a
//! budget, a pod admits only what fits (or a request alone), and "no room" means every pod the
//! request could go to is full for it; a grown entry reserves at least prompt + output, and a grow
//! raises a pod's reservations (past its budget too) by no more than the request holds beyond its
//! own; the line is unique and ordered, and a removed ticket never returns. At the end, once every
//! routed request has finished, every pod's reserved tokens, active blocks and entries are zero and
//! the line is empty.
#![no_main]

use arbitrary::Arbitrary;
use kvgate::admission::forecast::Load;
use kvgate::admission::line::{self, Ticket};
use kvgate::config::{Config, StalePolicy};
use kvgate::estimate::output_dist::OutputDist;
use kvgate::estimate::reservation::{Ended, Estimate};
use kvgate::pods::index_check::{self, HitTotals};
use kvgate::pods::record::{self, Snapshot};
use kvgate::pods::scrape;
use kvgate::routing::router::{Moved, Routed, Router};
use kvgate::store::fake_host::{FakeHost, FakeVm};
use kvgate::store::interface::Store;
use kvgate_fuzz::{chain_hashes, checked_pod, checked_queue, live, live_line, skip};
use libfuzzer_sys::fuzz_target;
use std::collections::HashSet;

// ---- Adapters: the kvgate APIs that are still moving, in one place. --------------------------

/// Which of the router's entry points a request goes through.
#[derive(Clone, Copy, PartialEq)]
enum Reach {
    /// `Router::route`: any pod with room.
    Any,
    /// `Router::route_cached`, as the line retries a head.
    Cached,
    /// `Router::route_patient`, as admission places a request that may wait for its prefix's pod.
    Patient,
}

/// `Router::route`, `route_cached` or `route_patient`: the routed request, or `None` when it was
/// not placed (no pods, no room, room only where its prefix is not cached). The bool says whether
/// it was refused for lack of room anywhere.
fn route(
    r: &mut Router,
    vm: &FakeVm,
    cfg: &Config,
    (hashes, reach): (Vec<u64>, Reach),
    est: &Estimate,
) -> (Option<Routed>, bool) {
    use kvgate::routing::router::Placement;
    let placed = match reach {
        Reach::Any => r.route(vm, cfg, "m", &hashes, est),
        Reach::Cached => r.route_cached(vm, cfg, ("m", &hashes, est)),
        Reach::Patient => r.route_patient(vm, cfg, ("m", &hashes, est)),
    };
    match placed.expect("the fake host never fails") {
        Placement::Routed(routed) => (Some(routed), false),
        Placement::NoPods => (None, false),
        Placement::Discovering => unreachable!("configured pods, no discovery: the pool is known"),
        Placement::NoRoom(belongs) => {
            assert!(POOL.contains(&belongs.as_str()), "{belongs:?}");
            (None, true)
        }
        Placement::Uncached(pods, belongs) => {
            assert!(
                reach != Reach::Any,
                "only route_cached and route_patient say where else there is room"
            );
            assert!(!pods.is_empty(), "room elsewhere names where");
            assert!(pods.iter().all(|p| POOL.contains(&p.as_str())), "{pods:?}");
            assert!(
                POOL.contains(&belongs.as_str()) && !pods.contains(&belongs),
                "{belongs:?} among {pods:?}"
            );
            (None, false)
        }
    }
}

/// The request as the pod's forecast would take it with no shared-prefix discount: the most it
/// can hold on any pod, a copy of its prompt for each of its answers, as on a pod caching no
/// prefixes (whether a pod caches them the router reads from its copy of the pod's record, which
/// may be older).
fn undiscounted(cfg: &Config, est: &Estimate) -> Load {
    let copies = est.choices;
    Load::fresh(
        est,
        (est.prompt_tokens as f64 * cfg.estimator.safety_factor * copies as f64).round() as u64,
        est.prompt_sigma * copies,
    )
}

/// The pod's forecast with `extra`, as admission computes it at `now_ms`.
fn forecast(
    cfg: &Config,
    r: &Router,
    rec: &record::PodRecord,
    extra: Option<Load>,
    now_ms: u64,
) -> u64 {
    let block = u64::from(r.block_tokens(&cfg.routing));
    let at = record::At::of(cfg, now_ms);
    rec.forecast(extra, cfg.admission.headroom(), block, at)
}

/// The pod's token budget as admission computes it.
fn budget(cfg: &Config, snapshot: Option<&Snapshot>) -> Option<u64> {
    kvgate::admission::budget::budget_tokens(cfg, snapshot)
}

// ---- The model. -------------------------------------------------------------------------------

const POOL: [&str; 4] = [
    "10.0.0.1:8000",
    "10.0.0.2:8000",
    "10.0.0.3:8000",
    "[fd00::4]:8000",
];
const MAX_OPS: usize = 192;

#[derive(Arbitrary, Debug)]
struct Setup {
    vms: u8,
    static_pods: u8,
    block_tokens: u8,
    ttl: u8,
    fallback: u8,
    temperature: bool,
    stale_saturated: bool,
    budget: u8,
    admission: bool,
    utilization: u8,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Route {
        vm: u8,
        path: u32,
        len: u8,
        prompt: u32,
        output: u16,
        cost: u32,
    },
    Grow {
        req: u8,
        tokens: u16,
        /// One more of its answers ends here (a request for several), having made this share
        /// (in 255ths) of what the answers still running have made.
        ends: Option<u8>,
    },
    Finish {
        req: u8,
    },
    FinishAgain {
        req: u8,
    },
    Rehome {
        req: u8,
        pod: u8,
    },
    Advance {
        ms: u16,
    },
    AdvanceLong {
        s: u8,
    },
    Pods {
        mask: u8,
    },
    Scrape {
        pod: u8,
        healthy: bool,
        running: u8,
        waiting: u8,
        kv: u8,
        capacity: u32,
        age_s: u8,
        block: u8,
        caches_prefixes: bool,
        /// The engine's prefix-cache counters (`u16::MAX` queries: not on the page); they rise,
        /// stay or fall (a restart) as the scrapes come.
        hits: u16,
        queries: u16,
    },
    Sync {
        vm: u8,
    },
    Enqueue {
        vm: u8,
        priority: i8,
        tenant: u8,
        cost: u32,
        boosted: bool,
        wait_ms: u16,
        /// The pods it may go to: four groups' bits, anywhere at 0.
        reach: u8,
    },
    Remove {
        ticket: u8,
        /// Admitted onto the pod of bit `1 << (n % 5)` (`1 << 4`: one no ticket reaches), or not.
        admitted: Option<u8>,
    },
    ChargeDirect {
        tenant: u8,
        cost: u32,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    setup: Setup,
    ops: Vec<Op>,
}

fn pick<T: Copy>(options: &[T], sel: u8) -> T {
    options[usize::from(sel) % options.len()]
}

fn config(s: &Setup) -> Config {
    let pods: Vec<&str> = POOL
        .iter()
        .enumerate()
        .filter(|(i, _)| s.static_pods & (1 << i) != 0)
        .map(|(_, p)| *p)
        .collect();
    let json = serde_json::json!({
        "pods": pods,
        "metrics": {
            "staleAfterMs": 5_000,
            "stalePolicy": if s.stale_saturated { "saturated" } else { "ignore" },
        },
        "routing": {
            "blockTokens": pick(&[0u32, 1, 16, 64], s.block_tokens),
            "requestTtlMs": pick(&[2_000u64, 60_000, 660_000], s.ttl),
            "fallbackPods": u32::from(s.fallback % 4),
            "temperature": if s.temperature { 0.5 } else { 0.0 },
        },
        "admission": {
            "enabled": s.admission,
            "budgetTokens": pick(&[0u64, 500, 5_000, 100_000], s.budget),
            "utilization": pick(&[0.9, 1.0, 0.01], s.utilization),
        },
    });
    match Config::parse(json.to_string().as_bytes()) {
        Ok(c) => c,
        Err(e) => panic!("the target's own config is invalid: {e}"),
    }
}

struct Req {
    owner: usize,
    routed: Routed,
    /// The estimate it was routed with: its outlook as it streams comes from it.
    est: Estimate,
    out: u64,
    /// Its answers that have ended, and their tokens.
    ended: Ended,
    finished: bool,
}

struct World {
    host: FakeHost,
    cfg: Config,
    vms: Vec<FakeVm>,
    routers: Vec<Router>,
    reqs: Vec<Req>,
    queued: Vec<u64>,
    removed: HashSet<u64>,
    next_ticket: u64,
}

impl World {
    fn store(&self) -> &FakeVm {
        &self.vms[0]
    }

    fn records(&self) -> Vec<record::PodRecord> {
        POOL.iter().map(|p| checked_pod(self.store(), p)).collect()
    }

    fn check(&self) {
        let now = self.host.now_ms();
        let records = self.records();
        let mut seen = HashSet::new();
        for (pod, rec) in POOL.iter().zip(&records) {
            // Whatever the engine's counters did, the index keeps a share of the pod it can use.
            if let Some(s) = rec.snapshot {
                let share = s.index_share();
                assert!(
                    (index_check::MIN_SHARE..=1.0).contains(&share),
                    "{pod}: index share {share}"
                );
            }
            for e in &live(rec, now).entries {
                assert!(
                    seen.insert(e.id),
                    "request {} has entries on two pods (one on {pod})",
                    e.id
                );
            }
            // A shared prefix is counted by an entry the record holds: whoever ended, whichever
            // worker ended it, a request leaning on it took it on or leans on one that did.
            for e in &rec.entries {
                assert_eq!(e.leans_on != 0, e.shared_blocks > 0, "{pod}: {e:?}");
                assert!(
                    e.leans_on == 0 || rec.entries.iter().any(|h| h.id == e.leans_on),
                    "{pod}: request {} leans on {}, which has no entry: {:?}",
                    e.id,
                    e.leans_on,
                    rec.entries
                );
            }
        }
        for r in self.reqs.iter().filter(|r| r.finished) {
            assert!(
                !seen.contains(&r.routed.request),
                "finished request {} still holds an entry",
                r.routed.request
            );
        }
        let q = checked_queue(self.store());
        for t in &q.tickets {
            assert!(
                !self.removed.contains(&t.id),
                "removed ticket {} is back",
                t.id
            );
        }
    }

    /// `route` found no room on worker `v`: every pod it could pick must be full for this
    /// request. The charge on a pod is at most the estimate's cost, so a full pod has something
    /// reserved and no room for the cost on top.
    fn check_no_room(&self, v: usize, est: &Estimate) {
        let now = self.host.now_ms();
        let stale_after = self.cfg.metrics.stale_after_ms;
        let records: Vec<(&String, record::PodRecord)> = self.routers[v]
            .pods()
            .iter()
            .map(|p| (p, live(&checked_pod(self.store(), p), now)))
            .collect();
        let fresh = |r: &record::PodRecord| {
            r.snapshot
                .is_some_and(|s| now.saturating_sub(s.at_ms) <= stale_after)
        };
        let any_fresh = records.iter().any(|(_, r)| fresh(r));
        // Eligible: healthy or never scraped; a stale pod only under the `ignore` policy, or
        // when no pod is fresh. When none is eligible, every pod that is not down is tried (no
        // model lists here: a pod serves the model unless it is down).
        let eligible = |r: &record::PodRecord| match r.snapshot {
            Some(s) if !s.healthy => false,
            Some(_) if !fresh(r) => {
                self.cfg.metrics.stale_policy == StalePolicy::Ignore || !any_fresh
            }
            _ => true,
        };
        let any_eligible = records.iter().any(|(_, r)| eligible(r));
        // A shared prefix only lowers what the request holds, so a pod that is full for it is
        // full for it undiscounted too.
        let down = |r: &record::PodRecord| r.snapshot.is_some_and(|s| !s.healthy);
        let tried = |r: &record::PodRecord| {
            if any_eligible {
                eligible(r)
            } else {
                !down(r)
            }
        };
        for (pod, rec) in records.iter().filter(|(_, r)| tried(r)) {
            let load = undiscounted(&self.cfg, est);
            let with = forecast(&self.cfg, &self.routers[v], rec, Some(load), now);
            let full = budget(&self.cfg, rec.snapshot.as_ref())
                .is_some_and(|b| !rec.entries.is_empty() && with > b);
            assert!(
                full,
                "no room, yet {pod} could take {load:?} (forecast with it {with}): {:?}",
                self.records()
            );
        }
    }

    /// The request's live (unexpired) entry on the pod.
    fn entry_of(&self, pod: &str, id: u64) -> Option<record::RequestEntry> {
        live(&checked_pod(self.store(), pod), self.host.now_ms())
            .entries
            .into_iter()
            .find(|e| e.id == id)
    }

    fn publish_pods(&self, pods: &[String]) {
        // As discovery does: new records created, the pool published, departed pods marked down.
        let s = self.store();
        scrape::publish_pods(s, pods, s.now_ms()).expect("fake host");
    }

    fn live(&self, sel: u8) -> Option<usize> {
        let live: Vec<usize> = (0..self.reqs.len())
            .filter(|&i| !self.reqs[i].finished)
            .collect();
        (!live.is_empty()).then(|| live[usize::from(sel) % live.len()])
    }

    fn finish(&mut self, i: usize) {
        let owner = self.reqs[i].owner;
        let routed = self.reqs[i].routed.clone();
        self.routers[owner]
            .finish(&self.vms[owner], &routed)
            .expect("fake host");
        self.reqs[i].finished = true;
        for pod in POOL {
            assert!(
                self.entry_of(pod, routed.request).is_none(),
                "request {} still on {pod} after finish",
                routed.request
            );
        }
    }

    fn apply(&mut self, op: &Op) {
        let now = self.host.now_ms();
        match *op {
            Op::Route {
                vm,
                path,
                len,
                prompt,
                output,
                cost,
            } => {
                let v = usize::from(vm) % self.vms.len();
                let mut est = Estimate::exact(u64::from(prompt % 2_000_000), u64::from(output));
                est.cost = u64::from(cost % (1 << 20));
                if cost & 1 == 1 {
                    // Length unknown: the prior's long tail up to the output cap, a guess
                    // (its error counted over the pod) half the time.
                    est.output = OutputDist::prior(256);
                    est.max_output_tokens = 8192;
                    est.bounded = false;
                    est.output_guessed = cost & 64 == 64;
                }
                // Parallel sampling: its choices grow it that many tokens a step.
                est.choices = 1 + u64::from(cost >> 3) % 4;
                est.output_tokens *= est.choices;
                est.max_output_tokens *= est.choices;
                let hashes = chain_hashes(path, len);
                let reach = match (cost >> 1) % 3 {
                    0 => Reach::Any,
                    1 => Reach::Cached,
                    _ => Reach::Patient,
                };
                let (routed, no_room) = route(
                    &mut self.routers[v],
                    &self.vms[v],
                    &self.cfg,
                    (hashes, reach),
                    &est,
                );
                if no_room {
                    assert!(self.cfg.admission.enabled, "no room without admission");
                    self.check_no_room(v, &est);
                }
                let Some(routed) = routed else {
                    return;
                };
                assert!(
                    POOL.contains(&routed.pod.as_str()),
                    "routed to {}",
                    routed.pod
                );
                assert_eq!(routed.order.first(), Some(&routed.pod), "{routed:?}");
                assert!(
                    routed.order.len() <= 1 + self.cfg.routing.fallback_pods as usize,
                    "{routed:?}"
                );
                let unique: HashSet<&String> = routed.order.iter().collect();
                assert_eq!(
                    unique.len(),
                    routed.order.len(),
                    "duplicate fallbacks: {routed:?}"
                );
                let rec = checked_pod(self.store(), &routed.pod);
                let entry = rec.entries.iter().find(|e| e.id == routed.request);
                let entry = entry.unwrap_or_else(|| panic!("routed without an entry: {routed:?}"));
                // What the request holds at first is its prompt (safety included), less a prefix
                // another request already holds there; its limit is its own.
                let most = undiscounted(&self.cfg, &est);
                assert!(
                    entry.held_tokens <= most.held,
                    "entry holds {} for a prompt of {} tokens",
                    entry.held_tokens,
                    est.prompt_tokens
                );
                assert_eq!(
                    u64::from(entry.left),
                    est.steps_left(est.choices, 0).min(u64::from(u32::MAX))
                );
                assert_eq!(u64::from(entry.choices), est.choices);
                assert_eq!(entry.outlook, most.outlook, "{entry:?}");
                // The promise: admitted only within the budget, unless it runs alone.
                if let Some(b) = budget(&self.cfg, rec.snapshot.as_ref()) {
                    let rec = live(&rec, now);
                    let with = forecast(&self.cfg, &self.routers[v], &rec, None, now);
                    assert!(
                        with <= b || rec.entries.len() == 1,
                        "pod {} over budget {b}: forecast {with} after admitting {entry:?}",
                        routed.pod,
                    );
                }
                self.reqs.push(Req {
                    owner: v,
                    routed,
                    est,
                    out: 0,
                    ended: Ended::default(),
                    finished: false,
                });
            }
            Op::Grow { req, tokens, ends } => {
                let Some(i) = self.live(req) else { return };
                let owner = self.reqs[i].owner;
                self.reqs[i].out += u64::from(tokens);
                let out = self.reqs[i].out;
                let est = self.reqs[i].est;
                let was = self.reqs[i].ended;
                if let Some(share) = ends.filter(|_| was.answers + 1 < est.choices) {
                    let live = out - was.tokens;
                    let ending = live * u64::from(share) / 255 / (est.choices - was.answers);
                    self.reqs[i].ended = Ended {
                        answers: was.answers + 1,
                        tokens: was.tokens + ending,
                    };
                }
                let ended = self.reqs[i].ended;
                let pod = self.reqs[i].routed.pod.clone();
                let before = live(&checked_pod(self.store(), &pod), now);
                let streamed = self.reqs[i].routed.streamed;
                let wrote = self.routers[owner]
                    .grow(
                        &self.vms[owner],
                        &self.cfg,
                        &mut self.reqs[i].routed,
                        &est,
                        out,
                        ended,
                    )
                    .expect("fake host");
                let routed = &self.reqs[i].routed;
                // Its answers still running, and what they have made.
                let running = est.choices - ended.answers;
                let made = out - ended.tokens;
                if wrote {
                    let e = self
                        .entry_of(&routed.pod, routed.request)
                        .unwrap_or_else(|| panic!("grow wrote but no entry: {routed:?}"));
                    let bt = u64::from(routed.block_tokens);
                    assert_eq!(u64::from(e.output_blocks), made.div_ceil(bt), "{e:?}");
                    assert_eq!(u64::from(e.choices), running, "{e:?}");
                    // Each makes a token a step, from where they stand on average.
                    let limit = est.max_output_tokens / est.choices;
                    let left = (limit * running).saturating_sub(made).div_ceil(running);
                    assert_eq!(u64::from(e.left), left.min(u64::from(u32::MAX)), "{e:?}");
                    let each = est.output.outlook(made / running, limit);
                    assert_eq!(e.outlook, each, "{e:?}");
                }
                // What the pod holds rises by what this request streamed since its last write,
                // once (never by its whole output again), less what its answers that ended since
                // had made.
                let after = live(&checked_pod(self.store(), &pod), now);
                let growth = if wrote { out - streamed } else { 0 };
                assert!(
                    after.held_tokens() <= before.held_tokens() + growth,
                    "{pod}: streaming {streamed} -> {out} took what is held from {} to {}",
                    before.held_tokens(),
                    after.held_tokens()
                );
            }
            Op::Finish { req } => {
                if let Some(i) = self.live(req) {
                    self.finish(i);
                }
            }
            Op::FinishAgain { req } => {
                let done: Vec<usize> = (0..self.reqs.len())
                    .filter(|&i| self.reqs[i].finished)
                    .collect();
                if !done.is_empty() {
                    let i = done[usize::from(req) % done.len()];
                    let owner = self.reqs[i].owner;
                    let gone = self.routers[owner]
                        .finish(&self.vms[owner], &self.reqs[i].routed)
                        .expect("fake host");
                    assert!(gone.is_none(), "a second finish removed {gone:?}");
                }
            }
            Op::Rehome { req, pod } => {
                let Some(i) = self.live(req) else { return };
                let owner = self.reqs[i].owner;
                let to = POOL[usize::from(pod) % POOL.len()];
                let from = self.reqs[i].routed.pod.clone();
                let had = self.entry_of(&from, self.reqs[i].routed.request);
                // The high bit: routing observes (Envoy chose), else the pick failed.
                let why = if pod & 0x80 != 0 {
                    Moved::EnvoyChose
                } else {
                    Moved::PickFailed
                };
                self.routers[owner]
                    .rehome(
                        &self.vms[owner],
                        &self.cfg,
                        &mut self.reqs[i].routed,
                        to,
                        why,
                    )
                    .expect("fake host");
                let routed = &self.reqs[i].routed;
                if routed.pod != from {
                    assert_eq!(routed.pod, to);
                    assert!(had.is_some(), "moved a request that had no entry");
                    assert!(
                        self.entry_of(&from, routed.request).is_none(),
                        "left behind on {from}"
                    );
                    assert!(self.entry_of(to, routed.request).is_some(), "not on {to}");
                }
            }
            Op::Advance { ms } => self.host.advance_ms(u64::from(ms)),
            Op::AdvanceLong { s } => self.host.advance_ms(u64::from(s) * 1_000),
            Op::Pods { mask } => {
                let pods: Vec<String> = POOL
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, p)| p.to_string())
                    .collect();
                self.publish_pods(&pods);
            }
            Op::Scrape {
                pod,
                healthy,
                running,
                waiting,
                kv,
                capacity,
                age_s,
                block,
                caches_prefixes,
                hits,
                queries,
            } => {
                let snapshot = Snapshot {
                    at_ms: now.saturating_sub(u64::from(age_s) * 100),
                    healthy,
                    running: f64::from(running),
                    waiting: f64::from(waiting),
                    kv_usage: if kv == 255 {
                        f64::NAN
                    } else {
                        f64::from(kv) / 254.0
                    },
                    capacity_tokens: u64::from(capacity % (1 << 22)),
                    block_size: pick(&[0u32, 1, 16, 32], block),
                    no_prefix_caching: !caches_prefixes,
                    // A counter that rises, stays or resets as the scrapes come.
                    preemptions: f64::from(running / 16),
                    hit_totals: (queries != u16::MAX).then(|| HitTotals {
                        hits: f64::from(hits),
                        queries: f64::from(queries),
                        tally: Default::default(),
                    }),
                    ..Snapshot::default()
                };
                let pod = POOL[usize::from(pod) % POOL.len()];
                record::write_snapshot(
                    self.store(),
                    pod,
                    snapshot,
                    self.cfg.metrics.waiting_grace_ms,
                    &self.cfg,
                )
                .expect("fake host");
            }
            Op::Sync { vm } => {
                let v = usize::from(vm) % self.vms.len();
                self.routers[v]
                    .sync(&self.vms[v], &self.cfg)
                    .expect("fake host");
            }
            Op::Enqueue {
                vm,
                priority,
                tenant,
                cost,
                boosted,
                wait_ms,
                reach,
            } => {
                let v = usize::from(vm) % self.vms.len();
                self.next_ticket += 1;
                let ticket = Ticket {
                    id: (1 << 48) | self.next_ticket,
                    vm: self.routers[v].vm(),
                    priority: i32::from(priority),
                    boosted,
                    start_tag: 0.0,
                    enqueued_ms: now,
                    deadline_ms: now + u64::from(wait_ms),
                    cost: u64::from(cost % (1 << 20)),
                    wants: 0,
                    reach: match reach % 16 {
                        0 => line::ANYWHERE,
                        bits => u64::from(bits),
                    },
                    // What it needs of an empty pod: its expected size and a margin.
                    need: u64::from(cost % (1 << 20)) + u64::from(wait_ms % 1_024),
                };
                let out = line::enqueue(&self.vms[v], ticket, u64::from(tenant % 8), 8_192.0, 16)
                    .expect("fake host");
                match out {
                    Ok(line::Joined {
                        ticket: t,
                        displaced,
                    }) => {
                        assert_eq!(t.id, ticket.id);
                        let q = checked_queue(self.store());
                        assert!(
                            q.tickets.iter().any(|x| x.id == t.id),
                            "enqueued but absent"
                        );
                        // A full line's place goes to a newcomer of higher precedence only, and
                        // the ticket it displaces, one that competed with it, is gone.
                        if let Some(d) = displaced {
                            assert!(d.reach & t.reach != 0, "displaced a ticket for other pods");
                            assert!(d.priority <= t.priority, "displaced a higher band");
                            assert!(
                                !q.tickets.iter().any(|x| x.id == d.id),
                                "displaced but present"
                            );
                            self.queued.retain(|&id| id != d.id);
                        }
                        self.queued.push(t.id);
                    }
                    // Told to come back no sooner than now, and no later than it would have
                    // been answered 503 in the line.
                    Err(line::Refused::Full(at)) => assert!(
                        at.is_none_or(|at| (now..=ticket.deadline_ms).contains(&at)),
                        "refused at {now} with a deadline of {}, told to come back at {at:?}",
                        ticket.deadline_ms
                    ),
                }
            }
            Op::Remove { ticket, admitted } => {
                if self.queued.is_empty() {
                    return;
                }
                let id = self.queued[usize::from(ticket) % self.queued.len()];
                let present = checked_queue(self.store())
                    .tickets
                    .iter()
                    .any(|t| t.id == id);
                let before = checked_queue(self.store());
                let leave = match admitted {
                    Some(n) => line::Leave::Admitted(1 << (n % 5)),
                    None => line::Leave::NotAdmitted,
                };
                let removed = line::remove(self.store(), id, leave).expect("fake host");
                if removed {
                    assert!(present, "removed ticket {id} that was not in the line");
                    assert!(self.removed.insert(id), "ticket {id} removed twice");
                    // A pass is counted only against a head it went past on a pod that head's
                    // group may take.
                    let after = checked_queue(self.store());
                    let headed = before.leaders().iter().any(|(t, free)| {
                        t.id == id && matches!(leave, line::Leave::Admitted(b) if b & free != 0)
                    });
                    if headed || leave == line::Leave::NotAdmitted {
                        for t in &after.tickets {
                            assert!(
                                after.passes(t.id) <= before.passes(t.id),
                                "ticket {id} left ({leave:?}) where it headed the line, yet {} was passed: {before:?} → {after:?}",
                                t.id
                            );
                        }
                    }
                }
            }
            Op::ChargeDirect { tenant, cost } => {
                line::charge_direct(
                    self.store(),
                    u64::from(tenant % 8),
                    u64::from(cost % (1 << 20)),
                )
                .expect("fake host");
            }
        }
    }
}

fuzz_target!(|input: Input| {
    let cfg = config(&input.setup);
    let host = FakeHost::new();
    host.set_now_ms(1_000_000);
    let vms: Vec<FakeVm> = (0..1 + usize::from(input.setup.vms % 3))
        .map(|_| host.vm())
        .collect();
    let routers: Vec<Router> = vms
        .iter()
        .map(|vm| Router::start(vm, &cfg).expect("fake host"))
        .collect();
    line::ensure(&vms[0]).expect("fake host");
    let mut world = World {
        host,
        cfg,
        vms,
        routers,
        reqs: Vec::new(),
        queued: Vec::new(),
        removed: HashSet::new(),
        next_ticket: 0,
    };
    for op in input.ops.iter().take(MAX_OPS) {
        world.apply(op);
        world.check();
    }
    // Everything still in flight finishes; every count returns to exactly zero.
    for i in 0..world.reqs.len() {
        if !world.reqs[i].finished {
            world.finish(i);
        }
    }
    world.check();
    let now = world.host.now_ms();
    for (pod, raw) in POOL.iter().zip(world.records()) {
        // Expired entries are logically gone; unless a known bug is skipped, they must also be
        // gone from what readers (routing, budgets, gauges) see.
        let rec = if skip("expired-entries") {
            live(&raw, now)
        } else {
            raw
        };
        assert!(
            rec.entries.is_empty() && rec.held_tokens() == 0,
            "{pod} holds {} entries, {} tokens after every request finished: {rec:?}",
            rec.entries.len(),
            rec.held_tokens()
        );
    }
    for id in world.queued.clone() {
        line::remove(world.store(), id, line::Leave::NotAdmitted).expect("fake host");
    }
    let raw = checked_queue(world.store());
    let q = if skip("abandoned-tickets") {
        live_line(&raw, now)
    } else {
        raw
    };
    assert!(
        q.tickets.is_empty(),
        "tickets left after all were removed: {q:?}"
    );
});
