//! Cost-aware admission: who may be sent now, who waits, and who is refused. A request is placed
//! only on a pod whose budget has room for its reservation (`router`, `budget`); when none has, it
//! joins the shared line (`line`) and its VM parks it. Release of budget anywhere wakes the VM
//! holding the head of the line through that VM's own shared queue (`kvgate.wake.<vm>`: one per
//! VM, since a shared queue notifies only its last registrant); the head is retried there, and on
//! success the next head's VM is woken in turn. A tick retries too, as a backstop only.

use crate::admission::line::{self, Leave, Refused, Ticket};
use crate::admission::sessions;
use crate::config::AdmissionConfig;
use crate::config::{Config, Mode};
use crate::estimate::reservation::Estimate;
use crate::hash::fnv1a;
use crate::openai::reply::LocalReply;
use crate::routing::router::{Placement, Routed, Router};
use crate::stats::{self, Stats};
use crate::store::interface::{Store, StoreError};
use hashbrown::HashMap;
use std::collections::BTreeMap;

/// Who a request is, for ordering, and how long it may wait: from its headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Class {
    pub priority: i32,
    pub tenant: u64,
    pub session: Option<u64>,
    /// The request's own time-to-first-token objective (`admission.ttftObjectiveHeader`), in ms:
    /// it waits in the line no longer than that, nor than `admission.maxWaitMs`.
    pub objective_ms: Option<u64>,
}

impl Class {
    /// The priority the client's headers set (directly, or through a named objective), if any.
    pub fn priority_given(
        cfg: &AdmissionConfig,
        objective: Option<&str>,
        priority: Option<&str>,
    ) -> Option<i32> {
        let from_objective = objective.and_then(|o| cfg.objectives.get(o.trim()).copied());
        let direct = priority.and_then(|p| p.trim().parse::<i32>().ok());
        direct.or(from_objective)
    }

    pub fn from_headers(
        cfg: &AdmissionConfig,
        objective: Option<&str>,
        priority: Option<&str>,
        tenant: Option<&str>,
        session: Option<&str>,
        ttft_objective: Option<&str>,
    ) -> Class {
        Class {
            priority: Self::priority_given(cfg, objective, priority)
                .unwrap_or(cfg.default_priority),
            tenant: fnv1a(tenant.unwrap_or("").as_bytes()),
            session: session
                .filter(|s| !s.is_empty())
                .map(|s| fnv1a(s.as_bytes())),
            objective_ms: ttft_objective.and_then(objective_ms),
        }
    }

    /// How long the request may wait in the line: `admission.maxWaitMs`, or its own objective
    /// when that is shorter.
    fn wait_ms(&self, cfg: &AdmissionConfig) -> u64 {
        self.objective_ms
            .map_or(cfg.max_wait_ms, |o| o.min(cfg.max_wait_ms))
    }
}

/// What bounded a ticket's wait, for the answer that says it ran out: its own objective, when
/// its deadline came sooner than the configured longest wait, or that wait.
fn wait_bound(ticket: &Ticket, max_wait_ms: u64) -> &'static str {
    if ticket.deadline_ms.saturating_sub(ticket.enqueued_ms) < max_wait_ms {
        "the request's time-to-first-token objective"
    } else {
        "admission.maxWaitMs"
    }
}

/// A time-to-first-token objective's value: milliseconds, whole or not (GIE's clients send
/// whole ones), rounded up, at least 1. Anything else (empty, negative, not a number) names
/// none: the request then waits as any other.
fn objective_ms(value: &str) -> Option<u64> {
    let ms: f64 = value.trim().parse().ok()?;
    (ms.is_finite() && ms > 0.0).then(|| (ms.ceil() as u64).max(1))
}

/// What admission decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Admit {
    Routed(Routed),
    /// No pod is known, and none is being discovered: the request goes to Envoy's own
    /// balancing.
    Unrouted,
    /// Parked until woken; the ticket is in the shared line.
    Wait(Ticket),
    Refuse(LocalReply),
}

fn wake_queue_name(vm: u32) -> String {
    format!("kvgate.wake.{vm}")
}

/// How many times a head may be passed: `backfillPasses`, and `cacheFirstPasses` more for a
/// backfill into room where its own prefix is cached (`cache_first`).
fn passes_allowed(cfg: &AdmissionConfig, cache_first: bool) -> u32 {
    if cache_first {
        cfg.backfill_passes.saturating_add(cfg.cache_first_passes)
    } else {
        cfg.backfill_passes
    }
}

/// How a ticket names the pod it waits for first (`Placement::NoRoom`, `Placement::Uncached`),
/// if one is named and someone reads it: only the replicas' sync does (`Gate::pod_views`), so
/// one gateway does not write it into the line.
fn wanted(cfg: &Config, belongs: &str) -> u64 {
    if belongs.is_empty() || !cfg.etcd.enabled() {
        0
    } else {
        line::pod_key(belongs)
    }
}

fn shed(message: &str, retry_after_ms: u64) -> Admit {
    Admit::Refuse(
        LocalReply::error(429, "rate_limit_exceeded", message, None).retry_after(retry_after_ms),
    )
}

/// A refused request is told to come back no sooner than a second (the header's own unit, and
/// about what a client told nothing waits before its second retry)...
const RETRY_AFTER_MIN_MS: u64 = 1_000;
/// ...and no later than 60 s, nor than `admission.maxWaitMs`: no request waits longer in the
/// line, and OpenAI's and Anthropic's SDKs ignore a longer `Retry-After` (they back off 0.5 s,
/// then 1 s, and give up after their two retries).
const RETRY_AFTER_MAX_MS: u64 = 60_000;

/// When a request shed, or answered 503, should come back (`Retry-After`): within the second
/// half of the time the tickets waiting for its pods take to leave the line (`drain`,
/// `QueueRecord::drain_ms`), where `spread` (in [0, 1)) puts it, so that those refused together
/// do not come back together. Back sooner, it finds the line as full as it left it and spends
/// one of its client's few retries.
fn retry_after_ms(drain: Option<u64>, max_wait_ms: u64, spread: f64) -> u64 {
    let latest = max_wait_ms.clamp(RETRY_AFTER_MIN_MS, RETRY_AFTER_MAX_MS);
    drain
        .map_or(RETRY_AFTER_MIN_MS, |drain| {
            (drain as f64 * (0.5 + 0.5 * spread)) as u64
        })
        .clamp(RETRY_AFTER_MIN_MS, latest)
}

pub struct Admission {
    vm: u32,
    wake_queue: u32,
    /// This VM's parked tickets and their times.
    parked: BTreeMap<u64, Parked>,
    /// The head of the line is this VM's and waits for room where its prefix is cached.
    head_waits_for_cache: bool,
    /// A request of this VM lost every compare-and-swap on shared data in its pick and waits
    /// (`contended`): nothing may wake the line for it, so it runs again at the quick tick.
    contended: bool,
    /// When each VM was last woken by this one, so a burst of releases sends one wake.
    woken: HashMap<u32, u64>,
    /// The earliest release time carried by the wakes being served: the start of the wake-up
    /// latency the next admission measures.
    released_at: Option<u64>,
    /// Requests this VM has refused: with the VM and the time, what spreads their
    /// `Retry-After`s (`retry_after_ms`).
    refused: u64,
}

