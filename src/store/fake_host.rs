//! An in-memory stand-in for Envoy's shared data and shared queues, with the host's real semantics,
//! so the core's multi-worker behaviour is tested natively: a stale compare-and-swap fails, a CAS on
//! a missing key creates it, keys cannot be deleted or listed, and a queue name registered by
//! several VMs notifies only its last registrant.

use crate::store::interface::{Store, StoreError, Versioned};
use hashbrown::HashMap;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;

#[derive(Default)]
struct Queue {
    owner: usize,
    items: VecDeque<Vec<u8>>,
}

#[derive(Default)]
struct Shared {
    data: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
    queues: Vec<Queue>,
    queue_names: HashMap<String, u32>,
    /// Per VM, the queue ids whose `on_queue_ready` the host would call, in order.
    notifications: HashMap<usize, Vec<u32>>,
    now_us: u64,
}

/// The host process: one per test, shared by every fake VM.
#[derive(Clone, Default)]
pub struct FakeHost {
    shared: Rc<RefCell<Shared>>,
    next_vm: Rc<Cell<usize>>,
}

/// One worker VM's view of the host.
#[derive(Clone)]
pub struct FakeVm {
    host: FakeHost,
    pub id: usize,
}

impl FakeHost {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn vm(&self) -> FakeVm {
        let id = self.next_vm.get();
        self.next_vm.set(id + 1);
        FakeVm {
            host: self.clone(),
            id,
        }
    }

    pub fn now_ms(&self) -> u64 {
        self.now_us() / 1_000
    }

    pub fn now_us(&self) -> u64 {
        self.shared.borrow().now_us
    }

    pub fn set_now_ms(&self, now: u64) {
        self.shared.borrow_mut().now_us = now * 1_000;
    }

    pub fn advance_ms(&self, by: u64) {
        self.advance_us(by * 1_000);
    }

    pub fn advance_us(&self, by: u64) {
        self.shared.borrow_mut().now_us += by;
    }
}

impl FakeVm {
    pub fn host(&self) -> &FakeHost {
        &self.host
    }

    /// The queue-ready notifications delivered to this VM since the last call.
    pub fn take_notifications(&self) -> Vec<u32> {
        self.host
            .shared
            .borrow_mut()
            .notifications
            .remove(&self.id)
            .unwrap_or_default()
    }
}

