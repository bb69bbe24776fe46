//! The pick log: how a routing decision made on one Envoy worker reaches every other worker
//! within milliseconds. Each dispatch and finish (and what other gateway replicas placed,
//! `replicas::placements`, and, with replicas, each response an engine stored,
//! `routing::stored`) is appended to a ring of shared-data slots
//! (`kvgate.log.seq` and `kvgate.log.<0..RING>`: a bounded key schema); every VM replays what it
//! has not seen before it decides, so each keeps a full replica of the prefix index and of the
//! in-flight prompt blocks without reading per-block keys. A VM that falls more than a ring
//! behind skips ahead: the replicas it feeds are approximate by design, and nothing that must
//! return to zero (reservations, active-block counts) depends on this log.
//!
//! A slot holds one or more events of its origin: a finish waits (`finish`) and rides with the
//! VM's next dispatch, or goes out on the next tick (`flush`), so a request costs one append, not
//! two. An append is two host calls (the sequence's compare-and-swap on the value the poll before
//! it read, and the slot), three when another worker appended in between. The sequence key also
//! carries the slot last appended (unless it is large), so a poll one append behind (with a few
//! workers, the usual case) is one read: the head. Readers of an older module take a slot's first
//! event and skip the rest, and read a head's number from its first eight bytes, as before.

use crate::store::codec::{Reader, Writer};
use crate::store::interface::{create_if_missing, update_from, Store, StoreError, Versioned};

pub const RING: u64 = 512;
const SEQ_KEY: &str = "kvgate.log.seq";
/// A slot claimed but not yet written is waited for this long, then skipped (its writer died).
const STUCK_MS: u64 = 200;
/// Finishes held for the next append at most; one more appends them at once.
const MAX_HELD_FINISHES: usize = 32;
/// The most prompt blocks one event carries (longer prompts are indexed by their first blocks).
pub const MAX_EVENT_BLOCKS: usize = 4096;
/// The largest slot the head carries as well (a dispatch of a prompt of about 32 KB, 500 blocks):
/// a longer one would be copied out of shared data on every poll, new or not.
const HEAD_SLOT_BYTES: usize = 4096;

/// A request sent to a pod, with the prompt blocks it brings there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatch {
    pub pod: String,
    pub request: u64,
    /// The request's LoRA adapter (`models::served::adapter_id`), 0 for a base model.
    pub adapter: u64,
    pub hashes: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Dispatch(Dispatch),
    Finish {
        pod: String,
        request: u64,
    },
    /// Another gateway replica sent the pod a prompt with these blocks (`replicas::placements`):
    /// for the prefix index only, as no request of this replica's holds them.
    Placed {
        pod: String,
        hashes: Vec<u64>,
    },
    /// A response stored on the pod (`routing::stored`), for the other gateway replicas
    /// (`replicas::placements`): no VM of this replica's indexes it. Logged only while replicas
    /// share etcd; a module from before it passes over the slot that carries it.
    Stored {
        pod: String,
        /// The response id's hash (`stored::id_hash`).
        id: u64,
        /// The conversation's tokens so far.
        tokens: u64,
    },
}

const DISPATCH_WITHOUT_ADAPTER: u8 = 1;
const FINISH: u8 = 2;
const DISPATCH: u8 = 3;
const PLACED: u8 = 4;
const STORED: u8 = 5;

fn slot_key(seq: u64) -> String {
    format!("kvgate.log.{}", seq % RING)
}

fn encode<'a>(seq: u64, origin: u32, events: impl Iterator<Item = &'a Event>) -> Vec<u8> {
    let mut w = Writer::new();
    w.u64(seq).u32(origin);
    for event in events {
        match event {
            Event::Dispatch(d) => {
                // The hashes are most of a slot: room for them at once, not by doublings.
                w.0.reserve(29 + d.pod.len() + 8 * d.hashes.len());
                w.u8(DISPATCH)
                    .bytes(d.pod.as_bytes())
                    .u64(d.request)
                    .u64(d.adapter)
                    .u32(d.hashes.len() as u32);
                d.hashes.iter().for_each(|h| {
                    w.u64(*h);
                });
            }
            Event::Finish { pod, request } => {
                w.u8(FINISH).bytes(pod.as_bytes()).u64(*request);
            }
            Event::Placed { pod, hashes } => {
                w.0.reserve(9 + pod.len() + 8 * hashes.len());
                w.u8(PLACED).bytes(pod.as_bytes()).u32(hashes.len() as u32);
                hashes.iter().for_each(|h| {
                    w.u64(*h);
                });
            }
            Event::Stored { pod, id, tokens } => {
                w.u8(STORED).bytes(pod.as_bytes()).u64(*id).u64(*tokens);
            }
        }
    }
    w.0
}

