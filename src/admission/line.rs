//! The one waiting line in front of all pods, shared by every worker (`kvgate.queue`): who waits,
//! in which order, and the fair-queuing state that orders them. Order, global across workers:
//! priority band (higher first); then start-time fair queuing between tenants by tokens — a
//! ticket's start tag is the later of the queue's virtual time and its tenant's last finish tag,
//! so a tenant that has been sent many tokens recently waits behind the others, and a large
//! request is never penalised for its own size; a boosted session follow-up has its tag moved
//! forward by a fixed credit; ties go to the earlier arrival. The head is admitted first; a
//! ticket behind it is admitted first only as a *backfill*: in the head's band, into room the
//! head does not fit (a pod's free KV after a release is often less than a long prompt, and
//! would idle until more is released), at most `admission.backfillPasses` times per head
//! ([`QueueRecord::passes`]).
//!
//! Each ticket names the pods it may be sent to (`Ticket::reach`: its model's). Order matters
//! only between tickets that wait for room on a pod in common: a ticket that no ticket ahead of
//! it shares a pod with heads a line of its own; any other waits behind the heads it is joined
//! to by pods in common, directly or through tickets between them
//! ([`QueueRecord::visit_heads`]), and a backfill past them counts a pass against each. On the
//! pods of its reach that no ticket ahead of it may take, a ticket heads the line
//! ([`QueueRecord::leaders`]: per-pod precedence): it is retried there like a head, and taking
//! room there passes nobody, since no ticket ahead of it waits for that room. Pods of
//! one model make one line with one head, the single line above; a second model on pods of its
//! own is not held behind the first model's head (measured: with one model's pods saturated,
//! 1–2 % of another model's requests, whose pods were idle, waited 0.15–0.6 s behind its line).
//!
//! Bound (docs/design.md): within a band, a ticket with start tag S is admitted after at most
//! the tickets with smaller tags, plus at most `backfillPasses` backfills (a few more when
//! workers race for the last pass: one per worker) while it is the head; a ticket arriving later
//! has a tag of at least V − credit, and V never passes S while S waits (a backfill moves V no
//! further than the head's tag), so what can overtake it is bounded by the tenants' backlogs
//! ahead of S, one boost credit and the backfills — however large the ticket's own cost. The
//! same holds for each head: it is passed only by the tickets behind it as above, and by tickets
//! that cannot take the room it waits for.

use crate::store::codec::{Reader, Writer};
use crate::store::interface::{create_if_missing, update, Store, StoreError};
use std::cmp::Ordering;

pub const KEY: &str = "kvgate.queue";
/// Tenants whose finish tag is ahead of the virtual time are remembered; at most this many.
const MAX_TENANTS: usize = 512;
/// A ticket whose owner has not collected it this long past its deadline is dropped (its VM died).
const ABANDONED_MS: u64 = 5_000;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ticket {
    pub id: u64,
    /// The VM holding the paused request; only it can resume it.
    pub vm: u32,
    pub priority: i32,
    pub boosted: bool,
    pub start_tag: f64,
    pub enqueued_ms: u64,
    pub deadline_ms: u64,
    pub cost: u64,
    /// The pod it would take first had it room (`pod_key` of its name), as the last pick that
    /// found it none said: with several gateway replicas this replica asks for credit there
    /// (`Gate::pod_views`). 0 before any pick has named one, and with one gateway (nothing
    /// reads it).
    pub wants: u64,
    /// The pods it may be sent to (its model's), each as its bit (`pod_bits`); `ANYWHERE` when not
    /// known. Tickets whose reaches share no bit never wait for each other.
    pub reach: u64,
    /// What it takes of a pod holding nothing else (`budget::need`): with several gateway
    /// replicas, the step of credit this replica asks for while it heads the line
    /// (`Gate::pod_views`). 0 in a record an older module wrote (its cost stands in).
    pub need: u64,
}

impl Ticket {
    /// The credit it asks of a pod (`need`; its cost in a record an older module wrote).
    pub fn asks(&self) -> u64 {
        if self.need > 0 {
            self.need
        } else {
            self.cost
        }
    }
}

/// A ticket's reach when the pods it may go to are not known: it waits behind every ticket.
pub const ANYWHERE: u64 = u64::MAX;

/// How a ticket names the pod it waits for: never 0, which names none.
pub fn pod_key(pod: &str) -> u64 {
    crate::hash::fnv1a(pod.as_bytes()).max(1)
}

/// Each pod's bit in a ticket's `reach`, for the pool `pods`: a bit of its own for each of up to
/// 64 pods. Its name's hash picks the bit it tries first, and the next free one is taken where
/// another pod has it, the pods taking theirs in the order of those first tries (then names),
/// so the bits depend on the set alone: every VM reads the same pool and gives the same bits,
/// and a pod joining or leaving moves only the pods after it among those trying the same bits
/// (a waiting ticket's reach follows at its next try). Bits of the hash alone were shared by
/// some two pods of two models with 8 pods each in 64 % of random pools (98 % at 16 each),
/// and shared bits make the models' tickets wait for each other. Past 64 pods, the rest share
/// the bits their names hash to: tickets that share a bit wait for each other as if they shared
/// the pod (as every ticket did before reaches), never the other way.
pub fn pod_bits(pods: &[String]) -> Vec<u64> {
    let first = |i: usize| crate::hash::fnv1a(pods[i].as_bytes()) % 64;
    let mut order: Vec<usize> = (0..pods.len()).collect();
    order.sort_by(|&a, &b| first(a).cmp(&first(b)).then_with(|| pods[a].cmp(&pods[b])));
    let (mut taken, mut bits) = (0u64, vec![0; pods.len()]);
    for i in order {
        let tried = first(i);
        let bit = (0..64)
            .map(|k| (tried + k) % 64)
            .find(|b| taken & (1 << b) == 0)
            .unwrap_or(tried);
        taken |= 1 << bit;
        bits[i] = 1 << bit;
    }
    bits
}

/// The pods a ticket heading the line on `free` (`QueueRecord::leaders`, `free_for`) may be
/// sent to, as `Estimate::within` takes them: `ANYWHERE` when that is all of its `reach` (it
/// heads a line of its own), and its pick is then not narrowed.
pub fn within(free: u64, reach: u64) -> u64 {
    if free == reach {
        ANYWHERE
    } else {
        free
    }
}

/// Who a ticket's tokens are charged to among the tenants: its tenant on the pods it may go to.
/// A tenant's use of one model's pods does not put its requests for another model's pods, whose
/// line is another, behind the other tenants there (as the Gateway API Inference Extension's
/// flow control keeps fairness per pool). Tickets of one model, and any whose pods are not known,
/// are charged to the tenant alone, as before.
pub fn fair_key(tenant: u64, reach: u64) -> u64 {
    if reach == ANYWHERE {
        tenant
    } else {
        crate::hash::fnv1a_from(tenant, &reach.to_le_bytes())
    }
}

/// Orders tickets: the first is admitted first.
pub fn order(a: &Ticket, b: &Ticket) -> Ordering {
    b.priority
        .cmp(&a.priority)
        .then(a.start_tag.total_cmp(&b.start_tag))
        .then(a.enqueued_ms.cmp(&b.enqueued_ms))
        .then(a.id.cmp(&b.id))
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct QueueRecord {
    pub virtual_time: f64,
    /// Tenant hash → finish tag of its last admitted or queued request.
    pub tenants: Vec<(u64, f64)>,
    /// Kept sorted by `order`.
    pub tickets: Vec<Ticket>,
    /// Tickets admitted past a head (`(head id, how many)`), for the backfill bound;
    /// only for tickets still in the line. The first ticket's is also written where a module
    /// from before reaches reads it (after the tickets: a record without it, older still, reads
    /// as no passes).
    pub passes: Vec<(u64, u32)>,
    /// How fast the tickets for each set of pods leave the line, which a refused request's
    /// `Retry-After` is worked out from (`QueueRecord::drain_ms`): one [`Drain`] per reach
    /// admitted from or refused, at most `MAX_DRAINS`. Per set of pods because each model's
    /// pods serve at their own pace: a model of long answers drains its line ten times slower
    /// than one of short answers beside it, and one pace for both told the first's refused
    /// clients to come back too soon, spending their retries.
    pub drains: Vec<Drain>,
}

/// How fast the tickets for one set of pods (`reach`) leave the line: `drained` more of them
/// admitted since the admission at `from_ms` (0: none since a ticket last waited for any of those
/// pods). Counted from a first admission, not from when the line filled: the wait for the first
/// release is as long as a request runs, and no gap between admissions. The span is halved
/// whenever the count reaches `2 × DRAIN_WINDOW`, so it covers the last `DRAIN_WINDOW` to twice
/// that many admissions.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Drain {
    pub reach: u64,
    pub from_ms: u64,
    pub drained: u64,
    /// How long the tickets that left it waited against their costs (`Sizes`): how much longer
    /// a large one waits than the count ahead of it says (`QueueRecord::late`). Empty in a
    /// record an older module wrote (sizes are then not judged).
    pub sizes: Sizes,
    /// The latest time a request for these pods refused for a full line was told to come back
    /// ([`QueueRecord::appoint`]).
    pub appointed_ms: u64,
}