/// One of this VM's parked tickets, as its retries need it.
#[derive(Debug, Clone, Copy)]
struct Parked {
    /// When it is answered 503 (`admission.maxWaitMs` after it arrived, or its own objective).
    deadline_ms: u64,
    /// Until when it waits for room where its prompt's prefix is cached (`Reach::Patient`):
    /// `admission.cacheWaitMs` after it was first refused for want of room there. `None` while
    /// it has only waited for room anywhere (the pool full): time in a line that admits nobody
    /// is not time spent waiting for the prefix's pod.
    patient_until_ms: Option<u64>,
    /// A request of higher precedence took its place in the full line (`line::enqueue`): it is
    /// answered 429 at its next retry (`Admission::displaced`).
    displaced: bool,
}

/// Parked tickets a VM looks through for backfills, at most: the line is bounded, but a worker's
/// share of a long one need not be read whole on every release.
const MAX_BACKFILL_SCAN: usize = 256;

/// Wakes to one VM are at most this frequent from one sender: its drain takes every message.
const WAKE_EVERY_MS: u64 = 2;

/// Where a parked request may go when the line moves (`drive::run_line`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Any pod with room.
    Any,
    /// Only a pod holding its prompt's cached prefix, when some pod holds half the prompt
    /// (`Router::route_cached`).
    Cached,
    /// As `Any`, except that a prompt whose cached prefix few in-flight requests share goes
    /// only to a pod caching it (`Router::route_patient`).
    Patient,
}

/// Why a retried request stays in the line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stay {
    /// No pod it may go to has room.
    NoRoom,
    /// Asked for its prefix's pods (`Reach::Cached`): only pods that would compute it again have
    /// room; these.
    Uncached(Vec<String>),
}

/// What a request asks of the pool: its model, its prompt's block hashes and its estimate.
#[derive(Clone, Copy)]
pub struct Asks<'a> {
    pub model: &'a str,
    pub hashes: &'a [u64],
    pub est: &'a Estimate,
}

impl Admission {
    pub fn start(store: &dyn Store, vm: u32) -> Result<Admission, StoreError> {
        line::ensure(store)?;
        sessions::ensure(store)?;
        crate::admission::feedback::ensure(store)?;
        let wake_queue = store.register_queue(&wake_queue_name(vm))?;
        Ok(Admission {
            vm,
            wake_queue,
            parked: BTreeMap::new(),
            head_waits_for_cache: false,
            contended: false,
            woken: HashMap::new(),
            released_at: None,
            refused: 0,
        })
    }

    pub fn wake_queue(&self) -> u32 {
        self.wake_queue
    }

    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// Places a request that has just arrived.
    pub fn place(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        router: &mut Router,
        stats: &mut Stats,
        class: Class,
        asks: &Asks,
    ) -> Result<Admit, StoreError> {
        let Asks { model, hashes, est } = *asks;
        let a = &cfg.admission;
        if !a.enabled {
            return Ok(match router.route(store, cfg, model, hashes, est)? {
                Placement::Routed(r) => Admit::Routed(r),
                Placement::NoPods
                | Placement::Discovering
                | Placement::NoRoom(_)
                | Placement::Uncached(..) => Admit::Unrouted,
            });
        }
        if a.mode == Mode::Observe {
            // Nothing waits and nothing is refused: a request no pod has room for goes to the
            // best-ranked pod past its budget (`observe` counts it); nobody is ever in the line.
            let placed = match router.route(store, cfg, model, hashes, est)? {
                Placement::NoRoom(_) | Placement::Uncached(..) => {
                    router.route_past_budget(store, cfg, (model, hashes, est))?
                }
                fits => fits,
            };
            return Ok(match placed {
                Placement::Routed(r) => {
                    if !r.over_budget {
                        stats.count(stats::ADMISSION_ADMITTED, 1);
                    }
                    Admit::Routed(r)
                }
                Placement::NoPods
                | Placement::Discovering
                | Placement::NoRoom(_)
                | Placement::Uncached(..) => Admit::Unrouted,
            });
        }
        let now = store.now_ms();
        let boosted = a.session_boost_ms > 0
            && match class.session {
                Some(s) => sessions::recently_finished(store, s, a.session_boost_ms)?,
                None => false,
            };
        let line = line::read(store)?;
        // Whom it competes with matters only against tickets already waiting, and once it waits.
        let reach = if line.tickets.is_empty() {
            line::ANYWHERE
        } else {
            router.reach(store, model)
        };
        let boost = if boosted {
            a.session_boost_tokens as f64
        } else {
            0.0
        };
        let mut ticket = Ticket {
            // The newest of its tag and millisecond until it has an id: a waiting ticket with
            // both is ahead of it (with 0 it went first and was sent past that ticket's pods).
            id: u64::MAX,
            vm: self.vm,
            priority: class.priority,
            boosted,
            start_tag: line.start_tag(line::fair_key(class.tenant, reach), boost),
            enqueued_ms: now,
            deadline_ms: now.saturating_add(class.wait_ms(a)),
            cost: est.cost,
            wants: 0,
            reach,
            need: 0,
        };
        // Only a request that would head the line on some of its pods may go straight to a pod,
        // and only to those: nobody waiting on any worker for a pod is overtaken there by a
        // lower-ordered newcomer (per-pod precedence, `QueueRecord::leaders`).
        let mut patient_until_ms = None;
        let mut contended = false;
        let mut learning = false;
        let free = line.free_for(&ticket);
        if free != 0 {
            let est = &Estimate {
                within: line::within(free, ticket.reach),
                ..*est
            };
            let placed = if a.cache_wait_ms > 0 {
                router.route_patient(store, cfg, (model, hashes, est))
            } else {
                router.route(store, cfg, model, hashes, est)
            };
            let placed = match placed {
                // Every compare-and-swap of its pick lost to other workers' writes, and nothing
                // was charged: it waits in the line like a request no pod had room for, and is
                // tried at the next pass. Sent on undecided, it would pass every budget.
                Err(StoreError::CasMismatch) => {
                    self.contended(stats);
                    contended = true;
                    Placement::NoRoom(String::new())
                }
                placed => placed?,
            };
            match placed {
                Placement::Routed(r) => {
                    // Fair-queuing tags matter only under contention: an uncontended pool skips
                    // the write to the one line every worker shares. Its entry is written: a
                    // failure here costs the tenant's tag this charge, not the request its place
                    // (an error would send it on unrouted, its entry left to expire).
                    if !line.tickets.is_empty() {
                        let tenant = line::fair_key(class.tenant, ticket.reach);
                        if let Err(e) = line::charge_direct(store, tenant, est.cost) {
                            log::debug!("charging the tenant's tag failed: {e:?}");
                        }
                    }
                    stats.count(stats::ADMISSION_ADMITTED, 1);
                    return Ok(Admit::Routed(r));
                }
                Placement::NoPods => return Ok(Admit::Unrouted),
                Placement::Uncached(_, belongs) => {
                    // It leads the line, and waits for room where its prefix is.
                    stats.count(stats::ADMISSION_CACHE_WAITS, 1);
                    ticket.wants = wanted(cfg, &belongs);
                    self.head_waits_for_cache = true;
                    patient_until_ms = Some(now.saturating_add(cfg.cache_wait_ms()));
                }
                // It waits for room anywhere; first where it would go.
                Placement::NoRoom(belongs) => ticket.wants = wanted(cfg, &belongs),
                Placement::Discovering => learning = true,
            }
        }
        // While the pool or its model lists are being learned nothing is saturated, nor when the
        // pick only lost its races: a sheddable request waits too.
        if class.priority < 0 && !contended && !learning && !router.discovering(store, cfg) {
            stats.count(stats::ADMISSION_SHED, 1);
            let spread = self.spread(now);
            let retry = retry_after_ms(line.drain_ms(ticket.reach, now), a.max_wait_ms, spread);
            return Ok(shed(
                "the pool is saturated and this request's priority is sheddable",
                retry,
            ));
        }
        // The line is full in time for it: those ahead of it would keep it most of its wait.
        if a.refuse_late
            && !contended
            && !learning
            && line.late(&ticket, now)
            && !router.discovering(store, cfg)
        {
            stats.count(stats::ADMISSION_QUEUE_FULL, 1);
            let spread = self.spread(now);
            let retry = retry_after_ms(line.drain_ms(ticket.reach, now), a.max_wait_ms, spread);
            let message = format!(
                "kvgate's queue is full for this request: the requests ahead of it would keep it \
                 waiting most of {}",
                wait_bound(&ticket, a.max_wait_ms)
            );
            return Ok(shed(&message, retry));
        }
        ticket.id = router.next_request_id();
        if line.tickets.is_empty() {
            ticket.reach = router.reach(store, model);
        }
        // Worked out only for a request that waits (a forecast): what it asks of the replicas'
        // split while it heads the line.
        ticket.need = crate::admission::budget::need(
            est,
            cfg,
            u64::from(router.block_tokens(&cfg.routing)),
            now,
        );
        match line::enqueue(
            store,
            ticket,
            line::fair_key(class.tenant, ticket.reach),
            a.session_boost_tokens as f64,
            a.max_queue as usize,
        )? {
            Ok(line::Joined {
                ticket: t,
                displaced,
            }) => {
                self.parked.insert(
                    t.id,
                    Parked {
                        deadline_ms: t.deadline_ms,
                        patient_until_ms,
                        displaced: false,
                    },
                );
                if let Some(d) = displaced {
                    // Its owner finds it gone at its next pass over the line (a tick at most).
                    log::debug!("ticket {} displaced from the full line by {}", d.id, t.id);
                }
                stats.count(stats::ADMISSION_QUEUED, 1);
                if boosted {
                    stats.count(stats::ADMISSION_BOOSTED, 1);
                }
                Ok(Admit::Wait(t))
            }
            Err(Refused::Full(back_at)) => {
                stats.count(stats::ADMISSION_QUEUE_FULL, 1);
                let retry = back_at.map_or(RETRY_AFTER_MIN_MS, |at| {
                    at.saturating_sub(now)
                        .clamp(RETRY_AFTER_MIN_MS, RETRY_AFTER_MAX_MS)
                });
                Ok(shed("kvgate's queue is full (admission.maxQueue)", retry))
            }
        }
    }

