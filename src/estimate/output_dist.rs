//! How long a model's answers run: a survival function `S(t) = P(output > t tokens)` learned per
//! model by `calibration` (source of truth: the model's shared slot, `kvgate.cal.<n>`) and what
//! admission asks of it about one request — its expected output, and its *outlook*: the chance it
//! is still running (and so still holds its KV) a number of decode steps ahead, given what it has
//! streamed so far and its `max_tokens`.
//!
//! Why a distribution and not one number: chat outputs are long-tailed (the median is a fraction of
//! the mean), so a per-request high quantile reserves several times what most requests use, and
//! the mean alone overfills a pod whenever a few run long. The pod-level forecast (`forecast`)
//! adds many requests' outlooks, whose sum is far more predictable than each one.
//!
//! Until a model has enough samples its survival is the prior; afterwards the prior still weighs as
//! eight samples, so the tail beyond anything seen yet never drops to zero. The prior depends on
//! the request: one with a max-tokens field is taken to run to its limit (its exact bound, so
//! nothing about it can overfill a pod before lengths are known; the first answers to finish are
//! the shortest, and learning from them alone would admit too much) until the model's engine is
//! seen ending such answers before their limit (`with_limits_ended`); one without follows an
//! exponential with the configured mean (`estimator.defaultOutputTokens`): long-tailed and
//! memoryless, so a request that outlives every sample is expected to go on, not to stop at once.

/// Output lengths are bucketed on a log scale, four buckets per doubling, up to 2^16 tokens.
pub const BUCKETS: usize = 64;
const BUCKETS_PER_DOUBLING: f64 = 4.0;
/// The prior's weight, in samples, once samples exist.
const PRIOR_SAMPLES: f64 = 8.0;
/// Once a model's answers have been seen to end, the prior's mean is at most this many times
/// theirs (`OutputDist::learned`).
const PRIOR_SPAN: f64 = 2.0;
/// The learned survival at the longest answer seen below which the answers' own mean (their
/// survival's area) is known, not only a lower bound: fewer than one answer in twenty went on
/// past every length seen.
const TAIL_SEEN: f64 = 0.05;

/// The forecast's intervals of decode steps ahead: interval j runs from `HORIZON_STEPS[j]` to
/// `HORIZON_STEPS[j + 1]` (the last to the output cap's default). A geometric grid, √2 a step:
/// the near future in detail, the far tail coarsely. The forecast counts a request in an interval
/// with its chance of running at the interval's start, so the grid's step is its caution: with
/// doublings, a long-tailed answer's last interval was counted up to a third too full, and a
/// KV-bound pool ran 30 % emptier than its budget.
pub const HORIZON_STEPS: [u32; 19] = [
    0, 16, 23, 32, 45, 64, 91, 128, 181, 256, 362, 512, 724, 1024, 1448, 2048, 2896, 4096, 5793,
];
/// Where the last interval ends.
pub const HORIZON_END: u32 = 8192;

/// The bucket of an output of `tokens` tokens.
pub fn bucket(tokens: u64) -> usize {
    let b = ((tokens as f64 + 1.0).log2() * BUCKETS_PER_DOUBLING) as usize;
    b.min(BUCKETS - 1)
}

/// The largest output length in bucket `b` (its right edge).
fn bucket_edge(b: usize) -> f64 {
    (2f64).powf((b + 1) as f64 / BUCKETS_PER_DOUBLING) - 1.0
}

/// The learned survival at the bucket edges (`knots[0]` is S(0) = 1, `knots[b + 1]` S at bucket
/// b's right edge), how many samples it stands for, and the prior it is blended with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutputDist {
    knots: [f32; BUCKETS + 1],
    samples: f32,
    prior_mean: f32,
    /// The prior is "runs to its limit" (a request with a max-tokens field), not exponential.
    runs_to_limit: bool,
    /// How much of that prior still runs to the limit, from 1 (nothing says otherwise) down as
    /// the model's engine is seen ending such answers by themselves (`with_limits_ended`); the
    /// rest is the exponential prior.
    limit_share: f32,
    /// The request's answer runs at least this long, whatever the model would say: vLLM and
    /// SGLang hold its end of sequence back until `min_tokens`, or for good under `ignore_eos`.
    floor: u64,
    /// What is known of this request's answers beyond its model's (its prompt's template's,
    /// `estimate::templates`), blended in by its weight.
    own: Own,
}

