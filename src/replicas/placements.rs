//! Where each gateway replica sends prompts, told to the others: every replica's prefix index
//! then learns of every replica's picks, as it learns of its own workers' through the pick log.
//! The same batches carry the responses its pods stored (`routing::stored`), whose follow-ups
//! may come through any replica.
//!
//! Without it each replica's index saw only its own picks. Two replicas sent one prompt group to
//! different pods as soon as either spilled it past a full pod, and each went on believing its own
//! choice: under cache pressure through two replicas a group's requests went to 3.6 pods of 8
//! where each replica alone used 2.5, and the engines hit 26 % of prompt tokens against 42 %
//! through one replica at the same rate (`tests/e2e/replicas_cache_bench.py`). NVIDIA Dynamo's
//! router replicas each see every placement for the same reason (every worker's KV events reach
//! each of them, Dynamo PR 2756; their in-flight accounting is shared over NATS, Dynamo PR 2264).
//! kvgate has etcd, read and written only by each replica's sync (`sync`), so placements travel
//! with it, a sync late.
//!
//! Source of truth: the replica's own pick log (`routing::pick_log`), whose dispatches and stored
//! responses the elected worker reads (`Outbox`) and writes to `<prefix>/placed/<replica>` under
//! the replica's lease while another replica is live, the last few batches together so a reader
//! a sync behind misses none. Readers (`Inbox`) apply each batch once: its placements are appended
//! to their own pick log as `Event::Placed`, which feeds the prefix index only (no request of
//! theirs holds those blocks), and its stored responses are noted in their records.

use crate::routing::pick_log::{Event, PickLog};
use crate::routing::stored::Note;
use crate::store::codec::{Reader, Writer};
use crate::store::interface::{Store, StoreError};
use hashbrown::{HashMap, HashSet};
use std::collections::VecDeque;

/// Batches a value carries at least: a reader whose sync runs up to two of the writer's late
/// misses none. It carries more while they are recent (`Outbox::value`).
const BATCHES: usize = 3;
/// Blocks one batch carries at most (32 KiB of hashes): past it a sync's placements are dropped,
/// the index being approximate by design.
const MAX_BATCH_BLOCKS: usize = 4_096;
/// Stored responses one batch carries at most (about 160 KiB with pods' names): past it the
/// oldest are dropped, and a follow-up to one of them through another replica is routed by cost.
const MAX_BATCH_NOTES: usize = 4_096;

/// One pod and the blocks of a prompt sent to it.
pub type Placement = (String, Vec<u64>);

/// What one sync's batch carries: the prompts sent, and the responses stored.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub placed: Vec<Placement>,
    pub stored: Vec<Note>,
}

impl Batch {
    fn is_empty(&self) -> bool {
        self.placed.is_empty() && self.stored.is_empty()
    }

    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u32(self.placed.len() as u32);
        for (pod, hashes) in &self.placed {
            w.bytes(pod.as_bytes()).u32(hashes.len() as u32);
            hashes.iter().for_each(|h| {
                w.u64(*h);
            });
        }
        // After the placements: a reader of an older module stops before it.
        w.u32(self.stored.len() as u32);
        for n in &self.stored {
            w.u64(n.id).u64(n.tokens).bytes(n.pod.as_bytes());
        }
        w.0
    }

    fn decode(bytes: &[u8]) -> Option<Batch> {
        let mut r = Reader(bytes);
        let placed = r.list(8, |r| {
            let pod = String::from_utf8(r.bytes()?.to_vec()).ok()?;
            Some((pod, r.list(8, Reader::u64)?))
        })?;
        // A writer of an older module sent placements only.
        let stored = if r.is_empty() {
            Vec::new()
        } else {
            r.list(20, |r| {
                let id = r.u64()?;
                let tokens = r.u64()?;
                let pod = String::from_utf8(r.bytes()?.to_vec()).ok()?;
                Some(Note { pod, id, tokens })
            })?
        };
        Some(Batch { placed, stored })
    }
}

/// This replica's placements and stored responses not yet written to etcd, from its pick log.
#[derive(Default)]
pub struct Outbox {
    log: Option<PickLog>,
    /// What the log brought since the last batch was made.
    next: Batch,
    /// The blocks `next` names for each pod: a group's prompts share their head.
    named: HashMap<String, HashSet<u64>>,
    /// The last batches, newest last: (its number, the batch, the batch encoded). Each is
    /// encoded again only when trimmed, not at every write of the value that carries it.
    batches: VecDeque<(u64, Batch, Vec<u8>)>,
    /// A batch not yet in etcd (the txn carrying it failed, or none was sent yet).
    unwritten: bool,
    /// One of them carries stored responses.
    unwritten_stored: bool,
}