/// The waits of the tickets that left a drain's line, against their costs, as the sums of a
/// least-squares line (each sum halved when the samples reach `2 × DRAIN_WINDOW`, so it covers
/// the last `DRAIN_WINDOW` to twice that many): the tickets admitted, and those whose deadline
/// came first, their wait counted as their deadline (they would have waited longer; left out, the
/// largest, which run out most, would go unseen).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sizes {
    n: f64,
    /// Σ cost, Σ cost², Σ wait (ms), Σ cost × wait.
    c: f64,
    cc: f64,
    w: f64,
    cw: f64,
}

impl Sizes {
    fn add(&mut self, cost: u64, wait_ms: u64) {
        let (c, w) = (cost as f64, wait_ms as f64);
        self.n += 1.0;
        self.c += c;
        self.cc += c * c;
        self.w += w;
        self.cw += c * w;
        if self.n >= 2.0 * DRAIN_WINDOW as f64 {
            for sum in [
                &mut self.n,
                &mut self.c,
                &mut self.cc,
                &mut self.w,
                &mut self.cw,
            ] {
                *sum /= 2.0;
            }
        }
    }

    fn merged(self, o: Sizes) -> Sizes {
        Sizes {
            n: self.n + o.n,
            c: self.c + o.c,
            cc: self.cc + o.cc,
            w: self.w + o.w,
            cw: self.cw + o.cw,
        }
    }

    /// How much longer than the average ticket one of `cost` waits, in ms (less when smaller):
    /// the slope times its cost's distance from the mean; 0 where there is no slope.
    fn longer_ms(&self, cost: u64) -> f64 {
        self.slope()
            .map_or(0.0, |slope| slope * (cost as f64 - self.c / self.n))
    }

    /// The least-squares slope of wait on cost (ms a token), never below 0. `None` over fewer
    /// than `DRAIN_WINDOW` samples, costs all alike (to within the sums' rounding), or sums that
    /// are not numbers (a record garbled).
    pub fn slope(&self) -> Option<f64> {
        let spread = self.n * self.cc - self.c * self.c;
        let slope = (self.n * self.cw - self.c * self.w) / spread;
        if self.n < DRAIN_WINDOW as f64 || spread <= 1e-9 * self.n * self.cc || !slope.is_finite() {
            return None;
        }
        Some(slope.max(0.0))
    }
}

impl Drain {
    /// The gap between its admissions now (ms; `rate`'s inverse), once it rests on
    /// `DRAIN_WINDOW` of them, as `QueueRecord::late` judges it: for the status page.
    pub fn gap_ms(&self, now: u64) -> Option<f64> {
        let rate = self.rate(now);
        (self.drained >= DRAIN_WINDOW && rate > 0.0).then(|| 1.0 / rate)
    }

    /// Admissions a millisecond over its span, which ends now; none before its first admission.
    fn rate(&self, now: u64) -> f64 {
        if self.from_ms == 0 {
            return 0.0;
        }
        self.drained.max(1) as f64 / now.saturating_sub(self.from_ms).max(1) as f64
    }
}

/// Sets of pods whose drains a line keeps (`QueueRecord::drains`): more than the models that
/// wait at once behind one gateway; past it the quietest set's is forgotten and measured again.
const MAX_DRAINS: usize = 32;

/// Admissions the drain's span covers at least (`QueueRecord::drained`): enough that releases
/// coming in bunches (requests started together end together) read as their mean.
const DRAIN_WINDOW: u64 = 32;
/// The share of the time a request has left that the tickets ahead of it may take before it is
/// refused as late (`QueueRecord::late`). Below 1: admissions come in bunches around their mean
/// pace, so a request let in with an estimate just under the whole time left waits past it about
/// as often as not. Measured on
/// two pods at 1.5× what they serve (BENCHMARKS.md, *Refused at arrival*): at the whole time,
/// 20–33 of the about 85 requests the line could not serve were still answered 503 after their
/// wait; at three quarters, 2–5, with the pods serving as many a second.
const LATE_SHARE: f64 = 0.75;

/// How far apart requests refused for a full line are told to come back, in the line's measured
/// gaps, and how much of its drain they wait for (`QueueRecord::appoint`): a little less than
/// measured. A return too early spends one of its client's retries, and waits in the line if
/// there is room; one too late leaves the pods without work; and early in a burst the measured
/// gap runs long (its span includes the pause after the few bunches seen). Measured on bursts of
/// 60, 120 and 200 requests, five and more times what the pool and its line held (BENCHMARKS.md,
/// *Retry-After*): at 1 gap the pool took 1.15–1.3× as long to serve them; at half, a fifth of
/// the 120 gave up.
const APPOINTMENT_GAPS: f64 = 0.75;

