//! This VM's copies of the pod records, for ranking. Reading every pod's record on every request
//! cost two host calls per pod (and a decode each); a copy younger than `COPY_MS`, or one this VM
//! has just written, ranks as well: other workers' changes reach it within that time, and their
//! picks at once: a dispatch or finish in the pick log drops the pod's copy (`forget`).
//!
//! A record read for the pick also starts the reservation's compare-and-swap when the request goes
//! to that pod in the same callback (`read_now`): a host call fewer, and no less fresh (a record
//! written since fails the swap and is read again).
//!
//! Source of truth: the shared-data record (`pods::record`). A copy never decides a reservation:
//! the router checks the fit again on the fresh record inside the compare-and-swap (against the
//! budget the stored snapshot gives, not the copy's: a scrape may have shrunk it), and when the
//! copies say no pod has room it reads every pod again before the request is queued. So a stale
//! copy can rank a pod wrongly for a moment; it can neither overfill a pod nor queue a request
//! that fits.

use crate::pods::record::{self, PodRecord};
use crate::routing::pod_id::{PodId, PodMap};
use crate::store::interface::{Store, StoreError, Versioned};
use std::rc::Rc;

/// How long a copy serves before the record is read again.
pub const COPY_MS: u64 = 20;

#[derive(Debug)]
struct Copy {
    /// When it was read or written.
    at: u64,
    /// Shared with the picks that rank on it: a pod's record holds an entry per request in
    /// flight, hundreds on a busy pod, and a copy per pick per request would copy them all.
    rec: Rc<PodRecord>,
    /// The value as read from shared data, until this VM writes the record or uses it.
    read: Option<Versioned>,
}

#[derive(Debug, Default)]
pub struct RecordCopies {
    copies: PodMap<Copy>,
}

impl RecordCopies {
    /// The record of the pod named `name`: its copy when young enough and `fresh` is not asked,
    /// else read (and kept). The second value says whether it was a copy. Expired entries are
    /// left out either way.
    pub fn get(
        &mut self,
        store: &dyn Store,
        (pod, name): (PodId, &str),
        now: u64,
        fresh: bool,
    ) -> Result<(Rc<PodRecord>, bool), StoreError> {
        if !fresh {
            if let Some(c) = self.copies.get_mut(&pod) {
                if now.saturating_sub(c.at) < COPY_MS {
                    // An entry expired by now stays expired: the copy itself can leave it out.
                    if c.rec.has_expired(now) {
                        Rc::make_mut(&mut c.rec).drop_expired(now);
                    }
                    return Ok((c.rec.clone(), true));
                }
            }
        }
        let (rec, read) = record::read_versioned(store, name)?;
        let rec = Rc::new(rec);
        self.keep(pod, rec.clone(), now, Some(read));
        Ok((rec, false))
    }

    /// The record as this VM just wrote it.
    pub fn wrote(&mut self, pod: PodId, rec: PodRecord, now: u64) {
        self.keep(pod, Rc::new(rec), now, None);
    }

    /// The pod's record as read at `now` (in this callback: the clock is read once per
    /// callback) and not written by this VM since, for a compare-and-swap to start from; once.
    pub fn read_now(&mut self, pod: PodId, now: u64) -> Option<Versioned> {
        let c = self.copies.get_mut(&pod)?;
        if c.at == now {
            c.read.take()
        } else {
            None
        }
    }

    /// Replaces the pod's copy.
    fn keep(&mut self, pod: PodId, rec: Rc<PodRecord>, now: u64, read: Option<Versioned>) {
        self.copies.insert(pod, Copy { at: now, rec, read });
    }

    /// This VM removed a request's entry from the pod's record: the copy follows (its age kept).
    pub fn finished(&mut self, pod: PodId, request: u64) {
        if let Some(c) = self.copies.get_mut(&pod) {
            Rc::make_mut(&mut c.rec).entries.retain(|e| e.id != request);
            c.read = None;
        }
    }

    /// The copy no longer shows the pod's load, so the next pick reads the record: another
    /// worker dispatched to the pod or finished there (the pick log says so), or a request's
    /// first token came (its prompt is computed). Without the first, two workers picking within
    /// `COPY_MS` of each other both saw the same least loaded pod and sent it both requests.
    pub fn forget(&mut self, pod: PodId) {
        self.copies.remove(&pod);
    }

