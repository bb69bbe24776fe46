//! Whether the pool's KV is about to run short before its pods fill: the demand arriving on it,
//! by Little's law (the requests in flight once the present pick rate has held for a request's
//! lifetime, each holding what this one would add), against the pool's budget. The pick needs it
//! where the pods' fill cannot say so yet: in a burst's first milliseconds every pod is nearly
//! empty, and a hot prefix copied to more pods then (its copy priced as shared by the requests to
//! come, `pick::copy_weight`) takes KV those requests need a few milliseconds later
//! (`Router::place` holds it home instead, asking `router::steps::kv_short`).
//!
//! The pool is the request's: the pods that may take it (those serving its model). A gateway in
//! front of several models' pools reads each against its own pods, so a burst on one model does
//! not read as the other's, nor a small pool's stream get lost in a large one's.
//!
//! Source of truth: the dispatches to the pool's pods that this VM has seen, its own and the
//! other workers' through the pick log (`ActiveBlocks::dispatched`, counted as they are
//! replayed, which every pick does first); and how long this VM's own requests lived on those
//! pods, dispatch to finish, or until one has ended there, the pods' scraped inter-token latency
//! (`pods::pace`). Per VM, approximate, and nothing shared is written. With several gateway
//! replicas both the dispatches and the budgets are this replica's (its grant of each pod's,
//! `replicas::share`), so the two sides of the comparison stay alike.
//!
//! What it cannot tell apart is far apart: a burst reads as past the pool's budget by several
//! times, and a hot prefix's steady stream (20 requests a second on 8 pods) at a fourteenth of it.

use hashbrown::HashMap;
use std::collections::VecDeque;

/// Dispatches the rate is measured over, at least: fewer decide nothing. A Poisson stream of 20 a
/// second (a hot prefix's benchmark) puts 16 dispatches within 75 ms, the span that would take it
/// past a pool's budget there, about once in 10⁹ picks; a burst gives them in 2–3 ms, before its
/// groups have requests enough in flight to be priced as shared.
pub const MIN_DISPATCHES: u64 = 16;
/// Samples kept per pool: twice [`MIN_DISPATCHES`], with one sample per count seen, so that a span
/// of that many dispatches is always among them.
const SAMPLES: usize = 32;
/// Pools whose samples are kept: one per model a gateway serves, as a rule; the pool picked for
/// longest ago makes room for a new one (a model's pods changing make a new pool too).
const POOLS: usize = 8;
/// A request's lifetime until this VM has seen one end on the pool's pods, per expected output
/// token, while no pod's inter-token latency is known either (a gateway that has just started,
/// before any answer): the low side of what engines take per token once their KV fills (a decode
/// step reads the weights and every sequence's KV: an 8B model on an H100 takes 6–7 ms alone,
/// 15–20 on an A100 with a full batch). Low, so that a fresh gateway under-reads demand rather
/// than over-reads it; the simulated pods take about 15 ms. A burst still reads as past the
/// budget: its picks came at 1.5–8 a ms (two Envoy workers), 64 tokens and 24 blocks each against
/// 8 pods of 1,945 blocks' budget, past it from just over one a ms.
pub const DEFAULT_TOKEN_MS: f64 = 10.0;
/// Weight of one finished request's lifetime in its pod's mean (about 20 requests' memory).
const WEIGHT: f64 = 0.05;

/// A pool as a pick sees it: which pods (`key`: [`pool_key`]) and how many dispatches to them
/// this VM has seen so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    pub key: u64,
    pub dispatched: u64,
}

/// The key of the pool made of these pods, by their places in the router's list of `of` pods (so
/// a new list makes every key anew: [`Demand::pods_changed`]): a bit per pod up to 64 pods, a
/// hash beyond.
pub fn pool_key(indices: &[usize], of: usize) -> u64 {
    if of <= 64 {
        indices.iter().fold(0, |mask, &i| mask | 1 << i)
    } else {
        let hash = |h, &i: &usize| crate::hash::chain(h, &(i as u64).to_le_bytes());
        indices.iter().fold(0, hash)
    }
}

#[derive(Debug, Default)]
pub struct Demand {
    /// Per pool, the one picked last first: its key, and (ms, dispatches) at this VM's picks,
    /// oldest first, one per count.
    pools: VecDeque<(u64, VecDeque<(u64, u64)>)>,
    /// Mean lifetime (ms) of this VM's requests on each pod, dispatch to finish, once one has
    /// ended there.
    lifetimes: HashMap<String, f64>,
}

