//! Responses the engines store, and the pod each is stored on: the Responses API's `store`
//! (on unless a request turns it off) keeps a response in its server's memory, and a follow-up
//! naming it as `previous_response_id` (or a `GET /v1/responses/{id}`) is answered only by that
//! server (vLLM keeps its store in the API server's process; its PR 37938, a store shared by
//! several instances, was not merged). Sent anywhere else it is not found: behind a pool of n pods,
//! n − 1 follow-ups in n failed. So the pod and the conversation's tokens so far are remembered
//! by response id, and the follow-up goes to that pod, its prompt counted with the history the
//! engine prepends.
//!
//! Source of truth: `SLOTS` shared records `kvgate.stored.<slot>`, a response's slot a hash of its
//! id, each the slot's last `PER_SLOT` responses (bounded keys and memory, oldest forgotten
//! first), written by the worker that saw the response end, and by the elected worker for the
//! responses other gateway replicas saw end: with replicas sharing etcd, each note is logged
//! (`Event::Stored`) and travels to the others with the replica's placements
//! (`replicas::placements`), a sync or two late (docs/design.md).

use crate::hash::fnv1a;
use crate::store::codec::{Reader, Writer};
use crate::store::interface::{create_if_missing, update_record, Store, StoreError};

const VERSION: u8 = 1;
/// Shared-data keys, one per slot: keys cannot be deleted, so their number is fixed.
pub const SLOTS: u64 = 256;
/// Responses a slot remembers: `SLOTS × PER_SLOT` in all (4,096).
const PER_SLOT: usize = 16;
const MAX_POD_CHARS: usize = 256;

fn key(slot: u64) -> String {
    format!("kvgate.stored.{slot}")
}

/// Where a stored response lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub pod: String,
    /// The conversation's tokens so far (the response's prompt, its history included, and its
    /// answer): what the engine prepends to a follow-up's input.
    pub tokens: u64,
}

/// A response stored on a pod, as the pick log and the other replicas carry it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub pod: String,
    /// The response id's hash (`id_hash`).
    pub id: u64,
    pub tokens: u64,
}

#[derive(Debug, Default)]
struct Slot(Vec<(u64, Stored)>);

fn decode(bytes: &[u8]) -> Option<Slot> {
    let mut r = Reader(bytes);
    if r.u8()? != VERSION {
        return None;
    }
    let entries = r.list(20, |r| {
        let id = r.u64()?;
        let tokens = r.u64()?;
        let pod = std::str::from_utf8(r.bytes()?).ok()?.to_string();
        Some((id, Stored { pod, tokens }))
    })?;
    Some(Slot(entries))
}

fn encode(slot: &Slot) -> Vec<u8> {
    let mut w = Writer::new();
    w.u8(VERSION).u32(slot.0.len() as u32);
    for (id, s) in &slot.0 {
        w.u64(*id).u64(s.tokens).bytes(s.pod.as_bytes());
    }
    w.0
}

/// Creates the slots before traffic can touch them: a compare-and-swap on a missing key is a
/// blind create, in which one of two workers' first responses would be lost.
pub fn ensure(store: &dyn Store) -> Result<(), StoreError> {
    let empty = encode(&Slot::default());
    (0..SLOTS).try_for_each(|slot| create_if_missing(store, &key(slot), &empty))
}

/// A response id as the slots, the pick log and the other replicas know it: ids are long, and
/// 64 bits tell 4,096 of them apart.
pub fn id_hash(id: &str) -> u64 {
    fnv1a(id.as_bytes())
}

/// Notes that `pod` stored the response whose id hashes to `h` (`id_hash`), whose conversation
/// now holds `tokens`.
pub fn remember(store: &dyn Store, h: u64, pod: &str, tokens: u64) -> Result<(), StoreError> {
    if pod.len() > MAX_POD_CHARS {
        return Ok(());
    }
    let stored = Stored {
        pod: pod.to_string(),
        tokens,
    };
    update_record(store, &key(h % SLOTS), decode, encode, |slot| {
        slot.0.retain(|(other, _)| *other != h);
        if slot.0.len() >= PER_SLOT {
            slot.0.remove(0);
        }
        slot.0.push((h, stored.clone()));
    })
}

/// Shared: until when some worker holds a request for another replica's note of a stored
/// response (`etcd.followUpWaitMs`): the elected worker's sync keeps the busy pace until then.
const SOUGHT_KEY: &str = "kvgate.stored.sought";

/// A request is held for another replica's note until `until_ms` (a blind write: every writer
/// writes a later time, give or take a worker's clock).
pub fn seek(store: &dyn Store, until_ms: u64) -> Result<(), StoreError> {
    store.set(SOUGHT_KEY, &until_ms.to_le_bytes(), None)
}

/// Whether a request may still be held for another replica's note.
pub fn sought(store: &dyn Store) -> Result<bool, StoreError> {
    let until = store.get(SOUGHT_KEY)?.value.and_then(|b| Reader(&b).u64());
    Ok(until.is_some_and(|until| store.now_ms() <= until))
}

