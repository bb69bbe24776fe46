//! The approximate index of what each pod's prefix cache holds: block hash → last use, per pod,
//! bounded by the pod's cache capacity in blocks (least recently used evicted first) and by a
//! time-to-live. Each VM keeps its own replica, fed by its own picks and by the pick log, so a
//! lookup is a local map probe per block, with no host call.

use hashbrown::HashMap;
use std::collections::VecDeque;

/// When a block was last used: a touch number for the LRU order (milliseconds repeat when many
/// touches land in one tick) and the time, for the TTL.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Use {
    touch: u64,
    ms: u64,
}

#[derive(Default)]
struct PodBlocks {
    last_use: HashMap<u64, Use>,
    /// Touches in order; an entry is stale when `last_use` has a later touch for its hash.
    order: VecDeque<(u64, u64)>,
}

impl PodBlocks {
    fn evict_to(&mut self, capacity: usize, expire_before: u64) {
        while let Some(&(h, touch)) = self.order.front() {
            let current = self.last_use.get(&h).copied();
            let live = current.is_some_and(|u| u.touch == touch);
            let fresh = current.is_some_and(|u| u.ms >= expire_before);
            if live && self.last_use.len() <= capacity && fresh {
                break;
            }
            self.order.pop_front();
            if live {
                self.last_use.remove(&h);
            }
        }
        // Repeated touches of the same blocks leave stale entries behind; rebuild when they
        // dominate so memory stays proportional to what is held.
        if self.order.len() > 4 * self.last_use.len() + 64 {
            let mut live: Vec<(u64, u64)> =
                self.last_use.iter().map(|(h, u)| (*h, u.touch)).collect();
            live.sort_by_key(|&(_, touch)| touch);
            self.order = live.into();
        }
    }
}

pub struct PrefixIndex {
    pods: HashMap<String, PodBlocks>,
    ttl_ms: u64,
    touches: u64,
}

impl PrefixIndex {
    pub fn new(ttl_ms: u64) -> Self {
        Self {
            pods: HashMap::new(),
            ttl_ms,
            touches: 0,
        }
    }

    /// How many leading blocks of `hashes` the pod is believed to hold.
    pub fn matched(&self, pod: &str, hashes: &[u64], now: u64) -> usize {
        let Some(p) = self.pods.get(pod) else {
            return 0;
        };
        let fresh_after = now.saturating_sub(self.ttl_ms);
        hashes
            .iter()
            .take_while(|h| p.last_use.get(*h).is_some_and(|u| u.ms >= fresh_after))
            .count()
    }

    /// The pod now holds these blocks (it was sent a request with this prompt).
    pub fn insert(&mut self, pod: &str, hashes: &[u64], now: u64, capacity: usize) {
        let p = self.pods.entry_ref(pod).or_default();
        for &h in hashes {
            self.touches += 1;
            p.last_use.insert(
                h,
                Use {
                    touch: self.touches,
                    ms: now,
                },
            );
            p.order.push_back((h, self.touches));
        }
        p.evict_to(capacity, now.saturating_sub(self.ttl_ms));
    }

    /// Forgets pods that are no longer in the pool.
    pub fn retain_pods(&mut self, keep: impl Fn(&str) -> bool) {
        self.pods.retain(|pod, _| keep(pod));
    }

    pub fn blocks_held(&self, pod: &str) -> usize {
        self.pods.get(pod).map_or(0, |p| p.last_use.len())
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn matches_leading_blocks_per_pod() {
        let mut idx = PrefixIndex::new(60_000);
        idx.insert("a", &[1, 2, 3], 0, 100);
        assert_eq!(idx.matched("a", &[1, 2, 3, 4], 0), 3);
        assert_eq!(idx.matched("a", &[1, 9, 3], 0), 1);
        assert_eq!(idx.matched("b", &[1, 2], 0), 0);
    }

    #[test]
    fn evicts_least_recently_used_beyond_capacity() {
        let mut idx = PrefixIndex::new(60_000);
        idx.insert("a", &[1, 2], 0, 3);
        idx.insert("a", &[10], 1, 3);
        idx.insert("a", &[1], 2, 3); // 1 is fresh again; 2 is now the oldest
        idx.insert("a", &[20], 3, 3);
        assert_eq!(idx.blocks_held("a"), 3);
        assert_eq!(idx.matched("a", &[1], 3), 1);
        assert_eq!(idx.matched("a", &[2], 3), 0);
    }

    #[test]
    fn blocks_touched_twice_in_one_millisecond_stay_recent() {
        let mut idx = PrefixIndex::new(60_000);
        // Four prompts sharing 3 leading blocks, replayed in one tick, in a pod holding 8.
        for tail in 0..4u64 {
            idx.insert("a", &[1, 2, 3, 100 + tail], 5, 8);
        }
        idx.insert("a", &[1, 2, 3, 200, 201], 5, 8);
        assert_eq!(
            idx.matched("a", &[1, 2, 3], 5),
            3,
            "the shared prefix is the most recent"
        );
    }

    #[test]
    fn expires_after_ttl_and_drops_departed_pods() {
        let mut idx = PrefixIndex::new(1_000);
        idx.insert("a", &[1], 0, 10);
        idx.insert("b", &[1], 0, 10);
        assert_eq!(idx.matched("a", &[1], 999), 1);
        assert_eq!(idx.matched("a", &[1], 1_001), 0);
        idx.retain_pods(|p| p == "a");
        assert_eq!(idx.blocks_held("b"), 0);
    }

    #[test]
    fn repeated_touches_keep_memory_bounded() {
        let mut idx = PrefixIndex::new(u64::MAX);
        for t in 0..10_000 {
            idx.insert("a", &[1, 2, 3], t, 100);
        }
        let p = idx.pods.get("a").unwrap();
        assert!(p.order.len() <= 4 * 3 + 64, "{}", p.order.len());
        assert_eq!(idx.matched("a", &[1, 2, 3], 10_000), 3);
    }
}