impl Demand {
    /// Notes the pool's count as a pick read it.
    pub fn sample(&mut self, now: u64, pool: Reading) {
        // The pool picked last is first (a gateway of one model has no other): moved there
        // otherwise, or made.
        match self.pools.iter().position(|(key, _)| *key == pool.key) {
            Some(0) => {}
            Some(i) => {
                if let Some(known) = self.pools.remove(i) {
                    self.pools.push_front(known);
                }
            }
            None => {
                self.pools
                    .push_front((pool.key, VecDeque::with_capacity(SAMPLES)));
                self.pools.truncate(POOLS);
            }
        }
        let Some((_, samples)) = self.pools.front_mut() else {
            return;
        };
        if samples.back().is_none_or(|&(_, n)| n < pool.dispatched) {
            if samples.len() == SAMPLES {
                samples.pop_front();
            }
            samples.push_back((now, pool.dispatched));
        }
    }

    /// Dispatches per ms to the pool over the latest span of at least [`MIN_DISPATCHES`] of them that
    /// ends now, if its samples hold one (a span within one ms counts as one ms).
    pub fn rate(&self, now: u64, pool: Reading) -> Option<f64> {
        let (_, samples) = self.pools.iter().find(|(key, _)| *key == pool.key)?;
        let &(at, from) = samples
            .iter()
            .rev()
            .find(|&&(_, n)| pool.dispatched.saturating_sub(n) >= MIN_DISPATCHES)?;
        Some((pool.dispatched - from) as f64 / now.saturating_sub(at).max(1) as f64)
    }

    /// One of this VM's requests lived this long on `pod`.
    pub fn finished(&mut self, pod: &str, lifetime_ms: u64) {
        let ms = lifetime_ms as f64;
        let mean = self.lifetimes.entry_ref(pod).or_insert(ms);
        *mean += WEIGHT * (ms - *mean);
    }

    /// The router's list of pods changed: the pools' keys name other pods now, and the pods that
    /// left are forgotten.
    pub fn pods_changed(&mut self, keep: impl Fn(&str) -> bool) {
        self.pools.clear();
        self.lifetimes.retain(|pod, _| keep(pod));
    }