impl QueueRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.f64(self.virtual_time).u32(self.tenants.len() as u32);
        for (t, f) in &self.tenants {
            w.u64(*t).f64(*f);
        }
        w.u32(self.tickets.len() as u32);
        for t in &self.tickets {
            w.u64(t.id)
                .u32(t.vm)
                .u32(t.priority as u32)
                .u8(u8::from(t.boosted))
                .f64(t.start_tag)
                .u64(t.enqueued_ms)
                .u64(t.deadline_ms)
                .u64(t.cost);
        }
        let first = self.tickets.first().map_or(0, |t| t.id);
        w.u64(first).u32(self.passes(first));
        // After the passes, for the same reason: a module that predates it reads none.
        w.u32(self.tickets.len() as u32);
        for t in &self.tickets {
            w.u64(t.wants);
        }
        // And the reaches and every head's passes after those.
        w.u32(self.tickets.len() as u32);
        for t in &self.tickets {
            w.u64(t.reach);
        }
        w.u32(self.passes.len() as u32);
        for (id, n) in &self.passes {
            w.u64(*id).u32(*n);
        }
        // And the needs after those.
        w.u32(self.tickets.len() as u32);
        for t in &self.tickets {
            w.u64(t.need);
        }
        // Where a module from before drains per set of pods read its one drain for the whole
        // line: written empty, so it measures its own. And each set's after that.
        w.u64(0).u64(0).u64(0);
        w.u32(self.drains.len() as u32);
        for d in &self.drains {
            w.u64(d.reach)
                .u64(d.from_ms)
                .u64(d.drained)
                .u64(d.appointed_ms);
        }
        // And their sizes after those, which a module from before reads as nothing more.
        w.u32(self.drains.len() as u32);
        for d in &self.drains {
            let z = &d.sizes;
            w.f64(z.n).f64(z.c).f64(z.cc).f64(z.w).f64(z.cw);
        }
        w.0
    }

    pub fn decode(bytes: &[u8]) -> Option<QueueRecord> {
        let mut r = Reader(bytes);
        let virtual_time = r.f64()?;
        let tenants = r.list(16, |r| Some((r.u64()?, r.f64()?)))?;
        let mut tickets = r.list(49, |r| {
            Some(Ticket {
                id: r.u64()?,
                vm: r.u32()?,
                priority: r.u32()? as i32,
                boosted: r.u8()? != 0,
                start_tag: r.f64()?,
                enqueued_ms: r.u64()?,
                deadline_ms: r.u64()?,
                cost: r.u64()?,
                wants: 0,
                reach: ANYWHERE,
                need: 0,
            })
        })?;
        let mut passes = if r.is_empty() {
            Vec::new()
        } else {
            vec![(r.u64()?, r.u32()?)]
        };
        if !r.is_empty() {
            let wants = r.list(8, Reader::u64)?;
            if wants.len() == tickets.len() {
                for (t, w) in tickets.iter_mut().zip(wants) {
                    t.wants = w;
                }
            }
        }
        if !r.is_empty() {
            let reaches = r.list(8, Reader::u64)?;
            if reaches.len() == tickets.len() {
                for (t, reach) in tickets.iter_mut().zip(reaches) {
                    t.reach = reach;
                }
            }
            passes = r.list(12, |r| Some((r.u64()?, r.u32()?)))?;
        }
        if !r.is_empty() {
            let needs = r.list(8, Reader::u64)?;
            if needs.len() == tickets.len() {
                for (t, need) in tickets.iter_mut().zip(needs) {
                    t.need = need;
                }
            }
        }
        // The whole line's drain a module from before wrote is not a set's: read as not yet
        // measured.
        if !r.is_empty() {
            for _ in 0..3 {
                r.u64()?;
            }
        }
        let mut drains = if r.is_empty() {
            Vec::new()
        } else {
            r.list(32, |r| {
                Some(Drain {
                    reach: r.u64()?,
                    from_ms: r.u64()?,
                    drained: r.u64()?,
                    sizes: Sizes::default(),
                    appointed_ms: r.u64()?,
                })
            })?
        };
        if !r.is_empty() {
            let sizes = r.list(40, |r| {
                Some(Sizes {
                    n: r.f64()?,
                    c: r.f64()?,
                    cc: r.f64()?,
                    w: r.f64()?,
                    cw: r.f64()?,
                })
            })?;
            if sizes.len() == drains.len() {
                for (d, sizes) in drains.iter_mut().zip(sizes) {
                    d.sizes = sizes;
                }
            }
        }
        passes.retain(|&(id, n)| n > 0 && tickets.iter().any(|t| t.id == id));
        Some(QueueRecord {
            virtual_time,
            tenants,
            tickets,
            passes,
            drains,
        })
    }

    /// How long the tickets waiting for a pod of `reach` take to leave the line at the pace it
    /// drains now: how many they are, times the gap between admissions from it (`pace`). What
    /// a request refused now would have waited behind them, and about when room comes for it and
    /// the others refused with it. `None` when none waits.
    pub fn drain_ms(&self, reach: u64, now: u64) -> Option<u64> {
        self.pace(reach, now)
            .map(|(n, gap)| (n as f64 * gap) as u64)
    }

    /// Whether `ticket`, joining now, would still be waiting near its deadline (`LATE_SHARE`)
    /// behind the tickets ahead of it in the line's order that wait for a pod it may take, at
    /// the pace tickets for those pods leave now (`pace`'s rates, the time since the last
    /// admission included). Such a request is answered at once (`admission.refuseLate`) rather
    /// than at its deadline with nothing done: its client learns it seconds sooner, and a line
    /// past the pool's pace does not fill with requests that cannot be served. Later arrivals of
    /// a higher band or a quieter tenant only push it further back. Judged only once the pace
    /// rests on `DRAIN_WINDOW` admissions: over fewer, releases that come in bunches read as a
    /// pause.
    pub fn late(&self, ticket: &Ticket, now: u64) -> bool {
        let (drained, rate) = self.drained(ticket.reach, now);
        if drained < DRAIN_WINDOW || rate <= 0.0 {
            return false;
        }
        // The line is kept in order, so those ahead of it are a prefix of it.
        let ahead = self
            .tickets
            .iter()
            .take_while(|t| order(t, ticket) == Ordering::Less)
            .filter(|t| t.reach & ticket.reach != 0)
            .count();
        // And its own size: at the head a large ticket waits for one pod to free its whole
        // cost while smaller ones behind it take what is freed before (`backfillPasses`).
        let sizes = self
            .drains
            .iter()
            .filter(|d| d.reach & ticket.reach != 0)
            .fold(Sizes::default(), |all, d| all.merged(d.sizes));
        ahead as f64 / rate + sizes.longer_ms(ticket.cost)
            > LATE_SHARE * ticket.deadline_ms.saturating_sub(now) as f64
    }

    /// The admissions counted by the drains of the sets of pods that share one with `reach`,
    /// and their rates summed (a millisecond): each admission there frees a place it may take.
    fn drained(&self, reach: u64, now: u64) -> (u64, f64) {
        self.drains
            .iter()
            .filter(|d| d.reach & reach != 0)
            .fold((0, 0.0), |(n, r), d| (n + d.drained, r + d.rate(now)))
    }

    /// How many tickets wait for a pod of `reach`, and the gap between admissions of tickets
    /// for those pods now: from the drains of the sets of pods that share one with `reach`, each
    /// its mean over its span, the time since its last admission included, so a line that stops
    /// draining reads slower at once; their rates add up, since each admission is a place
    /// freed. Before any such admission, the time since the oldest of those tickets arrived:
    /// nothing left in that time. `None` when none waits.
    fn pace(&self, reach: u64, now: u64) -> Option<(u64, f64)> {
        let (n, oldest) = self
            .tickets
            .iter()
            .filter(|t| t.reach & reach != 0)
            .fold((0u64, u64::MAX), |(n, oldest), t| {
                (n + 1, oldest.min(t.enqueued_ms))
            });
        if n == 0 {
            return None;
        }
        let (_, rate) = self.drained(reach, now);
        let gap = if rate > 0.0 {
            1.0 / rate
        } else {
            now.saturating_sub(oldest) as f64
        };
        Some((n, gap))
    }

    /// The drain of exactly the pods `reach`, made if there is none (the quietest set's place
    /// taken when `MAX_DRAINS` are kept).
    fn drain_of(&mut self, reach: u64) -> &mut Drain {
        let at = match self.drains.iter().position(|d| d.reach == reach) {
            Some(at) => at,
            None => {
                if self.drains.len() >= MAX_DRAINS {
                    if let Some(quietest) = (0..self.drains.len())
                        .min_by_key(|&i| (self.drains[i].drained, self.drains[i].appointed_ms))
                    {
                        self.drains.swap_remove(quietest);
                    }
                }
                self.drains.push(Drain {
                    reach,
                    ..Drain::default()
                });
                self.drains.len() - 1
            }
        };
        &mut self.drains[at]
    }

    /// When a request refused for a full line (`ticket`, which would have joined it) should
    /// come back: when a place will be free for it, after the tickets waiting for its pods have
    /// left (`drain_ms`) and one admission's gap more for each request for the same pods refused
    /// before it that is still to come back — so that those refused together come back one at a
    /// time, each to the room an admission made — but never past the ticket's deadline (it would
    /// have been answered 503 by then). Both aimed a little early (`APPOINTMENT_GAPS`). A line
    /// that stops refusing forgets its appointments as their times pass. `None` when none waits.
    pub fn appoint(&mut self, ticket: &Ticket, now: u64) -> Option<u64> {
        let (n, gap) = self.pace(ticket.reach, now)?;
        let gap = gap * APPOINTMENT_GAPS;
        let after_line = now.saturating_add((n as f64 * gap) as u64);
        let drain = self.drain_of(ticket.reach);
        let at = drain
            .appointed_ms
            .max(after_line)
            .saturating_add(gap as u64)
            .min(ticket.deadline_ms.max(now));
        drain.appointed_ms = at;
        Some(at)
    }

    /// A ticket for the pods `reach` was admitted from the line at `now`.
    fn note_admission(&mut self, reach: u64, now: u64) {
        let d = self.drain_of(reach);
        if d.from_ms == 0 {
            d.from_ms = now.max(1);
            return;
        }
        d.drained += 1;
        if d.drained >= 2 * DRAIN_WINDOW {
            d.drained /= 2;
            d.from_ms = now - now.saturating_sub(d.from_ms) / 2;
        }
    }

    /// Gaps are measured only while tickets wait: the time before a ticket waits for those pods
    /// again is not how fast they drain. A set's drain is forgotten once no ticket waits for its
    /// pods and its appointments have passed.
    fn forget_idle_drains(&mut self, now: u64) {
        let waiting = self.tickets.iter().fold(0, |all, t| all | t.reach);
        self.drains.retain_mut(|d| {
            if d.reach & waiting == 0 {
                (d.from_ms, d.drained, d.sizes) = (0, 0, Sizes::default());
            }
            d.from_ms > 0 || d.appointed_ms > now
        });
    }

    /// Tickets admitted past the ticket `id` while it headed a line of its own.
    pub fn passes(&self, id: u64) -> u32 {
        self.passes
            .iter()
            .find(|(h, _)| *h == id)
            .map_or(0, |(_, n)| *n)
    }

    /// Calls `f` with each ticket's index, in line order, and the heads it waits behind: the
    /// tickets ahead of it, or itself, that no ticket ahead of them shares a pod with, and to
    /// which it is joined by pods in common, directly or through tickets between them (its
    /// group). Just itself when no ticket ahead of it may take a pod it may take: then it heads a
    /// line of its own. Ascending. Stops when `f` returns false. `O(n · groups)`, groups at most
    /// 64 (the bits), allocating only as groups form or join: this runs on every release.
    pub fn visit_heads(&self, mut f: impl FnMut(usize, &[usize]) -> bool) {
        // Each group so far: the pods its tickets may take, and its heads.
        let mut groups: Vec<(u64, Vec<usize>)> = Vec::new();
        for (i, t) in self.tickets.iter().enumerate() {
            let mut joined = groups
                .iter()
                .enumerate()
                .filter(|(_, g)| g.0 & t.reach != 0)
                .map(|(k, _)| k);
            let at = match (joined.next(), joined.next()) {
                (Some(k), None) => k,
                (None, _) => {
                    groups.push((t.reach, vec![i]));
                    groups.len() - 1
                }
                (Some(_), Some(_)) => {
                    // It joins several groups into one.
                    let (mut reach, mut heads) = (t.reach, Vec::new());
                    groups.retain_mut(|(r, h)| {
                        let joins = *r & t.reach != 0;
                        if joins {
                            reach |= *r;
                            heads.append(h);
                        }
                        !joins
                    });
                    heads.sort_unstable();
                    groups.push((reach, heads));
                    groups.len() - 1
                }
            };
            let Some(group) = groups.get_mut(at) else {
                return;
            };
            group.0 |= t.reach;
            if !f(i, &group.1) {
                return;
            }
        }
    }

    /// The heads ticket `i` waits behind (`visit_heads`); empty past the line's end.
    pub fn heads_of(&self, i: usize) -> Vec<usize> {
        let mut out = Vec::new();
        self.visit_heads(|k, heads| {
            if k == i {
                out = heads.to_vec();
            }
            k < i
        });
        out
    }

    /// Each ticket that heads the line on some of its pods, in line order, with those pods (as
    /// bits, `free`): the pods it may take that no ticket ahead of it may take. A ticket heading a
    /// line of its own (`visit_heads`) heads it on all its pods; one joined to heads ahead of it by
    /// some of its pods heads it on the others, since room taken there is room no ticket ahead of
    /// it waits for (per-pod precedence). A base model's request behind a LoRA adapter's that
    /// only some of its pods serve goes to the others as they free room, instead of waiting for
    /// room where the adapter is, or a pass. At most one a pod: each takes a pod no earlier one
    /// may take.
    pub fn leaders(&self) -> Vec<(&Ticket, u64)> {
        let (mut ahead, mut out) = (0u64, Vec::new());
        for t in &self.tickets {
            let free = t.reach & !ahead;
            if free != 0 {
                out.push((t, free));
            }
            ahead |= t.reach;
            if ahead == ANYWHERE {
                break;
            }
        }
        out
    }

    fn pass(&mut self, head: u64) {
        match self.passes.iter_mut().find(|(h, _)| *h == head) {
            Some(entry) => entry.1 = entry.1.saturating_add(1),
            None => self.passes.push((head, 1)),
        }
    }

    fn tenant_finish(&self, tenant: u64) -> f64 {
        self.tenants
            .iter()
            .find(|(t, _)| *t == tenant)
            .map_or(0.0, |(_, f)| *f)
    }

    /// The start tag a request of this tenant would get now.
    pub fn start_tag(&self, tenant: u64, boost_credit: f64) -> f64 {
        self.virtual_time.max(self.tenant_finish(tenant)) - boost_credit
    }

    fn charge(&mut self, tenant: u64, start: f64, cost: u64) {
        let finish = start.max(self.tenant_finish(tenant)) + cost as f64;
        match self.tenants.iter_mut().find(|(t, _)| *t == tenant) {
            Some(entry) => entry.1 = finish,
            None => self.tenants.push((tenant, finish)),
        }
        // Tenants at or behind the virtual time are as good as new: forget them first.
        let v = self.virtual_time;
        self.tenants.retain(|(_, f)| *f > v);
        if self.tenants.len() > MAX_TENANTS {
            self.tenants.sort_by(|a, b| b.1.total_cmp(&a.1));
            self.tenants.truncate(MAX_TENANTS);
        }
    }

    /// The pods (as bits) on which a request ordered as `candidate` would head the line
    /// (`leaders`): those it may take that no ticket ahead of it may take. 0: none; all of its
    /// reach when it would head a line of its own.
    pub fn free_for(&self, candidate: &Ticket) -> u64 {
        let ahead = self
            .tickets
            .iter()
            .take_while(|t| order(t, candidate) == Ordering::Less)
            .fold(0, |ahead, t| ahead | t.reach);
        candidate.reach & !ahead
    }
}

