//! The approximate index of what each pod's prefix cache holds: block → last use, per pod,
//! bounded by the pod's cache capacity in blocks (least recently used evicted first) and by a
//! time-to-live. Each VM keeps its own replica, fed by its own picks and by the pick log, so a
//! lookup is a local map probe per block, with no host call.
//!
//! Sized for fleets: a block costs 8 bytes of map entry (and one control byte) per replica, so a
//! VM holds 16 pods of 30,000 indexed blocks in about 9 MiB (scripts/fleet_memory.py). A block is
//! kept as its chained hash folded to 32 bits (two blocks share one with probability about
//! n / 2³² in a pod holding n: 7·10⁻⁶ at 30,000, and a false match can only extend a true one,
//! since a prompt's blocks are matched from its start), and its last use as the pod's 32-bit touch
//! count; the touch counts' times are kept as a short list of checkpoints, which is what the TTL
//! reads (to within a 64th of it). Eviction beyond capacity is done in bulk, by the touch count
//! below which the oldest fall: no per-block order queue to keep. The bulk is centred on the
//! capacity (from a sixteenth above it to a sixteenth below), so that on average the index holds
//! as many blocks as the engine, whose cache is full under pressure: cut from the capacity to an
//! eighth below it, the index forgot prefixes the pod still held (the cache-pressure benchmark,
//! 2026-11-27, three runs each: it predicted 36.2–37.5 % hits where the engines reported
//! 37.8–38.9 %; centred, 38.4–38.7 % against 39.0–39.2 %, the engines' hits a point higher).
//!
//! It also keeps each prompt group's *home*: per pod, the first blocks of the prompts it was last
//! sent, kept after the blocks themselves are evicted. Under cache pressure (prefixes the pool
//! cannot all hold) a group whose copy was evicted everywhere goes back to the pod it used, so
//! each pod keeps serving the same few groups, and its cache, instead of every pod in turn
//! computing every group and evicting the others' (`Router::send_home`, in router/steps.rs).

use crate::routing::pod_id::{PodId, PodMap};
use hashbrown::HashMap;
use std::collections::VecDeque;

/// The checkpoints of a pod's touch counts span the TTL in about this many steps.
const CLOCK_STEPS: u64 = 64;

/// A pod keeps the homes of at most this share of its capacity in blocks (and at least
/// [`MIN_HOMES`]): a group matters here only while its prefix, of at least a block and usually
/// many, is worth computing there again, so a few entries per cached prompt's worth of blocks
/// is ample (1,024 blocks: 128 homes, 16 bytes each; 30,000 blocks: 3,750).
const HOMES_PER_BLOCK: usize = 8;
const MIN_HOMES: usize = 64;

/// The index's key for a block: its chained hash folded to 32 bits.
fn fingerprint(hash: u64) -> u32 {
    (hash ^ (hash >> 32)) as u32
}

#[derive(Default)]
struct PodBlocks {
    /// Block fingerprint → the touch count of its last use.
    last_use: HashMap<u32, u32>,
    /// The next touch count.
    touch: u32,
    /// (first touch count at or after, ms): when the touches happened, one checkpoint per step.
    clock: VecDeque<(u32, u64)>,
    /// When expired blocks were last swept out.
    swept_ms: u64,
    /// First block fingerprint of a prompt sent here → when it was last sent (ms).
    homes: HashMap<u32, u64>,
}

impl PodBlocks {
    /// The smallest touch count still within the TTL (`self.touch` when none is).
    fn fresh_from(&self, fresh_after: u64) -> u32 {
        self.clock
            .iter()
            .find(|&&(_, ms)| ms >= fresh_after)
            .map_or(self.touch, |&(t, _)| t)
    }

    fn touch(&mut self, hash: u64, now: u64, step_ms: u64) {
        if self.touch == u32::MAX {
            self.renumber();
        }
        if self
            .clock
            .back()
            .is_none_or(|&(_, ms)| now >= ms.saturating_add(step_ms))
        {
            self.clock.push_back((self.touch, now));
        }
        self.last_use.insert(fingerprint(hash), self.touch);
        self.touch += 1;
    }

