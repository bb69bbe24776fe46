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
//! Bound (docs/design.md): within a band, a ticket with start tag S is admitted after at most
//! the tickets with smaller tags, plus at most `backfillPasses` backfills (a few more when
//! workers race for the last pass: one per worker) while it is the head; a ticket arriving later
//! has a tag of at least V − credit, and V never passes S while S waits (a backfill moves V no
//! further than the head's tag), so what can overtake it is bounded by the tenants' backlogs
//! ahead of S, one boost credit and the backfills — however large the ticket's own cost.

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
}

/// How a ticket names the pod it waits for: never 0, which names none.
pub fn pod_key(pod: &str) -> u64 {
    crate::hash::fnv1a(pod.as_bytes()).max(1)
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
    /// Tickets admitted past the head (`(head id, how many)`), for the backfill bound. Written
    /// after the tickets, so a record without it (an older module's) reads as no passes, and an
    /// older module reading this one ignores it.
    pub passes: (u64, u32),
}

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
        w.u64(self.passes.0).u32(self.passes.1);
        // After the passes, for the same reason: a module that predates it reads none.
        w.u32(self.tickets.len() as u32);
        for t in &self.tickets {
            w.u64(t.wants);
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
            })
        })?;
        let passes = if r.is_empty() {
            (0, 0)
        } else {
            (r.u64()?, r.u32()?)
        };
        if !r.is_empty() {
            let wants = r.list(8, Reader::u64)?;
            if wants.len() == tickets.len() {
                for (t, w) in tickets.iter_mut().zip(wants) {
                    t.wants = w;
                }
            }
        }
        Some(QueueRecord {
            virtual_time,
            tenants,
            tickets,
            passes,
        })
    }

    /// Tickets admitted past the current head so far.
    pub fn head_passes(&self) -> u32 {
        match self.tickets.first() {
            Some(head) if head.id == self.passes.0 => self.passes.1,
            _ => 0,
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

    /// Whether a request with this key would be first in line.
    pub fn would_lead(&self, candidate: &Ticket) -> bool {
        self.tickets
            .first()
            .is_none_or(|head| order(candidate, head) == Ordering::Less)
    }
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
    Full,
}

/// Joins the line; the ticket's start tag is assigned here (start-time fair queuing).
pub fn enqueue(
    store: &dyn Store,
    mut ticket: Ticket,
    tenant: u64,
    boost_credit: f64,
    max_len: usize,
) -> Result<Result<Ticket, Refused>, StoreError> {
    let out = modify(store, |q| {
        if q.tickets.len() >= max_len {
            return Some(Err(Refused::Full));
        }
        let start = q.virtual_time.max(q.tenant_finish(tenant));
        ticket.start_tag = start - if ticket.boosted { boost_credit } else { 0.0 };
        q.charge(tenant, start, ticket.cost);
        let at = q
            .tickets
            .partition_point(|t| order(t, &ticket) == Ordering::Less);
        q.tickets.insert(at, ticket);
        Some(Ok(ticket))
    })?;
    Ok(out.unwrap_or(Err(Refused::Full)))
}

/// Leaves the line (admitted, timed out or gone), exactly once: true the first time. An admitted
/// ticket advances the virtual time to its start tag; one admitted from behind the head (a
/// backfill) counts a pass against the head and advances it no further than the head's tag.
pub fn remove(store: &dyn Store, id: u64, admitted: bool) -> Result<bool, StoreError> {
    Ok(modify(store, |q| {
        let i = q.tickets.iter().position(|t| t.id == id)?;
        let passed = q.head_passes();
        let t = q.tickets.remove(i);
        if admitted {
            let mut tag = t.start_tag;
            if let Some(head) = q.tickets.first().filter(|_| i > 0) {
                tag = tag.min(head.start_tag);
                q.passes = (head.id, passed.saturating_add(1));
            }
            q.virtual_time = q.virtual_time.max(tag);
        }
        Some(())
    })?
    .is_some())
}

/// A waiting ticket now waits for room on the pod `wants` names (`pod_key`; 0: on any), when it
/// is still in the line and waited elsewhere before.
pub fn set_wants(store: &dyn Store, id: u64, wants: u64) -> Result<(), StoreError> {
    modify(store, |q| {
        let t = q
            .tickets
            .iter_mut()
            .find(|t| t.id == id && t.wants != wants)?;
        t.wants = wants;
        Some(())
    })
    .map(|_| ())
}

/// A request admitted without waiting still pays its tenant's share, so a tenant that had the
/// pool to itself does not arrive at the next contention with a clean slate.
pub fn charge_direct(store: &dyn Store, tenant: u64, cost: u64) -> Result<(), StoreError> {
    modify(store, |q| {
        let start = q.virtual_time.max(q.tenant_finish(tenant));
        q.charge(tenant, start, cost);
        q.virtual_time = q.virtual_time.max(start);
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
        assert_eq!(
            enqueue(&vm, ticket(2, 0, 10), 1, 0.0, 1).unwrap(),
            Err(Refused::Full)
        );
        assert!(remove(&vm, 1, true).unwrap());
        assert!(!remove(&vm, 1, true).unwrap());
        assert!(read(&vm).unwrap().tickets.is_empty());
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
    fn record_round_trips_and_garbage_reads_empty() {
        let mut q = QueueRecord {
            virtual_time: 3.5,
            tenants: vec![(1, 4.0)],
            tickets: vec![ticket(9, -2, 5)],
            passes: (9, 2),
        };
        q.tickets[0].boosted = true;
        q.tickets[0].wants = pod_key("10.0.0.1:8000");
        assert_eq!(QueueRecord::decode(&q.encode()), Some(q.clone()));
        assert_eq!(QueueRecord::decode(b"xx"), None);
        // A record from before the pods tickets wait for (nothing after the passes) reads with
        // none; one from before backfills (nothing after the tickets) with neither.
        let bytes = q.encode();
        let before_wants = QueueRecord::decode(&bytes[..bytes.len() - 12]).unwrap();
        assert_eq!(before_wants.passes, (9, 2));
        assert_eq!(before_wants.tickets[0].wants, 0);
        let older = QueueRecord::decode(&bytes[..bytes.len() - 24]).unwrap();
        assert_eq!(older.passes, (0, 0));
        assert_eq!(older.tickets, before_wants.tickets);
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
        set_wants(&vm, 2, a).unwrap();
        let wants = |vm: &dyn Store| -> Vec<(u64, u64)> {
            read(vm)
                .unwrap()
                .tickets
                .iter()
                .map(|t| (t.id, t.wants))
                .collect()
        };
        assert_eq!(wants(&vm), vec![(1, 0), (2, a)]);
        // Line order and the other tickets are untouched; a ticket gone is not brought back.
        remove(&vm, 2, true).unwrap();
        set_wants(&vm, 2, a).unwrap();
        assert_eq!(wants(&vm), vec![(1, 0)]);
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
        assert!(remove(&vm, 2, true).unwrap(), "2 backfills past 1 (and 3)");
        let q = read(&vm).unwrap();
        assert_eq!(q.head_passes(), 1);
        assert_eq!(
            q.virtual_time, 0.0,
            "the tag of the waiting head (0), not the backfill's (100)"
        );
        assert!(remove(&vm, 3, true).unwrap());
        assert_eq!(read(&vm).unwrap().head_passes(), 2);
        assert!(remove(&vm, 1, false).unwrap(), "the head leaves");
        assert_eq!(read(&vm).unwrap().head_passes(), 0, "a new head, none");
    }
}