/// Whether any request waits in the line (an unreadable line: none).
pub fn waits(store: &dyn Store) -> bool {
    read(store).is_ok_and(|line| !line.tickets.is_empty())
}

/// Reads the line; tickets abandoned by a dead VM are left out (dropped on the next write).
pub fn read(store: &dyn Store) -> Result<QueueRecord, StoreError> {
    let now = store.now_ms();
    let mut q = store
        .get(KEY)?
        .value
        .and_then(|b| QueueRecord::decode(&b))
        .unwrap_or_default();
    q.tickets
        .retain(|t| t.deadline_ms.saturating_add(ABANDONED_MS) > now);
    Ok(q)
}

/// Creates the record before any request can race its creation (configure time).
pub fn ensure(store: &dyn Store) -> Result<(), StoreError> {
    create_if_missing(store, KEY, &QueueRecord::default().encode())
}

fn modify<T>(
    store: &dyn Store,
    mut change: impl FnMut(&mut QueueRecord) -> Option<T>,
) -> Result<Option<T>, StoreError> {
    let now = store.now_ms();
    update(store, KEY, |bytes| {
        let mut q = bytes.and_then(QueueRecord::decode).unwrap_or_default();
        q.tickets
            .retain(|t| t.deadline_ms.saturating_add(ABANDONED_MS) > now);
        let out = change(&mut q)?;
        Some((q.encode(), out))
    })
}

/// Why a request could not join the line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The line is full; come back at this time (`QueueRecord::appoint`), when it is known.
    Full(Option<u64>),
}

/// A ticket that joined the line (`enqueue`), and the one it displaced from a full line, if any.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Joined {
    pub ticket: Ticket,
    pub displaced: Option<Ticket>,
}

/// Joins the line, unless `max_len` tickets already wait for a pod it may take (one model's
/// flood does not refuse another model's requests, which wait for pods of their own): then it
/// is told when to come back (`QueueRecord::appoint`), unless it goes before the last of them in
/// the line's order (a higher band, or a quieter tenant's turn), which it then displaces: the
/// line's bound would otherwise refuse a critical request while standard ones wait, an inversion
/// of the bands (its owner answers it 429, `Admission::displaced`). The ticket's start tag is
/// assigned here (start-time fair queuing).
pub fn enqueue(
    store: &dyn Store,
    mut ticket: Ticket,
    tenant: u64,
    boost_credit: f64,
    max_len: usize,
) -> Result<Result<Joined, Refused>, StoreError> {
    let now = store.now_ms();
    let out = modify(store, |q| {
        let start = q.virtual_time.max(q.tenant_finish(tenant));
        ticket.start_tag = start - if ticket.boosted { boost_credit } else { 0.0 };
        let competing = q.tickets.iter().filter(|t| t.reach & ticket.reach != 0);
        let mut displaced = None;
        if competing.count() >= max_len {
            // The line is kept in order: the last competing ticket is the one served last.
            let last = q
                .tickets
                .iter()
                .rposition(|t| t.reach & ticket.reach != 0)
                .filter(|&i| order(&ticket, &q.tickets[i]) == Ordering::Less);
            let Some(last) = last else {
                return Some(Err(Refused::Full(q.appoint(&ticket, now))));
            };
            displaced = Some(q.tickets.remove(last));
            let tickets = &q.tickets;
            q.passes.retain(|&(h, _)| tickets.iter().any(|t| t.id == h));
        }
        q.charge(tenant, start, ticket.cost);
        let at = q
            .tickets
            .partition_point(|t| order(t, &ticket) == Ordering::Less);
        q.tickets.insert(at, ticket);
        Some(Ok(Joined { ticket, displaced }))
    })?;
    // `modify` always has an answer here: its change never declines.
    Ok(out.unwrap_or(Err(Refused::Full(None))))
}

/// How a ticket leaves the line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leave {
    /// Sent to the pod of this bit (`pod_bits`; 0 when not known).
    Admitted(u64),
    /// Timed out, gone, or answered without a pod.
    NotAdmitted,
}

/// Leaves the line (admitted, timed out or gone), exactly once: true the first time. An admitted
/// ticket advances the virtual time to its start tag, but never past the first ticket's; one
/// admitted from behind heads (a backfill) counts a pass against each, unless the pod it went to
/// is one no ticket ahead of it may take (it headed the line there: `QueueRecord::leaders`).
pub fn remove(store: &dyn Store, id: u64, leave: Leave) -> Result<bool, StoreError> {
    let now = store.now_ms();
    Ok(modify(store, |q| {
        let i = q.tickets.iter().position(|t| t.id == id)?;
        let ahead = q.tickets[..i].iter().fold(0, |ahead, t| ahead | t.reach);
        let free = q.tickets[i].reach & !ahead;
        let admitted = leave != Leave::NotAdmitted;
        // Heads it passes, if admitted onto a pod one of them may take: ahead of it, so where
        // they were.
        let passed: Vec<u64> = match leave {
            Leave::Admitted(bit) if bit & free == 0 => q
                .heads_of(i)
                .iter()
                .filter(|&&h| h < i)
                .filter_map(|&h| q.tickets.get(h).map(|h| h.id))
                .collect(),
            _ => Vec::new(),
        };
        let t = q.tickets.remove(i);
        if admitted {
            let mut tag = t.start_tag;
            if let Some(first) = q.tickets.first().filter(|_| i > 0) {
                tag = tag.min(first.start_tag);
            }
            for h in passed {
                q.pass(h);
            }
            q.virtual_time = q.virtual_time.max(tag);
            q.note_admission(t.reach, now);
        }
        // Its wait against its cost, where its pods' line is measured: admitted, or run out
        // (not one that left for another reason, whose wait says nothing of the line's).
        if admitted || now >= t.deadline_ms {
            if let Some(d) = q.drains.iter_mut().find(|d| d.reach == t.reach) {
                d.sizes.add(t.cost, now.saturating_sub(t.enqueued_ms));
            }
        }
        q.forget_idle_drains(now);
        let tickets = &q.tickets;
        q.passes.retain(|&(h, _)| tickets.iter().any(|t| t.id == h));
        Some(())
    })?
    .is_some())
}

/// A waiting ticket now waits for room on the pod `wants` names (`pod_key`; 0: on any), and may
/// go to the pods `reach` names (its model's may change while it waits), when it is still in
/// the line and either changed.
pub fn set_wants(store: &dyn Store, id: u64, wants: u64, reach: u64) -> Result<(), StoreError> {
    modify(store, |q| {
        let t = q
            .tickets
            .iter_mut()
            .find(|t| t.id == id && (t.wants, t.reach) != (wants, reach))?;
        (t.wants, t.reach) = (wants, reach);
        Some(())
    })
    .map(|_| ())
}

