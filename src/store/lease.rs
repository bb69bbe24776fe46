//! One worker elected among all of Envoy's VMs, by a lease in shared data (`kvgate.lease`, the
//! source of truth): the holder renews it every tick, and another VM takes over once it lapses.
//! The holder is the one scraper of pod metrics and discovery (`pods::scrape`) and the one
//! syncing with etcd (`replicas::sync`).

use crate::store::codec::{Reader, Writer};
use crate::store::interface::{update, Store, StoreError};

const LEASE_KEY: &str = "kvgate.lease";

/// Takes or renews the lease; true when this VM holds it until `now + ttl`.
pub fn hold_lease(store: &dyn Store, vm: u32, now: u64, ttl_ms: u64) -> Result<bool, StoreError> {
    let got = update(store, LEASE_KEY, |cur| {
        let (holder, expires) = cur
            .and_then(|b| {
                let mut r = Reader(b);
                Some((r.u32()?, r.u64()?))
            })
            .unwrap_or((0, 0));
        if holder != vm && expires > now {
            return None;
        }
        let mut w = Writer::new();
        w.u32(vm).u64(now.saturating_add(ttl_ms));
        Some((w.0, ()))
    })?;
    Ok(got.is_some())
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::test_support::two_vms;

    #[test]
    fn one_lease_holder_until_it_lapses() {
        let (a, b) = two_vms();
        assert!(hold_lease(&a, 1, 0, 1_000).unwrap());
        assert!(!hold_lease(&b, 2, 500, 1_000).unwrap());
        assert!(hold_lease(&a, 1, 900, 1_000).unwrap(), "renewal");
        assert!(!hold_lease(&b, 2, 1_800, 1_000).unwrap());
        assert!(
            hold_lease(&b, 2, 1_901, 1_000).unwrap(),
            "takeover after lapse"
        );
        assert!(!hold_lease(&a, 1, 1_950, 1_000).unwrap());
    }
}