/// A slot's sequence number, origin and events (at least one).
fn decode(bytes: &[u8]) -> Option<(u64, u32, Vec<Event>)> {
    let mut r = Reader(bytes);
    let seq = r.u64()?;
    let origin = r.u32()?;
    let mut events = vec![event(&mut r)?];
    while !r.0.is_empty() {
        events.push(event(&mut r)?);
    }
    Some((seq, origin, events))
}

fn event(r: &mut Reader) -> Option<Event> {
    let kind = r.u8()?;
    let pod = String::from_utf8(r.bytes()?.to_vec()).ok()?;
    if kind == PLACED {
        let hashes = r.list(8, Reader::u64)?;
        return Some(Event::Placed { pod, hashes });
    }
    let request = r.u64()?;
    Some(match kind {
        // A dispatch logged by a module from before adapters (during a reload) had none.
        DISPATCH_WITHOUT_ADAPTER | DISPATCH => {
            let adapter = if kind == DISPATCH { r.u64()? } else { 0 };
            let hashes = r.list(8, Reader::u64)?;
            Event::Dispatch(Dispatch {
                pod,
                request,
                adapter,
                hashes,
            })
        }
        FINISH => Event::Finish { pod, request },
        STORED => Event::Stored {
            pod,
            id: request,
            tokens: r.u64()?,
        },
        _ => return None,
    })
}

/// The log's head: the sequence number the next append claims.
fn seq_of(value: Option<&[u8]>) -> u64 {
    value.and_then(|b| Reader(b).u64()).unwrap_or(0)
}

/// One VM's position in the log.
#[derive(Debug, Default)]
pub struct PickLog {
    next: u64,
    stuck_since: Option<u64>,
    /// This VM's finishes not yet appended.
    held: Vec<Event>,
    /// The sequence key as the last poll read it, for the next append's first compare-and-swap:
    /// every append follows a poll in the same callback (the router syncs before it routes,
    /// finishes or flushes), so the append mostly needs no read of its own.
    seen: Option<Versioned>,
}

impl PickLog {
    /// Creates the sequence key (before traffic, see `interface::update`) and starts one ring behind
    /// the head, so a VM that starts or reloads inherits the recent picks of the others.
    pub fn start(store: &dyn Store) -> Result<PickLog, StoreError> {
        create_if_missing(store, SEQ_KEY, &0u64.to_le_bytes())?;
        let head = seq_of(store.get(SEQ_KEY)?.value.as_deref());
        Ok(PickLog {
            next: head.saturating_sub(RING),
            ..PickLog::default()
        })
    }

    /// Appends an event, with the finishes held so far; the caller has already applied it to its
    /// own replica.
    pub fn publish(
        &mut self,
        store: &dyn Store,
        origin: u32,
        event: &Event,
    ) -> Result<(), StoreError> {
        self.publish_all(store, origin, std::slice::from_ref(event))
    }

    /// Appends events in one slot, with the finishes held so far.
    pub fn publish_all(
        &mut self,
        store: &dyn Store,
        origin: u32,
        events: &[Event],
    ) -> Result<(), StoreError> {
        let held = std::mem::take(&mut self.held);
        self.append(store, origin, held.iter().chain(events))
    }

    /// Holds a finish for the next append (appends at once when many are held).
    pub fn finish(
        &mut self,
        store: &dyn Store,
        origin: u32,
        event: Event,
    ) -> Result<(), StoreError> {
        self.held.push(event);
        if self.held.len() < MAX_HELD_FINISHES {
            return Ok(());
        }
        self.flush(store, origin)
    }