impl Outbox {
    /// Reads the dispatches and stored responses the pick log took since the last call into the
    /// next batch.
    fn collect(&mut self, store: &dyn Store) -> Result<(), StoreError> {
        let log = match self.log.as_mut() {
            Some(log) => log,
            None => self.log.insert(PickLog::start(store)?),
        };
        let (next, named) = (&mut self.next, &mut self.named);
        let mut blocks: usize = next.placed.iter().map(|(_, h)| h.len()).sum();
        log.poll_every(store, |event| match event {
            Event::Dispatch(d) => {
                let Some(&first) = d.hashes.first() else {
                    return;
                };
                // Only the blocks this batch has not named for the pod yet, and the first
                // always, which names the group's home.
                let known = named.entry_ref(d.pod.as_str()).or_default();
                let new: Vec<u64> = d.hashes[1..]
                    .iter()
                    .copied()
                    .filter(|h| !known.contains(h))
                    .collect();
                if (new.is_empty() && known.contains(&first))
                    || blocks + 1 + new.len() > MAX_BATCH_BLOCKS
                {
                    return;
                }
                known.extend(new.iter().copied());
                known.insert(first);
                blocks += 1 + new.len();
                let mut hashes = Vec::with_capacity(1 + new.len());
                hashes.push(first);
                hashes.extend(new);
                next.placed.push((d.pod, hashes));
            }
            Event::Stored { pod, id, tokens } => {
                if next.stored.len() >= MAX_BATCH_NOTES {
                    next.stored.remove(0);
                }
                next.stored.push(Note { pod, id, tokens });
            }
            Event::Finish { .. } | Event::Placed { .. } => {}
        })
    }

    /// Whether a stored response waits to be written: a follow-up may soon come through
    /// another replica, so the sync should not wait its slow pace.
    pub fn holds_stored(&mut self, store: &dyn Store) -> Result<bool, StoreError> {
        self.collect(store)?;
        Ok(self.unwritten_stored || !self.next.stored.is_empty())
    }

    /// The value to write when it holds a batch etcd has not been sent yet; what the log brought
    /// since the last call makes a new batch. It carries the batches of the last `keep_ms` (at
    /// least `BATCHES`): this replica syncs at its busy pace while it holds stored responses,
    /// and another replica, idle, reads at its slow pace (`etcd.syncIntervalMs`), so a value of
    /// the last three batches carried a reader only the last three of the many made between its
    /// reads (measured: an idle replica received 11–15 of 20 stored responses sent one after
    /// another through the other). Placements, the bulk of a value, stay in the last `BATCHES`
    /// batches only, as before (the index is approximate, and etcd is written at each busy
    /// sync); past `MAX_BATCH_NOTES` stored responses the oldest are dropped.
    pub fn value(
        &mut self,
        store: &dyn Store,
        keep_ms: u64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.collect(store)?;
        if !self.next.is_empty() {
            let now = store.now_ms();
            let number = now.max(self.batches.back().map_or(0, |b| b.0 + 1));
            let batch = std::mem::take(&mut self.next);
            self.named.clear();
            self.unwritten_stored |= !batch.stored.is_empty();
            let encoded = batch.encode();
            self.batches.push_back((number, batch, encoded));
            while self.batches.len() > BATCHES
                && self
                    .batches
                    .front()
                    .is_some_and(|b| now.saturating_sub(b.0) > keep_ms)
            {
                self.batches.pop_front();
            }
            let mut notes = 0;
            for (k, (_, b, encoded)) in self.batches.iter_mut().rev().enumerate() {
                let mut trimmed = k >= BATCHES && !b.placed.is_empty();
                if trimmed {
                    b.placed.clear();
                }
                let room = MAX_BATCH_NOTES.saturating_sub(notes);
                if b.stored.len() > room {
                    b.stored.drain(..b.stored.len() - room);
                    trimmed = true;
                }
                notes += b.stored.len();
                if trimmed {
                    *encoded = b.encode();
                }
            }
            self.batches.retain(|(_, b, _)| !b.is_empty());
            self.unwritten = true;
        }
        if !self.unwritten {
            return Ok(None);
        }
        let mut w = Writer::new();
        w.u32(self.batches.len() as u32);
        for (number, _, encoded) in &self.batches {
            w.u64(*number).bytes(encoded);
        }
        Ok(Some(w.0))
    }

