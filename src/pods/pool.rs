//! The pool: who the pods are. The configured pods plus those the elected scraper discovers from
//! Envoy's admin `/clusters` (`pods::scrape`), kept in one shared record, `kvgate.pods`, that only
//! the lease holder writes. Each VM's router reads it at most once a second. Discovery runs on
//! its interval, or sooner when a worker saw Envoy fail a pick (`kvgate.pods.asked`): a pod gone
//! from Envoy's cluster is found at once rather than an interval later.

use crate::store::codec::{Reader, Writer};
use crate::store::interface::{Store, StoreError};

/// Discovered pods, written by the elected scraper: `kvgate.pods`.
pub const PODS_KEY: &str = "kvgate.pods";

/// When a worker last asked for discovery before its interval (`ask_discovery`): ms, little-endian.
pub const ASKED_KEY: &str = "kvgate.pods.asked";

/// Asks the lease holder to discover the pods at its next tick: Envoy could not use a pick, which
/// a pod gone from its cluster (a rollout, a scale-down) makes happen on every pick of it until
/// discovery drops it. A blind write: the latest ask is all that counts.
pub fn ask_discovery(store: &dyn Store, now_ms: u64) -> Result<(), StoreError> {
    store.set(ASKED_KEY, &now_ms.to_le_bytes(), None)
}

/// When discovery was last asked for (`ask_discovery`), if ever.
pub fn discovery_asked(store: &dyn Store) -> Option<u64> {
    let bytes = store.get(ASKED_KEY).ok()?.value?;
    Some(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?))
}

pub fn encode_pods(pods: &[String]) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(pods.len() as u32);
    for p in pods {
        w.bytes(p.as_bytes());
    }
    w.0
}

pub fn decode_pods(bytes: &[u8]) -> Option<Vec<String>> {
    let mut r = Reader(bytes);
    r.list(4, |r| String::from_utf8(r.bytes()?.to_vec()).ok())
}
