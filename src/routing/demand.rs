//! Whether the pool's KV is about to run short before its pods fill: the demand arriving on it,
//! by Little's law (the requests in flight once the present pick rate has held for a request's
//! lifetime, each holding what this one would add), against the pool's budget. The pick needs it
//! where the pods' fill cannot say so yet: in a burst's first milliseconds every pod is nearly
//! empty, and a hot prefix copied to more pods then (its copy priced as shared by the requests to
//! come, `pick::copy_weight`) takes KV those requests need a few milliseconds later
//! (`Router::place` holds it home instead, asking `router::steps::kv_short`).
//!
//! Source of truth: the pick log's head (`kvgate.log.seq`), which counts every worker's appends
//! (one per dispatch; finishes ride on them), as this VM's picks read it anyway; and how long this
//! VM's own requests lived, dispatch to finish, or until one has ended, the pods' scraped
//! inter-token latency (`pods::pace`). Per VM, approximate, and nothing shared is written. With
//! several gateway replicas the log and the budgets are both this replica's (its grant of each
//! pod's, `replicas::share`), so the two sides of the comparison stay alike.
//!
//! What it cannot tell apart is far apart: a burst reads as past the pool's budget by several
//! times, and a hot prefix's steady stream (20 requests a second on 8 pods) at a fourteenth of it.

use std::collections::VecDeque;

/// Appends the rate is measured over, at least: fewer decide nothing. A Poisson stream of 20 a
/// second (a hot prefix's benchmark) puts 16 appends within 75 ms, the span that would take it
/// past a pool's budget there, about once in 10⁹ picks; a burst gives them in 2–3 ms, before its
/// groups have requests enough in flight to be priced as shared.
pub const MIN_APPENDS: u64 = 16;
/// Samples kept: twice [`MIN_APPENDS`], with one sample per head seen, so that a span of that many
/// appends is always among them.
const SAMPLES: usize = 32;
/// A request's lifetime until this VM has seen one end, per expected output token, while no pod's
/// inter-token latency is known either (a gateway that has just started, before any answer): the
/// low side of what engines take per token once their KV fills (a decode step reads the weights
/// and every sequence's KV: an 8B model on an H100 takes 6–7 ms alone, 15–20 on an A100 with a
/// full batch). Low, so that a fresh gateway under-reads demand rather than over-reads it; the
/// simulated pods take about 15 ms. A burst still reads as past the budget: its picks came at
/// 1.5–8 a ms (two Envoy workers), 64 tokens and 24 blocks each against 8 pods of 1,945 blocks'
/// budget, past it from just over one a ms.
pub const DEFAULT_TOKEN_MS: f64 = 10.0;
/// Weight of one finished request's lifetime in the mean (about 20 requests' memory).
const WEIGHT: f64 = 0.05;

#[derive(Debug, Default)]
pub struct Demand {
    /// (ms, head) at this VM's picks, oldest first, one per head.
    samples: VecDeque<(u64, u64)>,
    /// Mean lifetime (ms) of this VM's requests, dispatch to finish, once one has ended.
    lifetime_ms: Option<f64>,
}

impl Demand {
    /// Notes the log's head as a pick read it.
    pub fn sample(&mut self, now: u64, head: u64) {
        if self.samples.back().is_some_and(|&(_, h)| h >= head) {
            return;
        }
        if self.samples.len() == SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((now, head));
    }

    /// Appends per ms over the latest span of at least [`MIN_APPENDS`] appends that ends now, if
    /// the samples hold one (a span within one ms counts as one ms).
    pub fn rate(&self, now: u64, head: u64) -> Option<f64> {
        let &(at, from) = self
            .samples
            .iter()
            .rev()
            .find(|&&(_, h)| head.saturating_sub(h) >= MIN_APPENDS)?;
        Some((head - from) as f64 / now.saturating_sub(at).max(1) as f64)
    }

    /// One of this VM's requests lived this long.
    pub fn finished(&mut self, lifetime_ms: u64) {
        let ms = lifetime_ms as f64;
        self.lifetime_ms = Some(self.lifetime_ms.map_or(ms, |m| m + WEIGHT * (ms - m)));
    }

