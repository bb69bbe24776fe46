//! This replica's share of one pod, as its workers see it (`kvgate.share.<ip:port>`): the grant it
//! holds in etcd, the sum of all grants there when it last synced, when it last reached etcd,
//! what the other replicas account for on the pod and what lapsed replicas' reclaimed grants still
//! hold out of it. Written by the syncing worker (`sync`), read on
//! every admission (`cap`) and by the scrape's feedback (`remote_tokens`). A copy of etcd, derived:
//! lost, the pod admits nothing until the next sync writes it again, which errs on the safe side.

use crate::config::Config;
use crate::replicas::split::admit_cap;
use crate::store::codec::{Reader, Writer};
use crate::store::interface::{update_record, Store, StoreError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Share {
    /// Tokens of the pod's budget this replica may reserve. Lowered as soon as a sync plans a
    /// smaller grant, raised only once etcd took a larger one, so it can sit below what the
    /// replica holds while a shrink is on its way to etcd; and below `published` while the
    /// replica's fair share is below what it holds, another owed a request there
    /// (`split::Next::cap`).
    pub grant: u64,
    /// The grant etcd holds for this replica, as far as it knows: the one read by the sync
    /// under way, or the one its last txn wrote. What the replica's requests hold on the pod
    /// never passes it; the status page shows it (`syncedGrantTokens`).
    pub published: u64,
    /// The sum of every replica's grant at the last sync, this one's included.
    pub granted: u64,
    /// When this replica last read etcd (its clock).
    pub contact_ms: u64,
    /// KV tokens the other replicas' in-flight requests hold on the pod, as they published them.
    pub remote_tokens: u64,
    /// Tokens of lapsed replicas' reclaimed grants the syncing worker holds out of the pod's
    /// split until a scrape has read the engine since (`sync::Ghost`): why the grants there may
    /// sum to less than the budget after a reclaim.
    pub ghost_tokens: u64,
}

pub fn key(pod: &str) -> String {
    format!("kvgate.share.{pod}")
}

impl Share {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u64(self.grant)
            .u64(self.published)
            .u64(self.granted)
            .u64(self.contact_ms)
            .u64(self.remote_tokens)
            .u64(self.ghost_tokens);
        w.0
    }

    fn decode(bytes: &[u8]) -> Option<Share> {
        let mut r = Reader(bytes);
        Some(Share {
            grant: r.u64()?,
            published: r.u64()?,
            granted: r.u64()?,
            contact_ms: r.u64()?,
            remote_tokens: r.u64()?,
            // Written last: a share an older module wrote reads as holding no ghosts.
            ghost_tokens: r.u64().unwrap_or(0),
        })
    }

    /// Reached etcd recently enough that its grant still stands as synced: within two syncs and
    /// a timeout.
    pub fn in_contact(&self, now: u64, cfg: &Config) -> bool {
        let e = &cfg.etcd;
        now.saturating_sub(self.contact_ms)
            <= e.sync_interval_ms
                .saturating_mul(2)
                .saturating_add(e.timeout_ms)
    }
}

/// The pod's share; `None` before the first sync wrote it.
pub fn read(store: &dyn Store, pod: &str) -> Result<Option<Share>, StoreError> {
    Ok(read_versioned(store, pod)?.0)
}

/// `read`, with the version it was read at.
pub fn read_versioned(
    store: &dyn Store,
    pod: &str,
) -> Result<(Option<Share>, Option<u32>), StoreError> {
    let read = store.get(&key(pod))?;
    Ok((read.value.and_then(|b| Share::decode(&b)), read.cas))
}

/// Applies `change` to the pod's share (a default one when none is written yet).
pub fn modify(
    store: &dyn Store,
    pod: &str,
    mut change: impl FnMut(&mut Share),
) -> Result<(), StoreError> {
    update_record(store, &key(pod), Share::decode, Share::encode, &mut change)
}

/// The hook admission reads a pod's budget through: with etcd off, the pod's budget itself; with
/// it on, what this replica's grant lets it reserve there now (`split::admit_cap`), nothing
/// before its first sync. An unlimited pod (`None`) stays unlimited.
pub fn cap(store: &dyn Store, cfg: &Config, pod: &str, budget: Option<u64>) -> Option<u64> {
    if budget.is_none() || !cfg.etcd.enabled() {
        return budget;
    }
    cap_of(read(store, pod).ok().flatten(), cfg, budget, store.now_ms())
}

/// `cap` from a share already read (the status page reads it with the pod's record).
pub fn cap_of(share: Option<Share>, cfg: &Config, budget: Option<u64>, now: u64) -> Option<u64> {
    let b = budget?;
    if !cfg.etcd.enabled() {
        return Some(b);
    }
    let Some(share) = share else {
        return Some(0);
    };
    Some(admit_cap(
        share.grant,
        share.granted,
        b,
        share.in_contact(now, cfg),
        cfg.etcd.max_replicas,
    ))
}

/// What the other replicas account for on the pod, for the scrape's unexplained-KV feedback: 0
/// with etcd off.
pub fn remote_tokens(store: &dyn Store, cfg: &Config, pod: &str) -> u64 {
    if !cfg.etcd.enabled() {
        return 0;
    }
    read(store, pod)
        .ok()
        .flatten()
        .map_or(0, |s| s.remote_tokens)
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn a_share_reads_back_as_written_and_an_older_modules_as_holding_no_ghosts() {
        let share = Share {
            grant: 1,
            published: 2,
            granted: 3,
            contact_ms: 4,
            remote_tokens: 5,
            ghost_tokens: 6,
        };
        let bytes = share.encode();
        assert_eq!(Share::decode(&bytes), Some(share));
        // The same share as a module before `ghost_tokens` wrote it: its last field missing.
        let older = &bytes[..bytes.len() - 8];
        assert_eq!(
            Share::decode(older),
            Some(Share {
                ghost_tokens: 0,
                ..share
            })
        );
        assert_eq!(Share::decode(&bytes[..8]), None, "a torn record is none");
    }
}