/// A request admitted without waiting still pays its tenant's share, so a tenant that had the
/// pool to itself does not arrive at the next contention with a clean slate. The virtual time
/// moves no further than the first waiting ticket's tag: a request heading a line of its own
/// (another model's pods) may be admitted past tickets with earlier tags, and a virtual time past
/// theirs would start a light tenant's next ticket behind them.
pub fn charge_direct(store: &dyn Store, tenant: u64, cost: u64) -> Result<(), StoreError> {
    modify(store, |q| {
        let start = q.virtual_time.max(q.tenant_finish(tenant));
        q.charge(tenant, start, cost);
        let waiting = q.tickets.first().map_or(f64::INFINITY, |t| t.start_tag);
        q.virtual_time = q.virtual_time.max(start.min(waiting));
        Some(())
    })
    .map(|_| ())
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::store::fake_host::FakeHost;

    fn ticket(id: u64, priority: i32, cost: u64) -> Ticket {
        Ticket {
            id,
            vm: 1,
            priority,
            boosted: false,
            start_tag: 0.0,
            enqueued_ms: id,
            deadline_ms: 1_000_000,
            cost,
            wants: 0,
            reach: ANYWHERE,
            need: 0,
        }
    }

    /// A ticket for the pods `reach` arriving now, to wait up to ten minutes.
    fn arriving(host: &FakeHost, id: u64, reach: u64) -> Ticket {
        Ticket {
            reach,
            enqueued_ms: host.now_ms(),
            deadline_ms: host.now_ms() + 600_000,
            ..ticket(id, 0, 10)
        }
    }

    fn ids(store: &dyn Store) -> Vec<u64> {
        read(store).unwrap().tickets.iter().map(|t| t.id).collect()
    }

    #[test]
    fn higher_priority_bands_go_first() {
        let vm = FakeHost::new().vm();
        ensure(&vm).unwrap();
        enqueue(&vm, ticket(1, 0, 10), 1, 0.0, 10).unwrap().unwrap();
        enqueue(&vm, ticket(2, -1, 10), 1, 0.0, 10)
            .unwrap()
            .unwrap();
        enqueue(&vm, ticket(3, 5, 10), 1, 0.0, 10).unwrap().unwrap();
        assert_eq!(ids(&vm), vec![3, 1, 2]);
    }

    #[test]
    fn a_flooding_tenant_waits_behind_a_quiet_one() {
        let vm = FakeHost::new().vm();
        ensure(&vm).unwrap();
        for i in 0..10 {
            enqueue(&vm, ticket(i, 0, 1000), 7, 0.0, 100)
                .unwrap()
                .unwrap();
        }
        enqueue(&vm, ticket(100, 0, 1000), 8, 0.0, 100)
            .unwrap()
            .unwrap();
        let order = ids(&vm);
        assert_eq!(order.iter().position(|&i| i == 100), Some(1), "{order:?}");
    }

    #[test]
    fn a_large_request_is_not_penalised_for_its_size() {
        let vm = FakeHost::new().vm();
        ensure(&vm).unwrap();
        enqueue(&vm, ticket(1, 0, 100_000), 1, 0.0, 100)
            .unwrap()
            .unwrap();
        for i in 2..50 {
            enqueue(&vm, ticket(i, 0, 10), 2 + i, 0.0, 100)
                .unwrap()
                .unwrap();
        }
        assert_eq!(ids(&vm)[0], 1);
    }

    #[test]
    fn boost_credit_moves_a_follow_up_ahead_but_not_unboundedly() {
        let vm = FakeHost::new().vm();
        ensure(&vm).unwrap();
        // Tenant 1 has already been served 20 000 tokens: its plain requests start late.
        charge_direct(&vm, 1, 20_000).unwrap();
        enqueue(&vm, ticket(1, 0, 100), 2, 0.0, 100)
            .unwrap()
            .unwrap();
        let mut boosted = ticket(2, 0, 100);
        boosted.boosted = true;
        enqueue(&vm, boosted, 1, 8_192.0, 100).unwrap().unwrap();
        assert_eq!(ids(&vm), vec![1, 2], "credit 8192 < backlog 20000: no jump");
        let mut boosted = ticket(3, 0, 100);
        boosted.boosted = true;
        enqueue(&vm, boosted, 3, 8_192.0, 100).unwrap().unwrap();
        assert_eq!(ids(&vm)[0], 3, "a fresh tenant's follow-up goes first");
    }

    #[test]
    fn full_queue_refuses_and_removal_is_exactly_once() {
        let vm = FakeHost::new().vm();
        ensure(&vm).unwrap();
        enqueue(&vm, ticket(1, 0, 10), 1, 0.0, 1).unwrap().unwrap();
        assert!(matches!(
            enqueue(&vm, ticket(2, 0, 10), 1, 0.0, 1).unwrap(),
            Err(Refused::Full(_))
        ));
        // One that waits for other pods is not refused for it.
        let elsewhere = Ticket {
            reach: 2,
            ..ticket(3, 0, 10)
        };
        set_wants(&vm, 1, 0, 1).unwrap();
        enqueue(&vm, elsewhere, 1, 0.0, 1).unwrap().unwrap();
        assert!(matches!(
            enqueue(
                &vm,
                Ticket {
                    reach: 3,
                    ..ticket(4, 0, 10)
                },
                1,
                0.0,
                1
            )
            .unwrap(),
            Err(Refused::Full(_))
        ));
        assert!(remove(&vm, 1, Leave::Admitted(0)).unwrap());
        assert!(!remove(&vm, 1, Leave::Admitted(0)).unwrap());
        assert!(remove(&vm, 3, Leave::NotAdmitted).unwrap());
        assert!(read(&vm).unwrap().tickets.is_empty());
    }

    #[test]
    fn a_full_line_takes_a_request_of_higher_precedence_in_place_of_its_last() {
        let vm = FakeHost::new().vm();
        ensure(&vm).unwrap();
        let join = |t: Ticket| enqueue(&vm, t, 1, 0.0, 2).unwrap();
        let displaced = |j: Result<Joined, Refused>| j.map(|j| j.displaced.map(|d| d.id));
        assert_eq!(displaced(join(ticket(1, 0, 10))), Ok(None));
        assert_eq!(displaced(join(ticket(2, 0, 10))), Ok(None));
        // A critical request is not refused because standard ones fill the line: the last of
        // them, the one served last, gives it its place.
        assert_eq!(displaced(join(ticket(3, 10, 10))), Ok(Some(2)));
        assert_eq!(ids(&vm), vec![3, 1]);
        // One that would be served after all of them is refused, as before.
        assert!(matches!(join(ticket(4, 0, 10)), Err(Refused::Full(_))));
        assert_eq!(displaced(join(ticket(5, 10, 10))), Ok(Some(1)));
        assert!(matches!(join(ticket(6, 10, 10)), Err(Refused::Full(_))));
        assert_eq!(ids(&vm), vec![3, 5]);
        // A request for other pods displaces nobody there: it is not refused to begin with.
        let elsewhere = |id| Ticket {
            reach: 2,
            ..ticket(id, 0, 10)
        };
        set_wants(&vm, 3, 0, 1).unwrap();
        set_wants(&vm, 5, 0, 1).unwrap();
        assert_eq!(displaced(join(elsewhere(7))), Ok(None));
        assert_eq!(ids(&vm), vec![3, 5, 7]);
    }

    #[test]
    fn abandoned_tickets_of_dead_vms_are_dropped() {
        let host = FakeHost::new();
        let vm = host.vm();
        ensure(&vm).unwrap();
        let mut t = ticket(1, 0, 10);
        t.deadline_ms = 100;
        enqueue(&vm, t, 1, 0.0, 10).unwrap().unwrap();
        host.set_now_ms(100 + ABANDONED_MS);
        assert!(
            read(&vm).unwrap().tickets.is_empty(),
            "not seen once abandoned"
        );
        enqueue(&vm, ticket(2, 0, 10), 1, 0.0, 10).unwrap().unwrap();
        assert_eq!(ids(&vm), vec![2]);
    }

    #[test]
    fn each_of_up_to_64_pods_has_a_bit_of_its_own_whatever_the_order() {
        // Pod addresses as a cluster's would be; by their names' hashes alone, some pod of the
        // first 16 shared a bit with one of the next 16 in 98 % of such pools.
        let mut seed = 7u64;
        let pods: Vec<String> = (0..70)
            .map(|_| {
                seed = crate::hash::fnv1a(&seed.to_le_bytes());
                format!("10.244.{}.{}:8000", seed % 256, (seed >> 8) % 253 + 2)
            })
            .collect();
        let bits = pod_bits(&pods[..64]);
        assert_eq!(
            bits.iter().fold(0, |all, b| all | b),
            u64::MAX,
            "64 bits, one each"
        );
        let mut reversed = pods[..64].to_vec();
        reversed.reverse();
        let mut back = pod_bits(&reversed);
        back.reverse();
        assert_eq!(back, bits, "the set decides, not its order");
        // A pod leaving moves only pods that tried the bits it took.
        let without: Vec<String> = pods[1..32].to_vec();
        let after = pod_bits(&without);
        let moved = after
            .iter()
            .zip(&pod_bits(&pods[..32])[1..])
            .filter(|(a, b)| a != b)
            .count();
        assert!(moved <= 4, "{moved} of 31 moved");
        // Past 64, the rest share bits, each still one bit.
        let all = pod_bits(&pods);
        assert!(all.iter().all(|b| b.count_ones() == 1));
        assert_eq!(all.iter().fold(0, |a, b| a | b), u64::MAX);
    }

    #[test]
    fn record_round_trips_and_garbage_reads_empty() {
        let mut q = QueueRecord {
            virtual_time: 3.5,
            tenants: vec![(1, 4.0)],
            tickets: vec![ticket(9, -2, 5)],
            passes: vec![(9, 2)],
            drains: vec![
                Drain {
                    reach: 1 << 5,
                    from_ms: 77,
                    drained: 5,
                    sizes: Sizes {
                        n: 40.0,
                        c: 4e4,
                        cc: 5e7,
                        w: 8e3,
                        cw: 9e6,
                    },
                    appointed_ms: 4_321,
                },
                Drain {
                    reach: 3,
                    from_ms: 0,
                    drained: 0,
                    sizes: Sizes::default(),
                    appointed_ms: 99,
                },
            ],
        };
        q.tickets[0].boosted = true;
        q.tickets[0].wants = pod_key("10.0.0.1:8000");
        q.tickets[0].reach = 1 << 5;
        q.tickets[0].need = 1_234;
        assert_eq!(QueueRecord::decode(&q.encode()), Some(q.clone()));
        assert_eq!(QueueRecord::decode(b"xx"), None);
        // A record from before the drains' sizes (nothing after the drains) reads them as none.
        let full = q.encode();
        let before_sizes = QueueRecord::decode(&full[..full.len() - 4 - 2 * 40]).unwrap();
        assert_eq!(before_sizes.drains[0].sizes, Sizes::default());
        assert_eq!(before_sizes.drains[0].drained, 5);
        assert_eq!(before_sizes.tickets, q.tickets);
        let full = &full[..full.len() - 4 - 2 * 40];
        // A record from before drains per set of pods (one drain for the whole line after the
        // needs, nothing after it) reads as a line not yet measured, as does one from before
        // the drain (nothing after the needs); one from before needs (nothing after the passes
        // of every head) with no needs; one from before reaches (nothing after the wants) with
        // every ticket reaching everywhere and the first ticket's passes; one from before the
        // pods tickets wait for (nothing after the passes) with no wants either; one from before
        // backfills (nothing after the tickets) with no passes.
        let whole_line = &full[..full.len() - 4 - 2 * 32];
        let mut legacy = whole_line.to_vec();
        legacy[whole_line.len() - 24..].copy_from_slice(&[7; 24]);
        let before_sets = QueueRecord::decode(&legacy).unwrap();
        assert_eq!(before_sets.drains, vec![]);
        assert_eq!(before_sets.tickets, q.tickets);
        let bytes = &whole_line[..whole_line.len() - 24];
        let before_drain = QueueRecord::decode(bytes).unwrap();
        assert_eq!(before_drain.drains, vec![]);
        assert_eq!(before_drain.tickets, q.tickets);
        let before_need = QueueRecord::decode(&bytes[..bytes.len() - 12]).unwrap();
        assert_eq!(before_need.tickets[0].need, 0);
        assert_eq!(before_need.tickets[0].reach, q.tickets[0].reach);
        let before_reach = QueueRecord::decode(&bytes[..bytes.len() - 40]).unwrap();
        assert_eq!(before_reach.passes, vec![(9, 2)]);
        assert_eq!(before_reach.tickets[0].wants, q.tickets[0].wants);
        assert_eq!(before_reach.tickets[0].reach, ANYWHERE);
        let before_wants = QueueRecord::decode(&bytes[..bytes.len() - 52]).unwrap();
        assert_eq!(before_wants.passes, vec![(9, 2)]);
        assert_eq!(before_wants.tickets[0].wants, 0);
        let older = QueueRecord::decode(&bytes[..bytes.len() - 64]).unwrap();
        assert_eq!(older.passes, vec![]);
        assert_eq!(older.tickets, before_wants.tickets);
    }

    /// How fast the line drains is measured as its admissions over a span that starts at the
    /// first, covers the last 32 to 64 and ends now, forgotten when the line empties, and read
    /// as the time the tickets waiting for the same pods take to leave.
    #[test]
    fn the_line_measures_how_fast_it_drains() {
        let host = FakeHost::new();
        let vm = host.vm();
        ensure(&vm).unwrap();
        let (a, b) = (1 << 0, 1 << 1);
        let on = |id, reach| arriving(&host, id, reach);
        host.advance_ms(1_000);
        for id in 1..=6 {
            enqueue(&vm, on(id, a), 1, 0.0, 1_000).unwrap().unwrap();
        }
        enqueue(&vm, on(7, b), 1, 0.0, 1_000).unwrap().unwrap();
        // Nothing admitted in 300 ms: a gap of at least that.
        host.advance_ms(300);
        let q = read(&vm).unwrap();
        assert_eq!(q.drain_ms(a, host.now_ms()), Some(6 * 300));
        assert_eq!(
            q.drain_ms(b, host.now_ms()),
            Some(300),
            "another model's pods: its own line"
        );
        assert_eq!(q.drain_ms(a | b, host.now_ms()), Some(7 * 300));
        // One admitted, then two at once (one release) 100 ms later, then a pause: the mean
        // over the span from the first, the pause included.
        assert!(remove(&vm, 1, Leave::Admitted(a)).unwrap());
        host.advance_ms(100);
        assert!(remove(&vm, 2, Leave::Admitted(a)).unwrap());
        assert!(
            remove(&vm, 3, Leave::NotAdmitted).unwrap(),
            "not an admission"
        );
        assert!(remove(&vm, 4, Leave::Admitted(a)).unwrap());
        assert_eq!(read(&vm).unwrap().drain_ms(a, host.now_ms()), Some(2 * 50));
        host.advance_ms(300);
        assert_eq!(read(&vm).unwrap().drain_ms(a, host.now_ms()), Some(2 * 200));
        // The span keeps the last 32 to 64 admissions: a line that drains faster is seen so.
        for id in 100..164 {
            enqueue(&vm, on(id, a), 1, 0.0, 1_000).unwrap().unwrap();
            host.advance_ms(10);
            assert!(remove(&vm, id, Leave::Admitted(a)).unwrap());
        }
        let q = read(&vm).unwrap();
        assert!((32..64).contains(&q.drains[0].drained), "{:?}", q.drains);
        let gap = q.drain_ms(a, host.now_ms()).unwrap() / 3;
        assert!((10..=20).contains(&gap), "{gap} ms");
        // Another model's pods drain at their own pace: nothing of theirs admitted yet.
        let since = host.now_ms() - 1_000;
        assert_eq!(read(&vm).unwrap().drain_ms(b, host.now_ms()), Some(since));
        // Once nobody waits for those pods, the idle time that follows is no gap.
        for id in [5, 6] {
            assert!(remove(&vm, id, Leave::Admitted(a)).unwrap());
        }
        let q = read(&vm).unwrap();
        assert_eq!(q.drains, vec![], "forgotten");
        assert_eq!(q.drain_ms(a, host.now_ms()), None, "nobody waits");
        assert!(remove(&vm, 7, Leave::Admitted(b)).unwrap());
        host.advance_ms(60_000);
        enqueue(&vm, on(8, a), 1, 0.0, 1_000).unwrap().unwrap();
        enqueue(&vm, on(9, a), 1, 0.0, 1_000).unwrap().unwrap();
        host.advance_ms(40);
        assert!(remove(&vm, 8, Leave::Admitted(a)).unwrap());
        host.advance_ms(30);
        assert_eq!(read(&vm).unwrap().drain_ms(a, host.now_ms()), Some(30));
    }

    /// A request is late when the tickets ahead of it for its pods would keep it past its
    /// deadline at the pace the line drains: not while that pace rests on fewer than
    /// `DRAIN_WINDOW` admissions, nor when it goes ahead of them (a higher band) or waits for
    /// other pods; a line that stops draining makes it late sooner.
    #[test]
    fn a_request_the_line_would_keep_past_its_deadline_is_late() {
        let host = FakeHost::new();
        let vm = host.vm();
        ensure(&vm).unwrap();
        let (a, b) = (1 << 0, 1 << 1);
        host.advance_ms(1_000);
        // One admission every 100 ms, a ticket always waiting (tenant 1's).
        enqueue(&vm, arriving(&host, 1, a), 1, 0.0, 1_000)
            .unwrap()
            .unwrap();
        let mut next = 2;
        let mut admit = |vm: &dyn Store, n: u64| {
            for _ in 0..n {
                enqueue(vm, arriving(&host, next, a), 1, 0.0, 1_000)
                    .unwrap()
                    .unwrap();
                host.advance_ms(100);
                assert!(remove(vm, next - 1, Leave::Admitted(a)).unwrap());
                next += 1;
            }
        };
        // The first admission starts the span: 31 counted.
        admit(&vm, DRAIN_WINDOW);
        for id in 1_000..1_020 {
            enqueue(&vm, arriving(&host, id, a), 1, 0.0, 1_000)
                .unwrap()
                .unwrap();
        }
        // Tenant 1's next, behind its 21 tickets for its pods, with a second to wait.
        let joining = |q: &QueueRecord, priority: i32, reach: u64| Ticket {
            priority,
            start_tag: q.start_tag(1, 0.0),
            deadline_ms: host.now_ms() + 1_000,
            ..arriving(&host, 9_999, reach)
        };
        let now = host.now_ms();
        let q = read(&vm).unwrap();
        assert!(!q.late(&joining(&q, 0, a), now), "a pace of 31: not judged");
        admit(&vm, 1);
        let now = host.now_ms();
        let q = read(&vm).unwrap();
        // 32 admissions over 3.1 s: 21 ahead take about 2 s, more than three quarters of 1 s.
        assert!(q.late(&joining(&q, 0, a), now));
        assert!(!q.late(&joining(&q, 5, a), now), "a higher band goes first");
        let quiet = Ticket {
            start_tag: q.start_tag(2, 0.0),
            ..joining(&q, 0, a)
        };
        assert!(!q.late(&quiet, now), "another tenant's turn comes first");
        assert!(!q.late(&joining(&q, 0, b), now), "other pods: none ahead");
        assert!(q.late(&joining(&q, 0, a | b), now), "may take either");
        // With 4 s to wait it is served in time; after a pause of 3 s it is not.
        let patient = |q: &QueueRecord| Ticket {
            deadline_ms: host.now_ms() + 4_000,
            ..joining(q, 0, a)
        };
        assert!(!q.late(&patient(&q), now));
        host.advance_ms(3_000);
        let q = read(&vm).unwrap();
        assert!(q.late(&patient(&q), host.now_ms()));
    }

    /// A large request waits longer than the count ahead of it says: at the head, for one pod
    /// to free its whole cost while smaller ones take what is freed before. The line learns how
    /// much longer from the waits of the tickets that left it, against their costs, those that
    /// ran out included; a small one is judged to wait less. Not judged without those waits.
    #[test]
    fn a_large_request_is_late_sooner_than_a_small_one() {
        let host = FakeHost::new();
        let vm = host.vm();
        ensure(&vm).unwrap();
        let pods = 0b11;
        host.advance_ms(1_000);
        let of = |id, cost| Ticket {
            cost,
            ..arriving(&host, id, pods)
        };
        // One always waiting; pairs of 500 and 1,500 tokens arriving together, the small one
        // admitted after 100 ms, the large one 100 ms later: 0.1 ms a token more.
        enqueue(&vm, of(1, 1_000), 1, 0.0, 1_000).unwrap().unwrap();
        for pair in 0..40 {
            let (small, large) = (10 + 2 * pair, 11 + 2 * pair);
            enqueue(&vm, of(small, 500), 1, 0.0, 1_000)
                .unwrap()
                .unwrap();
            enqueue(&vm, of(large, 1_500), 1, 0.0, 1_000)
                .unwrap()
                .unwrap();
            for id in [small, large] {
                host.advance_ms(100);
                assert!(remove(&vm, id, Leave::Admitted(1)).unwrap());
            }
        }
        let now = host.now_ms();
        let q = read(&vm).unwrap();
        // One ahead: 100 ms at a gap of 100 ms; its size adds 0.1 ms a token past the mean.
        let joining = |cost, wait| Ticket {
            start_tag: q.start_tag(1, 0.0),
            deadline_ms: now + wait,
            ..of(9_999, cost)
        };
        assert!(!q.late(&joining(1_000, 350), now));
        assert!(q.late(&joining(3_000, 350), now), "300 ms of 262");
        assert!(!q.late(&joining(2_500, 350), now), "250 ms");
        assert!(q.late(&joining(1_000, 120), now), "100 ms of 90");
        assert!(!q.late(&joining(200, 120), now), "20 ms");
        // A line whose drains hold no waits (an older module wrote it) judges the count alone.
        let mut older = q.clone();
        older.drains[0].sizes = Sizes::default();
        assert!(!older.late(&joining(3_000, 350), now));
        assert!(older.late(&joining(200, 120), now));
        // A ticket that runs out counts its wait; one that leaves before, not.
        let n = q.drains[0].sizes.n;
        enqueue(
            &vm,
            Ticket {
                deadline_ms: now + 50,
                ..of(500, 9_000)
            },
            1,
            0.0,
            1_000,
        )
        .unwrap()
        .unwrap();
        enqueue(&vm, of(501, 9_000), 1, 0.0, 1_000)
            .unwrap()
            .unwrap();
        host.advance_ms(50);
        assert!(remove(&vm, 500, Leave::NotAdmitted).unwrap());
        assert!(remove(&vm, 501, Leave::NotAdmitted).unwrap());
        assert_eq!(read(&vm).unwrap().drains[0].sizes.n, n + 1.0);
    }

    /// Two models on pods of their own, one answering ten times longer: each line is told its
    /// own pace, a request that may take either pods both, and refusals are spaced per set.
    /// Before (one drain for the whole line), the slow model's refusals were told the mixed
    /// pace, about a tenth of its own.
    #[test]
    fn each_set_of_pods_drains_at_its_own_pace() {
        let host = FakeHost::new();
        let vm = host.vm();
        ensure(&vm).unwrap();
        let (slow, quick) = (1 << 0, 1 << 1);
        let on = |id, reach| arriving(&host, id, reach);
        host.advance_ms(1_000);
        for id in 1..=4 {
            enqueue(&vm, on(id, slow), 1, 0.0, 4).unwrap().unwrap();
            enqueue(&vm, on(100 + id, quick), 1, 0.0, 4)
                .unwrap()
                .unwrap();
        }
        // One second: 1 slow admission a second, 10 quick ones, each replaced as it leaves.
        let mut next = 200;
        for tick in 0..=10 {
            if tick > 0 {
                host.advance_ms(100);
            }
            let head = read(&vm)
                .unwrap()
                .tickets
                .iter()
                .find(|t| t.reach == quick)
                .map(|t| t.id)
                .unwrap();
            assert!(remove(&vm, head, Leave::Admitted(quick)).unwrap());
            enqueue(&vm, on(next, quick), 1, 0.0, 4).unwrap().unwrap();
            next += 1;
            if tick % 10 == 0 {
                assert!(remove(&vm, tick / 10 + 1, Leave::Admitted(slow)).unwrap());
                enqueue(&vm, on(next, slow), 1, 0.0, 4).unwrap().unwrap();
                next += 1;
            }
        }
        let (q, now) = (read(&vm).unwrap(), host.now_ms());
        assert_eq!(q.drain_ms(slow, now), Some(4 * 1_000));
        assert_eq!(q.drain_ms(quick, now), Some(4 * 100));
        // Waiting for either set: eight tickets, each admission of either a place freed.
        assert_eq!(q.drain_ms(slow | quick, now), Some(8 * 1_000 / 11));
        // Refused together, each set's requests come back one of its own gaps apart.
        let back = |reach| match enqueue(&vm, on(next, reach), 1, 0.0, 4).unwrap() {
            Err(Refused::Full(Some(at))) => at - now,
            joined => panic!("{joined:?}"),
        };
        assert_eq!([back(slow), back(slow)], [3_750, 4_500]);
        assert_eq!([back(quick), back(quick)], [375, 450]);
        assert_eq!(back(slow), 5_250, "its own turn, not after the quick ones");
        // Refusals for many more sets than are kept: the quietest sets' places are taken, the
        // ones still measuring keep theirs.
        for k in 2..64 {
            back(slow | 1 << k);
        }
        let q = read(&vm).unwrap();
        assert_eq!(q.drains.len(), MAX_DRAINS);
        for reach in [slow, quick] {
            assert!(q.drains.iter().any(|d| d.reach == reach && d.drained > 0));
        }
    }

    /// Requests refused for a full line are told to come back one admission apart, after the
    /// line has drained, never past the deadline they would have had in it; once those times
    /// have passed, a refusal starts from the line again.
    #[test]
    fn requests_refused_for_a_full_line_come_back_one_at_a_time() {
        let host = FakeHost::new();
        let vm = host.vm();
        ensure(&vm).unwrap();
        let on = |id| Ticket {
            enqueued_ms: host.now_ms(),
            deadline_ms: host.now_ms() + 5_000,
            ..ticket(id, 0, 10)
        };
        host.advance_ms(1_000);
        for id in 1..=3 {
            enqueue(&vm, on(id), 1, 0.0, 3).unwrap().unwrap();
        }
        host.advance_ms(100);
        assert!(remove(&vm, 1, Leave::Admitted(1)).unwrap());
        host.advance_ms(100);
        assert!(remove(&vm, 2, Leave::Admitted(1)).unwrap());
        enqueue(&vm, on(4), 1, 0.0, 3).unwrap().unwrap();
        enqueue(&vm, on(5), 1, 0.0, 3).unwrap().unwrap();
        // Three wait, and one was admitted 100 ms after another: the line drains in 300 ms.
        // Returns are aimed a quarter sooner: from 225 ms on, 75 ms apart.
        let now = host.now_ms();
        let back: Vec<u64> = (6..=9)
            .map(|id| match enqueue(&vm, on(id), 1, 0.0, 3).unwrap() {
                Err(Refused::Full(Some(at))) => at - now,
                joined => panic!("{joined:?}"),
            })
            .collect();
        assert_eq!(back, vec![300, 375, 450, 525]);
        // Never past the deadline a ticket would have had.
        let soon = Ticket {
            deadline_ms: now + 450,
            ..on(10)
        };
        assert_eq!(
            enqueue(&vm, soon, 1, 0.0, 3).unwrap(),
            Err(Refused::Full(Some(now + 450)))
        );
        // Past those times, the next refusal is placed after the line alone, which has not
        // drained since: one admission in the 1.1 s since the first.
        host.advance_ms(1_000);
        let now = host.now_ms();
        assert_eq!(
            enqueue(&vm, on(11), 1, 0.0, 3).unwrap(),
            Err(Refused::Full(Some(now + 3 * 825 + 825)))
        );
    }

    #[test]
    fn a_ticket_names_the_pod_it_waits_for_until_it_leaves() {
        let host = FakeHost::new();
        let vm = host.vm();
        ensure(&vm).unwrap();
        enqueue(&vm, ticket(1, 0, 10), 1, 0.0, 10).unwrap().unwrap();
        enqueue(&vm, ticket(2, 0, 10), 2, 0.0, 10).unwrap().unwrap();
        let a = pod_key("10.0.0.1:8000");
        assert_ne!(a, pod_key("10.0.0.2:8000"));
        set_wants(&vm, 2, a, 6).unwrap();
        let wants = |vm: &dyn Store| -> Vec<(u64, u64, u64)> {
            read(vm)
                .unwrap()
                .tickets
                .iter()
                .map(|t| (t.id, t.wants, t.reach))
                .collect()
        };
        assert_eq!(wants(&vm), vec![(1, 0, ANYWHERE), (2, a, 6)]);
        // Line order and the other tickets are untouched; a ticket gone is not brought back.
        remove(&vm, 2, Leave::Admitted(0)).unwrap();
        set_wants(&vm, 2, a, 6).unwrap();
        assert_eq!(wants(&vm), vec![(1, 0, ANYWHERE)]);
    }

    #[test]
    fn a_backfill_counts_a_pass_against_the_head_and_keeps_the_virtual_time_behind_it() {
        let host = FakeHost::new();
        let vm = host.vm();
        // Three tenants, so their tags are 0, 0 and 0 then 100 behind: the head is 1.
        enqueue(&vm, ticket(1, 0, 100), 1, 0.0, 10)
            .unwrap()
            .unwrap();
        enqueue(&vm, ticket(2, 0, 100), 1, 0.0, 10)
            .unwrap()
            .unwrap();
        enqueue(&vm, ticket(3, 0, 100), 2, 0.0, 10)
            .unwrap()
            .unwrap();
        assert_eq!(ids(&vm), vec![1, 3, 2]);
        assert!(
            remove(&vm, 2, Leave::Admitted(0)).unwrap(),
            "2 backfills past 1 (and 3)"
        );
        let q = read(&vm).unwrap();
        assert_eq!(q.passes(1), 1);
        assert_eq!(
            q.virtual_time, 0.0,
            "the tag of the waiting head (0), not the backfill's (100)"
        );
        assert!(remove(&vm, 3, Leave::Admitted(0)).unwrap());
        assert_eq!(read(&vm).unwrap().passes(1), 2);
        assert!(
            remove(&vm, 1, Leave::NotAdmitted).unwrap(),
            "the head leaves"
        );
        assert_eq!(read(&vm).unwrap().passes, vec![], "and its passes with it");
    }

    /// Tickets of `reach`es, one tenant each (so in arrival order), `ids` 1, 2, …
    fn line_of(vm: &dyn Store, reaches: &[u64]) {
        for (i, &reach) in reaches.iter().enumerate() {
            let t = Ticket {
                reach,
                ..ticket(i as u64 + 1, 0, 100)
            };
            enqueue(vm, t, i as u64, 0.0, 10).unwrap().unwrap();
        }
    }

    #[test]
    fn tickets_that_share_no_pod_head_lines_of_their_own() {
        let vm = FakeHost::new().vm();
        // Two models on pods of their own (bits 1 and 2), one on both (3), one unknown.
        line_of(&vm, &[1, 2, 1, 2, 3, 1, ANYWHERE]);
        let q = read(&vm).unwrap();
        let heads: Vec<Vec<usize>> = (0..7).map(|i| q.heads_of(i)).collect();
        assert!(q.heads_of(7).is_empty());
        assert_eq!(heads[..4], [vec![0], vec![1], vec![0], vec![1]]);
        assert_eq!(
            heads[4..],
            [vec![0, 1], vec![0, 1], vec![0, 1]],
            "3 joins them"
        );
        let leaders: Vec<(u64, u64)> = q.leaders().iter().map(|(t, f)| (t.id, *f)).collect();
        assert_eq!(
            leaders,
            vec![(1, 1), (2, 2), (7, !3)],
            "7 may go anywhere: it heads the line on the pods nobody ahead of it may take"
        );
        // A newcomer heads a line of its own when nobody ahead of it may take its pods.
        let last = |reach| Ticket {
            reach,
            start_tag: 1e9,
            ..ticket(99, 0, 1)
        };
        assert_eq!(q.free_for(&last(4)), 0, "behind 7, which may go anywhere");
        let vm = FakeHost::new().vm();
        line_of(&vm, &[1, 2, 2]);
        let q = read(&vm).unwrap();
        assert_eq!(q.free_for(&last(4)), 4, "a third model's pods");
        assert_eq!(q.free_for(&last(2)), 0, "behind 2 and 3");
        assert_eq!(q.free_for(&last(ANYWHERE)), !3);
    }

    #[test]
    fn a_ticket_heads_the_line_on_the_pods_no_ticket_ahead_of_it_may_take() {
        let vm = FakeHost::new().vm();
        // An adapter on pods 1 (bit 1) waits; its base model, on pods 1 and 2 (3), waits behind
        // it; so does an adapter on pod 2 (2), behind the base model's ticket.
        line_of(&vm, &[1, 3, 2, 3]);
        let q = read(&vm).unwrap();
        assert_eq!(
            q.heads_of(1),
            vec![0],
            "the base model's ticket is joined to 1"
        );
        assert_eq!(
            q.heads_of(2),
            vec![0],
            "and the other adapter's, through it"
        );
        let leaders: Vec<(u64, u64)> = q.leaders().iter().map(|(t, f)| (t.id, *f)).collect();
        assert_eq!(leaders, vec![(1, 1), (2, 2)], "2 heads it on pod 2");
        assert_eq!(
            q.free_for(&Ticket {
                reach: 3,
                start_tag: 1e9,
                ..ticket(99, 0, 1)
            }),
            0
        );
        // Sent to pod 2, which 1 may not take: no pass against 1.
        assert!(remove(&vm, 2, Leave::Admitted(2)).unwrap());
        assert_eq!(read(&vm).unwrap().passes, vec![]);
        // 3 now heads a line of its own.
        assert_eq!(read(&vm).unwrap().heads_of(1), vec![1]);
        assert!(remove(&vm, 3, Leave::Admitted(2)).unwrap());
        assert_eq!(read(&vm).unwrap().passes, vec![]);
        // 4, sent to pod 1, goes past 1 where 1 waits: a pass.
        assert!(remove(&vm, 4, Leave::Admitted(1)).unwrap());
        assert_eq!(read(&vm).unwrap().passes, vec![(1, 1)]);
    }

    #[test]
    fn a_request_sent_past_waiting_tickets_leaves_the_virtual_time_behind_them() {
        let vm = FakeHost::new().vm();
        // Tenant 1 has been sent much; one ticket of tenant 2 waits for pods 1.
        charge_direct(&vm, 1, 5_000).unwrap();
        line_of(&vm, &[1]);
        let waiting = read(&vm).unwrap().tickets[0].start_tag;
        // Tenant 1 goes straight to pods 2 twice: its tags are far ahead of the waiting one's.
        charge_direct(&vm, 1, 100).unwrap();
        charge_direct(&vm, 1, 100).unwrap();
        let q = read(&vm).unwrap();
        assert!(q.virtual_time <= waiting, "{} > {waiting}", q.virtual_time);
        assert_eq!(
            q.start_tag(3, 0.0),
            q.virtual_time,
            "a new tenant starts with it"
        );
    }

    #[test]
    fn a_backfill_that_shares_pods_with_two_heads_passes_both() {
        let vm = FakeHost::new().vm();
        line_of(&vm, &[1, 2, 3]);
        assert!(remove(&vm, 3, Leave::Admitted(0)).unwrap());
        assert_eq!(read(&vm).unwrap().passes, vec![(1, 1), (2, 1)]);
    }

    #[test]
    fn a_pass_counts_against_the_backfills_own_heads_only() {
        let vm = FakeHost::new().vm();
        line_of(&vm, &[1, 2, 1, 2]);
        assert!(
            remove(&vm, 3, Leave::Admitted(0)).unwrap(),
            "3 backfills past 1"
        );
        assert!(
            remove(&vm, 2, Leave::Admitted(0)).unwrap(),
            "2 heads a line of its own: no pass"
        );
        let q = read(&vm).unwrap();
        assert_eq!(q.passes, vec![(1, 1)]);
        assert_eq!(
            (q.heads_of(0), q.heads_of(1)),
            (vec![0], vec![1]),
            "4 heads a line of its own now"
        );
        assert_eq!(
            q.virtual_time, 0.0,
            "the virtual time stays behind the first ticket's tag"
        );
    }
}