    /// A sixteenth beyond capacity: keeps the most recently used fifteen sixteenths of it. Past
    /// a TTL since the last sweep: drops what expired, and the checkpoints older than the oldest
    /// kept use.
    fn evict_to(&mut self, capacity: usize, fresh_after: u64, now: u64, ttl_ms: u64) {
        let mut evicted = false;
        if self.last_use.len() > capacity + capacity / 16 {
            let keep = capacity - capacity / 16;
            if keep == 0 {
                // A pod that reports no KV holds nothing (and `cut` below would be out of range).
                self.last_use.clear();
            } else {
                let mut touches: Vec<u32> = self.last_use.values().copied().collect();
                let cut = touches.len() - keep;
                let (_, &mut oldest_kept, _) = touches.select_nth_unstable(cut);
                self.last_use.retain(|_, t| *t >= oldest_kept);
            }
            evicted = true;
        }
        if now.saturating_sub(self.swept_ms) >= ttl_ms {
            self.swept_ms = now;
            let fresh = self.fresh_from(fresh_after);
            self.last_use.retain(|_, t| *t >= fresh);
            self.homes.retain(|_, ms| *ms >= fresh_after);
            evicted = true;
        }
        if !evicted {
            return;
        }
        let oldest = self.last_use.values().copied().min().unwrap_or(self.touch);
        // The checkpoint a kept touch falls under stays: it dates that touch.
        while self.clock.len() > 1 && self.clock.get(1).is_some_and(|&(t, _)| t <= oldest) {
            self.clock.pop_front();
        }
    }

    /// `first` was sent here now; beyond the bound, the least recently sent eighth of the homes
    /// goes.
    fn home(&mut self, first: u64, now: u64, capacity: usize) {
        self.homes.insert(fingerprint(first), now);
        let bound = (capacity / HOMES_PER_BLOCK).max(MIN_HOMES);
        if self.homes.len() > bound {
            let mut sent: Vec<u64> = self.homes.values().copied().collect();
            let cut = sent.len() - (bound - bound / 8);
            let (_, &mut newest_dropped, _) = sent.select_nth_unstable(cut - 1);
            // Ties with the newest dropped go too, so the bound holds; this send's own stays.
            self.homes.retain(|_, ms| *ms > newest_dropped);
            self.homes.insert(fingerprint(first), now);
        }
    }

    /// The touch count ran out (after four billion uses): counts restart from the oldest kept,
    /// or, when the kept ones span nearly the whole range, from nothing.
    fn renumber(&mut self) {
        let base = self.last_use.values().copied().min().unwrap_or(self.touch);
        if self.touch - base > u32::MAX / 2 {
            *self = PodBlocks::default();
            return;
        }
        self.last_use.values_mut().for_each(|t| *t -= base);
        self.clock
            .iter_mut()
            .for_each(|c| c.0 = c.0.saturating_sub(base));
        self.touch -= base;
    }
}

pub struct PrefixIndex {
    pods: PodMap<PodBlocks>,
    ttl_ms: u64,
    /// The pod's blocks (of tokens) per indexed block (of characters), an average over prompts
    /// routed here: a pod's capacity comes in the first, the index counts the second, and text
    /// of more characters per token than `charsPerBlockToken` makes more indexed blocks than
    /// the engine holds (a 2,342-token prompt of English prose: 180 indexed blocks, 147 of the
    /// engine's), so bounded by the engine's count the index forgot prefixes the pod still held.
    density: f64,
}

/// How much each prompt moves [`PrefixIndex::density`], and its bounds: a stray estimate must not
/// swing the index's size, and a pod's index never holds more than twice its block count.
const DENSITY_WEIGHT: f64 = 1.0 / 64.0;
const DENSITY_RANGE: (f64, f64) = (0.5, 4.0);

impl PrefixIndex {
    pub fn new(ttl_ms: u64) -> Self {
        Self {
            pods: PodMap::default(),
            ttl_ms,
            density: 1.0,
        }
    }

    #[cfg(test)]
    pub fn density(&self) -> f64 {
        self.density
    }

    /// A prompt of `indexed` blocks is estimated at `engine_blocks` of the pod's blocks.
    pub fn learn_density(&mut self, indexed: usize, engine_blocks: f64) {
        if indexed == 0 || !engine_blocks.is_finite() || engine_blocks <= 0.0 {
            return;
        }
        let d = (engine_blocks / indexed as f64).clamp(DENSITY_RANGE.0, DENSITY_RANGE.1);
        self.density += DENSITY_WEIGHT * (d - self.density);
    }