    /// Whether requests like this one (`blocks_each`: the KV blocks it would add, `output_tokens`:
    /// its expected answer, `token_ms`: the pods' time per token where known), arriving on the
    /// pool (`pods`, as read in `pool`) at the present rate for as long as one lives there, would
    /// hold more than `budget_blocks`, the pool's budget.
    pub fn short<'a>(
        &self,
        now: u64,
        (pool, pods): (Reading, impl Iterator<Item = &'a str>),
        (output_tokens, token_ms): (u64, Option<f64>),
        blocks_each: u64,
        budget_blocks: u64,
    ) -> bool {
        let Some(rate) = self.rate(now, pool) else {
            return false;
        };
        let (mut sum, mut n) = (0.0, 0u32);
        for ms in pods.filter_map(|pod| self.lifetimes.get(pod)) {
            sum += ms;
            n += 1;
        }
        let lifetime = if n > 0 {
            sum / f64::from(n)
        } else {
            output_tokens as f64 * token_ms.unwrap_or(DEFAULT_TOKEN_MS)
        };
        rate * lifetime * blocks_each as f64 > budget_blocks as f64
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    /// The first two of four pods.
    const PODS: [&str; 2] = ["a:1", "b:1"];

    /// The pool of [`PODS`] with `n` dispatches seen.
    fn at(n: u64) -> Reading {
        Reading {
            key: pool_key(&[0, 1], 4),
            dispatched: n,
        }
    }

    /// Picks every `gap` ms, `n` of them, from `t0`, each after one more dispatch.
    fn picks(d: &mut Demand, t0: u64, gap: u64, n: u64, from: u64) -> (u64, u64) {
        for k in 0..n {
            d.sample(t0 + k * gap, at(from + k));
        }
        (t0 + (n - 1) * gap, from + n - 1)
    }

    fn short(
        d: &Demand,
        now: u64,
        n: u64,
        output: (u64, Option<f64>),
        each: u64,
        budget: u64,
    ) -> bool {
        d.short(now, (at(n), PODS.into_iter()), output, each, budget)
    }

    #[test]
    fn a_rate_needs_enough_dispatches() {
        let mut d = Demand::default();
        let (now, n) = picks(&mut d, 1_000, 1, MIN_DISPATCHES, 0);
        assert_eq!(
            d.rate(now, at(n)),
            None,
            "15 dispatches since the first sample"
        );
        assert_eq!(
            d.rate(now + 1, at(n + 1)),
            Some(1.0),
            "16 dispatches in 16 ms"
        );
        // Other workers' dispatches count as much as this VM's own.
        assert_eq!(d.rate(now + 4, at(n + 40)), Some(40.0 / 4.0));
    }

    #[test]
    fn a_burst_reads_short_and_a_steady_stream_does_not() {
        // 16 requests in 2 ms, 64 tokens each (10 ms a token until one has ended), 20 blocks
        // each, against 8 pods of 1,945 blocks: 8 a ms × 640 ms × 20 = 102,400 blocks.
        let mut d = Demand::default();
        for k in 0..17 {
            d.sample(k / 8, at(k));
        }
        assert!(short(&d, 2, 16, (64, None), 20, 15_564));
        // At one pick a ms it is 12,800: not yet.
        assert!(!short(&d, 16, 16, (64, None), 20, 15_564));
        // The same pool at 20 requests a second that live 1.8 s and add 32 blocks: 1,152.
        let mut d = Demand::default();
        let (now, n) = picks(&mut d, 0, 50, 40, 0);
        (0..40).for_each(|_| d.finished("a:1", 1_800));
        assert!(!short(&d, now, n, (256, None), 32, 15_564));
        // Seventeen times the rate is past it: 0.33 a ms × 1.8 s × 32 = 19,200.
        let (now, n) = picks(&mut d, now + 3, 3, 40, n + 1);
        assert!(short(&d, now, n, (256, None), 32, 15_564));
    }

    #[test]
    fn a_pause_is_an_average_not_a_burst() {
        // This VM picks once, then again a second later after another worker's 100 picks: the
        // span is the second, not the millisecond of the replay.
        let mut d = Demand::default();
        d.sample(0, at(0));
        d.sample(1_000, at(100));
        assert_eq!(d.rate(1_000, at(100)), Some(0.1));
        // Samples at one count (a line retried at one room) are one sample.
        let mut d = Demand::default();
        (0..100).for_each(|t| d.sample(t, at(5)));
        d.sample(200, at(21));
        assert_eq!(d.rate(200, at(21)), Some(16.0 / 200.0));
    }

    #[test]
    fn each_pool_reads_its_own_dispatches() {
        // A burst on one model's pods, while another model's pool takes a request a second.
        let other = |n| Reading {
            key: pool_key(&[2, 3], 4),
            dispatched: n,
        };
        let mut d = Demand::default();
        for k in 0..40 {
            d.sample(k / 8, at(k));
            d.sample(k / 8, other(k / 40));
        }
        assert!(d.rate(5, at(40)).is_some_and(|r| r >= 8.0));
        assert_eq!(d.rate(5, other(1)), None, "one dispatch there");
        // As many pools as models, then the one picked longest ago gives way: six more, each
        // of one pod of sixteen, make eight, of which the first pool is the oldest.
        let one = |pod| Reading {
            key: pool_key(&[pod], 16),
            dispatched: 1,
        };
        (4..4 + POOLS - 2).for_each(|pod| d.sample(10, one(pod)));
        assert!(d.rate(5, at(40)).is_some(), "eight pools");
        d.sample(10, one(15));
        assert_eq!(d.rate(5, at(40)), None, "forgotten");
    }

    #[test]
    fn lifetimes_learned_replace_the_pace_and_the_pace_the_default() {
        let mut d = Demand::default();
        let (now, n) = picks(&mut d, 0, 10, 20, 0);
        // 0.1 a ms × 10 tokens × 10 ms × 10 blocks = 100.
        assert!(short(&d, now, n, (10, None), 10, 99));
        assert!(!short(&d, now, n, (10, None), 10, 100));
        // The pods' pace, 30 ms a token: 300.
        assert!(short(&d, now, n, (10, Some(30.0)), 10, 299));
        assert!(!short(&d, now, n, (10, Some(30.0)), 10, 300));
        // A lifetime learned on another pool's pod says nothing of this one's.
        d.finished("c:1", 5_000);
        assert!(!short(&d, now, n, (10, Some(30.0)), 10, 300));
        d.finished("a:1", 1_000);
        assert!(short(&d, now, n, (10, Some(30.0)), 10, 999));
        assert!(!short(&d, now, n, (10, Some(30.0)), 10, 1_000));
        d.finished("a:1", 0);
        // 950 ms on a, 2,000 on b: the pool's requests live 1,475 ms.
        d.finished("b:1", 2_000);
        assert!(short(&d, now, n, (10, None), 10, 1_474));
        assert!(!short(&d, now, n, (10, None), 10, 1_475));
        d.pods_changed(|pod| pod != "b:1");
        assert_eq!(d.rate(now, at(n)), None, "the pools are made anew");
        let (now, n) = picks(&mut d, now, 10, 20, n);
        assert!(short(&d, now, n, (10, None), 10, 949));
        assert!(!short(&d, now, n, (10, None), 10, 950));
    }
}
