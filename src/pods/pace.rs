//! Each pod's decode pace, learned from its engine's inter-token-latency histogram: the mean
//! inter-token latency over each scrape interval (two scrapes' totals apart), smoothed into the
//! pod's snapshot (`follow`), and the cost factor a pick gives each pod from it against the
//! others' (`cost_factors`): a pod whose tokens come twice as slowly as the pool's pays twice
//! for the same work. With no latency known, a pod's factor is 1: the configured weights as
//! they are.
//!
//! Stability: a pod's pace moves by a fraction of each interval's mean ([`WEIGHT`]), in log space
//! and by at most [`MAX_SAMPLE_STEP`] times from where it was, so no single scrape (a counter
//! reset, a stalled step, a garbage page) swings routing; the factor is bounded
//! ([`MIN_FACTOR`]..[`MAX_FACTOR`]). The feedback is negative: a pod given less work for being
//! slow decodes fewer sequences, its latency falls, and its factor with it, so the pool settles
//! where the pods' latencies weighted by their work meet rather than running away.

use crate::pods::metrics::ItlTotals;
use crate::pods::record::Snapshot;

/// Tokens an interval must have produced for its mean to count: fewer is one request's few
/// steps, dominated by whatever else that step did (a long prefill chunk).
pub const MIN_TOKENS: f64 = 20.0;
/// Interval means outside this range (seconds) are not inter-token latencies.
const PLAUSIBLE_S: core::ops::RangeInclusive<f64> = 1e-5..=60.0;
/// Weight of one interval's mean in the smoothed pace (an EWMA over scrapes: about four
/// intervals' memory).
pub const WEIGHT: f64 = 0.25;
/// One interval's mean counts as at most this many times faster or slower than the pace so far.
pub const MAX_SAMPLE_STEP: f64 = 4.0;
/// A pod's factor stays within these bounds of the configured weights.
pub const MIN_FACTOR: f64 = 0.25;
pub const MAX_FACTOR: f64 = 4.0;

/// Fills `next`'s smoothed inter-token latency from the previous snapshot's and the interval
/// between their totals. A scrape without the histogram (a pod marked down, a partial page, an
/// engine that does not export it) keeps the previous totals and pace: it says nothing of them.
pub fn follow(prev: Option<&Snapshot>, next: &mut Snapshot) {
    let pace = prev.map_or(0.0, |p| p.itl_s);
    next.itl_s = pace;
    let Some(now) = next.itl_totals else {
        next.itl_totals = prev.and_then(|p| p.itl_totals);
        return;
    };
    let Some(before) = prev.and_then(|p| p.itl_totals) else {
        return;
    };
    if let Some(mean) = interval_mean(before, now) {
        next.itl_s = smooth(pace, mean);
    }
}

/// The mean latency over an interval, when it says something: enough tokens, totals that did
/// not go backwards (a restarted engine starts a new baseline) and a plausible result.
fn interval_mean(before: ItlTotals, now: ItlTotals) -> Option<f64> {
    let tokens = now.count - before.count;
    let seconds = now.sum_s - before.sum_s;
    if !(tokens >= MIN_TOKENS && seconds >= 0.0) {
        return None;
    }
    Some(seconds / tokens).filter(|m| PLAUSIBLE_S.contains(m))
}

/// One step of the EWMA, in log space (a pace twice as slow and one twice as fast weigh alike),
/// the sample first brought within [`MAX_SAMPLE_STEP`] of the pace; the first sample is taken
/// as it is.
fn smooth(pace: f64, sample: f64) -> f64 {
    if pace <= 0.0 {
        return sample;
    }
    let step = (sample / pace).clamp(1.0 / MAX_SAMPLE_STEP, MAX_SAMPLE_STEP);
    pace * step.powf(WEIGHT)
}