/// Shared: when the elected worker's last read of etcd found no other replica alive (its
/// clock), 0 when it found some; absent before the first read.
const ALONE_KEY: &str = "kvgate.stored.alone";

/// What the last read of etcd found (`replicas::sync`): whether another replica is alive.
pub fn note_peers(store: &dyn Store, peers: bool) -> Result<(), StoreError> {
    let at = if peers { 0 } else { store.now_ms().max(1) };
    store.set(ALONE_KEY, &at.to_le_bytes(), None)
}

/// Whether a read of etcd since `since_ms` found no other replica alive: then none is there to
/// have stored a response this one has not heard of, or to send a note of it. False until such
/// a read (etcd out of reach, or not read since): others may be there.
pub fn alone_since(store: &dyn Store, since_ms: u64) -> Result<bool, StoreError> {
    let at = store.get(ALONE_KEY)?.value.and_then(|b| Reader(&b).u64());
    Ok(at.is_some_and(|at| at > 0 && at >= since_ms))
}

/// Where response `id` is stored, if this Envoy saw it end, or heard of it from another
/// replica.
pub fn find(store: &dyn Store, id: &str) -> Result<Option<Stored>, StoreError> {
    let h = id_hash(id);
    let Some(bytes) = store.get(&key(h % SLOTS))?.value else {
        return Ok(None);
    };
    Ok(decode(&bytes).and_then(|slot| {
        slot.0
            .into_iter()
            .find_map(|(other, s)| (other == h).then_some(s))
    }))
}

/// The response id a `/v1/responses/{id}` path (or one of its sub-paths: `/cancel`,
/// `/input_items`) names.
pub fn id_in_path(path: &str) -> Option<&str> {
    // Read from the end, a segment at a time: every request's path passes here.
    let end = memchr::memchr2(b'?', b'#', path.as_bytes()).unwrap_or(path.len());
    let path = path.get(..end)?;
    let mut segments = path.rsplit('/');
    let mut id = segments.next()?;
    if matches!(id, "cancel" | "input_items") {
        id = segments.next()?;
    }
    let named = segments.next()? == "responses" && segments.next()? == "v1";
    (named && !id.is_empty()).then_some(id)
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::store::fake_host::FakeHost;

    #[test]
    fn a_response_is_found_on_its_pod_until_its_slot_forgets_it() {
        let host = FakeHost::new();
        let vm = host.vm();
        ensure(&vm).unwrap();
        assert_eq!(find(&vm, "resp_a").unwrap(), None);
        remember(&vm, id_hash("resp_a"), "10.0.0.1:8000", 120).unwrap();
        let other = host.vm();
        assert_eq!(
            find(&other, "resp_a").unwrap(),
            Some(Stored {
                pod: "10.0.0.1:8000".into(),
                tokens: 120
            }),
            "every worker finds it"
        );
        // A follow-up's own response replaces nothing but itself; the slot keeps its last 16.
        remember(&vm, id_hash("resp_a"), "10.0.0.1:8000", 300).unwrap();
        assert_eq!(find(&vm, "resp_a").unwrap().map(|s| s.tokens), Some(300));
        let h = id_hash("resp_a") % SLOTS;
        let mut filled = 0;
        for i in 0.. {
            let id = format!("resp_{i}");
            if id_hash(&id) % SLOTS == h && id != "resp_a" {
                remember(&vm, id_hash(&id), "10.0.0.2:8000", 1).unwrap();
                filled += 1;
                if filled == PER_SLOT {
                    break;
                }
            }
        }
        assert_eq!(
            find(&vm, "resp_a").unwrap(),
            None,
            "the oldest is forgotten"
        );
    }

    #[test]
    fn garbage_in_a_slot_is_nothing_stored() {
        let host = FakeHost::new();
        let vm = host.vm();
        let h = id_hash("resp_x") % SLOTS;
        vm.set(&key(h), b"\x07garbage", None).unwrap();
        assert_eq!(find(&vm, "resp_x").unwrap(), None);
        remember(&vm, id_hash("resp_x"), "p:1", 5).unwrap();
        assert_eq!(
            find(&vm, "resp_x").unwrap().map(|s| s.pod),
            Some("p:1".into())
        );
    }

    #[test]
    fn paths_name_their_response() {
        assert_eq!(id_in_path("/v1/responses/resp_1"), Some("resp_1"));
        assert_eq!(id_in_path("/v1/responses/resp_1/cancel"), Some("resp_1"));
        assert_eq!(
            id_in_path("/v1/responses/resp_1?stream=true"),
            Some("resp_1")
        );
        assert_eq!(id_in_path("/v1/responses"), None);
        assert_eq!(id_in_path("/v1/responses/"), None);
        assert_eq!(id_in_path("/v1/chat/completions"), None);
        assert_eq!(id_in_path("/v1/responses/cancel"), None);
        assert_eq!(
            id_in_path("/openai/v1/responses/resp_2/input_items"),
            Some("resp_2")
        );
    }
}