    /// How many leading blocks of `hashes` the pod is believed to hold.
    pub fn matched(&self, pod: PodId, hashes: &[u64], now: u64) -> usize {
        let Some(p) = self.pods.get(&pod) else {
            return 0;
        };
        let fresh = p.fresh_from(now.saturating_sub(self.ttl_ms));
        hashes
            .iter()
            .take_while(|h| {
                p.last_use
                    .get(&fingerprint(**h))
                    .is_some_and(|t| *t >= fresh)
            })
            .count()
    }

    /// Whether the pod is believed to cache at least the first half of the prompt, by two lookups
    /// (its first block, and the last of its first half) instead of a walk: a cheap test over
    /// many parked requests (`drive::run_line`'s cache-first backfills), which a pick then makes
    /// exactly.
    pub fn caches_half(&self, pod: PodId, hashes: &[u64], now: u64) -> bool {
        let Some(p) = self.pods.get(&pod) else {
            return false;
        };
        let fresh = p.fresh_from(now.saturating_sub(self.ttl_ms));
        let held = |h: &u64| {
            p.last_use
                .get(&fingerprint(*h))
                .is_some_and(|t| *t >= fresh)
        };
        match (
            hashes.first(),
            hashes.get(hashes.len().div_ceil(2).saturating_sub(1)),
        ) {
            (Some(first), Some(half)) => held(first) && held(half),
            _ => false,
        }
    }

    /// The pod now holds these blocks (it was sent a request with this prompt); it holds
    /// `capacity` of its own blocks.
    pub fn insert(&mut self, pod: PodId, hashes: &[u64], now: u64, capacity: usize) {
        let capacity = (capacity as f64 / self.density).round() as usize;
        let step_ms = (self.ttl_ms / CLOCK_STEPS).max(1);
        let p = self.pods.entry(pod).or_default();
        // Last block first, so a prompt's head is its most recently used part and outlives its
        // tail, as in vLLM, which frees a finished request's blocks in reverse order so that the
        // tail is evicted first (and the simulator does the same): touched head first, the head
        // went first, the whole prompt stopped matching while the engine still held most of it.
        for &h in hashes.iter().rev() {
            p.touch(h, now, step_ms);
        }
        if let Some(&first) = hashes.first() {
            p.home(first, now, capacity);
        }
        p.evict_to(capacity, now.saturating_sub(self.ttl_ms), now, self.ttl_ms);
    }

    /// When a prompt starting with the block `first` was last sent to the pod, within the TTL:
    /// remembered after the pod's copy of it is evicted (the module header says why).
    pub fn sent_home(&self, pod: PodId, first: u64, now: u64) -> Option<u64> {
        let ms = *self.pods.get(&pod)?.homes.get(&fingerprint(first))?;
        (ms >= now.saturating_sub(self.ttl_ms)).then_some(ms)
    }

    /// Forgets every block believed in the pod (its engine started again with an empty cache,
    /// `pods::index_check`); the homes of its groups stay: still where each was served.
    pub fn forget_blocks(&mut self, pod: PodId) {
        if let Some(p) = self.pods.get_mut(&pod) {
            p.last_use.clear();
        }
    }

    /// Forgets pods that are no longer in the pool.
    pub fn retain_pods(&mut self, keep: impl Fn(PodId) -> bool) {
        self.pods.retain(|pod, _| keep(*pod));
    }

