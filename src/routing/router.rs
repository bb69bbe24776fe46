//! One VM's router: the pod set, the replicas of the prefix index and of active blocks (kept
//! current from the pick log), and the three moments of a routed request: `route` (rank the pods,
//! record the dispatch in the chosen pod's shared record, tell the other workers), `grow` (its
//! output crossed a block boundary) and `finish` (remove it, exactly once).

use crate::admission::budget::{budget_tokens, fits};
use crate::admission::line;
use crate::config::{Config, RoutingConfig, MAX_BLOCK_TOKENS};
use crate::estimate::reservation::{Ended, Estimate};
use crate::models::served::{adapter_id, ServedView};
use crate::pods::pool::{decode_pods, PODS_KEY};
use crate::pods::record::{self, PodRecord, RequestEntry};
use crate::pods::scrape::{first_discovery_ms, first_list_ms};
use crate::routing::active_blocks::ActiveBlocks;
use crate::routing::adapters::{Adapters, Fit};
use crate::routing::demand::Demand;
use crate::routing::pick::{rank, Candidate, Rng, Scored, Terms};
use crate::routing::pick_log::{Dispatch, Event, PickLog, MAX_EVENT_BLOCKS};
use crate::routing::pod_id::{PodId, PodMap};
use crate::routing::prefix_index::PrefixIndex;
use crate::routing::record_copies::RecordCopies;
use crate::routing::step_phase::StepPhases;
use crate::routing::unseen_lead::Leads;
use crate::store::codec::Reader;
use crate::store::interface::{create_if_missing, update, Store, StoreError};
use std::cell::{Cell, OnceCell};
use std::rc::Rc;

mod rehome;
mod steps;
pub use rehome::Moved;
use steps::{candidates, charges, mostly_cached, Ask};

const VM_SEQ_KEY: &str = "kvgate.vm.seq";
const PODS_CACHE_MS: u64 = 1_000;
/// How long what a VM learned from the pod records serves its upkeep (`Router::tend`): a VM
/// that routes learns on every request and does not read them again on its tick.
const LEARN_MS: u64 = 1_000;
/// A VM that has routed nothing for this long stops replaying the other workers' picks on its
/// tick (`Router::tend`); when it routes again, it first replays what it missed (at most the
/// log's ring). Envoy's main thread never routes, and replaying every request's prompt blocks
/// there doubled the index work of each request (with two workers, tripled it) and, at 256 KB
/// prompts, took 12–25 ms of every tick from the CPU the workers serve on (kvgate's p99 four
/// times its p50). Long enough that a worker between bursts keeps its replicas current.
const REPLAY_IDLE_MS: u64 = 60_000;
/// A block size derived from the pods is at least this: a multiple of every smaller power of two
/// (SGLang reports pages of one token), and long enough that `maxPromptBlocks` covers long prompts.
const MIN_DERIVED_BLOCK_TOKENS: u32 = 16;

/// Where a request goes.
#[derive(Debug, Clone, PartialEq)]
pub enum Placement {
    Routed(Routed),
    /// No pods known: Envoy's own balancing decides.
    NoPods,
    /// No pods known yet, and discovery has yet to answer for the first time
    /// (`Router::discovering`): the request waits for the pool rather than pass its budgets. Or
    /// no model list names the request's model while a pod's first list is awaited
    /// (`ServedView::awaits_list`): it waits to learn which pods serve it.
    Discovering,
    /// Every eligible pod's budget is full: the request must wait; the pod it would take first.
    NoRoom(String),
    /// Asked for a pod holding the prompt's cached prefix ([`Router::route_cached`]): only pods
    /// that would compute it again have room; these, and the pod it belongs on (the cheapest
    /// caching it, or its group's home), which has none.
    Uncached(Vec<String>, String),
}

/// A request kvgate routed, as the response side needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    pub request: u64,
    pub pod: String,
    /// `pod`'s key in this VM's routing tables (`pod_id`).
    pub pod_id: PodId,
    /// Output tokens its entry in the pod's record accounts for (written at block boundaries).
    pub streamed: u64,
    /// Its answers whose end its entry has taken (a request for several), and their tokens,
    /// which the engine freed.
    pub ended: Ended,
    /// The pick first, then fallbacks, as written in the override header.
    pub order: Vec<String>,
    pub prompt_blocks: usize,
    pub cached_blocks: usize,
    pub output_blocks: u32,
    /// Tokens per block when it was routed: its output grows in blocks of this size.
    pub block_tokens: u32,
    /// The pick had to load the request's adapter (it was not resident there).
    pub adapter_load: bool,
    /// With debug headers on: every candidate best first, as
    /// `pod cost=prefill+decode+active+queue+kv+adapter wait=<µs>us` (the wait for the engine's
    /// step under way, where known),
    /// ` full` where its budget had no room.
    pub ranking: String,
    /// Placed past every budget: no pod had room, and admission only observes
    /// (`admission.mode` `observe`, [`Router::route_past_budget`]).
    pub over_budget: bool,
    /// Its prompt's hot prefix was held to the pods caching it, rather than copied by cost,
    /// because the pool's KV read as about to run short (`routing::demand`).
    pub hot_held: bool,
    /// When it was dispatched, and when its stream's last chunk with tokens came, in µs
    /// (`routing::step_phase`).
    pub dispatched_us: u64,
    pub last_token_us: Option<u64>,
    /// The pod's pace (s a token) as its answer's last growth at that pace read it
    /// (`Router::grow_unseen`), 0 before any: what the lead it teaches at its end is measured
    /// against, with no read of the pod's record when it ends.
    pub unseen_itl_s: f64,
    /// The most output tokens one chunk of its stream brought an answer: how far behind the
    /// engine its stream was seen to reach the filter (`forecast::Lag`), written with its entry.
    pub lag: u16,
}

impl Routed {
    /// Seconds since it was dispatched.
    fn age_s(&self, store: &dyn Store) -> f64 {
        store.now_us().saturating_sub(self.dispatched_us) as f64 / 1e6
    }
}

/// Whether a pick must fit its pod's budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Room {
    Required,
    /// It must fit, on a pod holding at least half of what the pod holding most of the prompt
    /// holds (cached or held by in-flight requests), when some pod holds half the prompt; on its
    /// group's home when none does (`Router::route_cached`).
    Cached,
    /// As `Required`, but as `Cached` for a prompt whose cached prefix few in-flight requests
    /// share (`Router::route_patient`).
    Patient,
    /// Admission observes only: the best-ranked pod takes the request whatever its budget says.
    Ignored,
}

fn explain(
    candidates: &[Candidate],
    ranked: &[Scored],
    prompt_blocks: usize,
    own_blocks: u64,
    w: &RoutingConfig,
    room: impl Fn(usize) -> bool,
) -> String {
    // Whole numbers written as integers: `{:.0}` of a float takes the exact (bignum) path, and
    // this header is built on every request while debug headers are on.
    let whole = |x: f64| x.round_ties_even() as i64;
    let mut out = String::with_capacity(ranked.len() * 48);
    for s in ranked {
        let c = &candidates[s.index];
        let t = Terms::of(c, prompt_blocks, own_blocks, w);
        if !out.is_empty() {
            out.push_str(", ");
        }
        out.push_str(c.pod);
        out.push(' ');
        push_int(&mut out, whole(s.cost));
        let terms = [t.prefill, t.decode, t.active, t.queue, t.kv, t.adapter];
        for (k, term) in terms.into_iter().enumerate() {
            out.push(if k == 0 { '=' } else { '+' });
            push_int(&mut out, whole(term));
        }
        if c.step_wait_us > 0 {
            out.push_str(" wait=");
            push_int(&mut out, c.step_wait_us as i64);
            out.push_str("us");
        }
        if !room(s.index) {
            out.push_str(" full");
        }
    }
    out
}