/// Each pod's cost factor, from its smoothed latency (`paces`, 0 where unknown): its latency
/// over the geometric mean of the known ones, bounded. The reference is the pods compared, so
/// the factors say which of them is slower, not how fast any is: a pool of equal pods stays at 1
/// whatever its model's pace, and the geometric mean keeps a fast and a slow half symmetric
/// (×2 and ×½ of the configured weights, not ×1.33 and ×0.67).
pub fn cost_factors(paces: &[f64]) -> Vec<f64> {
    let known = |p: f64| p.is_finite() && p > 0.0;
    let (log_sum, n) = paces
        .iter()
        .filter(|&&p| known(p))
        .fold((0.0, 0usize), |(s, n), p| (s + p.ln(), n + 1));
    if n == 0 {
        return vec![1.0; paces.len()];
    }
    let reference = (log_sum / n as f64).exp();
    paces
        .iter()
        .map(|&p| {
            if known(p) {
                (p / reference).clamp(MIN_FACTOR, MAX_FACTOR)
            } else {
                1.0
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn scraped(sum_s: f64, count: f64) -> Snapshot {
        Snapshot {
            healthy: true,
            itl_totals: Some(ItlTotals { sum_s, count }),
            ..Snapshot::default()
        }
    }

    /// Follows a pod through scrapes of `(sum, count)` totals; its pace after each.
    fn paces(totals: &[(f64, f64)]) -> Vec<f64> {
        let mut prev: Option<Snapshot> = None;
        totals
            .iter()
            .map(|&(sum, count)| {
                let mut next = scraped(sum, count);
                follow(prev.as_ref(), &mut next);
                prev = Some(next);
                next.itl_s
            })
            .collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1e-9)
    }

    #[test]
    fn the_first_interval_sets_the_pace_and_later_ones_move_it_by_a_fraction() {
        // 10 ms a token, then 20 ms a token.
        let p = paces(&[(5.0, 1_000.0), (6.0, 1_100.0), (8.0, 1_200.0)]);
        assert_eq!(p[0], 0.0, "one scrape is no interval");
        assert!(close(p[1], 0.010), "{p:?}");
        assert!(close(p[2], 0.010 * 2f64.powf(WEIGHT)), "{p:?}");
        // Steady at 20 ms, the pace converges there.
        let mut totals = vec![(6.0, 1_100.0)];
        for i in 1..40 {
            totals.push((6.0 + 2.0 * f64::from(i), 1_100.0 + 100.0 * f64::from(i)));
        }
        let p = paces(&[&[(5.0, 1_000.0)], &totals[..]].concat());
        assert!((p[p.len() - 1] / 0.020 - 1.0).abs() < 1e-3, "{p:?}");
    }

    #[test]
    fn too_few_tokens_resets_and_garbage_leave_the_pace_as_it_was() {
        let start = [(5.0, 1_000.0), (6.0, 1_100.0)];
        for (bad, why) in [
            ((6.5, 1_110.0), "ten tokens"),
            ((0.1, 10.0), "a restarted engine's counters"),
            ((6.0, 1_200.0), "no time at all for a hundred tokens"),
            ((1e9, 1_200.0), "ten million seconds a token"),
            ((f64::NAN, 1_200.0), "not a number"),
            ((7.0, f64::INFINITY), "infinite tokens"),
        ] {
            let p = paces(&[start[0], start[1], bad]);
            assert!(close(p[2], 0.010), "{why}: {p:?}");
        }
        // After a reset, the next interval counts from the new baseline.
        let p = paces(&[start[0], start[1], (0.1, 10.0), (1.1, 60.0)]);
        assert!(close(p[3], 0.010 * 2f64.powf(WEIGHT)), "{p:?}");
    }

    #[test]
    fn one_wild_interval_moves_the_pace_by_a_bounded_step() {
        // A hundred tokens in 50 s: half a second each, fifty times the pace.
        let p = paces(&[(5.0, 1_000.0), (6.0, 1_100.0), (56.0, 1_200.0)]);
        assert!(close(p[2], 0.010 * MAX_SAMPLE_STEP.powf(WEIGHT)), "{p:?}");
        assert!(p[2] < 0.015);
    }

    #[test]
    fn a_scrape_without_the_histogram_keeps_the_totals_and_the_pace() {
        let mut prev = scraped(6.0, 1_100.0);
        prev.itl_s = 0.010;
        let mut down = Snapshot::default();
        follow(Some(&prev), &mut down);
        assert_eq!((down.itl_totals, down.itl_s), (prev.itl_totals, 0.010));
        let mut back = scraped(8.0, 1_200.0);
        follow(Some(&down), &mut back);
        assert!(close(back.itl_s, 0.010 * 2f64.powf(WEIGHT)));
    }

    #[test]
    fn factors_are_relative_to_the_geometric_mean_bounded_and_1_when_unknown() {
        let f = cost_factors(&[0.010, 0.010, 0.020, 0.020]);
        let half = 1.0 / 2f64.sqrt();
        assert!(close(f[0], half) && close(f[2], 2f64.sqrt()), "{f:?}");
        assert!(close(f[2] / f[0], 2.0), "twice as slow pays twice");
        assert_eq!(cost_factors(&[0.0, f64::NAN]), vec![1.0, 1.0]);
        let equal = cost_factors(&[0.010, 0.010, 0.0]);
        assert!(equal.iter().all(|&f| close(f, 1.0)), "{equal:?}");
        let f = cost_factors(&[0.001, 1.0]);
        assert_eq!(f, vec![MIN_FACTOR, MAX_FACTOR]);
        assert_eq!(cost_factors(&[]), Vec::<f64>::new());
    }
}