    pub fn blocks_held(&self, pod: PodId) -> usize {
        self.pods.get(&pod).map_or(0, |p| p.last_use.len())
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

    #[test]
    fn matches_leading_blocks_per_pod() {
        let mut idx = PrefixIndex::new(60_000);
        idx.insert(pod("a"), &[1, 2, 3], 0, 100);
        assert_eq!(idx.matched(pod("a"), &[1, 2, 3, 4], 0), 3);
        assert_eq!(idx.matched(pod("a"), &[1, 9, 3], 0), 1);
        assert_eq!(idx.matched(pod("b"), &[1, 2], 0), 0);
    }

    #[test]
    fn evicts_least_recently_used_beyond_capacity() {
        let mut idx = PrefixIndex::new(60_000);
        idx.insert(pod("a"), &[1, 2], 0, 3);
        idx.insert(pod("a"), &[10], 1, 3);
        idx.insert(pod("a"), &[1], 2, 3); // 1 is fresh again; 2 is now the oldest
        idx.insert(pod("a"), &[20], 3, 3);
        assert_eq!(idx.blocks_held(pod("a")), 3);
        assert_eq!(idx.matched(pod("a"), &[1], 3), 1);
        assert_eq!(idx.matched(pod("a"), &[2], 3), 0);
    }

    #[test]
    fn a_prompts_home_outlives_its_evicted_blocks_within_a_bound_and_the_ttl() {
        let mut idx = PrefixIndex::new(60_000);
        idx.insert(pod("a"), &[1, 2, 3], 0, 3);
        idx.insert(pod("a"), &[7, 8, 9], 5, 3); // evicts 1, 2, 3
        assert_eq!(idx.matched(pod("a"), &[1, 2, 3], 5), 0);
        assert_eq!(idx.sent_home(pod("a"), 1, 5), Some(0));
        assert_eq!(idx.sent_home(pod("a"), 7, 5), Some(5));
        assert_eq!(idx.sent_home(pod("b"), 1, 5), None);
        // Only a prompt's first block names its group.
        assert_eq!(idx.sent_home(pod("a"), 2, 5), None);
        assert_eq!(idx.sent_home(pod("a"), 1, 60_001), None, "past the TTL");
        // The bound: the least recently sent go first, the newest stays.
        for k in 0..(MIN_HOMES as u64 + 1) {
            idx.insert(pod("a"), &[100 + k], 10 + k, 4);
        }
        assert!(idx.pods[&pod("a")].homes.len() <= MIN_HOMES);
        assert_eq!(idx.sent_home(pod("a"), 1, 100), None);
        assert!(idx
            .sent_home(pod("a"), 100 + MIN_HOMES as u64, 100)
            .is_some());
        // Many sends in one millisecond still keep the bound (and the last send).
        for k in 0..(3 * MIN_HOMES as u64) {
            idx.insert(pod("a"), &[1_000 + k], 500, 4);
        }
        assert!(idx.pods[&pod("a")].homes.len() <= MIN_HOMES);
        assert!(idx
            .sent_home(pod("a"), 1_000 + 3 * MIN_HOMES as u64 - 1, 500)
            .is_some());
    }

    #[test]
    fn a_prompt_loses_its_tail_before_its_head() {
        let mut idx = PrefixIndex::new(60_000);
        idx.insert(pod("a"), &(0..80).collect::<Vec<u64>>(), 0, 100);
        // Another prompt of 40 blocks: 120 > 100 + 100 / 16, down to 100 - 100 / 16 = 94: 26 of
        // the first prompt's blocks go, from its end.
        idx.insert(pod("a"), &(1_000..1_040).collect::<Vec<u64>>(), 1, 100);
        assert_eq!(idx.matched(pod("a"), &(0..80).collect::<Vec<u64>>(), 1), 54);
    }

    #[test]
    fn capacity_counts_the_engines_blocks_at_the_learned_density() {
        let mut idx = PrefixIndex::new(60_000);
        // Prose: 4 of the engine's blocks for every 5 indexed ones.
        for _ in 0..1_000 {
            idx.learn_density(180, 144.0);
        }
        assert!((idx.density - 0.8).abs() < 0.01, "{}", idx.density);
        // A pod of 800 blocks holds 1,000 indexed ones, and up to a sixteenth more before it
        // keeps fifteen sixteenths.
        idx.insert(pod("a"), &(0..1_062).collect::<Vec<u64>>(), 0, 800);
        assert_eq!(idx.blocks_held(pod("a")), 1_062);
        idx.insert(pod("a"), &[5_000], 1, 800);
        assert_eq!(idx.blocks_held(pod("a")), 1_000 - 1_000 / 16);
        // Garbage moves nothing; extremes are bounded.
        idx.learn_density(0, 10.0);
        idx.learn_density(10, f64::NAN);
        assert!((idx.density - 0.8).abs() < 0.01);
        for _ in 0..10_000 {
            idx.learn_density(1, 1e9);
        }
        assert!(idx.density <= DENSITY_RANGE.1);
    }

    #[test]
    fn a_pod_with_no_room_holds_nothing_and_one_block_keeps_the_last() {
        // Found by the router fuzz target: a scrape of zero capacity made eviction cut past the end.
        let mut idx = PrefixIndex::new(60_000);
        idx.insert(pod("a"), &[1, 2, 3], 0, 0);
        assert_eq!(idx.blocks_held(pod("a")), 0);
        idx.insert(pod("a"), &[1, 2, 3], 1, 1);
        assert_eq!(idx.blocks_held(pod("a")), 1);
        assert_eq!(idx.matched(pod("a"), &[1], 1), 1, "the head kept");
    }

    #[test]
    fn blocks_touched_twice_in_one_millisecond_stay_recent() {
        let mut idx = PrefixIndex::new(60_000);
        // Four prompts sharing 3 leading blocks, replayed in one tick, in a pod holding 8.
        for tail in 0..4u64 {
            idx.insert(pod("a"), &[1, 2, 3, 100 + tail], 5, 8);
        }
        idx.insert(pod("a"), &[1, 2, 3, 200, 201], 5, 8);
        assert_eq!(
            idx.matched(pod("a"), &[1, 2, 3], 5),
            3,
            "the shared prefix is the most recent"
        );
    }

    #[test]
    fn expires_after_ttl_and_drops_departed_pods() {
        let mut idx = PrefixIndex::new(1_000);
        idx.insert(pod("a"), &[1], 0, 10);
        idx.insert(pod("b"), &[1], 0, 10);
        assert_eq!(idx.matched(pod("a"), &[1], 999), 1);
        assert_eq!(idx.matched(pod("a"), &[1], 1_001), 0);
        idx.retain_pods(|p| p == pod("a"));
        assert_eq!(idx.blocks_held(pod("b")), 0);
    }

    #[test]
    fn repeated_touches_keep_memory_bounded() {
        let mut idx = PrefixIndex::new(1_000);
        for t in 0..10_000 {
            idx.insert(pod("a"), &[1 << 32, 2 << 32, 3 << 32], t, 100);
        }
        let p = idx.pods.get(&pod("a")).unwrap();
        assert_eq!(p.last_use.len(), 3);
        assert!(
            p.clock.len() <= 2 * CLOCK_STEPS as usize + 2,
            "{}",
            p.clock.len()
        );
        assert_eq!(
            idx.matched(pod("a"), &[1 << 32, 2 << 32, 3 << 32], 10_000),
            3
        );
    }

    #[test]
    fn bulk_eviction_keeps_the_most_recent_and_sweeps_the_expired() {
        let mut idx = PrefixIndex::new(10_000);
        let blocks: Vec<u64> = (0..1_000u64).map(|i| i << 32).collect();
        for (i, chunk) in blocks.chunks(100).enumerate() {
            idx.insert(pod("a"), chunk, i as u64, 400);
        }
        // Between a sixteenth below the capacity and a sixteenth above.
        let held = idx.blocks_held(pod("a"));
        assert!((375..=425).contains(&held), "{held}");
        // The newest are all there, the oldest gone.
        assert_eq!(idx.matched(pod("a"), &blocks[900..], 10), 100);
        assert_eq!(idx.matched(pod("a"), &blocks[..1], 10), 0);
        // Past the TTL a sweep leaves only what was touched since.
        idx.insert(pod("a"), &[7 << 40], 20_000, 400);
        assert_eq!(idx.blocks_held(pod("a")), 1);
    }

    #[test]
    fn touch_counts_that_run_out_restart_from_the_oldest_kept() {
        let mut idx = PrefixIndex::new(60_000);
        idx.insert(pod("a"), &[1 << 32], 0, 100);
        let p = idx.pods.get_mut(&pod("a")).unwrap();
        p.touch = u32::MAX;
        p.last_use.insert(fingerprint(1 << 32), u32::MAX - 1);
        p.clock = VecDeque::from([(u32::MAX - 1, 0)]);
        idx.insert(pod("a"), &[2 << 32], 1, 100);
        assert_eq!(idx.matched(pod("a"), &[1 << 32], 2), 1);
        assert_eq!(idx.matched(pod("a"), &[2 << 32], 2), 1);
        assert!(idx.pods.get(&pod("a")).unwrap().touch < 10);
    }
}
