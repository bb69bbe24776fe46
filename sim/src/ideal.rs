//! The ceiling of prefix caching, for benchmarks: what every pod together would hit with one
//! cache of unbounded size, every prefix computed once. Owns the set of every prompt block any
//! pod of this process was asked for; each pod counts its own requests' ideal hits (reported in
//! /sim/stats next to the real ones), so a benchmark can say how far a router is from perfect.
//!
//! It never affects scheduling: the engines' real caches are in kv.rs.

use std::collections::HashSet;
use std::sync::Mutex;

#[derive(Default)]
pub struct IdealCache {
    seen: Mutex<HashSet<u64>>,
}

impl IdealCache {
    /// Tokens of a new prompt an unbounded shared cache would hold: the longest run of its
    /// leading blocks asked for before, capped like vLLM's hit at `prompt_len - 1` tokens (the
    /// last token is always computed). Records every block of the prompt as asked for.
    pub fn hit_tokens(&self, block_hashes: &[u64], prompt_len: usize, block_size: usize) -> usize {
        let cacheable = prompt_len.saturating_sub(1) / block_size.max(1);
        let Ok(mut seen) = self.seen.lock() else {
            return 0;
        };
        let hit = block_hashes
            .iter()
            .take(cacheable)
            .take_while(|h| seen.contains(h))
            .count();
        seen.extend(block_hashes.iter().copied());
        hit * block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_leading_blocks_asked_for_before() {
        let c = IdealCache::default();
        assert_eq!(c.hit_tokens(&[1, 2, 3], 50, 16), 0);
        // Same first two blocks, then different: 32 tokens.
        assert_eq!(c.hit_tokens(&[1, 2, 9], 50, 16), 32);
        // A gap stops the run, as a prefix cache does.
        assert_eq!(c.hit_tokens(&[7, 2, 3], 50, 16), 0);
        // An identical prompt of exactly three blocks: the last token is computed, so two hit.
        assert_eq!(c.hit_tokens(&[1, 2, 3], 48, 16), 32);
    }
}
