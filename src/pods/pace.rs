//! Each pod's decode pace, learned from its engine's inter-token-latency histogram: the mean
//! inter-token latency over each scrape interval (two scrapes' totals apart), smoothed into the
//! pod's snapshot (`follow`), and the cost factor a pick gives each pod from it against the
//! others' (`cost_factors`): a pod whose tokens come twice as slowly as the pool's pays twice
//! for the same work. With no latency known, a pod's factor is 1: the configured weights as
//! they are.
//!
//! Stability: a pod's pace moves by a fraction of each interval's mean ([`WEIGHT`]), in log space
//! and by at most [`MAX_SAMPLE_STEP`] times from where it was, so no single scrape (a stalled
//! step, a garbage page) swings routing; the factor is bounded ([`MIN_FACTOR`]..[`MAX_FACTOR`]).
//! The feedback is negative: a pod given less work for being slow decodes fewer sequences, its
//! latency falls, and its factor with it, so the pool settles where the pods' latencies weighted
//! by their work meet rather than running away.
//!
//! What keeps a pod from being passed over for good: a pace is only as good as its last samples.
//! A pod that gets no work has none (its histogram does not move), so after [`GRACE_INTERVALS`]
//! its pace fades into the pool's with the time constant [`FADE_MS`] ([`kept`]), and its next
//! interval, when it comes, is learned afresh rather than averaged with the old pace; a restarted
//! engine (its totals went backwards) starts with no pace at all. And noise is not a pace:
//! factors within [`DEAD_BAND`] of 1 are exactly 1, so equal pods tie and the pick's other terms
//! (and its tie-break, the pod caching least) spread them. The band is also what lets a fading
//! pace end: at light load every cost is small and equal, so a pod any dearer than the others
//! takes nothing until its factor is exactly 1.

use crate::pods::record::Snapshot;

/// Tokens an interval must have produced for its mean to count; until it has them, it goes on
/// from the same baseline over more scrapes. A mean over few tokens is decided by how many of
/// them happened to share a step with a long prefill chunk (a decode step that runs one is
/// several times as slow): end to end, equal pods serving 2k-token prompts with 8-token answers
/// (40–50 tokens a pod a second) showed paces 9–23 % apart with the mean taken over each
/// one-second scrape of at least 20 tokens, which split prompt groups the rendezvous would have
/// kept together (tests/e2e/test_replicas.py); over at least 256, all stayed at 1. A pool busy
/// enough for paces to matter produces that many a pod in a scrape or two.
pub const MIN_TOKENS: f64 = 256.0;
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
/// Scrape intervals (`metrics.intervalMs`) a pace keeps its whole say after the interval that
/// last moved it. A busy pod has a counted interval at every scrape or two; one that went two
/// without (fewer than [`MIN_TOKENS`] tokens over both) has too little work for its pace to
/// matter or to be measured.
pub const GRACE_INTERVALS: u64 = 2;
/// The time constant (ms) with which a pace past its grace fades into the pool's: its factor is
/// raised to the power e^(−t / FADE_MS). A pod that was slow for a while (a spell of long
/// streams, a throttled GPU since cooled) and got no work since is tried again once its factor
/// enters the [`DEAD_BAND`]: from a pace twice the others' (factor 2) after 2.2 time constants,
/// from the bound (4) after 2.9, so 11–15 s past the grace (2 s at the default interval):
/// traffic back within seconds, as an operator who relieved a pod expects (a restarted one is
/// learned afresh at once, `follow`). Not shorter: a pod that is really slow and idle is retried
/// about that often (one request served at its pace, which measures it again), a cost paid at
/// light load, the only time a pod gets no work.
pub const FADE_MS: f64 = 5_000.0;
/// Factors within this ratio of 1 either way count as exactly 1. Equal pods' paces differ by the
/// load each happens to carry: end to end, two equal simulated pods under load differed by up to
/// 4 % (77 % and 74 % of the pool's, 71 % and 69 %), and at light load by less than 1 %; without
/// the band that difference, however small, decided every light-load request (every cost there
/// is equal but for the factor), so all went to one pod. Twice the largest measured difference
/// keeps noise inside with room; a real difference stays out: a GPU twice as slow sits at ±41 %
/// (half the pool each way), and a gap between two halves counts from about 1.17× (±8 %).
pub const DEAD_BAND: f64 = 1.08;

