//! The pick log: how a routing decision made on one Envoy worker reaches every other worker
//! within milliseconds. Each dispatch and finish is appended to a ring of shared-data slots
//! (`kvgate.log.seq` and `kvgate.log.<0..RING>`: a bounded key schema); every VM replays what it
//! has not seen before it decides, so each keeps a full replica of the prefix index and of the
//! in-flight prompt blocks without reading per-block keys. A VM that falls more than a ring
//! behind skips ahead: the replicas it feeds are approximate by design, and nothing that must
//! return to zero (reservations, active-block counts) depends on this log.

use crate::store::codec::{Reader, Writer};
use crate::store::interface::{create_if_missing, update, Store, StoreError};

pub const RING: u64 = 512;
const SEQ_KEY: &str = "kvgate.log.seq";
/// A slot claimed but not yet written is waited for this long, then skipped (its writer died).
const STUCK_MS: u64 = 200;
/// The most prompt blocks one event carries (longer prompts are indexed by their first blocks).
pub const MAX_EVENT_BLOCKS: usize = 4096;

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
    Finish { pod: String, request: u64 },
}

const DISPATCH_WITHOUT_ADAPTER: u8 = 1;
const DISPATCH: u8 = 3;

fn slot_key(seq: u64) -> String {
    format!("kvgate.log.{}", seq % RING)
}

fn encode(seq: u64, origin: u32, event: &Event) -> Vec<u8> {
    let mut w = Writer::new();
    w.u64(seq).u32(origin);
    match event {
        Event::Dispatch(d) => {
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
            w.u8(2).bytes(pod.as_bytes()).u64(*request);
        }
    }
    w.0
}

fn decode(bytes: &[u8]) -> Option<(u64, u32, Event)> {
    let mut r = Reader(bytes);
    let seq = r.u64()?;
    let origin = r.u32()?;
    let kind = r.u8()?;
    let pod = String::from_utf8(r.bytes()?.to_vec()).ok()?;
    let request = r.u64()?;
    let event = match kind {
        // A dispatch logged by a module from before adapters (during a reload) had none.
        DISPATCH_WITHOUT_ADAPTER | DISPATCH => {
            let adapter = if kind == DISPATCH { r.u64()? } else { 0 };
            let n = r.count(8)?;
            let hashes = (0..n).map(|_| r.u64()).collect::<Option<Vec<_>>>()?;
            Event::Dispatch(Dispatch {
                pod,
                request,
                adapter,
                hashes,
            })
        }
        2 => Event::Finish { pod, request },
        _ => return None,
    };
    Some((seq, origin, event))
}

fn read_seq(store: &dyn Store) -> Result<u64, StoreError> {
    Ok(store
        .get(SEQ_KEY)?
        .value
        .and_then(|b| Reader(&b).u64())
        .unwrap_or(0))
}

/// One VM's position in the log.
#[derive(Debug, Default)]
pub struct PickLog {
    next: u64,
    stuck_since: Option<u64>,
}

impl PickLog {
    /// Creates the sequence key (before traffic, see `interface::update`) and starts one ring behind
    /// the head, so a VM that starts or reloads inherits the recent picks of the others.
    pub fn start(store: &dyn Store) -> Result<PickLog, StoreError> {
        create_if_missing(store, SEQ_KEY, &0u64.to_le_bytes())?;
        let head = read_seq(store)?;
        Ok(PickLog {
            next: head.saturating_sub(RING),
            stuck_since: None,
        })
    }

    /// Appends an event; the caller has already applied it to its own replica.
    pub fn publish(store: &dyn Store, origin: u32, event: &Event) -> Result<(), StoreError> {
        let seq = update(store, SEQ_KEY, |cur| {
            let n = cur.and_then(|b| Reader(b).u64()).unwrap_or(0);
            Some(((n + 1).to_le_bytes().to_vec(), n))
        })?
        .unwrap_or(0);
        store.set(&slot_key(seq), &encode(seq, origin, event), None)
    }

    /// Replays events from other VMs that this VM has not seen yet.
    pub fn poll(
        &mut self,
        store: &dyn Store,
        me: u32,
        mut apply: impl FnMut(Event),
    ) -> Result<(), StoreError> {
        let head = read_seq(store)?;
        if head.saturating_sub(self.next) > RING {
            self.next = head - RING;
        }
        while self.next < head {
            let slot = store.get(&slot_key(self.next))?.value;
            match slot.as_deref().and_then(decode) {
                Some((seq, origin, event)) if seq == self.next => {
                    if origin != me {
                        apply(event);
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
    use crate::store::fake_host::FakeHost;

    fn dispatch(request: u64) -> Event {
        Event::Dispatch(Dispatch {
            pod: "10.0.0.1:8000".into(),
            request,
            adapter: request * 7,
            hashes: vec![1, 2, 3],
        })
    }

    #[test]
    fn events_reach_other_vms_once_and_not_their_origin() {
        let host = FakeHost::new();
        let (a, b) = (host.vm(), host.vm());
        let mut la = PickLog::start(&a).unwrap();
        let mut lb = PickLog::start(&b).unwrap();
        PickLog::publish(&a, 1, &dispatch(7)).unwrap();
        PickLog::publish(
            &b,
            2,
            &Event::Finish {
                pod: "p".into(),
                request: 8,
            },
        )
        .unwrap();
        let mut seen_b = Vec::new();
        lb.poll(&b, 2, |e| seen_b.push(e)).unwrap();
        assert_eq!(seen_b, vec![dispatch(7)]);
        lb.poll(&b, 2, |e| seen_b.push(e)).unwrap();
        assert_eq!(seen_b.len(), 1, "nothing twice");
        let mut seen_a = Vec::new();
        la.poll(&a, 1, |e| seen_a.push(e)).unwrap();
        assert_eq!(
            seen_a,
            vec![Event::Finish {
                pod: "p".into(),
                request: 8
            }]
        );
    }

    #[test]
    fn new_vm_inherits_recent_history_and_laggards_skip_ahead() {
        let host = FakeHost::new();
        let a = host.vm();
        PickLog::start(&a).unwrap();
        for i in 0..(RING + 10) {
            PickLog::publish(&a, 1, &dispatch(i)).unwrap();
        }
        let b = host.vm();
        let mut lb = PickLog::start(&b).unwrap();
        let mut n = 0;
        lb.poll(&b, 2, |_| n += 1).unwrap();
        assert_eq!(n, RING);
    }

    #[test]
    fn claimed_but_unwritten_slot_waits_then_is_skipped() {
        let host = FakeHost::new();
        let (a, b) = (host.vm(), host.vm());
        let mut lb = PickLog::start(&b).unwrap();
        // A writer claimed seq 0 and died before writing its slot.
        a.set(SEQ_KEY, &1u64.to_le_bytes(), None).unwrap();
        PickLog::publish(&a, 1, &dispatch(9)).unwrap();
        let mut seen = Vec::new();
        lb.poll(&b, 2, |e| seen.push(e)).unwrap();
        assert!(seen.is_empty());
        host.advance_ms(STUCK_MS);
        lb.poll(&b, 2, |e| seen.push(e)).unwrap();
        assert_eq!(seen, vec![dispatch(9)]);
    }

    #[test]
    fn garbage_slots_are_not_trusted() {
        assert_eq!(decode(b"\x01\x02"), None);
        let mut bytes = encode(3, 1, &dispatch(1));
        bytes.truncate(bytes.len() - 4);
        assert_eq!(decode(&bytes), None);
    }
}