/// One template's answer lengths: lognormal, `log2(tokens + 1)` of mean `mean` and standard
/// deviation `spread`, weighing `weight` (0 to 1) against the model's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Own {
    pub mean: f32,
    pub spread: f32,
    pub weight: f32,
}

impl Own {
    /// Nothing known beyond the model's.
    pub const NONE: Own = Own {
        mean: 0.0,
        spread: 0.0,
        weight: 0.0,
    };

    fn survival(self, t: f64) -> f64 {
        let z = ((t + 1.0).log2() - f64::from(self.mean)) / f64::from(self.spread);
        0.5 * erfc(z / std::f64::consts::SQRT_2)
    }
}

/// The complementary error function, to a relative error under 1.2e-7 (Numerical Recipes'
/// `erfcc`, a Chebyshev fit).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * (-z * z + poly).exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// A request's outlook: for the start of each interval of [`HORIZON_STEPS`], the chance (in
/// 255ths, the nearest) that it is still running then. Rounded to the nearest, not up: a chance
/// rounded up from nothing to 1/255 at thousands of steps ahead, where a request would hold
/// thousands of tokens, is a variance the forecast pays in full (`forecast::peak`); a pod of many
/// short answers was held at half its KV for tails none of them had.
pub type Outlook = [u8; HORIZON_STEPS.len()];

impl OutputDist {
    /// The prior alone: exponential with mean `mean` tokens.
    pub fn prior(mean: u64) -> OutputDist {
        OutputDist {
            knots: [1.0; BUCKETS + 1],
            samples: 0.0,
            prior_mean: mean.max(1) as f32,
            runs_to_limit: false,
            limit_share: 1.0,
            floor: 0,
            own: Own::NONE,
        }
    }

    /// The same lengths for a model whose engine has ended `ended` answers (faded) of requests
    /// with a limit of their own before their limit. Each one shows the prior "runs to its
    /// limit" wrong for this engine (an engine that runs them to their limit — a benchmark's
    /// `ignore_eos` kvgate cannot see, a simulator in benchmark mode — ends none), so its share
    /// of the prior falls by e every `PRIOR_SAMPLES` of them, and the prior becomes the
    /// exponential one a request without a limit has: such a request is then one without,
    /// cut at its limit. Held at 1, it weighed as eight samples beside the ~256 faded ones
    /// forever: a chance of about 3 % that any such request ran to its limit, whatever the
    /// engine had shown, and a limit far past the answers (an agent's `max_tokens` of
    /// thousands) was held for as if one in thirty would reach it: its pods ran at two thirds
    /// of round robin's output (BENCHMARKS.md, *Large limits*).
    pub fn with_limits_ended(self, ended: f64) -> OutputDist {
        let share = (-ended.max(0.0) / PRIOR_SAMPLES).exp();
        OutputDist {
            limit_share: share as f32,
            ..self
        }
    }

    /// The same lengths with what is known of this request's own (`own`, its template's) blended
    /// in; an `own` that is no number, or of no spread, leaves them the model's.
    pub fn with_own(self, own: Own) -> OutputDist {
        let sound = [own.mean, own.spread, own.weight]
            .iter()
            .all(|v| v.is_finite())
            && own.spread > 0.0;
        OutputDist {
            own: if sound {
                Own {
                    weight: own.weight.clamp(0.0, 1.0),
                    ..own
                }
            } else {
                Own::NONE
            },
            ..self
        }
    }

    /// Answers that run to their limit, whatever it is (known lengths: `Estimate::exact`).
    #[cfg(any(test, feature = "fake-host"))]
    pub fn never_stops() -> OutputDist {
        OutputDist::prior(1).of_request(true, 0)
    }