    /// Appends the finishes held, if any (on the tick: when no dispatch carried them meanwhile).
    pub fn flush(&mut self, store: &dyn Store, origin: u32) -> Result<(), StoreError> {
        if self.held.is_empty() {
            return Ok(());
        }
        let held = std::mem::take(&mut self.held);
        self.append(store, origin, held.iter())
    }

    fn append<'a>(
        &mut self,
        store: &dyn Store,
        origin: u32,
        events: impl Iterator<Item = &'a Event>,
    ) -> Result<(), StoreError> {
        let events: Vec<&Event> = events.collect();
        // The head also carries the slot it claims: a VM one append behind (the usual case with
        // a few workers) replays it from the head it reads anyway, without reading the slot. Not
        // a large slot: every poll reads the head, also when it has nothing new.
        let claimed = update_from(store, SEQ_KEY, self.seen.take(), |cur| {
            let n = seq_of(cur);
            let slot = encode(n, origin, events.iter().copied());
            let carried = if slot.len() <= HEAD_SLOT_BYTES {
                &slot[..]
            } else {
                &[]
            };
            let mut head = Vec::with_capacity(8 + carried.len());
            head.extend_from_slice(&(n + 1).to_le_bytes());
            head.extend_from_slice(carried);
            Some((head, (n, slot)))
        })?;
        let Some((seq, slot)) = claimed else {
            return Ok(());
        };
        store.set(&slot_key(seq), &slot, None)?;
        // Nothing to replay in our own slot: when it is the next one, the poll need not read it.
        if self.next == seq {
            self.next = seq + 1;
            self.stuck_since = None;
        }
        Ok(())
    }

    /// Replays events from other VMs that this VM has not seen yet.
    pub fn poll(
        &mut self,
        store: &dyn Store,
        me: u32,
        apply: impl FnMut(Event),
    ) -> Result<(), StoreError> {
        self.poll_from(store, Some(me), apply)
    }

    /// Replays every event this cursor has not seen yet, whichever VM appended it: a reader of
    /// the whole log (the replica's placements sent to the others, `replicas::placements`).
    pub fn poll_every(
        &mut self,
        store: &dyn Store,
        apply: impl FnMut(Event),
    ) -> Result<(), StoreError> {
        self.poll_from(store, None, apply)
    }

    fn poll_from(
        &mut self,
        store: &dyn Store,
        skip: Option<u32>,
        mut apply: impl FnMut(Event),
    ) -> Result<(), StoreError> {
        let seen = store.get(SEQ_KEY)?;
        let head = seq_of(seen.value.as_deref());
        self.seen = Some(seen);
        if head.saturating_sub(self.next) > RING {
            self.next = head - RING;
        }
        while self.next < head {
            // The last slot appended comes with the head (none from an older module's head, or
            // when it was large); any other is read.
            let carried = (self.next + 1 == head)
                .then(|| self.seen.as_ref()?.value.as_deref()?.get(8..))
                .flatten()
                .filter(|slot| !slot.is_empty());
            let read;
            let slot = match carried {
                Some(slot) => Some(slot),
                None => {
                    read = store.get(&slot_key(self.next))?.value;
                    read.as_deref()
                }
            };
            match slot.and_then(decode) {
                Some((seq, origin, events)) if seq == self.next => {
                    if skip != Some(origin) {
                        events.into_iter().for_each(&mut apply);
                    }
                }
                _ => {
                    // Claimed but not written yet: wait briefly for its writer, then move on.
                    let now = store.now_ms();
                    let since = *self.stuck_since.get_or_insert(now);
                    if now.saturating_sub(since) < STUCK_MS {
                        return Ok(());
                    }
                }
            }
            self.stuck_since = None;
            self.next += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::store::fake_host::{FakeHost, FakeVm};

    fn dispatch(request: u64) -> Event {
        Event::Dispatch(Dispatch {
            pod: "10.0.0.1:8000".into(),
            request,
            adapter: request * 7,
            hashes: vec![1, 2, 3],
        })
    }

    /// Two VMs on one host, each with its log started.
    fn two_logs() -> ((FakeVm, PickLog), (FakeVm, PickLog)) {
        let host = FakeHost::new();
        let start = |vm: FakeVm| {
            let log = PickLog::start(&vm).unwrap();
            (vm, log)
        };
        (start(host.vm()), start(host.vm()))
    }

    #[test]
    fn events_reach_other_vms_once_and_not_their_origin() {
        let ((a, mut la), (b, mut lb)) = two_logs();
        la.publish(&a, 1, &dispatch(7)).unwrap();
        let finish = Event::Finish {
            pod: "p".into(),
            request: 8,
        };
        lb.finish(&b, 2, finish.clone()).unwrap();
        let stored = Event::Stored {
            pod: "p".into(),
            id: 9,
            tokens: 1_234,
        };
        lb.publish(&b, 2, &stored).unwrap();
        let mut seen_b = Vec::new();
        lb.poll(&b, 2, |e| seen_b.push(e)).unwrap();
        assert_eq!(seen_b, vec![dispatch(7)]);
        lb.poll(&b, 2, |e| seen_b.push(e)).unwrap();
        assert_eq!(seen_b.len(), 1, "nothing twice");
        let mut seen_a = Vec::new();
        la.poll(&a, 1, |e| seen_a.push(e)).unwrap();
        assert_eq!(seen_a, vec![finish, stored], "the held finish rides along");
    }

    #[test]
    fn a_vm_one_append_behind_replays_it_from_the_head_alone() {
        let ((a, mut la), (b, mut lb)) = two_logs();
        lb.poll(&b, 2, |_| {}).unwrap();
        la.publish(&a, 1, &dispatch(7)).unwrap();
        let reads = crate::test_support::Watched::new(&b);
        let mut seen = Vec::new();
        lb.poll(&reads, 2, |e| seen.push(e)).unwrap();
        assert_eq!(seen, vec![dispatch(7)]);
        assert_eq!(reads.reads.get(), 1, "the head, not the slot");
        // Two behind: the older slot is read, the newer comes with the head.
        la.publish(&a, 1, &dispatch(8)).unwrap();
        la.publish(&a, 1, &dispatch(9)).unwrap();
        lb.poll(&reads, 2, |e| seen.push(e)).unwrap();
        assert_eq!(seen, vec![dispatch(7), dispatch(8), dispatch(9)]);
        assert_eq!(reads.reads_of(&slot_key(1)), 1);
        assert_eq!(reads.reads_of(&slot_key(2)), 0);
        // A large slot is not carried: the head stays small and the slot is read.
        let big = Event::Dispatch(Dispatch {
            pod: "10.0.0.1:8000".into(),
            request: 11,
            adapter: 0,
            hashes: (0..1_000).collect(),
        });
        la.publish(&a, 1, &big).unwrap();
        assert_eq!(a.get(SEQ_KEY).unwrap().value.map(|v| v.len()), Some(8));
        lb.poll(&reads, 2, |e| seen.push(e)).unwrap();
        assert_eq!(seen.last(), Some(&big));
        assert_eq!(reads.reads_of(&slot_key(3)), 1);
        // A head written by an older module carries no slot: the slot is read.
        b.set(SEQ_KEY, &5u64.to_le_bytes(), None).unwrap();
        a.set(&slot_key(4), &encode(4, 1, [dispatch(10)].iter()), None)
            .unwrap();
        lb.poll(&reads, 2, |e| seen.push(e)).unwrap();
        assert_eq!(seen.last(), Some(&dispatch(10)));
        assert_eq!(reads.reads_of(&slot_key(4)), 1);
    }

    #[test]
    fn an_append_claims_a_slot_of_its_own_though_another_vm_appended_since_its_poll() {
        let ((a, mut la), (b, mut lb)) = two_logs();
        la.poll(&a, 1, |_| {}).unwrap();
        // Between a's poll and its append, b appends: the head a saw is stale.
        lb.publish(&b, 2, &dispatch(1)).unwrap();
        la.publish(&a, 1, &dispatch(2)).unwrap();
        lb.publish(&b, 2, &dispatch(3)).unwrap();
        let mut seen = Vec::new();
        lb.poll(&b, 2, |e| seen.push(e)).unwrap();
        assert_eq!(
            seen,
            vec![dispatch(2)],
            "a's event in a slot b did not write over"
        );
        la.poll(&a, 1, |e| seen.push(e)).unwrap();
        assert_eq!(seen, vec![dispatch(2), dispatch(1), dispatch(3)]);
        assert_eq!(seq_of(a.get(SEQ_KEY).unwrap().value.as_deref()), 3);
    }

    #[test]
    fn new_vm_inherits_recent_history_and_laggards_skip_ahead() {
        let host = FakeHost::new();
        let a = host.vm();
        let mut la = PickLog::start(&a).unwrap();
        for i in 0..(RING + 10) {
            la.publish(&a, 1, &dispatch(i)).unwrap();
        }
        let b = host.vm();
        let mut lb = PickLog::start(&b).unwrap();
        let mut n = 0;
        lb.poll(&b, 2, |_| n += 1).unwrap();
        assert_eq!(n, RING);
    }

    #[test]
    fn claimed_but_unwritten_slot_waits_then_is_skipped() {
        let ((a, mut la), (b, mut lb)) = two_logs();
        // A writer claimed seq 0 and died before writing its slot.
        a.set(SEQ_KEY, &1u64.to_le_bytes(), None).unwrap();
        la.publish(&a, 1, &dispatch(9)).unwrap();
        let mut seen = Vec::new();
        lb.poll(&b, 2, |e| seen.push(e)).unwrap();
        assert!(seen.is_empty());
        a.host().advance_ms(STUCK_MS);
        lb.poll(&b, 2, |e| seen.push(e)).unwrap();
        assert_eq!(seen, vec![dispatch(9)]);
    }

    #[test]
    fn garbage_slots_are_not_trusted() {
        assert_eq!(decode(b"\x01\x02"), None);
        let mut bytes = encode(3, 1, [&dispatch(1)].into_iter());
        bytes.truncate(bytes.len() - 4);
        assert_eq!(decode(&bytes), None);
    }

    #[test]
    fn finishes_wait_for_the_next_dispatch_or_the_tick_and_arrive_in_order() {
        let ((a, mut la), (b, mut lb)) = two_logs();
        let finish = |request| Event::Finish {
            pod: "p".into(),
            request,
        };
        la.finish(&a, 1, finish(1)).unwrap();
        la.finish(&a, 1, finish(2)).unwrap();
        let mut seen = Vec::new();
        lb.poll(&b, 2, |e| seen.push(e)).unwrap();
        assert!(seen.is_empty(), "held, not yet appended");
        la.publish(&a, 1, &dispatch(3)).unwrap();
        lb.poll(&b, 2, |e| seen.push(e)).unwrap();
        assert_eq!(seen, vec![finish(1), finish(2), dispatch(3)]);
        la.finish(&a, 1, finish(4)).unwrap();
        la.flush(&a, 1).unwrap();
        la.flush(&a, 1).unwrap();
        lb.poll(&b, 2, |e| seen.push(e)).unwrap();
        assert_eq!(seen.len(), 4, "one flush appends, an empty one nothing");
        // Many held finishes go out without waiting.
        for i in 0..MAX_HELD_FINISHES as u64 {
            la.finish(&a, 1, finish(10 + i)).unwrap();
        }
        lb.poll(&b, 2, |e| seen.push(e)).unwrap();
        assert_eq!(seen.len(), 4 + MAX_HELD_FINISHES);
    }

    #[test]
    fn a_vm_does_not_read_back_its_own_appends() {
        let host = FakeHost::new();
        let a = host.vm();
        let mut la = PickLog::start(&a).unwrap();
        la.publish(&a, 1, &dispatch(1)).unwrap();
        la.publish(&a, 1, &dispatch(2)).unwrap();
        assert_eq!(la.next, 2, "its own slots were the next ones");
        let mut seen = Vec::new();
        la.poll(&a, 1, |e| seen.push(e)).unwrap();
        assert!(seen.is_empty());
    }
}
