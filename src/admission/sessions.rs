//! Conversations that finished a turn recently (kthena's session boost): their next turn goes
//! ahead in the queue, so it reaches a pod while that pod still caches the conversation. A ring of
//! the last `CAPACITY` finished turns in one shared record (`kvgate.sessions`), keyed by a hash of
//! the session id: bounded memory, no per-session keys, oldest forgotten first.

use crate::store::codec::{Reader, Writer};
use crate::store::interface::{create_if_missing, update, Store, StoreError};

const KEY: &str = "kvgate.sessions";
const CAPACITY: usize = 4096;

fn decode(bytes: &[u8]) -> Option<Vec<(u64, u64)>> {
    let mut r = Reader(bytes);
    let n = r.count(16)?;
    (0..n).map(|_| Some((r.u64()?, r.u64()?))).collect()
}

fn encode(ring: &[(u64, u64)]) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(ring.len() as u32);
    for (s, t) in ring {
        w.u64(*s).u64(*t);
    }
    w.0
}

pub fn ensure(store: &dyn Store) -> Result<(), StoreError> {
    create_if_missing(store, KEY, &encode(&[]))
}

/// Whether the session finished a turn within `window_ms`.
pub fn recently_finished(
    store: &dyn Store,
    session: u64,
    window_ms: u64,
) -> Result<bool, StoreError> {
    let now = store.now_ms();
    let ring = store
        .get(KEY)?
        .value
        .and_then(|b| decode(&b))
        .unwrap_or_default();
    Ok(ring
        .iter()
        .any(|&(s, t)| s == session && now.saturating_sub(t) <= window_ms))
}

pub fn finished_turn(store: &dyn Store, session: u64) -> Result<(), StoreError> {
    let now = store.now_ms();
    update(store, KEY, |bytes| {
        let mut ring = bytes.and_then(decode).unwrap_or_default();
        ring.retain(|&(s, _)| s != session);
        ring.push((session, now));
        if ring.len() > CAPACITY {
            let excess = ring.len() - CAPACITY;
            ring.drain(..excess);
        }
        Some((encode(&ring), ()))
    })
    .map(|_| ())
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::store::fake_host::FakeHost;

    #[test]
    fn remembers_recent_turns_within_window_and_capacity() {
        let host = FakeHost::new();
        let vm = host.vm();
        ensure(&vm).unwrap();
        finished_turn(&vm, 7).unwrap();
        assert!(recently_finished(&vm, 7, 1_000).unwrap());
        assert!(!recently_finished(&vm, 8, 1_000).unwrap());
        host.advance_ms(1_001);
        assert!(!recently_finished(&vm, 7, 1_000).unwrap());
        for s in 0..(CAPACITY as u64 + 10) {
            finished_turn(&vm, 1_000 + s).unwrap();
        }
        assert!(
            !recently_finished(&vm, 1_000, u64::MAX).unwrap(),
            "oldest forgotten"
        );
        assert!(recently_finished(&vm, 1_000 + CAPACITY as u64, u64::MAX).unwrap());
    }
}