impl Store for FakeVm {
    fn get(&self, key: &str) -> Result<Versioned, StoreError> {
        let shared = self.host.shared.borrow();
        Ok(match shared.data.get(key) {
            Some((value, cas)) => Versioned {
                value: Some(value.clone()),
                cas: Some(*cas),
            },
            None => Versioned::default(),
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut shared = self.host.shared.borrow_mut();
        shared.next_cas = shared.next_cas.wrapping_add(1).max(1);
        let next = shared.next_cas;
        match shared.data.get_mut(key) {
            Some(entry) => {
                if matches!(cas, Some(c) if c != 0 && c != entry.1) {
                    return Err(StoreError::CasMismatch);
                }
                *entry = (value.to_vec(), next);
            }
            None => {
                shared.data.insert(key.to_string(), (value.to_vec(), next));
            }
        }
        Ok(())
    }

    fn register_queue(&self, name: &str) -> Result<u32, StoreError> {
        let mut shared = self.host.shared.borrow_mut();
        if let Some(&id) = shared.queue_names.get(name) {
            // Envoy keeps one queue per name; re-registering moves its notifications to this VM.
            if let Some(queue) = shared.queues.get_mut(id as usize) {
                queue.owner = self.id;
            }
            return Ok(id);
        }
        let id = shared.queues.len() as u32;
        shared.queues.push(Queue {
            owner: self.id,
            items: VecDeque::new(),
        });
        shared.queue_names.insert(name.to_string(), id);
        Ok(id)
    }

    fn resolve_queue(&self, name: &str) -> Result<Option<u32>, StoreError> {
        Ok(self.host.shared.borrow().queue_names.get(name).copied())
    }

    fn enqueue(&self, queue: u32, message: &[u8]) -> Result<(), StoreError> {
        let mut shared = self.host.shared.borrow_mut();
        let Some(q) = shared.queues.get_mut(queue as usize) else {
            return Err(StoreError::NotFound);
        };
        q.items.push_back(message.to_vec());
        let owner = q.owner;
        shared.notifications.entry(owner).or_default().push(queue);
        Ok(())
    }

    fn dequeue(&self, queue: u32) -> Result<Option<Vec<u8>>, StoreError> {
        let mut shared = self.host.shared.borrow_mut();
        match shared.queues.get_mut(queue as usize) {
            Some(q) => Ok(q.items.pop_front()),
            None => Err(StoreError::NotFound),
        }
    }

    fn now_us(&self) -> u64 {
        self.host.now_us()
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::store::interface::{update, update_from};
    use crate::test_support::{two_vms, Watched};

    #[test]
    fn stale_cas_fails_and_fresh_cas_wins() {
        let (a, b) = two_vms();
        a.set("k", b"1", None).unwrap();
        let seen_a = a.get("k").unwrap();
        let seen_b = b.get("k").unwrap();
        b.set("k", b"2", seen_b.cas).unwrap();
        assert_eq!(a.set("k", b"3", seen_a.cas), Err(StoreError::CasMismatch));
        assert_eq!(a.get("k").unwrap().value.as_deref(), Some(&b"2"[..]));
    }

    #[test]
    fn cas_on_missing_key_creates_it() {
        let vm = FakeHost::new().vm();
        vm.set("new", b"x", Some(12345)).unwrap();
        assert_eq!(vm.get("new").unwrap().value.as_deref(), Some(&b"x"[..]));
        assert_eq!(vm.get("absent").unwrap(), Versioned::default());
    }

    #[test]
    fn queue_notifies_only_last_registrant() {
        let (a, b) = two_vms();
        let qa = a.register_queue("wake").unwrap();
        let qb = b.register_queue("wake").unwrap();
        assert_eq!(qa, qb);
        a.enqueue(qa, b"hello").unwrap();
        assert!(a.take_notifications().is_empty());
        assert_eq!(b.take_notifications(), vec![qa]);
        assert_eq!(a.dequeue(qa).unwrap().as_deref(), Some(&b"hello"[..]));
        assert_eq!(a.dequeue(qa).unwrap(), None);
        assert_eq!(a.enqueue(99, b"x"), Err(StoreError::NotFound));
    }

    #[test]
    fn update_from_a_value_seen_current_writes_without_reading_and_a_stale_one_reads() {
        let (vm, b) = two_vms();
        let a = Watched::new(&vm);
        a.set("n", b"1", None).unwrap();
        let append = |cur: Option<&[u8]>| Some(([cur.unwrap_or_default(), b"+"].concat(), ()));
        let seen = a.get("n").unwrap();
        update_from(&a, "n", Some(seen.clone()), append).unwrap();
        assert_eq!(a.reads.get(), 1, "no read of its own");
        // Written since it was seen: the swap fails and the retry reads.
        b.set("n", b"2", None).unwrap();
        update_from(&a, "n", Some(seen), append).unwrap();
        assert_eq!(a.get("n").unwrap().value.as_deref(), Some(&b"2+"[..]));
        // A missing key seen has no version: never written blind from it.
        update_from(&a, "new", Some(Versioned::default()), append).unwrap();
        assert_eq!(a.reads.get(), 4);
        // Only the current value may refuse: declined as seen, it is read and asked again.
        let seen = a.get("n").unwrap();
        b.set("n", b"room", None).unwrap();
        let fits =
            |cur: Option<&[u8]>| (cur == Some(&b"room"[..])).then(|| (b"taken".to_vec(), ()));
        assert_eq!(update_from(&a, "n", Some(seen), fits), Ok(Some(())));
        assert_eq!(a.get("n").unwrap().value.as_deref(), Some(&b"taken"[..]));
        // Declined as read: no more reads.
        let before = a.reads.get();
        assert_eq!(update_from(&a, "n", None, fits), Ok(None));
        assert_eq!(a.reads.get(), before + 1);
    }

    #[test]
    fn update_retries_lost_races() {
        let (a, b) = two_vms();
        a.set("n", b"0", None).unwrap();
        let mut first = true;
        let out = update(&a, "n", |cur| {
            let n: u32 = std::str::from_utf8(cur?).ok()?.parse().ok()?;
            if first {
                // Another worker commits between this read and the write.
                first = false;
                b.set("n", b"10", None).unwrap();
            }
            Some(((n + 1).to_string().into_bytes(), n + 1))
        })
        .unwrap();
        assert_eq!(out, Some(11));
        assert_eq!(a.get("n").unwrap().value.as_deref(), Some(&b"11"[..]));
    }
}