/// A pod's learned pace as a pick reads it: its smoothed inter-token latency in seconds (0 while
/// unknown) and when an interval last moved it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Pace {
    pub itl_s: f64,
    pub at_ms: u64,
}

impl Pace {
    /// The tokens a request of `choices` answers has made in `elapsed_s` at this pace, a token
    /// an answer each whole step (`None` while the pace is unknown).
    pub fn tokens_made(self, elapsed_s: f64, choices: u64) -> Option<u64> {
        if !(self.itl_s.is_finite() && self.itl_s > 0.0) {
            return None;
        }
        let steps = (elapsed_s / self.itl_s).floor() as u64;
        Some(steps.saturating_mul(choices.max(1)))
    }
}

/// Fills `next`'s smoothed inter-token latency from the previous snapshot's and the interval
/// between their totals (`interval_ms`: `metrics.intervalMs`, which scales the grace). A scrape
/// without the histogram (a pod marked down, a partial page, an engine that does not export it)
/// keeps the previous totals and pace: it says nothing of them.
pub fn follow(prev: Option<&Snapshot>, next: &mut Snapshot, interval_ms: u64) {
    next.itl_s = prev.map_or(0.0, |p| p.itl_s);
    next.itl_at_ms = prev.map_or(0, |p| p.itl_at_ms);
    let Some(now) = next.itl_totals else {
        next.itl_totals = prev.and_then(|p| p.itl_totals);
        return;
    };
    let Some(before) = prev.and_then(|p| p.itl_totals) else {
        return;
    };
    if now.count < before.count {
        // A restarted engine (its counters start again): a new baseline, and no pace. What it
        // showed before (often a slow spell, the reason it was restarted) says little of the
        // engine now, and the address may be a new pod's; its first interval sets the pace.
        (next.itl_s, next.itl_at_ms) = (0.0, 0);
        return;
    }
    let tokens = now.count - before.count;
    if tokens.is_nan() || tokens < MIN_TOKENS {
        // Too few tokens yet (or garbage): the interval goes on from the same baseline, so a
        // lightly loaded pod is measured over as many scrapes as it takes to have enough.
        next.itl_totals = Some(before);
        return;
    }
    // Time that went backwards, or a mean no inter-token latency has (garbage): dropped, and the
    // next interval starts from these totals.
    let mean = (now.sum_s - before.sum_s) / tokens;
    if PLAUSIBLE_S.contains(&mean) {
        let kept = kept(next.itl_at_ms, next.at_ms, interval_ms);
        next.itl_s = smooth(next.itl_s, mean, kept);
        next.itl_at_ms = next.at_ms;
    }
}

/// The share of its say a pace last moved at `at_ms` keeps at `now`: all of it within
/// [`GRACE_INTERVALS`] scrape intervals, then fading with the time constant [`FADE_MS`].
pub fn kept(at_ms: u64, now: u64, interval_ms: u64) -> f64 {
    let grace = GRACE_INTERVALS.saturating_mul(interval_ms);
    let idle = now.saturating_sub(at_ms).saturating_sub(grace);
    if idle == 0 {
        // A pod measured at its last scrapes, the usual case: no exponential on the pick's path.
        return 1.0;
    }
    (-(idle as f64) / FADE_MS).exp()
}

/// One step of the EWMA, in log space (a pace twice as slow and one twice as fast weigh alike),
/// the sample first brought within [`MAX_SAMPLE_STEP`] of the pace; the first sample is taken
/// as it is. The old pace weighs what it has `kept` of its say: one long without samples is
/// learned again from the next interval almost as a first one, not averaged with a pace the pod
/// showed long ago (which, after it faded, would push the pod straight back out).
fn smooth(pace: f64, sample: f64, kept: f64) -> f64 {
    if pace <= 0.0 {
        return sample;
    }
    let step = (sample / pace).clamp(1.0 / MAX_SAMPLE_STEP, MAX_SAMPLE_STEP);
    pace * step.powf(1.0 - (1.0 - WEIGHT) * kept)
}