    /// The same lengths for one request: one that has a limit of its own (the prior then runs to
    /// it), and whose answer runs at least `floor` tokens (`Request::min_output_tokens`). An
    /// answer the engine may not end before `m` tokens is `max(L, m)` of the model's length `L`:
    /// sure to run until `m`, and past it as likely as any answer is to run that far.
    pub fn of_request(self, has_limit: bool, floor: u64) -> OutputDist {
        OutputDist {
            runs_to_limit: has_limit,
            floor,
            ..self
        }
    }

    /// Kaplan–Meier over bucketed, faded sample counts: `ended[b]` answers that stopped by
    /// themselves in bucket b, `cut[b]` answers known only to have gone on past bucket b (cut
    /// off there by their own `max_tokens`, or still running: dropping them would bias lengths
    /// short).
    ///
    /// Past the longest sample nothing is known: the survival there fades exponentially from
    /// where the samples leave it, with the prior's mean or the samples' own (their survival's
    /// area up to the longest), whichever is longer. Kaplan–Meier alone would hold it flat when
    /// the longest sample is censored, and a few answers still running would have every answer
    /// expected to run to the output cap. The prior's mean alone (256 tokens by default) said
    /// of a model whose answers were all still running at a thousand tokens that each would end
    /// within a few hundred more: on pods of answers a reasoning model's length (1,500 on
    /// average), the pods took more than they could hold while the first answers ran, and
    /// preempted.
    ///
    /// The prior's mean is lowered to `PRIOR_SPAN` times the answers' own where they have been
    /// seen to end (`TAIL_SEEN`). The record fades to about 256 answers' worth, so the prior's
    /// eight samples never wash out; at the configured 256 tokens they kept a model of short
    /// answers a fifth longer than it answered (answers of mean 32, σ 0.8: 39 tokens expected from
    /// 256 samples), and its tail, the forecast's variance far ahead, on every request. Where the
    /// answers still run past the longest seen, their area is only a lower bound of their mean
    /// (the first to end are the short ones), and the prior stays as configured. Nor is it
    /// lowered below `measured`, the mean the model's engines report over all their answers
    /// (0: none), which kvgate's own first answers do not overrule.
    pub fn learned(ended: &[f64], cut: &[f64], prior_mean: u64, measured: u64) -> OutputDist {
        let n: f64 = ended.iter().chain(cut).sum();
        let mut at_risk = n;
        let mut km = 1.0;
        let mut knots = [1f32; BUCKETS + 1];
        let mut last = None;
        let mut prior = prior_mean.max(1) as f64;
        for b in 0..BUCKETS {
            let d = ended.get(b).copied().unwrap_or(0.0);
            let c = cut.get(b).copied().unwrap_or(0.0);
            if at_risk > 0.0 {
                km *= (1.0 - d / at_risk).max(0.0);
            }
            at_risk -= d + c;
            if d + c > 0.0 {
                last = Some(b);
            }
            knots[b + 1] = km as f32;
        }
        if let Some(last) = last {
            let from = f64::from(knots[last + 1]);
            let area: f64 = (0..=last)
                .map(|b| {
                    let lo = if b == 0 { 0.0 } else { bucket_edge(b - 1) };
                    f64::from(knots[b] + knots[b + 1]) * 0.5 * (bucket_edge(b) - lo)
                })
                .sum();
            if from <= TAIL_SEEN {
                prior = prior.min((PRIOR_SPAN * area).max(measured as f64)).max(1.0);
            }
            let fade = area.max(prior);
            for b in last + 1..BUCKETS {
                let past = bucket_edge(b) - bucket_edge(last);
                knots[b + 1] = (from * (-past / fade).exp()) as f32;
            }
        }
        OutputDist {
            knots,
            samples: n as f32,
            ..OutputDist::prior(prior.round() as u64)
        }
    }

    fn prior_survival(&self, t: f64) -> f64 {
        let exponential = (-t / f64::from(self.prior_mean)).exp();
        if self.runs_to_limit {
            let share = f64::from(self.limit_share);
            share + (1.0 - share) * exponential
        } else {
            exponential
        }
    }