    pub fn retain_pods(&mut self, keep: impl Fn(PodId) -> bool) {
        self.copies.retain(|p, _| keep(*p));
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn pod(name: &str) -> PodId {
        PodId::of(name)
    }
    use crate::pods::record::RequestEntry;
    use crate::store::fake_host::FakeHost;
    use crate::test_support::two_vms;

    fn entry(id: u64, expires_ms: u64) -> RequestEntry {
        RequestEntry {
            id,
            expires_ms,
            ..RequestEntry::default()
        }
    }

    #[test]
    fn a_copy_serves_until_it_is_old_then_the_record_is_read_again() {
        let (a, b) = two_vms();
        record::ensure(&a, "p").unwrap();
        let mut copies = RecordCopies::default();
        let now = a.now_ms();
        let (rec, copy) = copies.get(&a, (pod("p"), "p"), now, false).unwrap();
        assert!(rec.entries.is_empty() && !copy);
        // Another worker reserves on the pod.
        record::modify(&b, "p", |r| {
            r.entries.push(entry(7, now + 60_000));
            Some(())
        })
        .unwrap();
        let (rec, copy) = copies
            .get(&a, (pod("p"), "p"), now + COPY_MS - 1, false)
            .unwrap();
        assert!(
            rec.entries.is_empty() && copy,
            "the copy, not yet the change"
        );
        let (rec, copy) = copies.get(&a, (pod("p"), "p"), now + 1, true).unwrap();
        assert_eq!((rec.entries.len(), copy), (1, false), "fresh when asked");
        let (rec, copy) = copies
            .get(&a, (pod("p"), "p"), now + 1 + COPY_MS, false)
            .unwrap();
        assert_eq!((rec.entries.len(), copy), (1, false), "read again once old");
    }

    #[test]
    fn a_record_read_in_this_callback_starts_the_swap_once_and_not_after_this_vm_wrote_it() {
        let (a, b) = two_vms();
        record::ensure(&a, "p").unwrap();
        let mut copies = RecordCopies::default();
        let now = a.now_ms();
        copies.get(&a, (pod("p"), "p"), now, false).unwrap();
        assert_eq!(
            copies.read_now(pod("p"), now + 1),
            None,
            "a later callback reads"
        );
        let seen = copies.read_now(pod("p"), now);
        assert_eq!(seen, Some(a.get(&record::key("p")).unwrap()));
        assert_eq!(copies.read_now(pod("p"), now), None, "once");
        // Read again, then written by this VM, then by another: never a version this VM knows
        // to be stale, and a stale one only fails the swap.
        copies.get(&a, (pod("p"), "p"), now, true).unwrap();
        copies.wrote(pod("p"), PodRecord::default(), now);
        assert_eq!(copies.read_now(pod("p"), now), None);
        copies.get(&a, (pod("p"), "p"), now, true).unwrap();
        copies.finished(pod("p"), 1);
        assert_eq!(copies.read_now(pod("p"), now), None);
        copies.get(&a, (pod("p"), "p"), now, true).unwrap();
        let seen = copies.read_now(pod("p"), now);
        record::modify(&b, "p", |r| {
            r.entries.push(entry(7, now + 60_000));
            Some(())
        })
        .unwrap();
        record::modify_from(&a, "p", seen, |r| {
            r.entries.push(entry(8, now + 60_000));
            Some(())
        })
        .unwrap();
        let ids: Vec<u64> = record::read(&a, "p")
            .unwrap()
            .entries
            .iter()
            .map(|e| e.id)
            .collect();
        assert_eq!(ids, vec![7, 8], "the other worker's entry kept");
    }

    #[test]
    fn writes_and_finishes_of_this_vm_show_at_once_and_expired_entries_never() {
        let host = FakeHost::new();
        let a = host.vm();
        record::ensure(&a, "p").unwrap();
        let mut copies = RecordCopies::default();
        let written = PodRecord {
            entries: vec![entry(1, 100), entry(2, 25)],
            ..PodRecord::default()
        };
        copies.wrote(pod("p"), written, 10);
        let (rec, copy) = copies.get(&a, (pod("p"), "p"), 20, false).unwrap();
        assert!(copy);
        assert_eq!(rec.entries.len(), 2);
        let (rec, _) = copies.get(&a, (pod("p"), "p"), 29, false).unwrap();
        assert_eq!(rec.entries.len(), 1, "entry 2 expired at 25");
        copies.finished(pod("p"), 1);
        let (rec, copy) = copies.get(&a, (pod("p"), "p"), 29, false).unwrap();
        assert!(copy && rec.entries.is_empty());
        copies.retain_pods(|p| p != pod("p"));
        let (_, copy) = copies.get(&a, (pod("p"), "p"), 29, false).unwrap();
        assert!(!copy, "a pod that left and came back is read");
    }
}