/// Each pod's cost factor at `now`, from its pace (`interval_ms`: `metrics.intervalMs`): its
/// latency over the pool's, bounded, faded by what it has [`kept`] of its say, and 1 within the
/// [`DEAD_BAND`] or where unknown. The reference is the pods compared, so the factors say which
/// of them is slower, not how fast any is: a pool of equal pods stays at 1 whatever its model's
/// pace, and a geometric mean keeps a fast and a slow half symmetric (×2 and ×½ of the
/// configured weights, not ×1.33 and ×0.67). Each pace weighs in that mean what it has kept, so
/// a fading pod moves towards the pool's pace and the pool's towards the others': a faded pod is
/// at 1 against pods at 1, not against a mean it still drags. (This weighted mean is the one
/// reference that the paces, each pulled towards it by the share of its say it lost, average to.)
pub fn cost_factors(paces: &[Pace], now: u64, interval_ms: u64) -> Vec<f64> {
    let weight = |p: &Pace| {
        if p.itl_s.is_finite() && p.itl_s > 0.0 {
            kept(p.at_ms, now, interval_ms)
        } else {
            0.0
        }
    };
    let (log_sum, total) = paces.iter().fold((0.0, 0.0), |(s, t), p| {
        let w = weight(p);
        if w > 0.0 {
            (s + w * p.itl_s.ln(), t + w)
        } else {
            (s, t)
        }
    });
    if total <= 0.0 {
        return vec![1.0; paces.len()];
    }
    let reference = log_sum / total;
    let band = DEAD_BAND.ln();
    paces
        .iter()
        .map(|p| {
            let w = weight(p);
            if w <= 0.0 {
                return 1.0;
            }
            let bounded = (p.itl_s.ln() - reference).clamp(MIN_FACTOR.ln(), MAX_FACTOR.ln());
            let log_factor = w * bounded;
            if log_factor.abs() <= band {
                1.0
            } else {
                log_factor.exp()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    /// The tests' scrape interval: one scrape a second, as by default.
    const INTERVAL_MS: u64 = 1_000;
    const GRACE_MS: u64 = GRACE_INTERVALS * INTERVAL_MS;

    fn scraped(at_ms: u64, sum_s: f64, count: f64) -> Snapshot {
        Snapshot {
            at_ms,
            healthy: true,
            itl_totals: Some(crate::pods::metrics::ItlTotals { sum_s, count }),
            ..Snapshot::default()
        }
    }

    /// Follows a pod through scrapes of `(sum, count)` totals, one a second; its pace after each.
    fn paces(totals: &[(f64, f64)]) -> Vec<f64> {
        let mut prev: Option<Snapshot> = None;
        totals
            .iter()
            .zip(0..)
            .map(|(&(sum, count), i)| {
                let mut next = scraped(i * INTERVAL_MS, sum, count);
                follow(prev.as_ref(), &mut next, INTERVAL_MS);
                prev = Some(next);
                next.itl_s
            })
            .collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1e-9)
    }

    /// Paces last moved at `at_ms`, in milliseconds a token.
    fn at(at_ms: u64, ms: &[f64]) -> Vec<Pace> {
        ms.iter()
            .map(|&ms| Pace {
                itl_s: ms / 1_000.0,
                at_ms,
            })
            .collect()
    }

    #[test]
    fn the_first_interval_sets_the_pace_and_later_ones_move_it_by_a_fraction() {
        // 10 ms a token, then 20 ms a token.
        let p = paces(&[(50.0, 10_000.0), (60.0, 11_000.0), (80.0, 12_000.0)]);
        assert_eq!(p[0], 0.0, "one scrape is no interval");
        assert!(close(p[1], 0.010), "{p:?}");
        assert!(close(p[2], 0.010 * 2f64.powf(WEIGHT)), "{p:?}");
        // Steady at 20 ms, the pace converges there.
        let mut totals = vec![(60.0, 11_000.0)];
        for i in 1..40 {
            totals.push((
                60.0 + 20.0 * f64::from(i),
                11_000.0 + 1_000.0 * f64::from(i),
            ));
        }
        let p = paces(&[&[(50.0, 10_000.0)], &totals[..]].concat());
        assert!((p[p.len() - 1] / 0.020 - 1.0).abs() < 1e-3, "{p:?}");
    }

    #[test]
    fn too_few_tokens_and_garbage_leave_the_pace_as_it_was() {
        let start = [(50.0, 10_000.0), (60.0, 11_000.0)];
        for (bad, why) in [
            ((65.0, 11_100.0), "a hundred tokens"),
            ((60.0, 12_000.0), "no time at all for a thousand tokens"),
            ((1e10, 12_000.0), "ten million seconds a token"),
            ((f64::NAN, 12_000.0), "not a number"),
            ((70.0, f64::INFINITY), "infinite tokens"),
        ] {
            let p = paces(&[start[0], start[1], bad]);
            assert!(close(p[2], 0.010), "{why}: {p:?}");
        }
    }

    #[test]
    fn a_lightly_loaded_pods_interval_spans_the_scrapes_it_takes_to_have_enough_tokens() {
        // A hundred tokens a scrape: the first 10 ms a token, the next two 40 ms. No single
        // scrape counts; the third's interval does, from the baseline, all 300 tokens at their
        // mean (30 ms).
        let p = paces(&[(0.0, 0.0), (1.0, 100.0), (5.0, 200.0), (9.0, 300.0)]);
        assert_eq!(&p[..3], [0.0; 3], "{p:?}");
        assert!(close(p[3], 0.030), "{p:?}");
    }

    #[test]
    fn a_restarted_engine_starts_with_no_pace() {
        // 10 ms a token; the engine restarts (its counters start again) after a slow spell;
        // its first interval from the new baseline (500 tokens at 20 ms) is its pace, as it is.
        let p = paces(&[
            (50.0, 10_000.0),
            (60.0, 11_000.0),
            (1.0, 100.0),
            (11.0, 600.0),
        ]);
        assert_eq!(p[2], 0.0, "{p:?}");
        assert!(close(p[3], 0.020), "{p:?}");
        assert_eq!(cost_factors(&at(0, &[0.0, 10.0]), 0, INTERVAL_MS), [1.0; 2]);
    }

    #[test]
    fn one_wild_interval_moves_the_pace_by_a_bounded_step() {
        // A thousand tokens in 500 s: half a second each, fifty times the pace.
        let p = paces(&[(50.0, 10_000.0), (60.0, 11_000.0), (560.0, 12_000.0)]);
        assert!(close(p[2], 0.010 * MAX_SAMPLE_STEP.powf(WEIGHT)), "{p:?}");
        assert!(p[2] < 0.015);
    }

    #[test]
    fn a_scrape_without_the_histogram_keeps_the_totals_and_the_pace() {
        let mut prev = scraped(1_000, 60.0, 11_000.0);
        (prev.itl_s, prev.itl_at_ms) = (0.010, 1_000);
        let mut down = Snapshot {
            at_ms: 2_000,
            ..Snapshot::default()
        };
        follow(Some(&prev), &mut down, INTERVAL_MS);
        assert_eq!(
            (down.itl_totals, down.itl_s, down.itl_at_ms),
            (prev.itl_totals, 0.010, 1_000)
        );
        let mut back = scraped(3_000, 80.0, 12_000.0);
        follow(Some(&down), &mut back, INTERVAL_MS);
        assert!(close(back.itl_s, 0.010 * 2f64.powf(WEIGHT)));
        assert_eq!(back.itl_at_ms, 3_000);
    }

    #[test]
    fn a_pace_long_without_samples_is_learned_again_from_its_next_interval() {
        // 20 ms a token, last moved at 0; then an interval of 10 ms a token.
        let mut slow = scraped(0, 60.0, 11_000.0);
        (slow.itl_s, slow.itl_at_ms) = (0.020, 0);
        let next_at = |at_ms| {
            let mut next = scraped(at_ms, 70.0, 12_000.0);
            follow(Some(&slow), &mut next, INTERVAL_MS);
            next.itl_s
        };
        // Within its grace it moves by the usual fraction; a minute on, the old pace has faded
        // and the interval stands almost alone.
        assert!(close(next_at(GRACE_MS), 0.020 * 0.5f64.powf(WEIGHT)));
        let relearned = next_at(60_000);
        assert!((relearned / 0.010 - 1.0).abs() < 1e-4, "{relearned}");
    }

    #[test]
    fn a_pace_without_fresh_samples_fades_into_the_pools() {
        // Two pods at 10 ms a token measured at every scrape; a third last measured at 20 ms at
        // 0, with no work since.
        let factors = |now: u64| {
            let mut paces = at(now, &[10.0, 10.0]);
            paces.extend(at(0, &[20.0]));
            cost_factors(&paces, now, INTERVAL_MS)
        };
        let fresh = factors(0);
        assert!(close(fresh[2], 2f64.powf(2.0 / 3.0)), "{fresh:?}");
        assert_eq!(factors(GRACE_MS), fresh, "within the grace, all of its say");
        // One time constant past the grace it weighs e^-1: in its own factor, and in the pool's
        // reference, which moves towards the measured pods'.
        let w = (-1f64).exp();
        let reference = ((2.0 * 10f64.ln() + w * 20f64.ln()) / (2.0 + w)).exp();
        let fading = factors(GRACE_MS + FADE_MS as u64);
        assert!(close(fading[2], (20.0 / reference).powf(w)), "{fading:?}");
        assert!(close(fading[0], 10.0 / reference), "{fading:?}");
        assert!(1.0 < fading[2] && fading[2] < fresh[2], "{fading:?}");
        // Three time constants on, every factor is within the dead band: all exactly 1.
        assert_eq!(factors(GRACE_MS + 3 * FADE_MS as u64), [1.0; 3]);
        // No pace at all has any say, however old.
        assert_eq!(
            cost_factors(&at(0, &[10.0, 20.0]), u64::MAX, INTERVAL_MS),
            [1.0; 2]
        );
    }

    #[test]
    fn factors_within_the_dead_band_of_1_are_exactly_1() {
        // Equal pods a few percent apart: noise, every factor 1.
        assert_eq!(
            cost_factors(&at(0, &[10.0, 10.3, 9.8]), 0, INTERVAL_MS),
            [1.0; 3]
        );
        // Half a pool 1.15× the other's pace: ±7 %, within the band; 1.2×: ±9.5 %, a pace.
        assert_eq!(
            cost_factors(&at(0, &[10.0, 11.5]), 0, INTERVAL_MS),
            [1.0; 2]
        );
        let f = cost_factors(&at(0, &[10.0, 12.0]), 0, INTERVAL_MS);
        assert!(
            close(f[1], 1.2f64.sqrt()) && close(f[0], 1.0 / 1.2f64.sqrt()),
            "{f:?}"
        );
    }

    #[test]
    fn factors_are_relative_to_the_geometric_mean_bounded_and_1_when_unknown() {
        let f = cost_factors(&at(0, &[10.0, 10.0, 20.0, 20.0]), 0, INTERVAL_MS);
        let half = 1.0 / 2f64.sqrt();
        assert!(close(f[0], half) && close(f[2], 2f64.sqrt()), "{f:?}");
        assert!(close(f[2] / f[0], 2.0), "twice as slow pays twice");
        assert_eq!(
            cost_factors(&at(0, &[0.0, f64::NAN]), 0, INTERVAL_MS),
            [1.0; 2]
        );
        let equal = cost_factors(&at(0, &[10.0, 10.0, 0.0]), 0, INTERVAL_MS);
        assert!(equal.iter().all(|&f| close(f, 1.0)), "{equal:?}");
        let f = cost_factors(&at(0, &[1.0, 1_000.0]), 0, INTERVAL_MS);
        assert!(close(f[0], MIN_FACTOR) && close(f[1], MAX_FACTOR), "{f:?}");
        assert_eq!(cost_factors(&[], 0, INTERVAL_MS), Vec::<f64>::new());
    }
}