    /// The learned survival alone, between the knots; past the last one it fades like the prior.
    fn learned_survival(&self, t: f64) -> f64 {
        let b = bucket(t.ceil() as u64);
        let (lo, hi) = if b == 0 {
            (0.0, bucket_edge(0))
        } else {
            (bucket_edge(b - 1), bucket_edge(b))
        };
        let (s_lo, s_hi) = (f64::from(self.knots[b]), f64::from(self.knots[b + 1]));
        if t >= hi {
            return s_hi * (-(t - hi) / f64::from(self.prior_mean)).exp();
        }
        s_lo + (s_hi - s_lo) * (t - lo) / (hi - lo)
    }

    /// The lengths of `learned` for the request these were made for: its limit's prior, its
    /// floor (`of_request`) and its own lengths kept, for lengths learned while it runs.
    pub fn relearned(self, learned: OutputDist) -> OutputDist {
        learned
            .of_request(self.runs_to_limit, self.floor)
            .with_own(self.own)
    }

    /// Whether the engine holds the answer's end back (a floor): its length is not the model's.
    pub fn held_on(&self) -> bool {
        self.floor > 0
    }

    /// P(output > t): the learned survival blended with the prior, which weighs as
    /// `PRIOR_SAMPLES` samples; certain below the request's floor.
    pub fn survival(&self, t: f64) -> f64 {
        if t <= 0.0 || t < self.floor as f64 {
            return 1.0;
        }
        let n = f64::from(self.samples);
        let prior = self.prior_survival(t);
        let model = if n <= 0.0 {
            prior
        } else {
            (n * self.learned_survival(t) + PRIOR_SAMPLES * prior) / (n + PRIOR_SAMPLES)
        };
        let w = f64::from(self.own.weight);
        if w <= 0.0 {
            return model;
        }
        w * self.own.survival(t) + (1.0 - w) * model
    }

    /// P(output > t | output > k), with the exponential prior's memoryless tail when the learned
    /// survival has all but vanished at k.
    fn conditional(&self, k: f64, t: f64) -> f64 {
        let at_k = self.survival(k);
        if at_k < 1e-12 {
            return self.prior_survival((t - k).max(0.0));
        }
        (self.survival(t) / at_k).min(1.0)
    }

    /// Expected final output, given `streamed` tokens so far and a hard `max` (the request's
    /// `max_tokens`, or the output cap): `streamed + ∫ S(t | > streamed) dt` up to `max`.
    pub fn expected(&self, streamed: u64, max: u64) -> u64 {
        let k = streamed as f64;
        let m = max as f64;
        if k >= m {
            return max;
        }
        // Certain up to the floor; from there trapezoids over a geometric grid to m: fine where
        // S bends most, cheap in total.
        let from = k.max((self.floor as f64).min(m));
        let mut total = from - k;
        let (mut t, mut s) = (from, self.conditional(k, from));
        let mut step = 1.0f64;
        while t < m {
            let next = (t + step).min(m);
            let s_next = self.conditional(k, next);
            total += (s + s_next) * 0.5 * (next - t);
            if s_next < 1e-6 {
                break;
            }
            (t, s) = (next, s_next);
            step = (step * 1.25).max(next * 0.05);
        }
        (k + total).round().min(m) as u64
    }