    /// Retries a parked request that is at the head of the line, a backfill, or past its
    /// deadline (which is answered wherever it may reach), on the pods `within` names
    /// (`line::ANYWHERE`: all of its model's; fewer for a ticket heading the line on those
    /// only, `next_head`). `Ok(Err)`: it stays parked, and why. `Err`: shared data failed,
    /// nothing was charged, and its ticket is where it was (the caller keeps it parked when its
    /// pick lost its races, and otherwise sends it on undecided and `withdraw`s it).
    #[allow(clippy::too_many_arguments)]
    pub fn retry(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        router: &mut Router,
        stats: &mut Stats,
        ticket: &mut Ticket,
        asks: &Asks,
        (reach, within_pods): (Reach, u64),
    ) -> Result<Result<Admit, Stay>, StoreError> {
        let Asks { model, hashes, est } = *asks;
        let est = &Estimate {
            within: within_pods,
            ..*est
        };
        let now = store.now_ms();
        if self.parked.get(&ticket.id).is_some_and(|p| p.displaced) {
            // Out of the line already: nothing to leave but this VM's note of it.
            self.parked.remove(&ticket.id);
            stats.count(stats::ADMISSION_DISPLACED, 1);
            let retry = self.come_back_ms(store, ticket.reach, cfg.admission.max_wait_ms);
            return Ok(Ok(shed(
                "kvgate's queue is full (admission.maxQueue) and a request of higher priority \
                 took this one's place in it",
                retry,
            )));
        }
        if now >= ticket.deadline_ms {
            self.leave(store, ticket.id, Leave::NotAdmitted);
            stats.count(stats::ADMISSION_TIMED_OUT, 1);
            let retry = self.come_back_ms(store, ticket.reach, cfg.admission.max_wait_ms);
            let message = format!(
                "no model server had room before {} ran out",
                wait_bound(ticket, cfg.admission.max_wait_ms)
            );
            let reply =
                LocalReply::error(503, "service_unavailable", &message, None).retry_after(retry);
            return Ok(Ok(Admit::Refuse(reply)));
        }
        let placed = match reach {
            Reach::Any => router.route(store, cfg, model, hashes, est)?,
            Reach::Cached => router.route_cached(store, cfg, (model, hashes, est))?,
            Reach::Patient => router.route_patient(store, cfg, (model, hashes, est))?,
        };
        let (admit, on) = match placed {
            Placement::Routed(r) => {
                let bit = router.bit_of(&r.pod);
                (Admit::Routed(r), bit)
            }
            Placement::NoPods => (Admit::Unrouted, 0),
            Placement::Discovering => return Ok(Err(Stay::NoRoom)),
            // Where it now waits, for the replicas' sync (`Gate::pod_views`); a pick among some
            // of its pods that found none of them in the pool names nothing new.
            Placement::NoRoom(belongs) if belongs.is_empty() && est.within != line::ANYWHERE => {
                return Ok(Err(Stay::NoRoom));
            }
            Placement::NoRoom(belongs) => {
                Self::waits_on(store, cfg, ticket, &belongs, router.reach(store, model))?;
                return Ok(Err(Stay::NoRoom));
            }
            Placement::Uncached(pods, belongs) => {
                Self::waits_on(store, cfg, ticket, &belongs, router.reach(store, model))?;
                return Ok(Err(Stay::Uncached(pods)));
            }
        };
        self.leave(store, ticket.id, Leave::Admitted(on));
        stats.count(stats::ADMISSION_ADMITTED, 1);
        stats.histogram(
            stats::ADMISSION_WAIT_MS,
            now.saturating_sub(ticket.enqueued_ms),
        );
        if let Some(released) = self.released_at.take() {
            let latency = now.saturating_sub(released);
            stats.histogram(stats::ADMISSION_WAKE_LATENCY_MS, latency);
            stats.count(stats::ADMISSION_WAKE_LATENCY_MS_TOTAL, latency);
            stats.count(stats::ADMISSION_WAKES, 1);
        }
        Ok(Ok(admit))
    }