    /// etcd holds the value last returned.
    pub fn written(&mut self) {
        self.unwritten = false;
        self.unwritten_stored = false;
    }
}

/// The batches of one value: (number, its batch), a malformed batch passed over.
fn decode(value: &[u8]) -> Vec<(u64, Batch)> {
    let mut r = Reader(value);
    r.list(12, |r| Some((r.u64()?, r.bytes()?)))
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(n, b)| Some((n, Batch::decode(b)?)))
        .collect()
}

/// The batches of the other replicas this replica has applied.
#[derive(Default)]
pub struct Inbox {
    /// Replica → the numbers of its batches applied from its value as last read.
    applied: HashMap<String, Vec<u64>>,
}

impl Inbox {
    /// What the other replicas' values (replica → value) carry that was not applied before.
    /// Replicas no longer found are forgotten.
    pub fn take(&mut self, values: &[(&str, &[u8])]) -> Batch {
        let mut out = Batch::default();
        let mut applied = HashMap::new();
        for &(replica, value) in values {
            let before = self.applied.remove(replica).unwrap_or_default();
            let mut now = Vec::new();
            for (number, batch) in decode(value) {
                if !before.contains(&number) {
                    out.placed.extend(batch.placed);
                    out.stored.extend(batch.stored);
                }
                now.push(number);
            }
            applied.insert(replica.to_string(), now);
        }
        self.applied = applied;
        out
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::routing::pick_log::Dispatch;
    use crate::store::fake_host::FakeHost;

    fn dispatch(pod: &str, request: u64, hashes: &[u64]) -> Event {
        Event::Dispatch(Dispatch {
            pod: pod.into(),
            request,
            adapter: 0,
            hashes: hashes.to_vec(),
        })
    }

    #[test]
    fn every_workers_dispatches_reach_the_other_replicas_once_with_shared_heads_named_once() {
        let host = FakeHost::new();
        let (w1, w2, elected) = (host.vm(), host.vm(), host.vm());
        let mut out = Outbox::default();
        assert_eq!(out.value(&elected, 0).unwrap(), None, "nothing placed yet");
        let (mut l1, mut l2) = (PickLog::start(&w1).unwrap(), PickLog::start(&w2).unwrap());
        l1.publish(&w1, 1, &dispatch("p", 1, &[10, 11, 12]))
            .unwrap();
        l2.publish(&w2, 2, &dispatch("p", 2, &[10, 11, 13]))
            .unwrap();
        l2.publish(&w2, 2, &dispatch("q", 3, &[10, 11, 14]))
            .unwrap();
        // A finish and another replica's placement are not this replica's picks.
        l1.finish(
            &w1,
            1,
            Event::Finish {
                pod: "p".into(),
                request: 1,
            },
        )
        .unwrap();
        let echo = Event::Placed {
            pod: "p".into(),
            hashes: vec![99],
        };
        l1.publish(&w1, 1, &echo).unwrap();
        assert!(!out.holds_stored(&elected).unwrap());
        let stored = Note {
            pod: "q".into(),
            id: 77,
            tokens: 900,
        };
        let note = Event::Stored {
            pod: stored.pod.clone(),
            id: stored.id,
            tokens: stored.tokens,
        };
        l2.publish(&w2, 2, &note).unwrap();
        assert!(out.holds_stored(&elected).unwrap(), "due at the busy pace");
        let first = out.value(&elected, 0).unwrap().unwrap();
        assert!(out.holds_stored(&elected).unwrap(), "until etcd has it");
        let mut inbox = Inbox::default();
        let batch = inbox.take(&[("b", &first)]);
        assert_eq!(batch.stored, vec![stored]);
        assert_eq!(
            batch.placed,
            vec![
                ("p".to_string(), vec![10, 11, 12]),
                ("p".to_string(), vec![10, 13]),
                ("q".to_string(), vec![10, 11, 14]),
            ]
        );
        assert!(inbox.take(&[("b", &first)]).is_empty(), "each batch once");
        // Until etcd has it the value stays due; then only a new batch is.
        assert!(out.value(&elected, 0).unwrap().is_some());
        out.written();
        assert!(!out.holds_stored(&elected).unwrap());
        assert_eq!(out.value(&elected, 0).unwrap(), None);
        host.advance_ms(5);
        l2.publish(&w2, 2, &dispatch("q", 4, &[20])).unwrap();
        let second = out.value(&elected, 0).unwrap().unwrap();
        assert_eq!(
            inbox.take(&[("b", &second)]).placed,
            vec![("q".to_string(), vec![20])]
        );
        // A reader that missed the first value finds both batches in the second.
        assert_eq!(Inbox::default().take(&[("b", &second)]).placed.len(), 4);
        // A batch of an older module's, placements only, is read as such.
        let mut batch = Writer::new();
        batch.u32(1).bytes(b"p").u32(1).u64(5);
        let mut older = Writer::new();
        older.u32(1).u64(1).bytes(&batch.0);
        assert_eq!(
            Inbox::default().take(&[("c", &older.0)]),
            Batch {
                placed: vec![("p".to_string(), vec![5])],
                stored: vec![],
            }
        );
    }

    #[test]
    fn a_value_carries_the_last_batches_only_and_garbage_yields_nothing() {
        let host = FakeHost::new();
        let (w, elected) = (host.vm(), host.vm());
        let mut log = PickLog::start(&w).unwrap();
        let mut out = Outbox::default();
        let mut last = Vec::new();
        for i in 0..(BATCHES as u64 + 2) {
            host.advance_ms(1);
            log.publish(&w, 1, &dispatch("p", i, &[100 + i])).unwrap();
            last = out.value(&elected, 0).unwrap().unwrap();
        }
        assert_eq!(decode(&last).len(), BATCHES);
        let mut inbox = Inbox::default();
        assert!(inbox.take(&[("b", b"\xff\xff\xff\xff garbage")]).is_empty());
        assert!(inbox.take(&[("b", &last[..last.len() - 3])]).placed.len() < BATCHES);
    }

    fn stored(id: u64) -> Event {
        Event::Stored {
            pod: "p".into(),
            id,
            tokens: 1,
        }
    }

    #[test]
    fn a_reader_at_the_slow_pace_misses_no_batch_made_at_the_busy_one() {
        let host = FakeHost::new();
        let (w, elected) = (host.vm(), host.vm());
        let mut log = PickLog::start(&w).unwrap();
        let mut out = Outbox::default();
        let mut inbox = Inbox::default();
        // 100 syncs 20 ms apart, each with a response stored since the last; the other replica
        // reads every 500 ms. With the last three batches only, it received 12 of them.
        let (mut value, mut got) = (Vec::new(), Vec::new());
        for i in 0..100u64 {
            host.advance_ms(20);
            log.publish(&w, 1, &stored(i)).unwrap();
            value = out.value(&elected, 1_000).unwrap().unwrap();
            out.written();
            if i % 25 == 24 {
                let batch = inbox.take(&[("b", &value)]);
                got.extend(batch.stored.iter().map(|n| n.id));
            }
        }
        assert_eq!(got, (0..100).collect::<Vec<_>>());
        assert!(decode(&value).len() > 25, "the last second's batches");
        // Older than that, only the last three stay.
        host.advance_ms(5_000);
        log.publish(&w, 1, &stored(100)).unwrap();
        value = out.value(&elected, 1_000).unwrap().unwrap();
        assert_eq!(decode(&value).len(), BATCHES);
        // Placements stay in the last three batches, as before; the stored responses all stay.
        for i in 0..10u64 {
            host.advance_ms(20);
            let hashes: Vec<u64> = (0..2_000).map(|k| i * 10_000 + k).collect();
            log.publish(&w, 1, &dispatch("p", i, &hashes)).unwrap();
            log.publish(&w, 1, &stored(200 + i)).unwrap();
            value = out.value(&elected, 1_000).unwrap().unwrap();
        }
        let read = Inbox::default().take(&[("b", &value)]);
        let placed: Vec<u64> = read.placed.iter().map(|(_, h)| h[0] / 10_000).collect();
        assert_eq!(placed, vec![7, 8, 9], "the last three batches'");
        let ids: Vec<u64> = read.stored.iter().map(|n| n.id).collect();
        assert_eq!(ids, [vec![100], (200..210).collect()].concat());
    }

    #[test]
    fn a_batch_is_bounded() {
        let host = FakeHost::new();
        let (w, elected) = (host.vm(), host.vm());
        let mut log = PickLog::start(&w).unwrap();
        for i in 0..3u64 {
            let hashes: Vec<u64> = (0..2_000).map(|k| i * 10_000 + k).collect();
            log.publish(&w, 1, &dispatch("p", i, &hashes)).unwrap();
        }
        let mut out = Outbox::default();
        let placed = Inbox::default().take(&[("b", &out.value(&elected, 0).unwrap().unwrap())]);
        let blocks: usize = placed.placed.iter().map(|(_, h)| h.len()).sum();
        assert_eq!((placed.placed.len(), blocks), (2, 4_000));
    }
}