    /// Whether requests like this one (`blocks_each`: the KV blocks it would add, `output_tokens`:
    /// its expected answer, `token_ms`: the pods' time per token where known), arriving at the
    /// present rate for as long as one lives, would hold more than `budget_blocks`, the pool's
    /// budget.
    pub fn short(
        &self,
        now: u64,
        head: u64,
        (output_tokens, token_ms): (u64, Option<f64>),
        blocks_each: u64,
        budget_blocks: u64,
    ) -> bool {
        let Some(rate) = self.rate(now, head) else {
            return false;
        };
        let lifetime = self
            .lifetime_ms
            .unwrap_or_else(|| output_tokens as f64 * token_ms.unwrap_or(DEFAULT_TOKEN_MS));
        rate * lifetime * blocks_each as f64 > budget_blocks as f64
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    /// Picks every `gap` ms, `n` of them, from `t0`, each one append.
    fn picks(d: &mut Demand, t0: u64, gap: u64, n: u64, head0: u64) -> (u64, u64) {
        for k in 0..n {
            d.sample(t0 + k * gap, head0 + k);
        }
        (t0 + (n - 1) * gap, head0 + n - 1)
    }

    #[test]
    fn a_rate_needs_enough_appends() {
        let mut d = Demand::default();
        let (now, head) = picks(&mut d, 1_000, 1, MIN_APPENDS, 0);
        assert_eq!(d.rate(now, head), None, "15 appends since the first sample");
        assert_eq!(d.rate(now + 1, head + 1), Some(1.0), "16 appends in 16 ms");
        // Appends by other workers count as much as this VM's own picks.
        assert_eq!(d.rate(now + 4, head + 40), Some(40.0 / 4.0));
    }

    #[test]
    fn a_burst_reads_short_and_a_steady_stream_does_not() {
        // 16 requests in 2 ms, 64 tokens each (10 ms a token until one has ended), 20 blocks
        // each, against 8 pods of 1,945 blocks: 8 a ms × 640 ms × 20 = 102,400 blocks.
        let mut d = Demand::default();
        for k in 0..17 {
            d.sample(k / 8, k);
        }
        assert!(d.short(2, 16, (64, None), 20, 15_564));
        // At one pick a ms it is 12,800: not yet.
        assert!(!d.short(16, 16, (64, None), 20, 15_564));
        // The same pool at 20 requests a second that live 1.8 s and add 32 blocks: 1,152.
        let mut d = Demand::default();
        let (now, head) = picks(&mut d, 0, 50, 40, 0);
        (0..40).for_each(|_| d.finished(1_800));
        assert!(!d.short(now, head, (256, None), 32, 15_564));
        // Seventeen times the rate is past it: 0.33 a ms × 1.8 s × 32 = 19,200.
        let (now, head) = picks(&mut d, now + 3, 3, 40, head + 1);
        assert!(d.short(now, head, (256, None), 32, 15_564));
    }

    #[test]
    fn a_pause_is_an_average_not_a_burst() {
        // This VM picks once, then again a second later after another worker's 100 picks: the
        // span is the second, not the millisecond of the replay.
        let mut d = Demand::default();
        d.sample(0, 0);
        d.sample(1_000, 100);
        assert_eq!(d.rate(1_000, 100), Some(0.1));
        // Samples at one head (a line retried at one room) are one sample.
        let mut d = Demand::default();
        (0..100).for_each(|t| d.sample(t, 5));
        d.sample(200, 21);
        assert_eq!(d.rate(200, 21), Some(16.0 / 200.0));
    }

    #[test]
    fn lifetimes_learned_replace_the_pace_and_the_pace_the_default() {
        let mut d = Demand::default();
        let (now, head) = picks(&mut d, 0, 10, 20, 0);
        // 0.1 a ms × 10 tokens × 10 ms × 10 blocks = 100.
        assert!(d.short(now, head, (10, None), 10, 99));
        assert!(!d.short(now, head, (10, None), 10, 100));
        // The pods' pace, 30 ms a token: 300.
        assert!(d.short(now, head, (10, Some(30.0)), 10, 299));
        assert!(!d.short(now, head, (10, Some(30.0)), 10, 300));
        d.finished(1_000);
        assert!(d.short(now, head, (10, Some(30.0)), 10, 999));
        assert!(!d.short(now, head, (10, Some(30.0)), 10, 1_000));
        d.finished(0);
        assert!((d.lifetime_ms.unwrap_or(0.0) - 950.0).abs() < 1e-9);
    }
}
