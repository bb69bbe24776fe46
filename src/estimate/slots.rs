//! Where a model's record lives among a fixed set of shared-data keys, `<prefix><0..SLOTS>`
//! (`kvgate.cal.`, `kvgate.calf.`, `kvgate.engine_len.`): open addressing by the model name's
//! hash. Shared-data keys can be neither deleted nor listed, so the set is fixed and a record is
//! found by looking: its hash's own slot first, then the next ones, `PROBES` in all. A record is
//! put in the first of them it already holds, else the first never written or left by its model
//! (what "left" is, each record's owner says: not written for `IDLE_MS`).
//!
//! Why: with a model in its hash's slot alone, two models of one fleet whose names fell in the
//! same of the 32 slots (a chance of 28 % among five models, 79 % among ten) left the second on
//! the static rule and the configured output prior for as long as the first was served, and kept
//! both models' engine counts in one value that each scrape overwrote with the other's.
//!
//! Nothing is ever past a key never written: a record is put in the first free key its model
//! reaches, and a written key stays written, so a look stops at the first key never written.
//! Two VMs putting two models in one key never written at once both write blind (Envoy ignores
//! compare-and-swap on a missing key): the later stays, and the other model's next write finds the
//! key held and goes on to the next.

use crate::store::interface::{Store, StoreError, Versioned};

/// Keys per kind of record.
pub(crate) const SLOTS: u64 = 32;
/// Keys a model's record may be in, from its hash's own: a look reads at most this many.
const PROBES: u64 = 8;
/// A record its model has not written for this long is free for another model to take.
pub(crate) const IDLE_MS: u64 = 10 * 60 * 1_000;

/// The keys a record of name hash `hash` may be in, in the order looked at.
fn keys(prefix: &str, hash: u64) -> impl Iterator<Item = String> + '_ {
    (0..PROBES).map(move |i| format!("{prefix}{}", hash.wrapping_add(i) % SLOTS))
}

/// What `mine` makes of the first value among `hash`'s keys it accepts (the record of the model
/// looked for); `None` when none is, up to the first key never written.
pub fn find<T>(
    store: &dyn Store,
    prefix: &str,
    hash: u64,
    mut mine: impl FnMut(&[u8]) -> Option<T>,
) -> Option<T> {
    for key in keys(prefix, hash) {
        let bytes = store.get(&key).ok()?.value?;
        if let Some(found) = mine(&bytes) {
            return Some(found);
        }
    }
    None
}

/// What a slot's value is to the model looking for its own (`place`, and the write's check).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// Its own record.
    Mine,
    /// Another model's record, in use.
    Other,
    /// Another model's left idle, or unreadable: free to take.
    Free,
}

impl Held {
    /// A value's standing to the model looking, from what its owner's decoding says of it:
    /// `None` when it does not decode; else whether it is the looker's own, and when its model
    /// last wrote it (another model's left `IDLE_MS` ago is free).
    pub fn of(read: Option<(bool, u64)>, now: u64) -> Held {
        match read {
            Some((true, _)) => Held::Mine,
            Some((false, written_ms)) if now.saturating_sub(written_ms) < IDLE_MS => Held::Other,
            _ => Held::Free,
        }
    }
}

/// The key the record of name hash `hash` is in (`held` says `Mine` of its value), or else the
/// one to put it in: the first never written, or `Free`; with the key as read, for the write's
/// compare-and-swap (`update_from`). `None` when every one of its keys holds another model's
/// record in use.
pub fn place(
    store: &dyn Store,
    prefix: &str,
    hash: u64,
    held: impl Fn(&[u8]) -> Held,
) -> Result<Option<(String, Versioned)>, StoreError> {
    let mut first_free = None;
    for key in keys(prefix, hash) {
        let read = store.get(&key)?;
        let Some(bytes) = &read.value else {
            return Ok(first_free.or(Some((key, read))));
        };
        match held(bytes) {
            Held::Mine => return Ok(Some((key, read))),
            Held::Free if first_free.is_none() => first_free = Some((key, read)),
            _ => {}
        }
    }
    Ok(first_free)
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::store::fake_host::FakeHost;

    // A record here is the owner's hash and whether it is in use.
    fn value(owner: u64, busy: bool) -> Vec<u8> {
        let mut v = owner.to_le_bytes().to_vec();
        v.push(u8::from(busy));
        v
    }
    fn owner(bytes: &[u8]) -> Option<u64> {
        Some(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?))
    }
    fn put(store: &dyn Store, hash: u64, busy: bool) -> Option<String> {
        let key = place(store, "t.", hash, |b| {
            if owner(b) == Some(hash) {
                Held::Mine
            } else if b.get(8) == Some(&1) {
                Held::Other
            } else {
                Held::Free
            }
        })
        .ok()??
        .0;
        store.set(&key, &value(hash, busy), None).ok()?;
        Some(key)
    }
    fn look(store: &dyn Store, hash: u64) -> Option<String> {
        let mut at = keys("t.", hash);
        find(store, "t.", hash, |b| {
            let key = at.next();
            (owner(b) == Some(hash)).then_some(key).flatten()
        })
    }

    #[test]
    fn models_whose_hashes_share_a_slot_each_get_one_and_are_found_there() {
        let vm = FakeHost::new().vm();
        let (a, b, c) = (5, 5 + SLOTS, 6);
        assert_eq!(look(&vm, a), None);
        assert_eq!(put(&vm, a, true).as_deref(), Some("t.5"));
        assert_eq!(put(&vm, b, true).as_deref(), Some("t.6"));
        // The next one's own slot is taken: it goes on past it.
        assert_eq!(put(&vm, c, true).as_deref(), Some("t.7"));
        for (hash, key) in [(a, "t.5"), (b, "t.6"), (c, "t.7")] {
            assert_eq!(look(&vm, hash).as_deref(), Some(key));
            // Written again: where it is, not a second copy.
            assert_eq!(put(&vm, hash, true).as_deref(), Some(key));
        }
        // Wrapping past the last slot.
        assert_eq!(put(&vm, SLOTS - 1, true).as_deref(), Some("t.31"));
        assert_eq!(put(&vm, 2 * SLOTS - 1, true).as_deref(), Some("t.0"));
    }

    #[test]
    fn a_slot_left_idle_is_taken_and_its_model_found_where_it_was_put_again() {
        let vm = FakeHost::new().vm();
        let (a, b) = (9, 9 + SLOTS);
        put(&vm, a, false);
        // The idle record's slot is the newcomer's, ahead of one never written.
        assert_eq!(put(&vm, b, true).as_deref(), Some("t.9"));
        assert_eq!(look(&vm, a), None);
        assert_eq!(put(&vm, a, true).as_deref(), Some("t.10"));
        assert_eq!(look(&vm, b).as_deref(), Some("t.9"));
        // A model further on is found past an idle record.
        vm.set("t.9", &value(b, false), None).unwrap();
        assert_eq!(look(&vm, a).as_deref(), Some("t.10"));
    }

    #[test]
    fn with_every_slot_in_reach_held_a_model_gets_none() {
        let vm = FakeHost::new().vm();
        for i in 0..PROBES {
            put(&vm, 3 + i * SLOTS, true);
        }
        assert_eq!(put(&vm, 3 + PROBES * SLOTS, true), None);
        assert_eq!(look(&vm, 3 + PROBES * SLOTS), None);
        // The one just past the reach of the full ones still has its own.
        assert_eq!(
            put(&vm, 3 + PROBES, true).as_deref(),
            Some(format!("t.{}", 3 + PROBES).as_str())
        );
    }
}