    /// A parked ticket now waits for room on `belongs` first, and may go to the pods `reach`
    /// names: the line says so when either changed, and the ticket remembers it.
    fn waits_on(
        store: &dyn Store,
        cfg: &Config,
        ticket: &mut Ticket,
        belongs: &str,
        reach: u64,
    ) -> Result<(), StoreError> {
        let wants = wanted(cfg, belongs);
        if (wants, reach) != (ticket.wants, ticket.reach) {
            line::set_wants(store, ticket.id, wants, reach)?;
            (ticket.wants, ticket.reach) = (wants, reach);
        }
        Ok(())
    }

    /// The first ticket heading the line on some of its pods (`QueueRecord::leaders`) that this
    /// VM holds and that is not in `tried`, and the pods it may be sent to now (`line::ANYWHERE`
    /// when it heads a line of its own); the VMs holding the heads before it are woken.
    pub fn next_head(
        &mut self,
        store: &dyn Store,
        tried: &[u64],
    ) -> Result<Option<(u64, u64)>, StoreError> {
        // Tickets of this VM that it no longer holds (it lost track: a reload) are cleared; the
        // loop is bounded by the line's length.
        'read: for _ in 0..64 {
            let line = line::read(store)?;
            for (t, free) in line.leaders() {
                if t.vm != self.vm {
                    self.wake(store, t.vm);
                } else if !self.parked.contains_key(&t.id) {
                    line::remove(store, t.id, Leave::NotAdmitted)?;
                    continue 'read;
                } else if !tried.contains(&t.id) {
                    return Ok(Some((t.id, line::within(free, t.reach))));
                }
            }
            return Ok(None);
        }
        Ok(None)
    }

    /// This VM's parked tickets that may be admitted past their heads
    /// (`QueueRecord::visit_heads`) now (backfills, in line order; `behind`: those behind that
    /// head only): in their heads' band, while each has been passed fewer than
    /// `admission.backfillPasses` times, or, for requests whose prefix is cached where the head
    /// would compute its own again (`cache_first`), `cacheFirstPasses` more. Each is then
    /// retried like a head (`may_pass` first); its admission counts the pass against each
    /// (`line::remove`).
    pub fn backfill(
        &self,
        store: &dyn Store,
        cfg: &AdmissionConfig,
        cache_first: bool,
        behind: Option<u64>,
    ) -> Vec<u64> {
        let passes = passes_allowed(cfg, cache_first);
        if self.parked.is_empty() || passes == 0 {
            return Vec::new();
        }
        let line = match line::read(store) {
            Ok(line) => line,
            Err(e) => {
                log::debug!("reading the queue failed: {e:?}");
                return Vec::new();
            }
        };
        let tickets = &line.tickets;
        let mut out = Vec::new();
        line.visit_heads(|i, heads| {
            let Some(t) = tickets.get(i) else {
                return false;
            };
            let mut heads = heads.iter().filter_map(|&h| tickets.get(h));
            let passable = heads
                .clone()
                .all(|h| h.id != t.id && h.priority == t.priority && line.passes(h.id) < passes);
            if passable
                && behind.is_none_or(|b| heads.any(|h| h.id == b))
                && self.parked.contains_key(&t.id)
            {
                out.push(t.id);
            }
            out.len() < MAX_BACKFILL_SCAN
        });
        out
    }

    /// Whether `ticket`'s heads may all still be passed, read again before each backfill's
    /// pick: another worker may have taken the last passes meanwhile, and read once for a whole
    /// pass over the parked requests each worker could take all of them. True when it heads a
    /// line of its own now.
    pub fn may_pass(
        &self,
        store: &dyn Store,
        cfg: &AdmissionConfig,
        cache_first: bool,
        ticket: u64,
    ) -> bool {
        line::read(store).is_ok_and(|line| {
            let Some(i) = line.tickets.iter().position(|t| t.id == ticket) else {
                return false;
            };
            let allowed = passes_allowed(cfg, cache_first);
            line.heads_of(i).iter().all(|&h| {
                h == i
                    || line
                        .tickets
                        .get(h)
                        .is_some_and(|h| line.passes(h.id) < allowed)
            })
        })
    }

    /// Parked tickets no longer in the line, displaced by a request of higher precedence that
    /// found it full (`line::enqueue`): marked so that their retry answers them 429. The line is
    /// read only while this VM has parked tickets. Not read (shared data failed): none.
    pub fn displaced(&mut self, store: &dyn Store) -> Vec<u64> {
        if self.parked.is_empty() {
            return Vec::new();
        }
        let Ok(line) = line::read(store) else {
            return Vec::new();
        };
        let waiting: std::collections::HashSet<u64> = line.tickets.iter().map(|t| t.id).collect();
        let mut gone = Vec::new();
        for (&id, p) in self.parked.iter_mut() {
            if !waiting.contains(&id) {
                p.displaced = true;
                gone.push(id);
            }
        }
        gone
    }

    /// Parked tickets past their deadline.
    pub fn expired(&self, now: u64) -> Vec<u64> {
        self.parked
            .iter()
            .filter(|(_, p)| now >= p.deadline_ms)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Whether the parked `ticket`, at the head of the line with room only where its prompt's
    /// prefix is not cached, still waits for room where it is (`Reach::Patient`): for
    /// `cache_wait_ms` from the first time it was in that position.
    pub fn patient(&mut self, ticket: u64, now: u64, cache_wait_ms: u64) -> bool {
        self.parked.get_mut(&ticket).is_some_and(|p| {
            now < *p
                .patient_until_ms
                .get_or_insert(now.saturating_add(cache_wait_ms))
        })
    }

    /// The line starts a pass (`drive::run_line`): whatever must bring the next one soon is
    /// found again in this one.
    pub fn begin_pass(&mut self) {
        self.head_waits_for_cache = false;
        self.contended = false;
    }

    /// The head of the line, this VM's, waits for room where its prompt's prefix is cached
    /// (`drive::run_line`): the line must run again as that wait ends, even if nothing wakes it.
    pub fn set_head_waits_for_cache(&mut self) {
        self.head_waits_for_cache = true;
    }

    /// A request of this VM waits because its pick lost every compare-and-swap to other
    /// workers' writes (`kvgate.admission.contended`): it is tried again at the next pass,
    /// which no release may bring.
    pub fn contended(&mut self, stats: &mut Stats) {
        stats.count(stats::ADMISSION_CONTENDED, 1);
        self.contended = true;
    }

    /// Whether the line must run again soon, even if nothing wakes it (`Gate::tick_ms`).
    pub fn runs_again_soon(&self) -> bool {
        self.head_waits_for_cache || self.contended
    }

    /// A parked request's client went away, or this VM lost its stream.
    pub fn abandon(&mut self, store: &dyn Store, stats: &mut Stats, ticket: u64) {
        if self.withdraw(store, ticket) {
            stats.count(stats::ADMISSION_ABANDONED, 1);
        }
    }

    /// A parked request goes on without waiting any longer (its retry failed on shared data
    /// otherwise than by losing its races), or its stream is gone (`drive::retry`):
    /// its ticket leaves the line. Left there, it headed the line for nobody until it was
    /// dropped as abandoned, 35 s on, with every request behind it waiting: in the `chat-short`
    /// benchmark's tiny-request regime (400 clients) one failed retry in two runs of three timed
    /// out all 400. Whether it was parked here.
    pub fn withdraw(&mut self, store: &dyn Store, ticket: u64) -> bool {
        let parked = self.parked.contains_key(&ticket);
        if parked {
            self.leave(store, ticket, Leave::NotAdmitted);
        }
        parked
    }

    /// The ticket leaves the line. This VM forgets it first: should the line's write fail, the
    /// ticket is one this VM no longer holds, which `next_head` clears when it meets it.
    fn leave(&mut self, store: &dyn Store, ticket: u64, leave: Leave) {
        self.parked.remove(&ticket);
        if let Err(e) = line::remove(store, ticket, leave) {
            log::warn!("leaving the queue failed (cleared when met at its head): {e:?}");
        }
        // Whoever is next may fit in what is left.
        if let Err(e) = self.wake_head(store) {
            log::debug!("waking the queue failed: {e:?}");
        }
    }

    /// The `Retry-After` of a request for the pods of `reach` that leaves the line unserved now
    /// (`retry_after_ms`). Unread, the line is taken as empty: the shortest.
    fn come_back_ms(&mut self, store: &dyn Store, reach: u64, max_wait_ms: u64) -> u64 {
        let now = store.now_ms();
        let line = line::read(store).unwrap_or_default();
        let spread = self.spread(now);
        retry_after_ms(line.drain_ms(reach, now), max_wait_ms, spread)
    }

    /// Where in its span the `Retry-After` of the request this VM refuses now falls, in [0, 1):
    /// a hash of the VM, its count of refusals and the time, so that the requests refused
    /// together are spread apart.
    fn spread(&mut self, now: u64) -> f64 {
        self.refused = self.refused.wrapping_add(1);
        let mut seed = [0u8; 20];
        seed[..4].copy_from_slice(&self.vm.to_le_bytes());
        seed[4..12].copy_from_slice(&self.refused.to_le_bytes());
        seed[12..].copy_from_slice(&now.to_le_bytes());
        // FNV's top bits are its best mixed.
        (fnv1a(&seed) >> 54) as f64 / 1_024.0
    }

    /// Budget was released: every ticket heading the line on some pods gets a chance.
    pub fn wake_head(&mut self, store: &dyn Store) -> Result<(), StoreError> {
        let line = line::read(store)?;
        for (t, _) in line.leaders() {
            self.wake(store, t.vm);
        }
        Ok(())
    }

    fn wake(&mut self, store: &dyn Store, vm: u32) {
        let now = store.now_ms();
        if self
            .woken
            .get(&vm)
            .is_some_and(|&t| now.saturating_sub(t) < WAKE_EVERY_MS)
        {
            return;
        }
        self.woken.insert(vm, now);
        match store.resolve_queue(&wake_queue_name(vm)) {
            Ok(Some(q)) => {
                if let Err(e) = store.enqueue(q, &now.to_le_bytes()) {
                    log::debug!("wake of vm {vm} failed: {e:?}");
                }
            }
            other => log::debug!("no wake queue for vm {vm}: {other:?}"),
        }
    }

    /// Empties this VM's wake queue (one pass over the line follows, whatever the count),
    /// keeping the earliest release time the wakes carry, for that pass alone: a wake whose pass
    /// admitted nobody (the room it made was too small) is not where a later admission's wait
    /// started.
    pub fn drain_wakes(&mut self, store: &dyn Store) {
        self.released_at = None;
        while let Ok(Some(message)) = store.dequeue(self.wake_queue) {
            if let Some(at) = crate::store::codec::Reader(&message).u64() {
                self.released_at = Some(self.released_at.map_or(at, |t| t.min(at)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::pods::record::{self, Snapshot};
    use crate::pods::scrape::Target;
    use crate::store::fake_host::{FakeHost, FakeVm};

    struct Worker {
        vm: FakeVm,
        router: Router,
        admission: Admission,
        stats: Stats,
    }

    fn config(budget: u64) -> Config {
        let mut c = crate::test_support::with_pods(&["a:1"]);
        c.admission.budget_tokens = budget;
        // Whole numbers: prompts are held as estimated, and a partly filled block adds one token.
        c.estimator.safety_factor = 1.0;
        c.routing.block_tokens = 1;
        c.admission.max_queue = 3;
        c.admission.max_wait_ms = 1_000;
        c.admission.objectives.insert("batch".into(), -1);
        c.admission.objectives.insert("critical".into(), 10);
        c
    }

    fn worker(host: &FakeHost, cfg: &Config) -> Worker {
        let vm = host.vm();
        let router = Router::start(&vm, cfg).unwrap();
        let admission = Admission::start(&vm, router.vm()).unwrap();
        Worker {
            vm,
            router,
            admission,
            stats: Stats::default(),
        }
    }

    /// The one worker on its host, with `config(budget)`.
    fn one_worker(budget: u64) -> (Config, Worker) {
        let cfg = config(budget);
        let w = worker(&FakeHost::new(), &cfg);
        (cfg, w)
    }

    fn est(cost: u64) -> Estimate {
        Estimate::exact(cost, 0)
    }

    fn class(cfg: &Config, objective: Option<&str>, tenant: &str) -> Class {
        Class::from_headers(&cfg.admission, objective, None, Some(tenant), None, None)
    }

    impl Worker {
        fn place(&mut self, cfg: &Config, c: Class, cost: u64) -> Admit {
            let (w, est) = (self, est(cost));
            let asks = asks(&est);
            w.admission
                .place(&w.vm, cfg, &mut w.router, &mut w.stats, c, &asks)
                .unwrap()
        }

        fn retry(&mut self, cfg: &Config, t: &Ticket, cost: u64) -> Option<Admit> {
            let (w, est) = (self, est(cost));
            let asks = asks(&est);
            w.admission
                .retry(
                    &w.vm,
                    cfg,
                    &mut w.router,
                    &mut w.stats,
                    &mut t.clone(),
                    &asks,
                    (Reach::Any, line::ANYWHERE),
                )
                .unwrap()
                .ok()
        }
    }

    /// A request for model `m` with a two-block prompt.
    fn asks(est: &Estimate) -> Asks<'_> {
        Asks {
            model: "m",
            hashes: &[1, 2],
            est,
        }
    }

    fn routed(a: Admit) -> Routed {
        match a {
            Admit::Routed(r) => r,
            other => panic!("not routed: {other:?}"),
        }
    }

    fn waiting(a: Admit) -> Ticket {
        match a {
            Admit::Wait(t) => t,
            other => panic!("not waiting: {other:?}"),
        }
    }

    fn reserved(vm: &FakeVm) -> u64 {
        record::read(vm, "a:1").unwrap().held_tokens()
    }

    #[test]
    fn a_gateway_started_under_load_holds_requests_until_its_pods_are_discovered() {
        let mut cfg = config(100);
        cfg.pods.clear();
        cfg.discovery.admin_cluster = "kvgate_admin".into();
        let mut w = worker(&FakeHost::new(), &cfg);
        let first = waiting(w.place(&cfg, class(&cfg, None, "t"), 80));
        // Nothing is saturated yet: a sheddable request waits too, it is not refused.
        let batch = waiting(w.place(&cfg, class(&cfg, Some("batch"), "t"), 10));
        assert_eq!(w.retry(&cfg, &first, 80), None, "the pool is still unknown");
        assert_eq!(w.stats.take_count(stats::ADMISSION_SHED), 0);
        let clusters = crate::test_support::clusters_json(&["a:1"]);
        crate::pods::scrape::Scraper::default()
            .on_response(
                &w.vm,
                &cfg,
                &mut w.stats,
                &Target::Discovery,
                Some(200),
                &clusters,
            )
            .unwrap();
        let first = routed(w.retry(&cfg, &first, 80).unwrap());
        assert_eq!(first.pod, "a:1");
        assert_eq!(reserved(&w.vm), 80, "and its budget holds it");
        assert_eq!(
            w.retry(&cfg, &batch, 10).map(routed).map(|r| r.pod),
            Some("a:1".into())
        );
    }

    #[test]
    fn a_waiting_ticket_names_the_pod_it_would_take_first_for_the_replicas_sync_alone() {
        let (cfg, mut w) = one_worker(100);
        routed(w.place(&cfg, class(&cfg, None, "t"), 80));
        let alone = waiting(w.place(&cfg, class(&cfg, None, "t"), 50));
        assert_eq!(
            alone.wants, 0,
            "one gateway: nothing reads it, nothing is written"
        );
        // A replica before its first sync holds no credit anywhere: a request waits, first
        // for the pod it would take, and the line says so for the sync.
        let mut cfg = config(100);
        cfg.etcd.cluster = "etcd".into();
        cfg.etcd.max_replicas = 2;
        let mut w = worker(&FakeHost::new(), &cfg);
        let mut t = waiting(w.place(&cfg, class(&cfg, None, "t"), 50));
        assert_eq!(t.wants, line::pod_key("a:1"));
        assert_eq!(line::read(&w.vm).unwrap().tickets[0].wants, t.wants);
        // Where it would go first changes while it waits (here, by hand): a retry corrects the
        // line.
        line::set_wants(&w.vm, t.id, 5, t.reach).unwrap();
        t.wants = 5;
        assert!(w
            .admission
            .retry(
                &w.vm,
                &cfg,
                &mut w.router,
                &mut w.stats,
                &mut t,
                &asks(&est(50)),
                (Reach::Any, line::ANYWHERE)
            )
            .unwrap()
            .is_err());
        assert_eq!(t.wants, line::pod_key("a:1"));
        assert_eq!(line::read(&w.vm).unwrap().tickets[0].wants, t.wants);
    }

    #[test]
    fn a_wake_that_admitted_nobody_does_not_start_a_later_admissions_wait() {
        let cfg = config(100);
        let host = FakeHost::new();
        let mut w = worker(&host, &cfg);
        host.set_now_ms(1_000);
        let first = routed(w.place(&cfg, class(&cfg, None, "t"), 80));
        let t = waiting(w.place(&cfg, class(&cfg, None, "t"), 50));
        // Woken with no room made (a scrape, a release too small): its pass admits nobody.
        w.admission.wake_head(&w.vm).unwrap();
        w.admission.drain_wakes(&w.vm);
        assert_eq!(w.retry(&cfg, &t, 50), None);
        host.set_now_ms(1_500);
        w.router.finish(&w.vm, &first).unwrap();
        w.admission.wake_head(&w.vm).unwrap();
        host.set_now_ms(1_503);
        w.admission.drain_wakes(&w.vm);
        routed(w.retry(&cfg, &t, 50).unwrap());
        assert_eq!(
            w.stats.take_count(stats::ADMISSION_WAKE_LATENCY_MS_TOTAL),
            3,
            "from the release that made room, not the earlier wake"
        );
    }

    #[test]
    fn admits_within_budget_then_queues_then_resumes_on_release() {
        let (cfg, mut w) = one_worker(100);
        let first = routed(w.place(&cfg, class(&cfg, None, "t"), 80));
        let t = waiting(w.place(&cfg, class(&cfg, None, "t"), 50));
        assert_eq!(
            w.admission.next_head(&w.vm, &[]).unwrap(),
            Some((t.id, line::ANYWHERE))
        );
        assert_eq!(w.retry(&cfg, &t, 50), None, "still no room");
        w.router.finish(&w.vm, &first).unwrap();
        w.admission.wake_head(&w.vm).unwrap();
        assert_eq!(
            w.vm.take_notifications(),
            vec![w.admission.wake_queue()],
            "woken by the release"
        );
        let Some(Admit::Routed(second)) = w.retry(&cfg, &t, 50) else {
            panic!()
        };
        assert_eq!(reserved(&w.vm), 50);
        w.router.finish(&w.vm, &second).unwrap();
        assert_eq!(reserved(&w.vm), 0);
        assert!(line::read(&w.vm).unwrap().tickets.is_empty());
    }

    #[test]
    fn sheddable_is_refused_at_once_and_full_queue_is_429() {
        let (cfg, mut w) = one_worker(100);
        assert!(matches!(
            w.place(&cfg, class(&cfg, None, "t"), 100),
            Admit::Routed(_)
        ));
        let Admit::Refuse(r) = w.place(&cfg, class(&cfg, Some("batch"), "t"), 10) else {
            panic!()
        };
        assert_eq!(r.status, 429);
        for _ in 0..3 {
            assert!(matches!(
                w.place(&cfg, class(&cfg, None, "t"), 10),
                Admit::Wait(_)
            ));
        }
        let Admit::Refuse(r) = w.place(&cfg, class(&cfg, None, "t"), 10) else {
            panic!()
        };
        assert_eq!(r.status, 429);
    }

    /// A refused request is told when the line will have room for it, in seconds and in
    /// milliseconds: refused for a full line, after the line and one admission's gap after the
    /// one refused before it (`QueueRecord::appoint`); shed, within the second half of the time
    /// the tickets ahead take to leave (`QueueRecord::drain_ms`), spread between refusals;
    /// never past `maxWaitMs`.
    #[test]
    fn a_refusal_says_when_the_line_will_have_room() {
        let host = FakeHost::new();
        let mut cfg = config(100);
        cfg.admission.max_wait_ms = 30_000;
        let mut w = worker(&host, &cfg);
        let _ = routed(w.place(&cfg, class(&cfg, None, "t"), 100));
        for _ in 0..3 {
            let _ = waiting(w.place(&cfg, class(&cfg, None, "t"), 10));
        }
        // Nothing has left the line in 4 s: its three tickets take at least 12 s.
        host.advance_ms(4_000);
        let told = |w: &mut Worker, cfg: &Config, objective| {
            let Admit::Refuse(r) = w.place(cfg, class(cfg, objective, "t"), 10) else {
                panic!()
            };
            assert_eq!(r.status, 429);
            let header = |name: &str| {
                r.headers
                    .iter()
                    .find(|(k, _)| k == name)
                    .and_then(|(_, v)| v.parse::<u64>().ok())
                    .unwrap()
            };
            let ms = header("retry-after-ms");
            assert_eq!(header("retry-after"), ms.div_ceil(1_000));
            ms
        };
        // Refused for a full line: after the line, a quarter early (`APPOINTMENT_GAPS`).
        let full: Vec<u64> = (0..8).map(|_| told(&mut w, &cfg, None)).collect();
        assert_eq!(
            full,
            [12_000, 15_000, 18_000, 21_000, 24_000, 27_000, 30_000, 30_000]
        );
        let shed: Vec<u64> = (0..8).map(|_| told(&mut w, &cfg, Some("batch"))).collect();
        assert!(
            shed.iter().all(|ms| (6_000..=12_000).contains(ms)),
            "{shed:?}"
        );
        assert!(shed.windows(2).any(|p| p[0] != p[1]), "spread: {shed:?}");
        // Never past `maxWaitMs`: nobody waits longer.
        cfg.admission.max_wait_ms = 5_000;
        assert_eq!(told(&mut w, &cfg, None), 5_000);
    }

    /// A line of critical requests that has drained one every 100 ms over 40 admissions, with 20
    /// of them still waiting: two seconds ahead of any newcomer.
    fn draining_behind_twenty(host: &FakeHost, vm: &FakeVm) {
        let critical = |id| Ticket {
            id,
            vm: 9,
            priority: 10,
            boosted: false,
            start_tag: 0.0,
            enqueued_ms: host.now_ms(),
            deadline_ms: host.now_ms() + 600_000,
            cost: 10,
            wants: 0,
            reach: line::ANYWHERE,
            need: 0,
        };
        for id in 0..20 {
            line::enqueue(vm, critical(1_000 + id), 0, 0.0, 1_000)
                .unwrap()
                .unwrap();
        }
        for id in 0..40 {
            line::enqueue(vm, critical(id), 0, 0.0, 1_000)
                .unwrap()
                .unwrap();
            host.advance_ms(100);
            assert!(line::remove(vm, id, line::Leave::Admitted(1)).unwrap());
        }
    }

    /// A request that the line ahead of it would keep most of `maxWaitMs` is refused at once (429,
    /// counted as a full line), told when to come back; with `refuseLate` off it waits, to be
    /// answered 503 at its deadline.
    #[test]
    fn a_request_the_line_would_keep_past_its_wait_is_refused_at_once() {
        let host = FakeHost::new();
        let mut cfg = config(100);
        cfg.admission.max_queue = 1_000;
        let mut w = worker(&host, &cfg);
        let _ = routed(w.place(&cfg, class(&cfg, None, "t"), 100));
        draining_behind_twenty(&host, &w.vm);
        // Twenty ahead at ten a second: two seconds, more than its one.
        let Admit::Refuse(r) = w.place(&cfg, class(&cfg, None, "t"), 10) else {
            panic!("not refused")
        };
        assert_eq!(r.status, 429);
        assert!(r.headers.iter().any(|(k, _)| k == "retry-after"));
        assert_eq!(w.stats.take_count(stats::ADMISSION_QUEUE_FULL), 1);
        // Given four seconds, it waits.
        cfg.admission.max_wait_ms = 4_000;
        let _ = waiting(w.place(&cfg, class(&cfg, None, "t"), 10));
        cfg.admission.max_wait_ms = 1_000;
        cfg.admission.refuse_late = false;
        let _ = waiting(w.place(&cfg, class(&cfg, None, "t"), 10));
        assert_eq!(w.stats.take_count(stats::ADMISSION_QUEUE_FULL), 0);
    }

    /// A request's own time-to-first-token objective bounds its wait below `maxWaitMs`: refused
    /// at once when the line ahead would keep it most of that objective (the answer names it),
    /// waiting otherwise, and answered 503 when its objective runs out, not `maxWaitMs`.
    #[test]
    fn a_requests_own_objective_bounds_its_wait() {
        let host = FakeHost::new();
        let mut cfg = config(100);
        cfg.admission.max_queue = 1_000;
        cfg.admission.max_wait_ms = 30_000;
        let mut w = worker(&host, &cfg);
        let _ = routed(w.place(&cfg, class(&cfg, None, "t"), 100));
        let with =
            |ms: &str| Class::from_headers(&cfg.admission, None, None, Some("t"), None, Some(ms));
        // Read as the header says it, or not at all.
        assert_eq!(with(" 250 ").objective_ms, Some(250));
        assert_eq!(with("0.4").objective_ms, Some(1));
        for bad in ["", "-5", "0", "soon", "NaN", "inf"] {
            assert_eq!(with(bad).objective_ms, None, "{bad}");
            assert_eq!(with(bad).wait_ms(&cfg.admission), 30_000, "{bad}");
        }
        assert_eq!(with("90000").wait_ms(&cfg.admission), 30_000);
        draining_behind_twenty(&host, &w.vm);
        // Two seconds ahead of it: past an objective of one second, refused at once.
        let Admit::Refuse(r) = w.place(&cfg, with("1000"), 10) else {
            panic!("not refused")
        };
        assert_eq!(r.status, 429);
        let body = String::from_utf8_lossy(&r.body);
        assert!(body.contains("time-to-first-token objective"), "{body}");
        assert_eq!(w.stats.take_count(stats::ADMISSION_QUEUE_FULL), 1);
        // Without one, or with four seconds, it waits: until its own deadline.
        let _ = waiting(w.place(&cfg, class(&cfg, None, "t"), 10));
        let t = waiting(w.place(&cfg, with("4000"), 10));
        assert_eq!(t.deadline_ms, t.enqueued_ms + 4_000);
        host.advance_ms(4_000);
        let Some(Admit::Refuse(r)) = w.retry(&cfg, &t, 10) else {
            panic!("not answered at its objective")
        };
        assert_eq!(r.status, 503);
        let body = String::from_utf8_lossy(&r.body);
        assert!(body.contains("time-to-first-token objective"), "{body}");
        assert_eq!(w.stats.take_count(stats::ADMISSION_TIMED_OUT), 1);
    }

    #[test]
    fn observing_admission_sends_what_would_wait_or_be_shed_past_the_budget() {
        let host = FakeHost::new();
        let mut cfg = config(100);
        cfg.admission.mode = Mode::Observe;
        let mut w = worker(&host, &cfg);
        let first = routed(w.place(&cfg, class(&cfg, None, "t"), 80));
        assert!(!first.over_budget, "it fits");
        let second = routed(w.place(&cfg, class(&cfg, None, "t"), 50));
        assert!(second.over_budget, "it would have waited");
        let third = routed(w.place(&cfg, class(&cfg, Some("batch"), "t"), 30));
        assert!(third.over_budget, "it would have been shed");
        assert!(
            reserved(&w.vm) > 100,
            "recorded past the budget, as it runs"
        );
        assert!(
            line::read(&w.vm).unwrap().tickets.is_empty(),
            "nobody waits"
        );
        assert_eq!(w.stats.take_count(stats::ADMISSION_ADMITTED), 1);
        for r in [first, second, third] {
            w.router.finish(&w.vm, &r).unwrap();
        }
        assert_eq!(reserved(&w.vm), 0);
    }

    #[test]
    fn a_waiting_request_is_not_overtaken_by_a_newcomer_on_another_worker() {
        let host = FakeHost::new();
        let cfg = config(100);
        let mut w1 = worker(&host, &cfg);
        let mut w2 = worker(&host, &cfg);
        let big = routed(w1.place(&cfg, class(&cfg, None, "t"), 90));
        let t = waiting(w1.place(&cfg, class(&cfg, None, "t"), 50));
        // 10 tokens are free: a small newcomer would fit, but it must queue behind the ticket;
        // also one of another tenant whose tag ties with the ticket's, in the same millisecond
        // (which went first while it had no id).
        for tenant in ["t", "u"] {
            assert!(matches!(
                w2.place(&cfg, class(&cfg, None, tenant), 5),
                Admit::Wait(_)
            ));
        }
        // A higher band leads the line and may go straight in.
        assert!(matches!(
            w2.place(&cfg, class(&cfg, Some("critical"), "t"), 5),
            Admit::Routed(_)
        ));
        w1.router.finish(&w1.vm, &big).unwrap();
        assert_eq!(
            w2.admission.next_head(&w2.vm, &[]).unwrap(),
            None,
            "w1 holds the head"
        );
        assert_eq!(w1.vm.take_notifications(), vec![w1.admission.wake_queue()]);
        assert!(matches!(w1.retry(&cfg, &t, 50), Some(Admit::Routed(_))));
    }

    #[test]
    fn deadline_gives_503_with_retry_after_and_disconnect_leaves_nothing() {
        let host = FakeHost::new();
        let cfg = config(100);
        let mut w = worker(&host, &cfg);
        let _ = routed(w.place(&cfg, class(&cfg, None, "t"), 100));
        let t1 = waiting(w.place(&cfg, class(&cfg, None, "t"), 10));
        let t2 = waiting(w.place(&cfg, class(&cfg, None, "u"), 10));
        w.admission.abandon(&w.vm, &mut w.stats, t2.id);
        host.advance_ms(1_000);
        assert_eq!(w.admission.expired(host.now_ms()), vec![t1.id]);
        let Some(Admit::Refuse(r)) = w.retry(&cfg, &t1, 10) else {
            panic!()
        };
        assert_eq!(r.status, 503);
        assert!(r
            .headers
            .iter()
            .any(|(k, v)| k == "retry-after" && v == "1"));
        assert!(line::read(&w.vm).unwrap().tickets.is_empty());
        assert_eq!(w.admission.parked(), 0);
    }

    #[test]
    fn a_request_displaced_from_the_full_line_by_a_higher_band_is_answered_429() {
        let host = FakeHost::new();
        let cfg = config(100);
        let mut w1 = worker(&host, &cfg);
        let mut w2 = worker(&host, &cfg);
        let _ = routed(w1.place(&cfg, class(&cfg, None, "t"), 100));
        // The line (`max_queue` 3) full of standard requests of w1's.
        let standard: Vec<Ticket> = (0..3)
            .map(|_| waiting(w1.place(&cfg, class(&cfg, None, "t"), 10)))
            .collect();
        // Another of the same band and tenant would be served after them: refused.
        assert!(matches!(
            w2.place(&cfg, class(&cfg, None, "t"), 10),
            Admit::Refuse(r) if r.status == 429
        ));
        assert_eq!(w2.stats.take_count(stats::ADMISSION_QUEUE_FULL), 1);
        // A critical one takes the place of the last standard one.
        let critical = waiting(w2.place(&cfg, class(&cfg, Some("critical"), "u"), 10));
        assert_eq!(w1.admission.displaced(&w1.vm), vec![standard[2].id]);
        assert!(w2.admission.displaced(&w2.vm).is_empty());
        let Some(Admit::Refuse(r)) = w1.retry(&cfg, &standard[2], 10) else {
            panic!("not answered")
        };
        assert_eq!(r.status, 429);
        assert!(r.headers.iter().any(|(k, _)| k == "retry-after"));
        assert_eq!(w1.stats.take_count(stats::ADMISSION_DISPLACED), 1);
        assert_eq!(w1.admission.parked(), 2, "the other two wait on");
        assert!(w1.admission.displaced(&w1.vm).is_empty(), "answered once");
        let ids: Vec<u64> = line::read(&w1.vm)
            .unwrap()
            .tickets
            .iter()
            .map(|t| t.id)
            .collect();
        assert_eq!(ids, vec![critical.id, standard[0].id, standard[1].id]);
    }

    #[test]
    fn budget_comes_from_scraped_capacity() {
        let (cfg, mut w) = one_worker(0);
        let snap = Snapshot {
            healthy: true,
            capacity_tokens: 1000,
            kv_usage: 0.0,
            ..Snapshot::default()
        };
        record::write_snapshot(&w.vm, "a:1", snap, 0, &Config::default()).unwrap();
        assert!(matches!(
            w.place(&cfg, class(&cfg, None, "t"), 850),
            Admit::Routed(_)
        ));
        assert!(
            matches!(w.place(&cfg, class(&cfg, None, "t"), 200), Admit::Wait(_)),
            "a budget of 1000 (the whole capacity, `utilization` 1.0)"
        );
    }

    #[test]
    fn priority_header_and_objectives_map_to_bands() {
        let cfg = config(0);
        assert_eq!(class(&cfg, Some("critical"), "t").priority, 10);
        assert_eq!(class(&cfg, Some("unknown"), "t").priority, 0);
        let direct = Class::from_headers(
            &cfg.admission,
            Some("critical"),
            Some("-3"),
            None,
            Some("s"),
            None,
        );
        assert_eq!(direct.priority, -3);
        assert!(direct.session.is_some());
    }
}
