//! A pod's key in this VM's routing tables: the prefix index, the active blocks, the adapters,
//! the record copies, the engines' step phases and the router's index bounds. It is the pod's
//! name hashed once, when the pool is read (`Router::refresh_pods` keeps one per pod beside the
//! names), so that a pick finds each pod in each table by a number. Keyed by the name, every
//! table hashed it and compared it byte for byte on every lookup, five or six lookups a pod on
//! every request: at 64 pods a fifth of a request's time in V8 (BENCHMARKS.md, *Each pod looked
//! up by a number*).
//!
//! Source of truth for who the pods are: the pool (`pods::pool`); an id says nothing the name
//! does not. Two names whose ids agree would share their tables' entries: the id is 64 bits of a
//! mixed FNV-1a hash, about one chance in 10^16 for a pool of 64 pods (the line's tickets name
//! the pods they wait for by the same kind of hash, `line::pod_key`).

use std::hash::{BuildHasherDefault, Hasher};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PodId(u64);

impl PodId {
    pub fn of(name: &str) -> PodId {
        // FNV-1a's low bits depend only on the bytes' low bits: mixed (splitmix64's finalizer)
        // so that the tables, which take the id as their hash, spread pods over every bit.
        let mut x = crate::hash::fnv1a(name.as_bytes());
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        PodId(x ^ (x >> 31))
    }
}

/// Hashes a `PodId` as itself: it is a hash already.
#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is reached (a `PodId` hashes its one field); bytes fold in as FNV-1a
        // would, so that any other key still hashes well.
        self.0 = crate::hash::fnv1a_from(self.0, bytes);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A routing table of one value per pod.
pub type PodMap<V> = hashbrown::HashMap<PodId, V, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn ids_tell_a_pools_names_apart_and_spread_over_the_low_bits() {
        let names: Vec<String> = (0..1024)
            .map(|i| format!("10.0.{}.{}:8000", i / 250, i % 250 + 1))
            .collect();
        let mut ids: Vec<u64> = names.iter().map(|n| PodId::of(n).0).collect();
        assert_eq!(PodId::of(&names[7]), PodId::of(&names[7].clone()));
        // The table's buckets are the low bits: 1,024 names over 256 buckets, none crowded.
        let mut buckets = [0u32; 256];
        for id in &ids {
            buckets[(id & 255) as usize] += 1;
        }
        assert!(buckets.iter().all(|&n| n <= 14), "{buckets:?}");
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), names.len());
    }

    #[test]
    fn a_table_finds_each_pod_by_its_id() {
        let mut map: PodMap<&str> = PodMap::default();
        for name in ["a:1", "b:1", "c:1"] {
            map.insert(PodId::of(name), name);
        }
        assert_eq!(map.get(&PodId::of("b:1")), Some(&"b:1"));
        assert_eq!(map.get(&PodId::of("d:1")), None);
    }
}