/// Appends `n` in decimal, as `write!` would: `write!` takes the formatter's padding path for
/// every integer, several times the cost of the digits, and the ranking writes seven per
/// candidate on every request.
fn push_int(out: &mut String, n: i64) {
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    let mut rest = n.unsigned_abs();
    for d in digits.iter_mut().rev() {
        *d = b'0' + (rest % 10) as u8;
        start -= 1;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    if n < 0 {
        out.push('-');
    }
    out.extend(digits.iter().skip(start).map(|&d| char::from(d)));
}

/// What bounds a pod's prefix index, from its record: its capacity in blocks less the share the
/// engine's counters say the index should leave out, and how many engine restarts the record has
/// counted (`pods::index_check`).
#[derive(Clone, Copy)]
struct IndexBound {
    blocks: usize,
    restarts: u32,
}

/// The most blocks a pod's prefix index keeps: its bound as last read from its record, else the
/// configured capacity.
fn index_capacity(bounds: &PodMap<IndexBound>, pod: PodId, cfg: &Config) -> usize {
    bounds
        .get(&pod)
        .map_or(cfg.routing.pod_capacity_blocks as usize, |b| b.blocks)
}

pub struct Router {
    vm: u32,
    next_request: u32,
    log: PickLog,
    prefix: PrefixIndex,
    active: ActiveBlocks,
    adapters: Adapters,
    /// What each pod serves, as last scraped (`models::served`).
    served: ServedView,
    pods: Vec<String>,
    /// Each pod's key in this VM's routing tables (`pod_id`), as `pods` is ordered.
    pod_ids: Vec<PodId>,
    /// Each pod's bit in a waiting request's reach (`line::pod_bits`), as `pods` is ordered.
    pod_bits: Vec<u64>,
    pods_read_ms: Option<u64>,
    /// Whether the discovered pod set has been published (`kvgate.pods` exists), as last read.
    discovered: bool,
    /// When this VM started: how long its requests may wait for the first discovery.
    started_ms: u64,
    /// What bounds each pod's prefix index, as last read from its record: replayed picks are
    /// bounded by it too, not only this VM's own.
    index_bounds: PodMap<IndexBound>,
    /// The largest block size the pods' metrics reported, 0 before any did.
    engine_block_tokens: u32,
    /// When this VM last learned from the pod records (`learn`).
    learned_ms: Option<u64>,
    /// When this VM last routed a request (`REPLAY_IDLE_MS`).
    routed_ms: Option<u64>,
    /// The pod records as this VM last read or wrote them, for ranking.
    copies: RecordCopies,
    /// Where each pod stands in its engine step, from the streams this VM carries.
    phases: StepPhases,
    /// The rate of picks and the requests' lifetime: whether the pool's KV is about to run short.
    demand: Demand,
    /// How long each pod's unseen answers take before their tokens begin, from those this VM
    /// carried (`routing::unseen_lead`).
    leads: Leads,
}

impl Router {
    /// Joins the pool of VMs: takes a VM number, creates the keys requests will touch.
    pub fn start(store: &dyn Store, cfg: &Config) -> Result<Router, StoreError> {
        create_if_missing(store, VM_SEQ_KEY, &0u32.to_le_bytes())?;
        let vm = update(store, VM_SEQ_KEY, |cur| {
            let n = cur
                .and_then(|b| Reader(b).u32())
                .unwrap_or(0)
                .wrapping_add(1);
            Some((n.to_le_bytes().to_vec(), n))
        })?
        .unwrap_or(0);
        for pod in &cfg.pods {
            record::ensure(store, pod)?;
        }
        crate::routing::stored::ensure(store)?;
        Ok(Router {
            vm,
            next_request: 0,
            log: PickLog::start(store)?,
            prefix: PrefixIndex::new(cfg.routing.prefix_ttl_ms),
            active: ActiveBlocks::default(),
            adapters: Adapters::default(),
            served: ServedView::of(&cfg.pods),
            pods: cfg.pods.clone(),
            pod_ids: cfg.pods.iter().map(|p| PodId::of(p)).collect(),
            pod_bits: crate::admission::line::pod_bits(&cfg.pods),
            pods_read_ms: None,
            discovered: false,
            started_ms: store.now_ms(),
            index_bounds: PodMap::default(),
            learned_ms: None,
            routed_ms: None,
            engine_block_tokens: 0,
            copies: RecordCopies::default(),
            phases: StepPhases::new(cfg.routing.dispatch_delay_ms * 1_000.0),
            leads: Leads::default(),
            demand: Demand::default(),
        })
    }

    /// Tokens per hashed block: the configured size, else the largest block size the pods report
    /// (engines use powers of two, so it is a multiple of the others'), at least 16.
    pub fn block_tokens(&self, r: &RoutingConfig) -> u32 {
        if r.block_tokens > 0 {
            r.block_tokens
        } else {
            self.engine_block_tokens
                .clamp(MIN_DERIVED_BLOCK_TOKENS, MAX_BLOCK_TOKENS)
        }
    }

    pub fn vm(&self) -> u32 {
        self.vm
    }

    /// A request id unique across VMs: this VM's number, then a counter.
    pub fn next_request_id(&mut self) -> u64 {
        self.next_request = self.next_request.wrapping_add(1);
        (u64::from(self.vm) << 32) | u64::from(self.next_request)
    }

    pub fn pods(&self) -> &[String] {
        &self.pods
    }

    /// Each pod's bit in a waiting request's reach (`line::pod_bits`), as `pods` orders them.
    pub fn pod_bits(&self) -> &[u64] {
        &self.pod_bits
    }

    /// The bit of `pod` (`pod_bits`); 0 for a pod not in the pool.
    pub fn bit_of(&self, pod: &str) -> u64 {
        self.pods
            .iter()
            .position(|p| p == pod)
            .and_then(|i| self.pod_bits.get(i).copied())
            .unwrap_or(0)
    }

    /// Whether no pod is known yet because discovery has not answered for the first time: the
    /// gateway has just started (a restart under load sends at once), and until the pool is
    /// known a request sent on would reach a pod outside every budget. Bounded by
    /// `scrape::first_discovery_ms` from the VM's start, after which a pool still unknown
    /// (discovery broken) leaves the choice to Envoy's balancing, as with no pods at all.
    pub fn discovering(&mut self, store: &dyn Store, cfg: &Config) -> bool {
        let now = store.now_ms();
        self.refresh_pods(store, cfg, now);
        self.awaits_pool(cfg, now)
    }

    /// `discovering` as this VM last read the pool.
    pub fn awaits_pool(&self, cfg: &Config, now: u64) -> bool {
        self.pods.is_empty() && self.waits_for_discovery(cfg, now)
    }

    /// Whether a pod's first model list is awaited, as this VM last read the lists
    /// (`ServedView::awaits_any`): requests for a model no list names wait for it.
    pub fn awaits_lists(&self, now: u64) -> bool {
        self.served.awaits_any(now)
    }

    fn waits_for_discovery(&self, cfg: &Config, now: u64) -> bool {
        !cfg.discovery.admin_cluster.is_empty()
            && !self.discovered
            && now < self.started_ms.saturating_add(first_discovery_ms(cfg))
    }

    fn refresh_pods(&mut self, store: &dyn Store, cfg: &Config, now: u64) {
        self.served.set_wait(first_list_ms(cfg));
        if self
            .pods_read_ms
            .is_some_and(|t| now.saturating_sub(t) < PODS_CACHE_MS)
        {
            return;
        }
        let mut pods = cfg.pods.clone();
        let found = store
            .get(PODS_KEY)
            .ok()
            .and_then(|v| v.value)
            .and_then(|b| decode_pods(&b));
        self.discovered = found.is_some();
        // A pool discovery has yet to publish is read again by the next request, not a second
        // later: those requests wait for it (`discovering`).
        if !self.waits_for_discovery(cfg, now) {
            self.pods_read_ms = Some(now);
        }
        for p in found.into_iter().flatten() {
            if !pods.contains(&p) {
                pods.push(p);
            }
        }
        if pods != self.pods {
            let ids: Vec<PodId> = pods.iter().map(|p| PodId::of(p)).collect();
            let kept = |id: PodId| ids.contains(&id);
            self.index_bounds.retain(|&p, _| kept(p));
            self.prefix.retain_pods(kept);
            self.active.retain_pods(kept);
            self.adapters.retain_pods(kept);
            self.copies.retain_pods(kept);
            self.phases.retain_pods(kept);
            self.leads.retain_pods(kept);
            self.demand.pods_changed(|p| pods.iter().any(|q| q == p));
            self.served.pool_changed(&pods);
            self.pod_bits = crate::admission::line::pod_bits(&pods);
            self.pods = pods;
            self.pod_ids = ids;
        }
    }

    /// What the pod records say that this VM's replicas depend on: the engines' block size and
    /// each pod's capacity (which bound the prefix index) and which requests are still in flight
    /// (the active-block and adapter replicas drop the others). Learned for the next requests:
    /// the current one's blocks were already cut.
    fn learn(&mut self, cfg: &Config, records: &[Rc<PodRecord>], now: u64) {
        if let Some(b) = records
            .iter()
            .filter_map(|rec| rec.snapshot.map(|s| s.block_size))
            .max()
            .filter(|&b| b > 0)
        {
            self.engine_block_tokens = b;
        }
        self.learned_ms = Some(now);
        let bt = u64::from(self.block_tokens(&cfg.routing));
        for (&pod, rec) in self.pod_ids.iter().zip(records) {
            // Sorted once, so that each replica entry is looked up, not compared with every one
            // of the record's: this runs on every request, and a pod may run hundreds. Only
            // entries past the replicas' grace are asked about, so most requests sort nothing.
            let live = OnceCell::new();
            let is_live = |id| {
                live.get_or_init(|| rec.live_ids())
                    .binary_search(&id)
                    .is_ok()
            };
            self.active.prune(pod, is_live, now);
            self.adapters.prune(pod, is_live, now);
            let bound = IndexBound {
                blocks: rec.index_blocks(bt, cfg.routing.pod_capacity_blocks),
                restarts: rec.snapshot.map_or(0, |s| s.engine_restarts),
            };
            match self.index_bounds.get_mut(&pod) {
                Some(known) => {
                    if known.restarts != bound.restarts {
                        // The engine started again with an empty cache (`pods::index_check`).
                        self.prefix.forget_blocks(pod);
                    }
                    *known = bound;
                }
                None => {
                    self.index_bounds.insert(pod, bound);
                }
            }
        }
    }

    /// The tick's upkeep: learns from the records (`learn`), then replays the other workers'
    /// picks and sends the finishes this VM holds. A VM that routes learns on every request; one
    /// that does not (Envoy's main thread, a worker without traffic) would otherwise bound its
    /// prefix index by `podCapacityBlocks` instead of the pods' real size and keep requests whose
    /// finish it missed in its replicas for good. A VM that learned within `LEARN_MS` (it routes)
    /// skips the reads. A VM that has not routed within `REPLAY_IDLE_MS` (or ever) leaves the log
    /// for its next request's `sync`: the picks it would replay serve no decision of its own
    /// until then.
    pub fn tend(&mut self, store: &dyn Store, cfg: &Config) -> Result<(), StoreError> {
        let now = store.now_ms();
        if self
            .learned_ms
            .is_none_or(|at| now.saturating_sub(at) >= LEARN_MS)
        {
            let mut records = Vec::with_capacity(self.pods.len());
            for (&id, pod) in self.pod_ids.iter().zip(&self.pods) {
                records.push(self.copies.get(store, (id, pod), now, false)?.0);
            }
            self.learn(cfg, &records, now);
        }
        if self
            .routed_ms
            .is_some_and(|at| now.saturating_sub(at) < REPLAY_IDLE_MS)
        {
            self.sync(store, cfg)?;
        } else {
            self.refresh_pods(store, cfg, now);
        }
        self.log.flush(store, self.vm)
    }

    /// Brings this VM's replicas up to date with the other workers' picks.
    pub fn sync(&mut self, store: &dyn Store, cfg: &Config) -> Result<(), StoreError> {
        let now = store.now_ms();
        self.refresh_pods(store, cfg, now);
        let (prefix, active, bounds) = (&mut self.prefix, &mut self.active, &self.index_bounds);
        let (adapters, copies) = (&mut self.adapters, &mut self.copies);
        self.log.poll(store, self.vm, |event| match event {
            Event::Dispatch(d) => {
                let pod = PodId::of(&d.pod);
                prefix.insert(pod, &d.hashes, now, index_capacity(bounds, pod, cfg));
                adapters.dispatch(pod, d.request, d.adapter, now);
                copies.forget(pod);
                active.add(pod, d.request, d.hashes, now);
            }
            Event::Finish { pod, request } => {
                let pod = PodId::of(&pod);
                adapters.finish(pod, request);
                copies.forget(pod);
                active.remove(pod, request);
            }
            Event::Placed { pod, hashes } => {
                let pod = PodId::of(&pod);
                prefix.insert(pod, &hashes, now, index_capacity(bounds, pod, cfg));
            }
            Event::Stored { .. } => {}
        })
    }

    /// What the other gateway replicas sent the pods (`replicas::placements`), for this VM's
    /// prefix index and, through the pick log, every other worker's. Pods not in the pool are
    /// passed over.
    pub fn import(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        placed: Vec<(String, Vec<u64>)>,
    ) -> Result<(), StoreError> {
        let now = store.now_ms();
        let events: Vec<Event> = placed
            .into_iter()
            .filter(|(pod, hashes)| !hashes.is_empty() && self.pods.contains(pod))
            .map(|(pod, hashes)| {
                let id = PodId::of(&pod);
                let cap = index_capacity(&self.index_bounds, id, cfg);
                self.prefix.insert(id, &hashes, now, cap);
                Event::Placed { pod, hashes }
            })
            .collect();
        if events.is_empty() {
            return Ok(());
        }
        self.log.publish_all(store, self.vm, &events)
    }

    /// Ranks the pods for a request and dispatches it to the best one whose budget has room for
    /// its reservation, taken with compare-and-swap so every worker sees one truth.
    pub fn route(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        model: &str,
        hashes: &[u64],
        est: &Estimate,
    ) -> Result<Placement, StoreError> {
        self.route_with(store, cfg, (model, hashes, est), Room::Required)
    }

    /// `route` among the pods that hold the prompt's cached prefix, when some pod holds half of
    /// it, or on its group's home when none does (`send_home`'s, when it has one):
    /// `Placement::Uncached` when only the others have room. For the line's order
    /// (`drive::run_line`): a parked request goes to room where its prefix is before one that
    /// would compute its prefix again there.
    pub fn route_cached(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        request: (&str, &[u64], &Estimate),
    ) -> Result<Placement, StoreError> {
        self.route_with(store, cfg, request, Room::Cached)
    }

    fn route_with(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        request: (&str, &[u64], &Estimate),
        need: Room,
    ) -> Result<Placement, StoreError> {
        let now = store.now_ms();
        self.routed_ms = Some(now);
        self.sync(store, cfg)?;
        if self.awaits_pool(cfg, now) {
            return Ok(Placement::Discovering);
        }
        if self.pods.is_empty() {
            return Ok(Placement::NoPods);
        }
        let (placement, from_copies) = self.place(store, cfg, request, false, need)?;
        if from_copies && matches!(placement, Placement::NoRoom(_) | Placement::Uncached(..)) {
            // The copies said no pod has room: the records decide before the request waits.
            return Ok(self.place(store, cfg, request, true, need)?.0);
        }
        Ok(placement)
    }

    /// `route`, except for a prompt some pod caches at least half of (as `route_cached` says)
    /// while fewer in-flight requests share that prefix than there are pods: when a pod caching
    /// it is within a whole prefill of the prompt of the cheapest pod with room, it goes only to
    /// such a pod, and gets `Placement::Uncached` when only the others have room, so that
    /// admission holds it for room there (`admission.cacheWaitMs`; docs/design.md, "Waiting for
    /// the prefix's pod"). The formula prices a copy at this request's prefill, but the copy also
    /// evicts another prompt's prefix there; ranked by it alone, the pick copied whenever the
    /// prefix's pod was busier by more than the prefill it saves. A prefix many requests share (a
    /// hot system prompt) is copied by cost as before: a copy there serves the requests that
    /// follow it (`pick::copy_weight`).
    pub fn route_patient(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        request: (&str, &[u64], &Estimate),
    ) -> Result<Placement, StoreError> {
        self.route_with(store, cfg, request, Room::Patient)
    }

    /// Whether the prompt belongs on one of `pods`, a cheap test before a pick decides: this VM's
    /// index has one caching at least half of it (`PrefixIndex::caches_half`), or one is its
    /// group's home (`home_among`).
    pub fn belongs_on(&self, cfg: &Config, pods: &[String], hashes: &[u64], now: u64) -> bool {
        pods.iter()
            .any(|pod| self.prefix.caches_half(PodId::of(pod), hashes, now))
            || hashes
                .first()
                .is_some_and(|&first| self.home_among(cfg, pods, first, now))
    }

    /// `route` for a request [`route`](Self::route) found no room for, when admission only
    /// observes: the best-ranked pod takes it past its budget, its entry recorded like any other
    /// (so the pod's forecast shows how far past the budget enforcement would have kept it).
    pub fn route_past_budget(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        request: (&str, &[u64], &Estimate),
    ) -> Result<Placement, StoreError> {
        Ok(self.place(store, cfg, request, true, Room::Ignored)?.0)
    }

    /// `route` on the records as this VM's copies have them (`fresh`: as stored); also says
    /// whether any copy was used.
    fn place(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        (model, hashes, est): (&str, &[u64], &Estimate),
        fresh: bool,
        need: Room,
    ) -> Result<(Placement, bool), StoreError> {
        let now = store.now_ms();
        let r = &cfg.routing;
        let block_tokens = self.block_tokens(r);
        let bt = u64::from(block_tokens);
        let hashes = &hashes[..hashes.len().min(MAX_EVENT_BLOCKS)];
        let prompt_blocks = hashes.len().max(est.prompt_tokens.div_ceil(bt) as usize);
        if hashes.len() < (r.max_prompt_blocks as usize).min(MAX_EVENT_BLOCKS) && est.prompts == 1 {
            // A whole prompt: its text's blocks against its tokens' (a cut one would mislead, and
            // so would a batch, hashed on its first prompt: a stream of reranks drove the
            // density to its bound and cut every pod's index to a quarter).
            self.prefix
                .learn_density(hashes.len(), est.prompt_tokens as f64 / bt as f64);
        }
        let output_blocks = est.output_tokens.div_ceil(bt);

        let request = self.next_request_id();
        let mut from_copies = false;
        let mut records: Vec<Rc<PodRecord>> = Vec::with_capacity(self.pods.len());
        for (&id, pod) in self.pod_ids.iter().zip(&self.pods) {
            let (rec, copy) = self.copies.get(store, (id, pod), now, fresh)?;
            from_copies |= copy;
            records.push(rec);
        }
        self.learn(cfg, &records, now);
        self.served.refresh(store, now);
        if self
            .served
            .awaits_list(model, now, |i| !records[i].is_down())
        {
            return Ok((Placement::Discovering, from_copies));
        }
        let mut indices = self.eligible(cfg, model, &records, now);
        if let Some(only) = est.only_on {
            // Only that pod can answer; gone from the pool, its engine's answer is a clear 404
            // wherever the request goes, so it goes by cost.
            let on = |&i: &usize| crate::hash::fnv1a(self.pods[i].as_bytes()) == only;
            if indices.iter().any(on) {
                indices.retain(on);
            }
        }
        if indices.is_empty() {
            // The model lists changed since the flow checked: the engine answers for itself.
            return Ok((Placement::NoPods, from_copies));
        }
        if est.within != line::ANYWHERE {
            // It heads the line on these pods only: the others are for tickets ahead of it.
            let bits = &self.pod_bits;
            indices.retain(|&i| bits.get(i).is_some_and(|b| b & est.within != 0));
            if indices.is_empty() {
                return Ok((Placement::NoRoom(String::new()), from_copies));
            }
        }
        let pool = self.pool(&indices);
        self.demand.sample(now, pool);
        let adapter_fit = self.adapter_fits(&indices, model, &records, now, cfg);
        let mut ask = Ask {
            records: &records,
            hashes,
            prompt_blocks,
            output_blocks,
            block_tokens: bt,
            now,
            hot_blocks: 0,
            copy_weight: 1.0,
            pool,
        };
        // Leading prompt blocks already held by in-flight requests, per candidate: they cost no
        // new KV there, in the score and in the reservation alike.
        let shared: Vec<usize> = indices
            .iter()
            .map(|&i| {
                self.active
                    .active_prefix(self.pod_ids[i], ask.recorded(&records[i]))
            })
            .collect();
        (ask.hot_blocks, ask.copy_weight) = self.hot_prefix(&indices, &shared, hashes);
        let (loads, alones) = charges(est, &indices, &shared, &ask, cfg.estimator.safety_factor);
        let mut candidates = candidates(
            (&self.pods, &self.pod_ids),
            &self.prefix,
            cfg,
            &indices,
            &loads,
            &adapter_fit,
            &ask,
        );
        let mut rng = Rng::new(request ^ now.rotate_left(17));
        // Each of its choices reads its prompt a step.
        let own_blocks = prompt_blocks as u64 * est.answers_per_prompt() + output_blocks;
        let mut ranked = rank(&candidates, prompt_blocks, own_blocks, r, &mut rng);
        // The engine steps' phase orders pods for a prompt the best mostly caches, and the ranking
        // header shows it: worked out only then.
        let phase_counts = ranked
            .first()
            .is_some_and(|s| mostly_cached(&candidates[s.index], prompt_blocks));
        if r.step_phase && (phase_counts || cfg.debug_headers) {
            let waits = self.step_waits(store, &indices, &records);
            for (c, wait) in candidates.iter_mut().zip(waits) {
                c.step_wait_us = wait;
            }
            if phase_counts {
                Self::soonest_step(r, &mut ranked, &candidates, prompt_blocks, own_blocks);
            }
        }
        self.send_home(cfg, &mut ranked, &candidates, &ask);
        let budgets: Vec<Option<u64>> = indices
            .iter()
            // With several gateway replicas, this one's grant of the budget (`replicas::share`).
            .map(|&i| {
                let budget = budget_tokens(cfg, records[i].snapshot.as_ref());
                crate::replicas::share::cap(store, cfg, &self.pods[i], budget)
            })
            .collect();
        // Each candidate's fit is a forecast over its in-flight requests: worked out at most once
        // per request, though the fallbacks, the ranking header and the dispatch all ask.
        let fit: Vec<Cell<Option<bool>>> = vec![Cell::new(None); indices.len()];
        let room = |k: usize| {
            fit[k].get().unwrap_or_else(|| {
                let f = fits(&records[indices[k]], loads[k], budgets[k], cfg, bt, now);
                fit[k].set(Some(f));
                f
            })
        };
        // What each candidate holds of the prompt, for `Room::Cached`.
        let held: Vec<usize> = candidates
            .iter()
            .zip(&shared)
            .map(|(c, &s)| c.cached_blocks.max(s))
            .collect();
        let most = held.iter().copied().max().unwrap_or(0);
        let cached = most * 2 >= prompt_blocks;
        // In the line (`route_cached`), a prompt no pod holds half of goes first to its group's
        // home, when it has one, as a cached one goes first where it is cached: in a saturated
        // pool room opens one request at a time wherever one ends, and a group evicted
        // everywhere went to whichever pod freed room first, so its requests spread over most
        // pods and each pod computed most groups and kept few (docs/design.md, "In a saturated
        // pool").
        let home = match need {
            Room::Cached if !cached => self.home(cfg, &candidates, &ask),
            _ => None,
        };
        let near = |k: usize| match home {
            Some(h) => k == h,
            None => !cached || held[k] * 2 >= most,
        };
        // Fewer in-flight requests hold the prefix than there are pods (`copy_weight` above a
        // half; 1 when none holds it), or the pool's KV is about to run short (`kv_short`), and no
        // pod with room is cheaper than the cheapest pod caching it by more than a whole prefill
        // of the prompt: what a copy costs the pool beyond this request (the prefill again, and
        // the prefix it evicts there), which the formula leaves out. A pod caching it but far
        // busier (an engine queue only its metrics show) is no place to wait for. Only pods that
        // much cheaper have their fit worked out.
        //
        // A prefix many requests share is priced as shared by the requests to come
        // (`pick::copy_weight`), which holds while the pool has room for them; where it is about
        // to have none, a copy takes the KV of requests that will wait for it, and the prefix is
        // held like any other. A burst's ten groups were copied to 14–19 more pods in its first
        // 12 ms, on pods still empty, which then filled with copies instead of requests (held:
        // 7–10 more, 533–545 requests in the first wave against 464–504, TTFT mean 6 % lower;
        // a hot prefix's steady stream reads a fourteenth of its pool and is copied as before).
        let patient = need == Room::Patient && cached;
        let hot = patient && ask.copy_weight <= 0.5 && {
            let blocks_each = prompt_blocks.saturating_sub(most) as u64 + output_blocks;
            self.kv_short(&ask, &indices, &budgets, est, blocks_each)
        };
        let sticks = patient && (ask.copy_weight > 0.5 || hot) && {
            let nearest = ranked
                .iter()
                .filter(|s| near(s.index))
                .map(|s| s.cost)
                .fold(f64::INFINITY, f64::min);
            let tolerance = r.prefill_weight * prompt_blocks as f64;
            !ranked
                .iter()
                .any(|s| s.cost + tolerance < nearest && room(s.index))
        };
        // A pod may take the request when it has room, or when admission only observes.
        let takes = |k: usize| match need {
            Room::Ignored => true,
            Room::Required => room(k),
            Room::Cached => near(k) && room(k),
            Room::Patient => room(k) && (!sticks || near(k)),
        };
        // Pods without room are not offered as fallbacks either: a retry must not overfill them.
        let order: Vec<String> = ranked
            .iter()
            .filter(|s| takes(s.index))
            .take(1 + r.fallback_pods as usize)
            .map(|s| candidates[s.index].pod.to_string())
            .collect();
        let ranking = if cfg.debug_headers {
            explain(&candidates, &ranked, prompt_blocks, own_blocks, r, room)
        } else {
            String::new()
        };
        for s in ranked.iter().filter(|s| takes(s.index)) {
            let best = &candidates[s.index];
            let pod = best.pod.to_string();
            let id = self.pod_ids[indices[s.index]];
            let shared_blocks = shared[s.index];
            let sharing = loads[s.index];
            let alone = alones[s.index];
            // What the pick believed the pod holds of the prompt, against the engine's hits
            // (`pods::index_check`).
            let believed = held[s.index] as u64;
            let entry = RequestEntry {
                id: request,
                expires_ms: now.saturating_add(r.request_ttl_ms),
                dispatched_ms: now,
                held_tokens: alone.held,
                held_sigma: u32::try_from(alone.sigma).unwrap_or(u32::MAX),
                bounded: est.bounded,
                output_guessed: est.output_guessed,
                left: u32::try_from(sharing.left).unwrap_or(u32::MAX),
                outlook: sharing.outlook,
                prompt_blocks: prompt_blocks as u32,
                output_blocks: 0,
                // Each answer reads its own prompt: a batch's prompts (`Request::prompts`) are
                // sequences apart, each about its share of the blocks, whole blocks as the engine
                // holds them (all of them counted for each answer, a batch of eight read eight
                // times what its answers do). Never fewer than its hashed first prompt: the
                // extent of the prefix others lean on, which its heir takes on (`record::remove`).
                context_blocks: (prompt_blocks as u64)
                    .div_ceil(est.prompts.max(1))
                    .max(hashes.len() as u64) as u32,
                pending_blocks: if est.streams {
                    prompt_blocks.saturating_sub(held[s.index]) as u32
                } else {
                    0
                },
                leans_on: 0,
                shared_blocks: 0,
                shared_tokens: 0,
                choices: u16::try_from(est.choices).unwrap_or(u16::MAX),
                // Its stream shows it once it comes.
                lag: 0,
            };
            // Who the replica says holds the shared prefix: the record says which of them is
            // still in flight, and without one the request counts its whole prompt.
            let holders = self.active.holding(id, hashes, shared_blocks);
            // The read above may be a copy, older than the last scrape: the fit is checked again
            // inside the compare-and-swap, against the budget the stored snapshot gives.
            let seen = self.copies.read_now(id, now);
            let taken = record::modify_from(store, &pod, seen, |rec| {
                let lean = holders.iter().copied().find(|&h| rec.is_live(h));
                let (load, entry) = match lean {
                    Some(holder) => (
                        sharing,
                        RequestEntry {
                            held_tokens: sharing.held,
                            held_sigma: u32::try_from(sharing.sigma).unwrap_or(u32::MAX),
                            prompt_blocks: (prompt_blocks - shared_blocks) as u32,
                            leans_on: holder,
                            shared_blocks: shared_blocks as u32,
                            shared_tokens: alone.held.saturating_sub(sharing.held),
                            ..entry
                        },
                    ),
                    None => (alone, entry),
                };
                let budget = budget_tokens(cfg, rec.snapshot.as_ref());
                let budget = crate::replicas::share::cap(store, cfg, &pod, budget);
                if need != Room::Ignored && !fits(rec, load, budget, cfg, bt, now) {
                    return None;
                }
                rec.tally.add(believed, prompt_blocks as u64);
                rec.entries.push(entry);
                Some(rec.clone())
            })?;
            let Some(written) = taken else {
                continue;
            };
            self.copies.wrote(id, written, now);
            let rec = &records[indices[s.index]];
            let kept = ask.recorded(rec);
            let bound = rec.index_blocks(bt, r.pod_capacity_blocks);
            self.prefix.insert(id, kept, now, bound);
            let fit = adapter_fit[s.index];
            let adapter = fit.map_or(0, |_| adapter_id(model));
            self.adapters.dispatch(id, request, adapter, now);
            let event = Event::Dispatch(Dispatch {
                pod: pod.clone(),
                request,
                adapter,
                hashes: kept.to_vec(),
            });
            if let Err(e) = self.log.publish(store, self.vm, &event) {
                // The other workers miss one pick; their replicas are approximate by design.
                log::debug!("pick log publish failed: {e:?}");
            }
            // The published copy of the hashes becomes this VM's replica entry: one copy per pick.
            if let Event::Dispatch(d) = event {
                self.active.add(id, request, d.hashes, now);
            }
            let mut order = order;
            order.retain(|p| *p != pod);
            order.insert(0, pod.clone());
            order.truncate(1 + r.fallback_pods as usize);
            return Ok((
                Placement::Routed(Routed {
                    request,
                    pod,
                    pod_id: id,
                    streamed: 0,
                    ended: Ended::default(),
                    order,
                    prompt_blocks,
                    cached_blocks: best.cached_blocks,
                    output_blocks: 0,
                    block_tokens,
                    adapter_load: fit.is_some_and(|f| f != Fit::Resident),
                    ranking,
                    over_budget: need == Room::Ignored,
                    hot_held: hot && sticks,
                    dispatched_us: store.now_us(),
                    last_token_us: None,
                    unseen_itl_s: 0.0,
                    lag: 0,
                }),
                from_copies,
            ));
        }
        // Where it waits: the pod it would take first, had that room.
        let held_to_near = need == Room::Cached || sticks;
        let belongs = ranked
            .iter()
            .find(|s| !held_to_near || near(s.index))
            .map(|s| candidates[s.index].pod.to_string())
            .unwrap_or_default();
        if held_to_near {
            let roomy: Vec<String> = (0..candidates.len())
                .filter(|&k| !near(k) && room(k))
                .map(|k| candidates[k].pod.to_string())
                .collect();
            if !roomy.is_empty() {
                return Ok((Placement::Uncached(roomy, belongs), from_copies));
            }
        }
        Ok((Placement::NoRoom(belongs), from_copies))
    }

    /// A chunk of the response carried `tokens` output tokens: the end of a step on its pod
    /// (`routing::step_phase`).
    pub fn streamed(&mut self, store: &dyn Store, routed: &mut Routed, tokens: u64) {
        let now = store.now_us();
        self.phases.tokens(
            routed.pod_id,
            tokens,
            routed.last_token_us,
            routed.dispatched_us,
            now,
        );
        routed.last_token_us = Some(now);
    }

    /// The delay from a pick to the engine's scheduler this VM has learned, in µs, when it routes
    /// (a VM that never routed, such as Envoy's main thread, learned nothing).
    pub fn dispatch_delay_us(&self) -> Option<u64> {
        self.routed_ms
            .map(|_| self.phases.delay_us().round() as u64)
    }

    /// How long a request sent now would wait, in whole µs, for each candidate's current engine
    /// step to end (`routing::step_phase`): none on a pod running none of kvgate's requests.
    fn step_waits(
        &self,
        store: &dyn Store,
        indices: &[usize],
        records: &[Rc<PodRecord>],
    ) -> Vec<u64> {
        let pods: Vec<PodId> = indices.iter().map(|&i| self.pod_ids[i]).collect();
        let busy: Vec<bool> = indices
            .iter()
            .map(|&i| !records[i].entries.is_empty())
            .collect();
        self.phases
            .waits(&pods, &busy, store.now_us())
            .into_iter()
            .map(|us| us.round() as u64)
            .collect()
    }

    /// The response has produced `output_tokens` so far, of which answers that `ended` made
    /// some (a request for several): grows the entry by whole blocks (what it holds by what it
    /// streamed since, less what its answers that ended since held, its outlook and its steps
    /// from where its answers still running stand, by the estimate it was routed with, and how
    /// far behind the engine its stream has been seen, `Routed::lag`) and renews its expiry.
    /// Returns whether the shared record was written.
    pub fn grow(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        routed: &mut Routed,
        est: &Estimate,
        output_tokens: u64,
        ended: Ended,
    ) -> Result<bool, StoreError> {
        let bt = u64::from(routed.block_tokens.max(1));
        let blocks = output_tokens.div_ceil(bt) as u32;
        let ends = ended.answers > routed.ended.answers;
        if blocks <= routed.output_blocks && !ends {
            return Ok(false);
        }
        let first = routed.output_blocks == 0;
        routed.output_blocks = routed.output_blocks.max(blocks);
        let expires = store.now_ms().saturating_add(cfg.routing.request_ttl_ms);
        // Only what streamed since the last write is added, and only what ended since is taken
        // off: a prefix inherited meanwhile from another request stays counted.
        let more = output_tokens.saturating_sub(routed.streamed);
        let freed = ended.tokens.saturating_sub(routed.ended.tokens);
        routed.streamed = output_tokens;
        routed.ended = ended;
        let running = est.choices.saturating_sub(ended.answers).max(1);
        let live = output_tokens.saturating_sub(ended.tokens);
        let outlook = est.outlook(running, live);
        let left = est.steps_left(running, live);
        if first {
            // The first token: the prompt it waited for no longer loads the pod, which this VM's
            // copy of the record would still say.
            self.copies.forget(routed.pod_id);
        }
        record::modify_entry(store, &routed.pod, routed.request, |e| {
            e.output_blocks = live.div_ceil(bt) as u32;
            // Its first token came: its prompt is computed.
            e.pending_blocks = 0;
            e.expires_ms = expires;
            e.held_tokens = e.held_tokens.saturating_add(more).saturating_sub(freed);
            e.left = u32::try_from(left).unwrap_or(u32::MAX);
            e.choices = u16::try_from(running).unwrap_or(u16::MAX);
            e.outlook = outlook;
            e.output_guessed = est.output_guessed;
            e.lag = routed.lag;
        })
    }

    /// An answer that does not stream shows kvgate no token until it ends, while the engine's
    /// KV for it grows a token a step: its entry grows as `grow` grows a stream's, by the tokens
    /// the pod's pace says it has made since it was sent (its smoothed inter-token latency,
    /// `pods::pace`), less the time such answers take there before their tokens begin
    /// (`routing::unseen_lead`). Without this its entry held its prompt
    /// alone and what the engine held beyond was unexplained KV, taken off the budget at each
    /// scrape while the forecast counted the same tokens as still to come: each of those
    /// answers was paid for twice. A pod whose pace is unknown grows nothing, as before. The
    /// estimate errs long while the engine queues the request (kvgate's admission keeps it from
    /// queueing), short when it prefills at once; the scrape's unexplained KV still takes what
    /// the engine holds beyond it. Returns whether the entry was written.
    pub fn grow_unseen(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        routed: &mut Routed,
        est: &Estimate,
    ) -> Result<bool, StoreError> {
        let pod = (routed.pod_id, routed.pod.as_str());
        let (rec, _) = self.copies.get(store, pod, store.now_ms(), false)?;
        let pace = rec.pace();
        routed.unseen_itl_s = pace.itl_s;
        let begun_s = (routed.age_s(store) - self.leads.lead_s(routed.pod_id)).max(0.0);
        let Some(made) = pace.tokens_made(begun_s, est.choices) else {
            return Ok(false);
        };
        let made = made.min(est.max_output_tokens);
        self.grow(store, cfg, routed, est, made, Ended::default())
    }

    /// An answer that did not stream ended with `tokens` tokens an answer: how long it took before
    /// they began, at the pace its growth read, is learned for the next ones
    /// (`routing::unseen_lead`). One never grown at a pace (none known, or it ended before the
    /// tick) teaches nothing.
    pub fn unseen_ended(&mut self, store: &dyn Store, routed: &Routed, tokens: u64) {
        self.leads.ended(
            routed.pod_id,
            routed.age_s(store),
            tokens,
            routed.unseen_itl_s,
        );
    }

    /// The request is over, however it ended. Safe to call more than once.
    pub fn finish(
        &mut self,
        store: &dyn Store,
        routed: &Routed,
    ) -> Result<Option<RequestEntry>, StoreError> {
        // The record hands what it counted of a shared prefix to a request leaning on it.
        self.active.remove(routed.pod_id, routed.request);
        self.adapters.finish(routed.pod_id, routed.request);
        let gone = record::finish(store, &routed.pod, routed.request)?;
        self.copies.finished(routed.pod_id, routed.request);
        if let Some(entry) = &gone {
            let now = store.now_ms();
            self.demand
                .finished(&routed.pod, now.saturating_sub(entry.dispatched_ms));
            let event = Event::Finish {
                pod: routed.pod.clone(),
                request: routed.request,
            };
            // Held for this VM's next append: the other workers' replicas keep the request a
            // little longer, which their prune by the pod records bounds.
            if let Err(e) = self.log.finish(store, self.vm, event) {
                log::debug!("pick log publish failed: {e:?}");
            }
        }
        Ok(gone)
    }

    /// A response stored on `pod` (`routing::stored`), logged for this replica's placements to
    /// carry to the other gateway replicas: appended now, not held, as a follow-up may come
    /// through another replica soon after its answer.
    pub fn stored(
        &mut self,
        store: &dyn Store,
        pod: &str,
        id: u64,
        tokens: u64,
    ) -> Result<(), StoreError> {
        let event = Event::Stored {
            pod: pod.to_string(),
            id,
            tokens,
        };
        self.log.publish(store, self.vm, &event)
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::admission::forecast::Headroom;
    use crate::pods::index_check::HitTotals;
    use crate::pods::pool::encode_pods;
    use crate::pods::record::Snapshot;
    use crate::routing::record_copies::COPY_MS;
    use crate::store::fake_host::{FakeHost, FakeVm};

    impl Placement {
        fn routed(self) -> Routed {
            match self {
                Placement::Routed(r) => r,
                other => panic!("not routed: {other:?}"),
            }
        }
    }

    impl Router {
        /// Routes a request for model `m` that must be routed.
        fn route_m(
            &mut self,
            store: &dyn Store,
            cfg: &Config,
            hashes: &[u64],
            est: &Estimate,
        ) -> Routed {
            self.route(store, cfg, "m", hashes, est).unwrap().routed()
        }
    }

    /// With a prompt margin (`estimator.safetyFactor` 1.1), so the tests see it carried
    /// through shared prefixes.
    fn config(pods: &[&str]) -> Config {
        let mut cfg = crate::test_support::with_pods(pods);
        cfg.estimator.safety_factor = 1.1;
        cfg
    }

    /// One VM's router over `pods`, with the tests' configuration.
    /// Two workers of one Envoy (one host), each with its router, on `cfg`'s pods.
    fn two_workers(cfg: &Config) -> (FakeHost, [(FakeVm, Router); 2]) {
        let host = FakeHost::new();
        let worker = || {
            let vm = host.vm();
            let r = Router::start(&vm, cfg).unwrap();
            (vm, r)
        };
        let workers = [worker(), worker()];
        (host, workers)
    }

    fn router(pods: &[&str]) -> (FakeVm, Config, Router) {
        let cfg = config(pods);
        let vm = FakeHost::new().vm();
        let r = Router::start(&vm, &cfg).unwrap();
        (vm, cfg, r)
    }

    fn est(prompt: u64, output: u64) -> Estimate {
        Estimate::exact(prompt, output)
    }

    /// An in-flight request holding `held_tokens` over `context_blocks` of prompt, 16 tokens to
    /// go, as a pod's record keeps it.
    fn running(id: u64, held_tokens: u64, context_blocks: u32) -> RequestEntry {
        RequestEntry {
            id,
            expires_ms: u64::MAX,
            held_tokens,
            context_blocks,
            prompt_blocks: context_blocks,
            left: 16,
            outlook: [255; crate::estimate::output_dist::HORIZON_STEPS.len()],
            ..RequestEntry::default()
        }
    }

    use crate::test_support::prompt_blocks as hashes;

    fn total_active(vm: &FakeVm, cfg: &Config) -> u64 {
        cfg.pods
            .iter()
            .map(|p| record::read(vm, p).unwrap().active_blocks(16))
            .sum()
    }

    #[test]
    fn ranking_integers_are_written_as_write_would() {
        for n in [0, 7, -7, 10, 99, -100, 12_345, i64::MAX, i64::MIN] {
            let mut out = String::from("x");
            push_int(&mut out, n);
            assert_eq!(out, format!("x{n}"));
        }
    }

    #[test]
    fn a_pick_on_one_worker_steers_the_next_request_on_another() {
        let cfg = config(&["a:1", "b:1", "c:1", "d:1"]);
        let (_host, [(w1, mut r1), (w2, mut r2)]) = two_workers(&cfg);
        let first = r1.route_m(&w1, &cfg, &hashes(7, 64), &est(1024, 16));
        r1.finish(&w1, &first).unwrap();
        let second = r2.route_m(&w2, &cfg, &hashes(7, 64), &est(1024, 16));
        assert_eq!(second.pod, first.pod);
        assert_eq!(second.cached_blocks, 64);
        r2.finish(&w2, &second).unwrap();
        assert_eq!(total_active(&w1, &cfg), 0);
    }

    #[test]
    fn another_replicas_placement_steers_every_worker_and_holds_nothing() {
        let cfg = config(&["a:1", "b:1", "c:1", "d:1"]);
        let (_host, [(w1, mut r1), (w2, mut r2)]) = two_workers(&cfg);
        let placed = vec![
            ("c:1".to_string(), hashes(7, 64)),
            ("elsewhere:1".to_string(), hashes(8, 64)),
        ];
        r1.import(&w1, &cfg, placed).unwrap();
        // The other worker learns it through the pick log; no pod is charged for it.
        assert_eq!(total_active(&w2, &cfg), 0);
        let next = r2.route_m(&w2, &cfg, &hashes(7, 64), &est(1024, 16));
        assert_eq!((next.pod.as_str(), next.cached_blocks), ("c:1", 64));
        r2.finish(&w2, &next).unwrap();
        let here = r1.route_m(&w1, &cfg, &hashes(7, 64), &est(1024, 16));
        assert_eq!((here.pod.as_str(), here.cached_blocks), ("c:1", 64));
        r1.finish(&w1, &here).unwrap();
        assert_eq!(total_active(&w1, &cfg), 0);
    }

    #[test]
    fn another_workers_pick_shows_in_the_next_ranking_at_once() {
        let mut cfg = config(&["a:1", "b:1"]);
        cfg.debug_headers = true;
        let (_host, [(w1, mut r1), (w2, mut r2)]) = two_workers(&cfg);
        // Worker 2 reads both records (its copies now show two idle pods), then worker 1 sends a
        // long request to one of them, within the copies' lifetime.
        let warm = r2.route_m(&w2, &cfg, &hashes(1, 4), &est(64, 16));
        r2.finish(&w2, &warm).unwrap();
        let long = r1.route_m(&w1, &cfg, &hashes(2, 64), &est(1024, 256));
        let next = r2.route_m(&w2, &cfg, &hashes(3, 4), &est(64, 16));
        // Each candidate's decode term, the third of `pod cost=prefill+decode+...`.
        let decode = |pod: &str| -> String {
            let entry = next
                .ranking
                .split(", ")
                .find(|e| e.starts_with(pod))
                .unwrap();
            entry.split(['=', '+']).nth(2).unwrap().to_string()
        };
        let other = if long.pod == "a:1" { "b:1" } else { "a:1" };
        assert_ne!(
            decode(&long.pod),
            decode(other),
            "worker 2 ranks with worker 1's request on {}: {}",
            long.pod,
            next.ranking
        );
        assert_eq!(next.pod, other);
    }

    #[test]
    fn a_streaming_prompt_is_work_its_pod_still_has_until_its_first_token() {
        let (vm, mut cfg, mut r) = router(&["a:1", "b:1"]);
        cfg.debug_headers = true;
        let streaming = |prompt| Estimate {
            streams: true,
            ..est(prompt, 64)
        };
        let pending = || {
            record::read(&vm, "a:1").unwrap().pending_blocks()
                + record::read(&vm, "b:1").unwrap().pending_blocks()
        };
        // A long request that has started answering on one pod (its 40 blocks are read at each
        // of its decode steps there), and a shorter one still waiting for its first token on the
        // other.
        let mut long = r.route_m(&vm, &cfg, &hashes(1, 40), &streaming(640));
        r.grow(&vm, &cfg, &mut long, &streaming(640), 1, Ended::default())
            .unwrap();
        assert_eq!(pending(), 0, "the first token came: its prompt is computed");
        let mut waiting = r.route_m(&vm, &cfg, &hashes(2, 10), &streaming(160));
        assert_ne!(waiting.pod, long.pod);
        assert_eq!(pending(), 10, "its whole prompt, nothing cached");
        // A small request: the decode load says the second pod (10 blocks read against 40), but
        // its first token would wait for the 10 blocks that pod is computing (2 × 10).
        let small = r.route_m(&vm, &cfg, &hashes(3, 2), &streaming(32));
        assert_eq!(small.pod, long.pod, "{}", small.ranking);
        r.grow(
            &vm,
            &cfg,
            &mut waiting,
            &streaming(160),
            1,
            Ended::default(),
        )
        .unwrap();
        assert_eq!(pending(), 2);
        for routed in [&long, &waiting, &small] {
            r.finish(&vm, routed).unwrap();
        }
        assert_eq!(pending(), 0);
    }

    /// Two pods each running one stream alike, whose engines end their steps every 6 ms, `b`'s
    /// `offset_ms` after `a`'s; the clock stops `at_ms` after `a`'s last step ended. Both cache
    /// an 8-block prefix ([`on_the_cached_prefix`]).
    fn streaming_on_two_pods(offset_ms: u64, at_ms: u64) -> (FakeVm, Config, Router) {
        streaming_on(config(&["a:1", "b:1"]), offset_ms, at_ms)
    }

    fn streaming_on(cfg: Config, offset_ms: u64, at_ms: u64) -> (FakeVm, Config, Router) {
        let vm = FakeHost::new().vm();
        let mut r = Router::start(&vm, &cfg).unwrap();
        let mut first = r.route_m(&vm, &cfg, &hashes(1, 8), &est(128, 512));
        let mut second = r.route_m(&vm, &cfg, &hashes(2, 8), &est(128, 512));
        let (on_a, on_b) = if first.pod == "a:1" {
            (&mut first, &mut second)
        } else {
            (&mut second, &mut first)
        };
        for _ in 0..4 {
            vm.host().advance_ms(6 - offset_ms);
            r.streamed(&vm, on_a, 1);
            vm.host().advance_ms(offset_ms);
            r.streamed(&vm, on_b, 1);
        }
        vm.host().advance_ms(at_ms.saturating_sub(offset_ms));
        for pod in ["a:1", "b:1"] {
            r.prefix
                .insert(PodId::of(pod), &hashes(70, 8), vm.now_ms(), 10_000);
        }
        (vm, cfg, r)
    }

    /// A prompt both pods mostly cache: the 8-block prefix, and one block of its own.
    fn on_the_cached_prefix(q: u64) -> Vec<u64> {
        let mut prompt = hashes(70, 8);
        prompt.push(hashes(1_000 + q, 1)[0]);
        prompt
    }

    #[test]
    fn among_pods_loaded_alike_the_one_whose_engine_step_ends_first_takes_a_cached_prompt() {
        // a ended a step 4 ms ago (2 left), b 1 ms ago (5 left): a request reaching the engine
        // 1–1.5 ms from now waits 0.75 ms on a, 3.75 ms on b.
        let (vm, cfg, mut r) = streaming_on_two_pods(3, 4);
        let probe = r.route_m(&vm, &cfg, &on_the_cached_prefix(0), &est(144, 16));
        assert_eq!(probe.pod, "a:1", "{}", probe.ranking);
        // a's step ends in 1 ms, within the delay: a request sent now misses it and waits for
        // the next one there (1 + 6 − 1.25 ms), while b's has just begun (6 − 1.25 ms).
        let (vm, cfg, mut r) = streaming_on_two_pods(5, 0);
        let probe = r.route_m(&vm, &cfg, &on_the_cached_prefix(0), &est(144, 16));
        assert_eq!(probe.pod, "b:1", "{}", probe.ranking);
        // Were requests there at once, a would be sooner.
        let mut at_once = config(&["a:1", "b:1"]);
        at_once.routing.dispatch_delay_ms = 0.0;
        let (vm, cfg, mut r) = streaming_on(at_once, 5, 0);
        let probe = r.route_m(&vm, &cfg, &on_the_cached_prefix(0), &est(144, 16));
        assert_eq!(probe.pod, "a:1", "{}", probe.ranking);
        // Off, the phase does not count: the pods tie, and either may take it.
        let (vm, mut cfg, mut r) = streaming_on_two_pods(3, 4);
        cfg.routing.step_phase = false;
        let mut took = std::collections::BTreeSet::new();
        for q in 0..16 {
            let probe = r.route_m(&vm, &cfg, &on_the_cached_prefix(q), &est(144, 16));
            took.insert(probe.pod.clone());
            r.finish(&vm, &probe).unwrap();
        }
        assert_eq!(took.len(), 2, "{took:?}");
        // A prompt mostly still to compute keeps the cost's order: the phase does not decide.
        let (vm, cfg, mut r) = streaming_on_two_pods(3, 4);
        let mut took = std::collections::BTreeSet::new();
        for q in 0..16 {
            let probe = r.route_m(&vm, &cfg, &hashes(100 + q, 9), &est(144, 16));
            took.insert(probe.pod.clone());
            r.finish(&vm, &probe).unwrap();
        }
        assert_eq!(took.len(), 2, "{took:?}");
    }

    #[test]
    fn the_step_phase_never_takes_a_prompt_from_the_pod_caching_it() {
        // a's step ends sooner (as above); b caches the prompt's 32-block prefix.
        let (vm, cfg, mut r) = streaming_on_two_pods(3, 4);
        let mut prompt = hashes(50, 32);
        r.prefix
            .insert(PodId::of("b:1"), &prompt, vm.now_ms(), 10_000);
        prompt.extend(hashes(60, 4));
        let probe = r.route_m(&vm, &cfg, &prompt, &est(576, 16));
        assert_eq!(probe.pod, "b:1", "{}", probe.ranking);
    }

    #[test]
    fn a_hot_prefix_spreads_when_its_pod_is_loaded() {
        let (vm, cfg, mut r) = router(&["a:1", "b:1"]);
        let mut pods = Vec::new();
        let mut inflight = Vec::new();
        for i in 0..20 {
            // Same 32-block system prompt, different 32-block questions, long outputs.
            let mut h = hashes(1, 32);
            h.extend(hashes(100 + i, 32));
            let routed = r.route_m(&vm, &cfg, &h, &est(1024, 512));
            pods.push(routed.pod.clone());
            inflight.push(routed);
        }
        // Each request in flight at home makes every decode step there read its 64 prompt blocks
        // again (× 0.2) and holds 32 more (× 0.05): 14.4 a request. Copying the prefix elsewhere
        // costs 2 × 32 blocks, shared with the requests the copy will serve: with k of them in
        // flight over two pods, 64 / (1 + k/2) — 42.7, 32, 25.6 — so the fourth is cheaper
        // elsewhere (counted in full, 64, it was the sixth).
        assert!(pods[1..3].iter().all(|p| *p == pods[0]), "{pods:?}");
        assert_ne!(pods[3], pods[0], "the fourth goes elsewhere: {pods:?}");
        let home = pods.iter().filter(|p| **p == pods[0]).count();
        assert!((8..=12).contains(&home), "then the two alternate: {pods:?}");
        for routed in &inflight {
            r.finish(&vm, routed).unwrap();
        }
        assert_eq!(total_active(&vm, &cfg), 0);
    }

    #[test]
    fn a_group_whose_last_pod_is_full_goes_to_an_earlier_one_before_a_pod_it_never_had() {
        let (vm, mut cfg, mut r) = router(&["a:1", "b:1", "c:1"]);
        cfg.admission.budget_tokens = 2_000;
        let group = hashes(1, 16);
        // The group was sent to a, then to b; each still indexes its first block only.
        r.prefix
            .insert(PodId::of("a:1"), &group[..1], vm.now_ms(), 1_000);
        vm.host().advance_ms(10);
        r.prefix
            .insert(PodId::of("b:1"), &group[..1], vm.now_ms(), 1_000);
        // b is full; a runs a small request (dearer than the idle c, within the tolerance).
        for (pod, e) in [("b:1", running(1, 2_000, 4)), ("a:1", running(2, 256, 16))] {
            record::modify(&vm, pod, |rec| {
                rec.entries.push(e);
                Some(())
            })
            .unwrap();
        }
        let routed = r.route_m(&vm, &cfg, &group, &est(256, 16));
        assert_eq!(routed.pod, "a:1", "{}", routed.ranking);
    }

    #[test]
    fn a_group_evicted_everywhere_goes_back_to_its_pod_while_load_allows() {
        let (vm, mut cfg, mut r) = router(&["a:1", "b:1"]);
        cfg.admission.enabled = false;
        let group = hashes(1, 16);
        vm.host().advance_ms(1_000); // this send is newer than the stale copy below
        let first = r.route_m(&vm, &cfg, &group, &est(256, 16));
        r.finish(&vm, &first).unwrap();
        let home = first.pod.clone();
        // The home's cache turns over (other prompts evict the group there), and a long request
        // on what it now holds keeps it busier than the other pod.
        let other_prompt = hashes(2, 40);
        r.prefix
            .insert(PodId::of(&home), &other_prompt, vm.now_ms(), 40);
        assert_eq!(r.prefix.matched(PodId::of(&home), &group, vm.now_ms()), 0);
        let busy = r.route_m(&vm, &cfg, &other_prompt, &est(640, 64));
        assert_eq!(busy.pod, home);
        // A group never seen goes to the idle pod; this one goes home, within half its prefill
        // (2 × 16 / 2) of the best cost.
        let new = r.route_m(&vm, &cfg, &hashes(3, 16), &est(256, 16));
        assert_ne!(new.pod, home, "{}", new.ranking);
        r.finish(&vm, &new).unwrap();
        // The other pod still has the head of its old copy (a head outlives its tail): the
        // group goes home all the same.
        let other = cfg.pods.iter().find(|p| **p != home).unwrap().clone();
        r.prefix.insert(PodId::of(&other), &group[..2], 0, 40);
        assert_eq!(r.prefix.matched(PodId::of(&other), &group, vm.now_ms()), 2);
        let again = r.route_m(&vm, &cfg, &group, &est(256, 16));
        assert_eq!(again.pod, home, "{}", again.ranking);
        r.finish(&vm, &again).unwrap();
        r.finish(&vm, &busy).unwrap();
        assert_eq!(total_active(&vm, &cfg), 0);
    }

    #[test]
    fn in_the_line_a_group_evicted_everywhere_goes_first_to_its_home_as_a_cached_one_to_its_pod() {
        let (vm, mut cfg, mut r) = router(&["a:1", "b:1"]);
        let e = est(256, 16);
        let group = |question| [hashes(1, 14), hashes(question, 2)].concat();
        let first = r.route_m(&vm, &cfg, &group(10), &e);
        r.finish(&vm, &first).unwrap();
        let home = first.pod.clone();
        let other = if home == "a:1" { "b:1" } else { "a:1" };
        // Its home's cache turns over: nothing holds half of the prompt any more.
        r.prefix
            .insert(PodId::of(&home), &hashes(2, 40), vm.now_ms(), 40);
        assert_eq!(
            r.prefix.matched(PodId::of(&home), &group(11), vm.now_ms()),
            0
        );
        assert!(r
            .prefix
            .sent_home(PodId::of(&home), group(11)[0], vm.now_ms())
            .is_some());
        // The home has room for nothing more: a request of another group fills it.
        let filler = running(1, 300, 19);
        record::modify(&vm, &home, |rec| {
            rec.entries.push(filler);
            Some(())
        })
        .unwrap();
        cfg.admission.budget_tokens = record::read(&vm, &home).unwrap().forecast(
            None,
            Headroom::uniform(2.0),
            16,
            crate::pods::record::At::UNTIMED,
        );
        assert!(cfg.admission.budget_tokens >= 300);
        let uncached = Placement::Uncached(vec![other.to_string()], home.clone());
        // In the line's cache-first order it goes only to its home, as a cached prompt goes only
        // where it is cached, and hears where else there is room. It is not held there
        // (`route_patient`: nothing is cached at home either); routed as usual it goes where
        // the room is.
        let ask = ("m", &group(11)[..], &e);
        assert_eq!(r.route_cached(&vm, &cfg, ask).unwrap(), uncached);
        // The line's cheap look before a pick says the same.
        assert!(r.belongs_on(&cfg, std::slice::from_ref(&home), ask.1, vm.now_ms()));
        assert!(!r.belongs_on(&cfg, &[other.to_string()], ask.1, vm.now_ms()));
        let patient = r.route_patient(&vm, &cfg, ask).unwrap().routed();
        assert_eq!(patient.pod, other);
        r.finish(&vm, &patient).unwrap();
        let copied = r.route(&vm, &cfg, "m", ask.1, &e).unwrap().routed();
        assert_eq!(copied.pod, other);
        r.finish(&vm, &copied).unwrap();
        // A group never sent anywhere has no home and takes the room.
        let fresh = r
            .route_cached(&vm, &cfg, ("m", &hashes(4, 16), &e))
            .unwrap();
        assert_eq!(fresh.routed().pod, other);
        // With several replicas a group's home is where every replica would send it: one pod.
        cfg.etcd.cluster = "etcd".into();
        let homes: Vec<&String> = cfg
            .pods
            .iter()
            .filter(|p| r.belongs_on(&cfg, std::slice::from_ref(*p), &hashes(5, 16), vm.now_ms()))
            .collect();
        assert_eq!(homes.len(), 1, "{homes:?}");
    }

    #[test]
    fn route_patient_holds_a_lightly_shared_prefix_and_a_hot_one_when_kv_runs_short() {
        let e = est(192, 16);
        let prompt = |question| [hashes(1, 6), hashes(question, 6)].concat();
        // The group's prefix is cached on a, which runs a long request of another group: busier
        // than the idle b by more than the prefill a saves, but by less than a whole prefill
        // more.
        let pool = || {
            let (vm, cfg, mut r) = router(&["a:1", "b:1"]);
            r.prefix
                .insert(PodId::of("a:1"), &prompt(10), vm.now_ms(), 1_000);
            let long = running(1, 1_700, 106);
            record::modify(&vm, "a:1", |rec| {
                rec.entries.push(long);
                Some(())
            })
            .unwrap();
            (vm, cfg, r)
        };
        // By cost alone, b computes the prefix again.
        let (vm, cfg, mut r) = pool();
        let by_cost = r.route_m(&vm, &cfg, &prompt(11), &e);
        assert_eq!(by_cost.pod, "b:1", "{}", by_cost.ranking);

        let (vm, mut cfg, mut r) = pool();
        let patient = |r: &mut Router, cfg: &Config, question| {
            r.route_patient(&vm, cfg, ("m", &prompt(question)[..], &e))
                .unwrap()
        };
        // Kept to the pod caching its prefix.
        let kept = patient(&mut r, &cfg, 11).routed();
        assert_eq!(kept.pod, "a:1", "{}", kept.ranking);
        // With that pod full, it waits for room there rather than copy the prefix to b.
        cfg.admission.budget_tokens = record::read(&vm, "a:1").unwrap().forecast(
            None,
            Headroom::uniform(2.0),
            16,
            crate::pods::record::At::UNTIMED,
        );
        assert_eq!(
            patient(&mut r, &cfg, 12),
            Placement::Uncached(vec!["b:1".to_string()], "a:1".to_string())
        );
        // A prompt no pod caches goes where there is room.
        let fresh = r
            .route_patient(&vm, &cfg, ("m", &hashes(3, 12), &e))
            .unwrap()
            .routed();
        assert_eq!(fresh.pod, "b:1", "{}", fresh.ranking);
        for done in [&kept, &fresh] {
            r.finish(&vm, done).unwrap();
        }

        // Nor is it kept to a pod that is busier by more than a whole prefill of the prompt.
        let (vm, cfg, mut r) = pool();
        record::modify(&vm, "a:1", |rec| {
            let first = rec.entries[0];
            rec.entries.push(RequestEntry { id: 2, ..first });
            Some(())
        })
        .unwrap();
        let far = r
            .route_patient(&vm, &cfg, ("m", &prompt(14)[..], &e))
            .unwrap()
            .routed();
        assert_eq!(far.pod, "b:1", "{}", far.ranking);

        // A prefix as many in-flight requests share as there are pods is copied by cost, as
        // `route` does: such a copy serves the requests that follow it.
        let (vm, cfg, mut r) = pool();
        let held: Vec<Routed> = (20..22)
            .map(|q| {
                r.route_patient(&vm, &cfg, ("m", &prompt(q)[..], &e))
                    .unwrap()
                    .routed()
            })
            .collect();
        assert!(held.iter().all(|h| h.pod == "a:1"));
        let copied = r
            .route_patient(&vm, &cfg, ("m", &prompt(22)[..], &e))
            .unwrap()
            .routed();
        assert_eq!(copied.pod, "b:1", "{}", copied.ranking);

        // Unless the pool's KV is about to run short (`routing::demand`): after another worker's
        // 16 dispatches within a millisecond (a burst's pace), requests like these would fill the
        // pool's budget many times over within their lifetime, and the hot prefix is held to its
        // pod like a lightly shared one. The same dispatches spread over a second leave it
        // copied, and so do those of a burst on another model's pod. A long prefix, so that its
        // pod stays within a prefill of the idle one.
        let e = est(512, 16);
        let prompt = |question| [hashes(1, 30), hashes(question, 2)].concat();
        for (spread_ms, burst_on, held_home) in
            [(0, "b:1", true), (1_600, "b:1", false), (0, "c:1", false)]
        {
            let (vm, mut cfg, mut r) = router(&["a:1", "b:1", "c:1"]);
            let now = vm.now_ms();
            for (pod, model) in [("a:1", "m"), ("b:1", "m"), ("c:1", "n")] {
                let list = [crate::models::served::ServedModel {
                    id: model.into(),
                    parent: None,
                }];
                crate::models::served::write_list(&vm, pod, &list, now).unwrap();
            }
            cfg.admission.budget_tokens = 10_000;
            r.prefix.insert(PodId::of("a:1"), &prompt(10), now, 1_000);
            // And a long answer of another group's, so that a copy to b is the cheaper pick.
            record::modify(&vm, "a:1", |rec| {
                rec.entries.push(running(1, 3_200, 200));
                Some(())
            })
            .unwrap();
            let mut patient = |question| {
                r.route_patient(&vm, &cfg, ("m", &prompt(question)[..], &e))
                    .unwrap()
                    .routed()
            };
            for q in 20..22 {
                let held = patient(q);
                assert_eq!(held.pod, "a:1");
                assert!(
                    !held.hot_held,
                    "a lightly shared prefix is held whatever the KV"
                );
            }
            let mut other = PickLog::start(&vm).unwrap();
            for k in 0..16 {
                vm.host().advance_ms(spread_ms / 16);
                let event = Event::Dispatch(Dispatch {
                    pod: burst_on.to_string(),
                    request: 1_000 + k,
                    adapter: 0,
                    hashes: hashes(100 + k, 2),
                });
                other.publish(&vm, u32::MAX, &event).unwrap();
            }
            let next = patient(22);
            assert_eq!(
                next.pod == "a:1",
                held_home,
                "{burst_on} {spread_ms} {}",
                next.ranking
            );
            assert_eq!(next.hot_held, held_home);
        }
    }

    #[test]
    fn route_cached_takes_only_room_where_the_prompts_prefix_is_and_says_when_room_is_elsewhere() {
        let (vm, mut cfg, mut r) = router(&["a:1", "b:1"]);
        // Room for one request a pod, not for a second even beside its group's first.
        cfg.admission.budget_tokens = 300;
        let e = est(192, 16);
        let prompt = |group, question| [hashes(group, 6), hashes(question, 6)].concat();
        let x1 = r.route_m(&vm, &cfg, &prompt(1, 10), &e);
        let y1 = r.route_m(&vm, &cfg, &prompt(2, 11), &e);
        assert_ne!(x1.pod, y1.pod, "a new group goes where nothing is cached");
        r.finish(&vm, &y1).unwrap();
        let x2 = |r: &mut Router, cached: bool| {
            let request = ("m", &prompt(1, 12)[..], &e);
            if cached {
                r.route_cached(&vm, &cfg, request).unwrap()
            } else {
                r.route(&vm, &cfg, request.0, request.1, request.2).unwrap()
            }
        };
        // x's pod is full; y's has room but would compute x's prefix again.
        assert_eq!(
            x2(&mut r, true),
            Placement::Uncached(vec![y1.pod.clone()], x1.pod.clone())
        );
        let y2 = r
            .route_cached(&vm, &cfg, ("m", &prompt(2, 13), &e))
            .unwrap();
        assert_eq!(y2.routed().pod, y1.pod, "y's prefix is cached there");
        assert_eq!(
            x2(&mut r, true),
            Placement::NoRoom(x1.pod.clone()),
            "no room anywhere now: it waits where its prefix is"
        );
        // A prompt no pod caches may go anywhere; and any request may, routed as usual.
        let fresh = r.route_cached(&vm, &cfg, ("m", &prompt(3, 14), &e));
        assert!(matches!(fresh.unwrap(), Placement::NoRoom(_)));
        let y2 = record::read(&vm, &y1.pod).unwrap().entries[0].id;
        record::finish(&vm, &y1.pod, y2).unwrap();
        assert!(matches!(
            r.route_cached(&vm, &cfg, ("m", &prompt(3, 14), &e))
                .unwrap(),
            Placement::Routed(_)
        ));
        let z = record::read(&vm, &y1.pod).unwrap().entries[0].id;
        record::finish(&vm, &y1.pod, z).unwrap();
        assert_eq!(x2(&mut r, false).routed().pod, y1.pod, "a copy when asked");
    }

    #[test]
    fn a_shared_prefix_is_held_once_and_never_swallows_the_question() {
        let (vm, cfg, mut r) = router(&["a:1"]);
        // Twenty character blocks, ten of them a shared system prompt, would be 320 tokens at
        // 16 per block, but the text is denser: the prompt is 100 tokens, 5 per block; safety
        // factor 1.1.
        let e = est(100, 200);
        let prompt = |question| [hashes(1, 10), hashes(question, 10)].concat();
        r.route_m(&vm, &cfg, &prompt(2), &e);
        r.route_m(&vm, &cfg, &prompt(3), &e);
        assert_eq!(
            record::read(&vm, "a:1").unwrap().held_tokens(),
            110 + (110 - 53),
            "the second is spared the whole blocks of the held 50 prompt tokens (48, × 1.1), \
             not its question, nor the block where the held prefix ends"
        );
    }

    #[test]
    fn active_blocks_are_the_engines_blocks_of_what_is_held_not_the_texts() {
        // Prose of more characters per token than the cut assumes: 10 blocks of characters,
        // 96 tokens (with the tests' 1.1 margin, 106), which the engine holds in 7 blocks of 16.
        let (vm, cfg, mut r) = router(&["a:1"]);
        let x = r.route_m(&vm, &cfg, &hashes(1, 10), &est(96, 0));
        let rec = record::read(&vm, "a:1").unwrap();
        assert_eq!(rec.held_tokens(), 106);
        assert_eq!(
            rec.active_blocks(16),
            7,
            "not the prompt's 10 character blocks"
        );
        r.finish(&vm, &x).unwrap();
        assert_eq!(total_active(&vm, &cfg), 0);
    }

    #[test]
    fn a_batch_whose_first_prompt_is_long_leaves_its_whole_shared_prefix_to_its_heir() {
        // A request on 3 blocks; a batch of two prompts, 192 tokens in all (12 blocks, 6 a
        // prompt), whose first is 8 blocks leading with those 3; a request on the same 8 blocks.
        // The batch leans on the first for 3 blocks and the last on the batch for 8: when the
        // batch ends, its heir must count the 5 blocks after the first's, not its share's 3.
        let held = |vm: &FakeVm| record::read(vm, "a:1").unwrap().held_tokens();
        let (vm, cfg, mut r) = router(&["a:1"]);
        let first = r.route_m(&vm, &cfg, &hashes(1, 3), &est(48, 0));
        let last = r.route_m(&vm, &cfg, &hashes(1, 8), &est(128, 0));
        let without_batch = held(&vm);
        r.finish(&vm, &last).unwrap();
        let batch = Estimate {
            prompts: 2,
            choices: 2,
            ..est(192, 0)
        };
        let x = r.route_m(&vm, &cfg, &hashes(1, 8), &batch);
        let last = r.route_m(&vm, &cfg, &hashes(1, 8), &est(128, 0));
        r.finish(&vm, &x).unwrap();
        assert_eq!(
            held(&vm),
            without_batch,
            "the heir counts all it shared with the batch"
        );
        r.finish(&vm, &last).unwrap();
        r.finish(&vm, &first).unwrap();
        assert_eq!(held(&vm), 0);
    }

    /// A rerank of eight documents, 64 query tokens and 32 of a document a pair: on a pod that
    /// caches prefixes its pairs share the query's 4 blocks, held once (320 tokens, × 1.1),
    /// not once a pair (768). And a stream of such pages leaves the index's density (its
    /// blocks per engine block) where single prompts put it: a page is hashed on its first
    /// pair but counts all of them.
    #[test]
    fn a_pages_query_is_held_once_and_pages_teach_no_density() {
        let (vm, cfg, mut r) = router(&["a:1"]);
        let page = Estimate {
            prompts: 8,
            choices: 8,
            repeated: (64, 7),
            ..est(8 * (64 + 32), 0)
        };
        let x = r.route_m(&vm, &cfg, &hashes(1, 6), &page);
        let held = record::read(&vm, "a:1").unwrap().held_tokens();
        assert_eq!(held, 352, "(768 - 7 × 64) × 1.1");
        r.finish(&vm, &x).unwrap();
        let before = r.prefix.density();
        for i in 0..200 {
            let x = r.route_m(&vm, &cfg, &hashes(i, 6), &page);
            r.finish(&vm, &x).unwrap();
        }
        assert_eq!(r.prefix.density(), before);
    }

    #[test]
    fn shared_prefix_blocks_count_once_and_return_to_zero() {
        let cfg = config(&["a:1"]);
        let (_host, [(w1, mut r1), (w2, mut r2)]) = two_workers(&cfg);
        let x = r1.route_m(&w1, &cfg, &hashes(1, 10), &est(160, 0));
        let y = r2.route_m(&w2, &cfg, &hashes(1, 10), &est(160, 0));
        assert_eq!(
            total_active(&w1, &cfg),
            11,
            "the shared 176 tokens (160 × 1.1) count once: 11 blocks"
        );
        let held = |vm: &FakeVm| record::read(vm, "a:1").unwrap().held_tokens();
        assert_eq!(
            held(&w1),
            176,
            "the second holds nothing more: its whole prompt is the first one's (× 1.1)"
        );
        r1.finish(&w1, &x).unwrap();
        assert_eq!(
            held(&w1),
            176,
            "the prefix's tokens stay held with its heir"
        );
        assert_eq!(
            total_active(&w1, &cfg),
            11,
            "still held by the other request"
        );
        r2.finish(&w2, &y).unwrap();
        r2.finish(&w2, &y).unwrap();
        assert_eq!(total_active(&w1, &cfg), 0);
        assert_eq!(held(&w1), 0);
    }

    #[test]
    fn a_reservation_starts_from_the_record_its_pick_just_read() {
        let (vm, cfg, mut r) = router(&["a"]);
        let store = crate::test_support::Watched::new(&vm);
        r.route(&store, &cfg, "m", &hashes(1, 4), &est(100, 10))
            .unwrap()
            .routed();
        assert_eq!(
            store.reads_of(&record::key("a")),
            1,
            "read once, for the pick"
        );
        // Another worker wrote the record between the pick and the swap: the swap fails, the
        // record is read again, and both reservations stand.
        let (vm, cfg, mut r) = router(&["a"]);
        let other = vm.host().vm();
        let racing = crate::test_support::Watched::racing(&vm, || {
            record::modify(&other, "a", |rec| {
                rec.entries.push(RequestEntry {
                    id: 99,
                    expires_ms: u64::MAX,
                    ..RequestEntry::default()
                });
                Some(())
            })
            .unwrap();
        });
        r.route(&racing, &cfg, "m", &hashes(1, 4), &est(100, 10))
            .unwrap()
            .routed();
        assert_eq!(record::read(&vm, "a").unwrap().entries.len(), 2);
    }

    #[test]
    fn a_prefix_whose_holder_finished_on_another_worker_is_counted_by_the_next_request() {
        let cfg = config(&["a:1"]);
        let (_host, [(w1, mut r1), (w2, mut r2)]) = two_workers(&cfg);
        let prompt = |question| [hashes(1, 10), hashes(question, 10)].concat();
        let held = || record::read(&w1, "a:1").unwrap().held_tokens();
        // Worker 2 learns of worker 1's request through the pick log; worker 1 then finishes it,
        // and its finish waits in worker 1's next append, so worker 2 still believes it in flight.
        let x = r1.route_m(&w1, &cfg, &prompt(2), &est(320, 0));
        let warm = r2.route_m(&w2, &cfg, &hashes(9, 1), &est(16, 0));
        r2.finish(&w2, &warm).unwrap();
        r1.finish(&w1, &x).unwrap();
        assert_eq!(held(), 0);
        let y = r2.route_m(&w2, &cfg, &prompt(3), &est(320, 0));
        assert_eq!(
            held(),
            352,
            "the engine holds the whole prompt for it: nobody else counts the prefix (× 1.1)"
        );
        // While the holder is in flight, a request leaning on it holds only its question, and
        // takes the prefix on when the holder ends first, whichever worker ends it.
        let z = r1.route_m(&w1, &cfg, &prompt(4), &est(320, 0));
        assert_eq!(held(), 352 + 176);
        r2.finish(&w2, &y).unwrap();
        assert_eq!(held(), 352);
        r1.finish(&w1, &z).unwrap();
        assert_eq!((held(), total_active(&w1, &cfg)), (0, 0));
    }

    #[test]
    fn output_grows_by_blocks_and_unhealthy_pods_are_avoided() {
        let host = FakeHost::new();
        let cfg = config(&["a:1", "b:1"]);
        let vm = host.vm();
        host.set_now_ms(10_000);
        record::write_snapshot(
            &vm,
            "a:1",
            Snapshot {
                at_ms: 10_000,
                healthy: false,
                ..Snapshot::default()
            },
            0,
            &cfg,
        )
        .unwrap();
        let mut r = Router::start(&vm, &cfg).unwrap();
        let mut routed = r.route_m(&vm, &cfg, &hashes(1, 4), &est(64, 64));
        assert_eq!(routed.pod, "b:1");
        let e = est(64, 64);
        assert!(r
            .grow(&vm, &cfg, &mut routed, &e, 17, Ended::default())
            .unwrap());
        assert!(!r
            .grow(&vm, &cfg, &mut routed, &e, 20, Ended::default())
            .unwrap());
        assert_eq!(record::read(&vm, "b:1").unwrap().active_blocks(16), 4 + 2);
        r.finish(&vm, &routed).unwrap();
        assert_eq!(total_active(&vm, &cfg), 0);
    }

    #[test]
    fn two_workers_cannot_both_take_the_last_room() {
        let mut cfg = config(&["a:1"]);
        cfg.admission.budget_tokens = 1_000;
        let (_host, [(w1, mut r1), (w2, mut r2)]) = two_workers(&cfg);
        let first = r1
            .route(&w1, &cfg, "m", &hashes(1, 4), &est(400, 100))
            .unwrap();
        assert!(matches!(first, Placement::Routed(_)));
        // Either of the next two fits beside the first (440 + 100 + 16, then 330 + 50 + 16 each),
        // not both. Worker 2 takes the room while worker 1 is between its read and its write.
        let mut second = None;
        let racing = crate::test_support::Watched::racing(&w1, || {
            second = Some(
                r2.route(&w2, &cfg, "m", &hashes(2, 4), &est(300, 50))
                    .unwrap(),
            );
        });
        let third = r1
            .route(&racing, &cfg, "m", &hashes(3, 4), &est(300, 50))
            .unwrap();
        drop(racing);
        assert!(matches!(second, Some(Placement::Routed(_))), "{second:?}");
        assert_eq!(
            third,
            Placement::NoRoom("a:1".to_string()),
            "checked again inside the compare-and-swap"
        );
        let rec = record::read(&w1, "a:1").unwrap();
        assert_eq!(rec.entries.len(), 2);
        assert!(
            rec.forecast(
                None,
                cfg.admission.headroom(),
                16,
                crate::pods::record::At::UNTIMED
            ) <= 1_000
        );
    }

    /// One pod, admission off, and the routers of two VMs: a worker's and another's.
    fn worker_and_main(host: &FakeHost) -> (Config, FakeVm, Router, FakeVm, Router) {
        let mut cfg = config(&["a:1"]);
        cfg.admission.enabled = false;
        let (worker, main) = (host.vm(), host.vm());
        let w = Router::start(&worker, &cfg).unwrap();
        let m = Router::start(&main, &cfg).unwrap();
        (cfg, worker, w, main, m)
    }

    #[test]
    fn a_vm_that_routes_little_bounds_its_replicas_by_the_records() {
        // A worker with little traffic: its replicas are fed by the others' picks on its tick
        // (the 30-minute soak's one growing VM was Envoy's main thread, which now replays none).
        let host = FakeHost::new();
        let (cfg, worker, mut w, main, mut m) = worker_and_main(&host);
        let snapshot = Snapshot {
            healthy: true,
            block_size: 16,
            capacity_tokens: 16 * 40,
            ..Snapshot::default()
        };
        record::write_snapshot(&worker, "a:1", snapshot, 0, &cfg).unwrap();
        let own = m.route_m(&main, &cfg, &hashes(1, 8), &est(128, 16));
        m.finish(&main, &own).unwrap();
        for i in 0..10 {
            let routed = w.route_m(&worker, &cfg, &hashes(100 + i, 8), &est(128, 16));
            w.finish(&worker, &routed).unwrap();
        }
        m.tend(&main, &cfg).unwrap();
        assert!(
            m.prefix.blocks_held(PodId::of("a:1")) <= 40,
            "bounded by the pod's 40 blocks, not podCapacityBlocks: {}",
            m.prefix.blocks_held(PodId::of("a:1"))
        );
        // A request whose finish the log lost (a ring overrun, a VM gone) leaves its replicas
        // once its entry has left the record.
        let lost = w.route_m(&worker, &cfg, &hashes(200, 8), &est(128, 16));
        m.tend(&main, &cfg).unwrap();
        assert_eq!(m.active.unique_blocks(PodId::of("a:1")), 8);
        record::finish(&worker, "a:1", lost.request).unwrap();
        host.advance_ms(5_000);
        m.tend(&main, &cfg).unwrap();
        assert_eq!(m.active.unique_blocks(PodId::of("a:1")), 0);
    }

    #[test]
    fn the_engines_prefix_counters_shrink_what_the_index_holds_and_a_restart_empties_it() {
        let host = FakeHost::new();
        let (cfg, worker, mut w, main, mut m) = worker_and_main(&host);
        let scraped = |hits: f64, queries: f64| {
            let snapshot = Snapshot {
                at_ms: host.now_ms(),
                healthy: true,
                block_size: 16,
                capacity_tokens: 16 * 400,
                hit_totals: Some(HitTotals {
                    hits,
                    queries,
                    tally: record::Tally::default(),
                }),
                ..Snapshot::default()
            };
            record::write_snapshot(&worker, "a:1", snapshot, 0, &cfg).unwrap();
        };
        scraped(0.0, 0.0);
        // Twenty prompts sent twice: kvgate believes the second of each cached, half of it all.
        for i in 0..40 {
            let routed = w.route_m(&worker, &cfg, &hashes(1_000 + i / 2, 8), &est(128, 16));
            assert_eq!(routed.cached_blocks, if i % 2 == 1 { 8 } else { 0 });
            w.finish(&worker, &routed).unwrap();
        }
        let tally = record::read(&worker, "a:1").unwrap().tally;
        assert_eq!(
            (tally.requests, tally.believed_blocks, tally.sent_blocks),
            (40, 160, 320)
        );
        // The engine found none of it cached (others filled its cache): the index keeps half
        // of the pod's 400 blocks.
        scraped(0.0, 40.0 * 128.0);
        let share = |vm: &FakeVm| {
            record::read(vm, "a:1")
                .unwrap()
                .snapshot
                .map(|s| s.index_share())
        };
        assert_eq!(share(&worker), Some(0.5));
        for i in 0..30 {
            let routed = w.route_m(&worker, &cfg, &hashes(2_000 + i, 8), &est(128, 16));
            w.finish(&worker, &routed).unwrap();
        }
        m.route_m(&main, &cfg, &hashes(3_000, 8), &est(128, 16));
        for (vm, held) in [
            ("worker", w.prefix.blocks_held(PodId::of("a:1"))),
            ("main", m.prefix.blocks_held(PodId::of("a:1"))),
        ] {
            // Evicted past a sixteenth above 200 blocks: 400 without the engine's word.
            assert!(held <= 200 + 200 / 16, "{vm}: {held}");
        }
        let again = w.route_m(&worker, &cfg, &hashes(2_029, 8), &est(128, 16));
        assert_eq!(again.cached_blocks, 8);
        w.finish(&worker, &again).unwrap();
        m.tend(&main, &cfg).unwrap();
        assert_eq!(
            m.prefix
                .matched(PodId::of("a:1"), &hashes(2_029, 8), host.now_ms()),
            8,
            "replayed"
        );
        // The engine's counters start again: it restarted, with an empty cache, and every VM
        // forgets what it believed the pod held, replayed picks included.
        scraped(0.0, 128.0);
        assert_eq!(
            record::read(&worker, "a:1")
                .unwrap()
                .snapshot
                .map(|s| s.engine_restarts),
            Some(1)
        );
        // Once this VM's copy of the record is as old as copies get.
        host.advance_ms(COPY_MS);
        let after = w.route_m(&worker, &cfg, &hashes(2_028, 8), &est(128, 16));
        assert_eq!(after.cached_blocks, 0, "believed cached before the restart");
        // The other VM learns on its next request, or its tick a second after it last did.
        host.advance_ms(LEARN_MS);
        m.tend(&main, &cfg).unwrap();
        assert_eq!(
            m.prefix
                .matched(PodId::of("a:1"), &hashes(2_029, 8), host.now_ms()),
            0
        );
        assert_eq!(
            m.prefix
                .matched(PodId::of("a:1"), &hashes(2_028, 8), host.now_ms()),
            8,
            "sent since"
        );
        w.finish(&worker, &after).unwrap();
    }

    #[test]
    fn a_vm_that_does_not_route_replays_picks_only_when_it_routes() {
        let host = FakeHost::new();
        let (cfg, worker, mut w, main, mut m) = worker_and_main(&host);
        // Envoy's main thread: it ticks, and the workers' picks cost it nothing.
        let before = w.route_m(&worker, &cfg, &hashes(100, 8), &est(128, 16));
        m.tend(&main, &cfg).unwrap();
        assert_eq!(m.prefix.blocks_held(PodId::of("a:1")), 0);
        assert_eq!(m.active.unique_blocks(PodId::of("a:1")), 0);
        // A worker's first request: it replays what it missed first, so its pick knows them.
        w.route_m(&worker, &cfg, &hashes(200, 8), &est(128, 16));
        m.route_m(&main, &cfg, &hashes(300, 8), &est(128, 16));
        assert_eq!(
            m.active.unique_blocks(PodId::of("a:1")),
            24,
            "both picks before and its own"
        );
        assert_eq!(m.prefix.blocks_held(PodId::of("a:1")), 24);
        // Routing, it replays on its tick too.
        w.route_m(&worker, &cfg, &hashes(400, 8), &est(128, 16));
        m.tend(&main, &cfg).unwrap();
        assert_eq!(m.active.unique_blocks(PodId::of("a:1")), 32);
        // Idle for `REPLAY_IDLE_MS`, it leaves the log to its next request.
        host.advance_ms(REPLAY_IDLE_MS);
        w.route_m(&worker, &cfg, &hashes(500, 8), &est(128, 16));
        m.tend(&main, &cfg).unwrap();
        assert_eq!(m.prefix.blocks_held(PodId::of("a:1")), 32);
        m.route_m(&main, &cfg, &hashes(600, 8), &est(128, 16));
        assert_eq!(m.prefix.blocks_held(PodId::of("a:1")), 48);
        w.finish(&worker, &before).unwrap();
    }

    #[test]
    fn a_scrape_that_shrinks_the_budget_binds_before_the_copy_is_refreshed() {
        let host = FakeHost::new();
        let mut cfg = config(&["a:1"]);
        cfg.metrics.cluster = "kvgate_metrics".into();
        let vm = host.vm();
        crate::test_support::lists_failed(&vm, &["a:1"]);
        let mut r = Router::start(&vm, &cfg).unwrap();
        let scraped = |capacity_tokens| {
            let snapshot = Snapshot {
                at_ms: host.now_ms(),
                healthy: true,
                capacity_tokens,
                ..Snapshot::default()
            };
            record::write_snapshot(&vm, "a:1", snapshot, 0, &cfg).unwrap();
        };
        scraped(10_000);
        host.advance_ms(COPY_MS);
        let first = r.route(&vm, &cfg, "m", &hashes(1, 4), &est(400, 100));
        assert!(matches!(first.unwrap(), Placement::Routed(_)));
        // The pod shrinks (a scrape on another worker) while this VM's copy still shows the room
        // it had: the stored snapshot's budget decides, not the copy's (found by the router fuzz
        // target: a pod first seen unscraped, then scraped small, took a second request).
        scraped(600);
        let second = r.route(&vm, &cfg, "m", &hashes(2, 4), &est(300, 50));
        assert_eq!(second.unwrap(), Placement::NoRoom("a:1".to_string()));
        assert_eq!(record::read(&vm, "a:1").unwrap().entries.len(), 1);
    }

    #[test]
    fn streaming_adds_only_what_streamed_since_the_last_write() {
        let (vm, cfg, mut r) = router(&["a:1"]);
        let e = est(100, 64);
        let mut routed = r.route_m(&vm, &cfg, &hashes(1, 4), &e);
        let held = || record::read(&vm, "a:1").unwrap().held_tokens();
        assert_eq!(held(), 110);
        r.grow(&vm, &cfg, &mut routed, &e, 17, Ended::default())
            .unwrap();
        r.grow(&vm, &cfg, &mut routed, &e, 40, Ended::default())
            .unwrap();
        assert_eq!(
            held(),
            110 + 40,
            "prompt plus output so far, never the output twice"
        );
        let rec = record::read(&vm, "a:1").unwrap();
        assert_eq!(rec.entries[0].left, 64 - 40);
    }

    /// Four answers of up to 64 tokens: as two of them end, the engine frees their tokens and
    /// the entry holds, grows and reads for the two still running.
    #[test]
    fn answers_that_end_free_their_tokens_while_the_others_run_on() {
        let (vm, cfg, mut r) = router(&["a:1"]);
        let e = Estimate {
            choices: 4,
            max_output_tokens: 4 * 64,
            ..est(100, 4 * 64)
        };
        let mut routed = r.route_m(&vm, &cfg, &hashes(1, 4), &e);
        let entry = || record::read(&vm, "a:1").unwrap().entries[0];
        assert_eq!(
            (entry().held_tokens, entry().choices, entry().left),
            (110, 4, 64)
        );
        r.grow(&vm, &cfg, &mut routed, &e, 80, Ended::default())
            .unwrap();
        assert_eq!((entry().held_tokens, entry().left), (110 + 80, 64 - 20));
        // Two answers end, 25 tokens between them, while the stream reaches 90.
        let two = Ended {
            answers: 2,
            tokens: 25,
        };
        assert!(r.grow(&vm, &cfg, &mut routed, &e, 90, two).unwrap());
        let now = entry();
        assert_eq!((now.held_tokens, now.choices), (110 + 90 - 25, 2));
        // The two left have made 65 tokens, 32 or so each: 64 less that, a step each.
        assert_eq!(now.left, (2 * 64 - 65u32).div_ceil(2));
        assert_eq!(now.output_blocks, 65u32.div_ceil(16));
        assert_eq!(now.outlook, e.outlook(2, 65));
        assert!(
            !r.grow(&vm, &cfg, &mut routed, &e, 90, two).unwrap(),
            "nothing new"
        );
        r.finish(&vm, &routed).unwrap();
        assert_eq!(total_active(&vm, &cfg), 0);
    }

    #[test]
    fn a_pick_served_elsewhere_is_marked_down_and_its_accounting_moves() {
        let (vm, cfg, mut r) = router(&["a:1", "b:1"]);
        let mut routed = r.route_m(&vm, &cfg, &hashes(1, 4), &est(64, 0));
        let (picked, other) = if routed.pod == "a:1" {
            ("a:1", "b:1")
        } else {
            ("b:1", "a:1")
        };
        r.rehome(&vm, &cfg, &mut routed, other, Moved::PickFailed)
            .unwrap();
        assert_eq!(
            (routed.pod.as_str(), routed.pod_id),
            (other, PodId::of(other))
        );
        let blocks = |r: &Router, pod: &str| r.active.unique_blocks(PodId::of(pod));
        assert_eq!(
            (blocks(&r, picked), blocks(&r, other)),
            (0, 4),
            "the replica follows"
        );
        assert!(!record::read(&vm, picked).unwrap().snapshot.unwrap().healthy);
        // 64 tokens with the tests' 1.1 margin: 70, in 5 blocks of 16.
        assert_eq!(record::read(&vm, other).unwrap().active_blocks(16), 5);
        let next = r.route_m(&vm, &cfg, &hashes(1, 4), &est(64, 0));
        assert_eq!(next.pod, other);
        r.finish(&vm, &routed).unwrap();
        r.finish(&vm, &next).unwrap();
        assert_eq!(total_active(&vm, &cfg), 0);
        assert_eq!(blocks(&r, other), 0);
    }

    #[test]
    fn a_pod_without_prefix_caching_gets_no_prefix_credit_and_shares_nothing() {
        let host = FakeHost::new();
        let cfg = config(&["a:1"]);
        let vm = host.vm();
        let snapshot = Snapshot {
            healthy: true,
            no_prefix_caching: true,
            ..Snapshot::default()
        };
        record::write_snapshot(&vm, "a:1", snapshot, 0, &Config::default()).unwrap();
        let mut r = Router::start(&vm, &cfg).unwrap();
        let x = r.route_m(&vm, &cfg, &hashes(1, 10), &est(160, 0));
        let y = r.route_m(&vm, &cfg, &hashes(1, 10), &est(160, 0));
        assert_eq!(y.cached_blocks, 0, "served before, but not cached there");
        let rec = record::read(&vm, "a:1").unwrap();
        // 176 tokens each (the rule's margin until calibrated), 11 blocks of 16.
        assert_eq!(rec.held_tokens(), 2 * 176);
        assert_eq!(
            rec.active_blocks(16),
            22,
            "each sequence holds its own copy"
        );
        r.finish(&vm, &x).unwrap();
        assert_eq!(record::read(&vm, "a:1").unwrap().active_blocks(16), 11);
        r.finish(&vm, &y).unwrap();
        assert_eq!(total_active(&vm, &cfg), 0);
        // A request of three answers: each answer's sequence holds its own copy of the prompt
        // there (vLLM shares a prompt among answers only through its prefix cache).
        let three = Estimate {
            choices: 3,
            ..est(160, 0)
        };
        let z = r.route_m(&vm, &cfg, &hashes(2, 10), &three);
        assert_eq!(record::read(&vm, "a:1").unwrap().held_tokens(), 3 * 176);
        r.finish(&vm, &z).unwrap();
        // A batch of three prompts, one answer each: each prompt is its own, held once. Its
        // hashes are its first prompt's, a third of the 10 blocks.
        let batch = Estimate {
            prompts: 3,
            ..three
        };
        let z = r.route_m(&vm, &cfg, &hashes(3, 4), &batch);
        let rec = record::read(&vm, "a:1").unwrap();
        assert_eq!(rec.held_tokens(), 176);
        // Each answer reads its own prompt at each step, a third of the 10 blocks in whole
        // blocks: not all 10 (before: 3 × 10).
        assert_eq!(rec.read_blocks(), 3 * 4);
        r.finish(&vm, &z).unwrap();
    }

    #[test]
    fn a_request_of_several_answers_holds_its_prompt_once_where_prefixes_are_cached() {
        let (vm, cfg, mut r) = router(&["a:1"]);
        let three = Estimate {
            choices: 3,
            ..est(160, 0)
        };
        let z = r.route_m(&vm, &cfg, &hashes(2, 10), &three);
        let rec = record::read(&vm, "a:1").unwrap();
        assert_eq!(rec.held_tokens(), 176);
        assert_eq!(rec.entries[0].choices, 3);
        // Each answer reads the prompt at each step: three times its 10 blocks.
        assert_eq!(rec.read_blocks(), 3 * 10);
        r.finish(&vm, &z).unwrap();
    }

    #[test]
    fn the_block_size_follows_the_pods_unless_configured() {
        let (vm, cfg, mut r) = router(&["a:1", "b:1"]);
        assert_eq!(r.block_tokens(&cfg.routing), 16, "before any scrape");
        let scraped = |pod, block_size| {
            let snapshot = Snapshot {
                at_ms: 0,
                healthy: true,
                block_size,
                ..Snapshot::default()
            };
            record::write_snapshot(&vm, pod, snapshot, 0, &Config::default()).unwrap();
        };
        scraped("a:1", 16);
        scraped("b:1", 32);
        // The router ranks on its copies of the records: a scrape reaches it within COPY_MS.
        vm.host().advance_ms(COPY_MS);
        let first = r.route_m(&vm, &cfg, &hashes(1, 4), &est(64, 64));
        assert_eq!(first.block_tokens, 16, "cut before the pods were read");
        assert_eq!(r.block_tokens(&cfg.routing), 32, "the largest reported");
        let second = r.route_m(&vm, &cfg, &hashes(2, 4), &est(64, 64));
        assert_eq!(second.block_tokens, 32);
        scraped("a:1", 1);
        scraped("b:1", 1);
        vm.host().advance_ms(COPY_MS);
        r.route(&vm, &cfg, "m", &hashes(3, 4), &est(64, 64))
            .unwrap();
        assert_eq!(
            r.block_tokens(&cfg.routing),
            16,
            "SGLang's one-token pages are hashed 16 at a time"
        );
        let mut pinned = cfg.clone();
        pinned.routing.block_tokens = 64;
        assert_eq!(r.block_tokens(&pinned.routing), 64);
    }

    #[test]
    fn until_discovery_first_answers_a_request_waits_for_the_pool_and_then_is_routed() {
        let (vm, mut cfg, _) = router(&[]);
        cfg.discovery.admin_cluster = "kvgate_admin".into();
        let mut r = Router::start(&vm, &cfg).unwrap();
        let place = |r: &mut Router| r.route(&vm, &cfg, "m", &hashes(1, 4), &est(64, 0)).unwrap();
        assert_eq!(place(&mut r), Placement::Discovering, "started under load");
        assert!(r.discovering(&vm, &cfg));
        // Published within the same second: the unknown pool was not cached.
        vm.host().advance_ms(30);
        vm.set(PODS_KEY, &encode_pods(&["x:1".into()]), None)
            .unwrap();
        assert!(matches!(place(&mut r), Placement::Routed(p) if p.pod == "x:1"));
        assert!(!r.discovering(&vm, &cfg));

        // Discovery found pods, then lost them all: nothing to wait for.
        let vm = FakeHost::new().vm();
        let mut r = Router::start(&vm, &cfg).unwrap();
        vm.set(PODS_KEY, &encode_pods(&[]), None).unwrap();
        assert_eq!(
            r.route(&vm, &cfg, "m", &hashes(1, 4), &est(64, 0)).unwrap(),
            Placement::NoPods
        );

        // Discovery never answers (a broken admin cluster): past its first wait, Envoy's
        // balancing serves, as with no pods at all.
        let vm = FakeHost::new().vm();
        let mut r = Router::start(&vm, &cfg).unwrap();
        vm.host().advance_ms(first_discovery_ms(&cfg) - 1);
        assert!(r.discovering(&vm, &cfg));
        vm.host().advance_ms(1);
        assert!(!r.discovering(&vm, &cfg));
        assert_eq!(
            r.route(&vm, &cfg, "m", &hashes(1, 4), &est(64, 0)).unwrap(),
            Placement::NoPods
        );

        // Without discovery no pod will appear: no wait.
        let (vm, cfg, mut r) = router(&[]);
        assert!(!r.discovering(&vm, &cfg));
    }

    #[test]
    fn discovered_pods_join_and_departed_ones_leave() {
        let (vm, cfg, mut r) = router(&[]);
        assert_eq!(
            r.route(&vm, &cfg, "m", &hashes(1, 4), &est(64, 0)).unwrap(),
            Placement::NoPods
        );
        vm.set(PODS_KEY, &encode_pods(&["x:1".into()]), None)
            .unwrap();
        vm.host().advance_ms(PODS_CACHE_MS);
        let routed = r.route_m(&vm, &cfg, &hashes(1, 4), &est(64, 0));
        assert_eq!(routed.pod, "x:1");
        r.finish(&vm, &routed).unwrap();
        vm.set(PODS_KEY, &encode_pods(&[]), None).unwrap();
        vm.host().advance_ms(PODS_CACHE_MS);
        r.sync(&vm, &cfg).unwrap();
        assert!(r.pods().is_empty());
    }

    /// Pods that each serve `base` and the adapters `a1`..`a3` with one adapter slot, scraped now.
    fn adapter_pool(host: &FakeHost, vm: &FakeVm, pods: &[&str]) {
        use crate::models::served::{write_list, write_lora, LoraState, ServedModel};
        let mut list = vec![ServedModel {
            id: "base".into(),
            parent: None,
        }];
        for a in ["a1", "a2", "a3"] {
            list.push(ServedModel {
                id: a.into(),
                parent: Some("base".into()),
            });
        }
        let now = host.now_ms();
        for pod in pods {
            write_list(vm, pod, &list, now).unwrap();
            let lora = LoraState {
                at_ms: now,
                max_lora: 1,
                ..LoraState::default()
            };
            write_lora(vm, pod, lora).unwrap();
            record::modify(vm, pod, |rec| {
                rec.snapshot = Some(Snapshot {
                    at_ms: now,
                    healthy: true,
                    kv_usage: f64::NAN,
                    ..Snapshot::default()
                });
                Some(())
            })
            .unwrap();
        }
    }

    #[test]
    fn an_adapter_goes_where_it_is_resident_then_to_a_free_slot_and_a_hot_one_spreads() {
        let host = FakeHost::new();
        let vm = host.vm();
        let pods = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"];
        let cfg = config(&pods);
        adapter_pool(&host, &vm, &pods);
        let mut r = Router::start(&vm, &cfg).unwrap();
        let mut send = |model: &str, group: u64| {
            r.route(&vm, &cfg, model, &hashes(group, 64), &est(1024, 256))
                .unwrap()
                .routed()
        };
        let first = send("a1", 1);
        assert!(first.adapter_load, "nothing was resident");
        let again = send("a1", 2);
        assert_eq!(again.pod, first.pod, "resident, though the pod is busier");
        assert!(!again.adapter_load);
        let second = send("a2", 3);
        assert_ne!(second.pod, first.pod, "a1 holds that pod's one slot");
        let third = send("a3", 4);
        assert!(third.pod != first.pod && third.pod != second.pod);
        let base = send("base", 5);
        assert!(!base.adapter_load, "a base model has no adapter to load");
        // A hot adapter spreads once its pod's load outweighs loading it elsewhere (there, where
        // another adapter holds the one slot: 160 + 400): each request in flight adds its 80
        // blocks to what the pod's steps read (× 0.2) and hold (× 0.05), 20 a request.
        let spread = (6..200).find(|&g| send("a1", g).pod != first.pod);
        assert!(spread.is_some_and(|g| (20..50).contains(&g)), "{spread:?}");
    }

    #[test]
    fn adapter_affinity_off_weighs_nothing_and_only_listing_pods_are_eligible() {
        let host = FakeHost::new();
        let vm = host.vm();
        let pods = ["10.0.0.1:80", "10.0.0.2:80"];
        let mut cfg = config(&pods);
        cfg.models.adapter_load_cost = 0.0;
        cfg.models.adapter_slot_cost = 0.0;
        adapter_pool(&host, &vm, &pods[..1]);
        let mut r = Router::start(&vm, &cfg).unwrap();
        for g in 0..20 {
            let routed = r
                .route(&vm, &cfg, "a1", &hashes(g, 4), &est(64, 16))
                .unwrap()
                .routed();
            assert_eq!(
                routed.pod, pods[0],
                "the other pod lists nothing, but a pod lists a1"
            );
        }
        assert!(
            r.serves(&vm, &cfg, "zz"),
            "the second pod may serve it: not listed yet"
        );
        crate::models::served::write_list(&vm, pods[1], &[], 1).unwrap();
        host.advance_ms(1_000);
        assert!(
            !r.serves(&vm, &cfg, "zz"),
            "every pod listed, none lists it"
        );
    }

    #[test]
    fn a_request_no_list_names_waits_for_the_pods_first_lists_then_goes_where_its_model_is() {
        use crate::models::served::{write_failure, write_list, ServedModel};
        use crate::pods::scrape::first_list_ms;
        let host = FakeHost::new();
        let vm = host.vm();
        let pods = ["a:1", "b:1"];
        let mut cfg = config(&pods);
        cfg.metrics.cluster = "kvgate_metrics".into();
        let mut r = Router::start(&vm, &cfg).unwrap();
        let lists = |pod: &str, model: &str| {
            let list = [ServedModel {
                id: model.into(),
                parent: None,
            }];
            write_list(&vm, pod, &list, host.now_ms()).unwrap()
        };
        let send = |r: &mut Router, cfg: &Config, model: &str, g: u64| {
            r.route(&vm, cfg, model, &hashes(g, 4), &est(64, 8))
        };
        // The gateway has just started under load: no list has landed. Sent now, model-a's
        // requests went to either pod, and b:1's engine serves only model-b (404).
        assert_eq!(
            send(&mut r, &cfg, "model-a", 1).unwrap(),
            Placement::Discovering
        );
        // One naming no model is any engine's own: it goes, within its pod's budget.
        let own = send(&mut r, &cfg, "", 0).unwrap().routed();
        r.finish(&vm, &own).unwrap();
        host.advance_ms(30);
        assert!(lists("b:1", "model-b"), "b:1's first list");
        assert_eq!(
            send(&mut r, &cfg, "model-a", 2).unwrap(),
            Placement::Discovering,
            "a:1's list may still name it"
        );
        assert_eq!(
            send(&mut r, &cfg, "model-b", 3).unwrap().routed().pod,
            "b:1"
        );
        host.advance_ms(10);
        assert!(lists("a:1", "model-a"));
        // Within the quick tick, not a whole view's cache later (a view read before the lists
        // landed was kept 500 ms, and every request in it went anywhere).
        host.advance_ms(crate::gate::QUICK_TICK_MS);
        for g in 4..24 {
            let routed = send(&mut r, &cfg, "model-a", g).unwrap().routed();
            assert_eq!(routed.pod, "a:1");
            r.finish(&vm, &routed).unwrap();
        }
        assert!(!r.awaits_lists(host.now_ms()));
        // A pod that joins later and never answers: requests for a model no list names wait for
        // it no longer than `first_list_ms`, then it is taken to serve everything.
        let mut cfg = config(&["a:1", "b:1", "c:1"]);
        cfg.metrics.cluster = "kvgate_metrics".into();
        let mut r = Router::start(&vm, &cfg).unwrap();
        let started = host.now_ms();
        assert_eq!(
            send(&mut r, &cfg, "model-c", 30).unwrap(),
            Placement::Discovering
        );
        assert_eq!(
            send(&mut r, &cfg, "model-a", 31).unwrap().routed().pod,
            "a:1",
            "listed: no wait"
        );
        host.set_now_ms(started + first_list_ms(&cfg) - 1);
        assert_eq!(
            send(&mut r, &cfg, "model-c", 32).unwrap(),
            Placement::Discovering
        );
        host.advance_ms(1);
        assert_eq!(
            send(&mut r, &cfg, "model-c", 33).unwrap().routed().pod,
            "c:1"
        );
        // One whose list failed is not waited for at all.
        let mut cfg = config(&["a:1", "d:1"]);
        cfg.metrics.cluster = "kvgate_metrics".into();
        let mut r = Router::start(&vm, &cfg).unwrap();
        write_failure(&vm, "d:1", host.now_ms()).unwrap();
        let routed = r.route(&vm, &cfg, "model-d", &hashes(40, 4), &est(64, 8));
        assert_eq!(routed.unwrap().routed().pod, "d:1");
        assert!(!r.awaits_lists(host.now_ms()));

        // The pool discovered after a request read the lists (none known then): the new pods'
        // records are read at once and their lists awaited. A copy read before discovery answered
        // was kept, and had the new pods in no state at all: taken to serve every model.
        let host = FakeHost::new();
        let vm = host.vm();
        let mut cfg = config(&[]);
        cfg.discovery.admin_cluster = "kvgate_admin".into();
        cfg.metrics.cluster = "kvgate_metrics".into();
        let mut r = Router::start(&vm, &cfg).unwrap();
        let mut send = |model: &str, g: u64| {
            r.serves(&vm, &cfg, model);
            r.route(&vm, &cfg, model, &hashes(g, 4), &est(64, 8))
                .unwrap()
        };
        assert_eq!(send("model-e", 50), Placement::Discovering, "no pool yet");
        host.advance_ms(5);
        vm.set(PODS_KEY, &encode_pods(&["e:1".into(), "f:1".into()]), None)
            .unwrap();
        let only_f = [ServedModel {
            id: "model-f".into(),
            parent: None,
        }];
        write_list(&vm, "f:1", &only_f, host.now_ms()).unwrap();
        host.advance_ms(5);
        assert_eq!(
            send("model-e", 51),
            Placement::Discovering,
            "e:1's list awaited"
        );
        assert_eq!(send("model-f", 52).routed().pod, "f:1");
    }

    #[test]
    fn a_pod_whose_tokens_come_slower_takes_less_of_the_load() {
        // Two pods scraped twice: a:1 decoded 500 tokens at 10 ms each in between, b:1 at 20 ms.
        // Twenty requests held in flight: how many a:1 takes.
        let on_fast = |learn: bool| {
            let host = FakeHost::new();
            let mut cfg = config(&["a:1", "b:1"]);
            cfg.routing.learn_decode_cost = learn;
            let vm = host.vm();
            let mut r = Router::start(&vm, &cfg).unwrap();
            for (pod, itl) in [("a:1", 0.010), ("b:1", 0.020)] {
                for count in [1_000.0, 1_500.0] {
                    let snapshot = Snapshot {
                        at_ms: host.now_ms(),
                        healthy: true,
                        itl_totals: Some(crate::pods::metrics::ItlTotals {
                            sum_s: itl * count,
                            count,
                        }),
                        ..Snapshot::default()
                    };
                    record::write_snapshot(&vm, pod, snapshot, 0, &cfg).unwrap();
                }
            }
            host.advance_ms(COPY_MS);
            (0..20)
                .filter(|&i| {
                    r.route_m(&vm, &cfg, &hashes(100 + i, 8), &est(128, 128))
                        .pod
                        == "a:1"
                })
                .count()
        };
        let alike = on_fast(false);
        assert!(
            (9..=11).contains(&alike),
            "not learned, they alternate: {alike}"
        );
        // Learned, everything b:1 computes costs it twice what a:1 pays: its decode steps, and
        // the request's own prefill too (8 blocks × 2.0 against 16 read blocks × 0.2 a request),
        // so a:1 runs twice b:1's sequences and then some: balanced at 6 + 2 × b's, 15.3 of 20.
        let learned = on_fast(true);
        assert!(
            (15..=17).contains(&learned),
            "{learned} of 20 on the fast pod"
        );
    }

    /// Scrapes `pod` now, its inter-token-latency totals at `(seconds, tokens)`.
    fn scrape_itl(host: &FakeHost, vm: &FakeVm, cfg: &Config, pod: &str, totals: (f64, f64)) {
        let snapshot = Snapshot {
            at_ms: host.now_ms(),
            healthy: true,
            itl_totals: Some(crate::pods::metrics::ItlTotals {
                sum_s: totals.0,
                count: totals.1,
            }),
            ..Snapshot::default()
        };
        record::write_snapshot(vm, pod, snapshot, 0, cfg).unwrap();
    }

    /// Light load: a request of each prompt group in `groups` (new to every pod), one after
    /// another, each finished before the next is sent; how many each of `pods` took.
    fn one_at_a_time(
        r: &mut Router,
        vm: &FakeVm,
        cfg: &Config,
        pods: &[&str],
        groups: core::ops::Range<u64>,
    ) -> Vec<usize> {
        let mut took = vec![0; pods.len()];
        for g in groups {
            let routed = r.route_m(vm, cfg, &hashes(g, 8), &est(128, 64));
            r.finish(vm, &routed).unwrap();
            if let Some(k) = pods.iter().position(|&p| p == routed.pod) {
                took[k] += 1;
            }
        }
        took
    }

    /// A router over `pods` that learns each pod's pace, on a host of its own.
    fn paced(pods: &[&str]) -> (FakeHost, FakeVm, Config, Router) {
        let host = FakeHost::new();
        let mut cfg = config(pods);
        cfg.routing.learn_decode_cost = true;
        let vm = host.vm();
        let r = Router::start(&vm, &cfg).unwrap();
        (host, vm, cfg, r)
    }

    #[test]
    fn equal_pods_a_few_percent_apart_share_light_load() {
        // Three pods scraped twice, 500 tokens in between at 10, 10.3 and 9.8 ms a token: as
        // equal GPUs measure. Every cost at light load is the same but for the factor; within the
        // dead band the factors are exactly 1, and the pod caching least takes each request.
        let pods = ["a:1", "b:1", "c:1"];
        let (host, vm, cfg, mut r) = paced(&pods);
        for (pod, itl) in pods.iter().zip([0.010, 0.0103, 0.0098]) {
            scrape_itl(&host, &vm, &cfg, pod, (itl * 1_000.0, 1_000.0));
        }
        host.advance_ms(cfg.metrics.interval_ms);
        for (pod, itl) in pods.iter().zip([0.010, 0.0103, 0.0098]) {
            scrape_itl(&host, &vm, &cfg, pod, (itl * 1_500.0, 1_500.0));
        }
        host.advance_ms(COPY_MS);
        assert_eq!(one_at_a_time(&mut r, &vm, &cfg, &pods, 0..12), [4, 4, 4]);
    }

    #[test]
    fn a_pod_left_idle_after_a_slow_spell_gets_requests_again_within_seconds() {
        // a:1 and b:1 decode at 10 ms a token and are measured at every scrape; c:1 showed 20 ms
        // (a spell of long streams) and, passed over since, decodes nothing.
        let pods = ["a:1", "b:1", "c:1"];
        let (host, vm, cfg, mut r) = paced(&pods);
        let mut tokens = 1_000.0;
        let mut scrape = |host: &FakeHost| {
            for (pod, itl) in [("a:1", 0.010), ("b:1", 0.010)] {
                scrape_itl(host, &vm, &cfg, pod, (itl * tokens, tokens));
            }
            tokens += 500.0;
        };
        scrape(&host);
        scrape_itl(&host, &vm, &cfg, "c:1", (10.0, 1_000.0));
        host.advance_ms(cfg.metrics.interval_ms);
        scrape(&host);
        scrape_itl(&host, &vm, &cfg, "c:1", (20.0, 1_500.0));
        host.advance_ms(COPY_MS);
        assert_eq!(
            one_at_a_time(&mut r, &vm, &cfg, &pods, 0..12)[2],
            0,
            "slower: passed over"
        );
        // Fifteen seconds of scrapes later, c:1's pace has faded into the others': it takes its
        // share again, and one request there would measure it anew.
        for _ in 0..15 {
            host.advance_ms(cfg.metrics.interval_ms);
            scrape(&host);
            scrape_itl(&host, &vm, &cfg, "c:1", (20.0, 1_500.0));
        }
        host.advance_ms(COPY_MS);
        let took = one_at_a_time(&mut r, &vm, &cfg, &pods, 100..112);
        assert!(took[2] >= 3, "{took:?}");
    }
}