    /// The request's outlook, given `streamed` tokens so far and its hard `max`.
    pub fn outlook(&self, streamed: u64, max: u64) -> Outlook {
        let k = streamed as f64;
        let mut out = [0u8; HORIZON_STEPS.len()];
        for (o, &s) in out.iter_mut().zip(&HORIZON_STEPS) {
            let t = k + f64::from(s);
            // In flight now, whatever it has left; past its limit, certainly gone.
            if s == 0 || t < max as f64 {
                *o = (self.conditional(k, t) * 255.0).round().clamp(0.0, 255.0) as u8;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    /// Weights for `n` answers of each of `lengths`.
    fn hist(lengths: &[(u64, f64)]) -> [f64; BUCKETS] {
        let mut h = [0.0; BUCKETS];
        for &(len, n) in lengths {
            h[bucket(len)] += n;
        }
        h
    }

    #[test]
    fn the_prior_is_exponential_with_the_configured_mean() {
        let d = OutputDist::prior(256);
        assert!((d.survival(256.0) - (-1f64).exp()).abs() < 0.02);
        let e = d.expected(0, 100_000) as f64;
        assert!((e - 256.0).abs() < 8.0, "{e}");
        // Memoryless: having streamed 500 tokens, about 256 more are expected.
        let later = d.expected(500, 100_000) as f64 - 500.0;
        assert!((later - 256.0).abs() < 16.0, "{later}");
    }

    #[test]
    fn learned_lengths_replace_the_prior_but_the_tail_never_vanishes() {
        // 90 answers of 100 tokens, 10 of 1000.
        let ended = hist(&[(100, 90.0), (1000, 10.0)]);
        let d = OutputDist::learned(&ended, &[0.0; BUCKETS], 256, 0);
        let e = d.expected(0, 100_000) as f64;
        assert!((180.0..=230.0).contains(&e), "mean about 190: {e}");
        assert!(d.survival(200.0) < 0.15 && d.survival(200.0) > 0.08);
        // Past 100 tokens the answer is one of the long ones.
        let long = d.expected(150, 100_000);
        // Mostly the long ones' 1000, with the prior's tail (eight samples' worth) pulling down.
        assert!((700..=1_000).contains(&long), "{long}");
        assert!(d.survival(5_000.0) > 0.0, "the prior keeps a tail");
    }

    #[test]
    fn answers_cut_by_max_tokens_count_as_longer_not_as_short() {
        // Half the answers stopped at 50 tokens, half were cut at 200 by their max_tokens.
        let ended = hist(&[(50, 50.0)]);
        let cut = hist(&[(200, 50.0)]);
        let censored = OutputDist::learned(&ended, &cut, 256, 0);
        let dropped = OutputDist::learned(&ended, &[0.0; BUCKETS], 256, 0);
        assert!(
            censored.survival(150.0) > 0.45,
            "the cut half is still running at 150"
        );
        assert!(
            dropped.survival(150.0) < 0.1,
            "dropping them says nobody runs that long"
        );
    }

    #[test]
    fn past_the_longest_sample_the_survival_fades_like_the_prior() {
        // Every answer seen is still running (censored) at 300 tokens.
        let d = OutputDist::learned(&[0.0; BUCKETS], &hist(&[(300, 100.0)]), 256, 0);
        assert!(d.survival(250.0) > 0.95);
        let at = |t: f64| d.survival(t);
        // From there on, an exponential with the samples' mean of about 300, not 1 up to the
        // output cap.
        assert!(at(3_000.0) < 0.01, "{d:?}");
        let e = d.expected(0, 100_000);
        assert!((500..=700).contains(&e), "about 300 and 300 more: {e}");
        // Answers of a short model, seen to end: past its longest they fade at twice their own
        // mean (about 24 tokens), not at the configured 256, which they were seen not to reach.
        let ended = hist(&[(20, 90.0), (60, 10.0)]);
        let short = OutputDist::learned(&ended, &[0.0; BUCKETS], 256, 0);
        let tail = |d: &OutputDist, t: f64| d.survival(t + 100.0) / d.survival(t);
        let own = (-100.0f64 / (2.0 * 24.5)).exp();
        assert!(
            (tail(&short, 200.0) - own).abs() < 0.05,
            "{}",
            tail(&short, 200.0)
        );
        // Unless their engines report a longer mean over all their answers: that one stands.
        let reported = OutputDist::learned(&ended, &[0.0; BUCKETS], 750, 750);
        let at_750 = (-100.0f64 / 750.0).exp();
        assert!((tail(&reported, 200.0) - at_750).abs() < 0.05);
        // Answers all still running at a thousand tokens: expected to go on about as long again,
        // not to end within the prior's 256.
        let running = OutputDist::learned(&[0.0; BUCKETS], &hist(&[(1_000, 50.0)]), 256, 0);
        let more = running.expected(1_000, 100_000) - 1_000;
        assert!((800..=1_300).contains(&more), "{more}");
    }

    #[test]
    fn the_prior_does_not_lengthen_a_short_models_answers() {
        // 256 answers (what the faded record holds) of a lognormal of mean 32, σ 0.8: the
        // configured prior's eight samples of mean 256 had them expected at 39 tokens.
        let mut ended = [0.0; BUCKETS];
        let mut sum = 0.0;
        for i in 0..256 {
            // Spread over the distribution by its quantiles (a normal's, by a logistic fit).
            let p = (f64::from(i) + 0.5) / 256.0;
            let z = (p / (1.0 - p)).ln() / 1.702;
            let len = ((32f64.ln() - 0.32) + 0.8 * z).exp().round().max(1.0);
            sum += len;
            ended[bucket(len as u64)] += 1.0;
        }
        let mean = sum / 256.0;
        let e = OutputDist::learned(&ended, &[0.0; BUCKETS], 256, 0).expected(0, 100_000) as f64;
        assert!((e - mean).abs() <= 0.08 * mean, "{e} against {mean}");
        // As before, with the prior held at 256 (here: engines reporting that mean).
        let held = OutputDist::learned(&ended, &[0.0; BUCKETS], 256, 256).expected(0, 100_000);
        assert!(held as f64 >= 1.15 * mean, "{held} against {mean}");
        // Answers still running past every length seen: their mean is unknown, the prior stays.
        let cut = hist(&[(200, 100.0)]);
        let running = OutputDist::learned(&ended, &cut, 256, 0);
        let as_before = OutputDist::learned(&ended, &cut, 256, 256);
        assert_eq!(running, as_before);
        assert!(running.expected(200, 100_000) >= 200 + 150);
    }

    #[test]
    fn a_request_with_a_limit_runs_to_it_until_lengths_are_learned() {
        let prior = OutputDist::prior(256);
        assert_eq!(prior.of_request(true, 0).expected(0, 1000), 1000);
        let ended = hist(&[(50, 100.0)]);
        let learned = OutputDist::learned(&ended, &[0.0; BUCKETS], 256, 0).of_request(true, 0);
        let e = learned.expected(0, 1000);
        // 100 answers of 50 tokens, and eight samples' worth of running to the limit.
        assert!((100..=160).contains(&e), "{e}");
    }

    /// Once the model's engine has ended answers of requests with a limit before it, a limit
    /// far past the answers is not held for as if one in thirty ran to it: the request is one
    /// without a limit, cut at it. An engine that runs them to their limit ends none, and the
    /// prior stays.
    #[test]
    fn a_limit_the_engine_is_seen_not_to_run_to_is_not_held_for() {
        let ended = hist(&[(50, 180.0), (400, 20.0)]);
        let learned = OutputDist::learned(&ended, &[0.0; BUCKETS], 256, 0);
        let far = 8192;
        let held = learned.of_request(true, 0);
        let none = learned.of_request(false, 0);
        // Eight samples of running to 8,192 beside 200 answers of mean 85: a request expected
        // at over 350 tokens, and still running at 4,000 one time in 27.
        assert!(held.expected(0, far) > 350, "{}", held.expected(0, far));
        assert!(held.survival(4_000.0) > 0.03);
        for (seen, share) in [(8.0, 0.37), (64.0, 0.0)] {
            let d = learned.with_limits_ended(seen).of_request(true, 0);
            assert!((f64::from(d.limit_share) - share).abs() < 0.01, "{seen}");
            assert!(d.expected(0, far) < held.expected(0, far));
        }
        let seen = learned.with_limits_ended(64.0).of_request(true, 0);
        assert!(seen.expected(0, far).abs_diff(none.expected(0, far)) <= 1);
        assert!(seen.survival(4_000.0) < 1e-4);
        // The bound still ends the outlook, and lengths relearned keep what the engine showed.
        assert_eq!(seen.expected(0, 30), none.expected(0, 30));
        assert_eq!(held.relearned(seen), seen);
        assert_eq!(learned.with_limits_ended(0.0), learned);
    }

    /// An answer the engine will not end before `floor` tokens runs there surely, and past it as
    /// the model's answers run (`max(L, floor)`); under `ignore_eos` (a floor past the limit) to
    /// its limit.
    #[test]
    fn a_floor_holds_the_answer_on_until_it() {
        let d = OutputDist::learned(&hist(&[(50, 90.0), (400, 10.0)]), &[0.0; BUCKETS], 256, 0);
        let held = d.of_request(false, 200);
        assert_eq!(held.survival(199.0), 1.0);
        assert_eq!(held.survival(300.0), d.survival(300.0));
        assert!(d.expected(0, 8192) < 150 && held.expected(0, 8192) > 200);
        // Streamed 100 of its 200 sure tokens: still certain at 180, then the long answers' odds.
        let o = held.outlook(100, 8192);
        let at = |s: u32| HORIZON_STEPS.iter().position(|&h| h == s).unwrap();
        assert_eq!(o[at(64)], 255);
        assert!(o[at(128)] < 60, "{o:?}");
        let exact = d.of_request(true, u64::MAX);
        assert_eq!(exact.expected(0, 300), 300);
        let o = exact.outlook(0, 300);
        assert!(o[..at(362)].iter().all(|&p| p == 255) && o[at(362)..].iter().all(|&p| p == 0));
    }

    #[test]
    fn max_tokens_bounds_the_expectation_and_ends_the_outlook() {
        let d = OutputDist::prior(256);
        assert_eq!(d.expected(0, 10), 10.min(d.expected(0, 10)));
        assert!(d.expected(0, 10) <= 10);
        assert_eq!(d.expected(30, 20), 20, "already at its limit");
        let o = d.outlook(0, 100);
        assert!(
            o[1] > 200,
            "16 steps ahead: very likely still running {o:?}"
        );
        let at = |steps| HORIZON_STEPS.iter().position(|&s| s == steps).unwrap();
        assert!(o[at(91)] > 0, "91 steps ahead it may still run: {o:?}");
        assert_eq!(
            o[at(128)],
            0,
            "128 steps ahead it has certainly stopped at 100: {o:?}"
        );
        let unbounded = d.outlook(0, u64::MAX);
        assert!(unbounded.windows(2).all(|w| w[0] >= w[1]), "{unbounded:?}");
        assert!(unbounded[at(4096)] < 5);
    }

    #[test]
    fn a_requests_own_lengths_are_blended_in_by_their_weight() {
        let ended = hist(&[(100, 90.0), (1000, 10.0)]);
        let d = OutputDist::learned(&ended, &[0.0; BUCKETS], 256, 0);
        // Its own: a median of 399 tokens (log2 400), half a doubling of spread, all its weight.
        let own = Own {
            mean: 400f32.log2(),
            spread: 0.5,
            weight: 1.0,
        };
        let o = d.with_own(own);
        assert!((o.survival(399.0) - 0.5).abs() < 1e-6);
        // One standard deviation up: 15.9 % run on.
        assert!((o.survival(400.0 * 2f64.sqrt() - 1.0) - 0.158_655).abs() < 1e-5);
        let e = o.expected(0, 100_000) as f64;
        assert!((400.0..=480.0).contains(&e), "{e}");
        // Half its weight: half way between.
        let half = d.with_own(Own { weight: 0.5, ..own });
        for t in [50.0, 399.0, 2000.0] {
            let mid = 0.5 * (o.survival(t) + d.survival(t));
            assert!((half.survival(t) - mid).abs() < 1e-9, "{t}");
        }
        // Below the request's floor it certainly runs on.
        assert_eq!(o.of_request(false, 500).survival(450.0), 1.0);
        // Lengths learned later keep the request's own, its limit and its floor.
        let request = d.of_request(true, 7).with_own(own);
        assert_eq!(request.relearned(d), request);
        for broken in [
            Own {
                mean: f32::NAN,
                ..own
            },
            Own { spread: 0.0, ..own },
            Own {
                weight: f32::INFINITY,
                ..own
            },
        ] {
            assert_eq!(d.with_own(broken), d, "{broken:?}");
        }
        assert!((erfc(0.0) - 1.0).abs() < 1e-7 && (erfc(-3.0) - 1.999_977_91).abs() < 1e-7);
    }
}
