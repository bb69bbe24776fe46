//! How long the answers to each prompt template run, as this VM has seen them end: what a
//! request's answer is likely to be beyond its model's lengths (`output_dist::Own`). Source of
//! truth: this VM alone, from the answers it streamed; nothing is shared.
//!
//! Why: one model serves many applications, and their answers' lengths differ far more between
//! them than within one (a classifier's few tokens, a summary's hundreds, an assistant's long
//! turns). The model's distribution (`calibration`) is their mixture: every request is expected
//! at the mixture's mean, with the mixture's spread, so a pod's forecast reserves long answers
//! for short applications and short ones for long applications, and its headroom pays for the
//! spread between applications on every request. An application's requests start alike: a chat
//! prompt's opening (its tools and system turns, `Request::opening`, hashed by
//! `routing::prefix::opening_hash`, which covers the model and the cache salt) names its
//! template, and a completions prompt's by its first block (`flow::admit`).
//!
//! What is learned: for each template, and for each model over all its templates, the faded
//! mean and variance of `log2(answer + 1)` over the answers that ended by themselves (those cut
//! off by their own `max_tokens` say only that the answer would have gone on, and are left out):
//! a lognormal, the shape answer lengths take within one application. A template's lognormal is
//! blended with the model's lengths by how surely its mean differs from the model's: with the
//! positive-part James–Stein weight `1 − JS · se² / d²` (`d` the difference, `se` its standard
//! error from the template's answers), so that templates whose answers are drawn alike (a model
//! behind many system prompts that do not change its answers) stay with the model's lengths,
//! which pool all their answers, instead of each taking its own sampling noise; and never above
//! `1 − RESIDUAL`, so the model's long tail is never quite given up. Kept in a fixed table, one
//! entry a key by its hash, which a key that shares it takes only from a holder no longer
//! answering: at most `SLOTS` templates and models a VM, 24 bytes each.

use crate::estimate::output_dist::Own;

/// Entries of the table: templates a VM keeps at once.
const SLOTS: usize = 1024;
/// Each answer counts one; older ones fade by this much per answer of the same template, so an
/// entry holds about the last 256 answers' worth (as the model's own histograms do,
/// `calibration`).
const FADE: f64 = 1.0 / 256.0;
/// A template is its model's until it has this weight of answers: eight, a little faded.
const MIN_ANSWERS: f64 = 7.5;
/// What of the model's lengths a template's requests keep however sure their own: the tail of
/// answers no application's lognormal foresees.
const RESIDUAL: f64 = 0.03;
/// How many squared standard errors a template's mean must lie from its model's before it
/// weighs anything: at two standard errors, nothing; at four, three quarters. A template drawn
/// like its model passes two about one time in twenty, and then weighs little.
const JS: f64 = 4.0;
/// Its spread, `log2` of the answers, is taken as at least this (a quarter on either side): a
/// template whose answers all came out one length is still a model's, whose next answer may not.
const MIN_SPREAD: f64 = 0.32;

/// One key's answers, faded: their weight, and the mean of `log2(tokens + 1)` and of its square.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Entry {
    key: u64,
    weight: f32,
    mean: f32,
    square: f32,
}

impl Entry {
    fn spread(&self) -> f64 {
        (f64::from(self.square) - f64::from(self.mean).powi(2))
            .max(0.0)
            .sqrt()
    }
}

/// Each template's and each model's answers, as this VM saw them end.
#[derive(Debug, Clone)]
pub struct Templates {
    entries: Vec<Entry>,
}

impl Default for Templates {
    fn default() -> Self {
        Templates {
            entries: vec![Entry::default(); SLOTS],
        }
    }
}

impl Templates {
    fn find(&self, key: u64) -> Option<&Entry> {
        self.entries
            .get(key as usize % SLOTS)
            .filter(|e| e.key == key && e.weight > 0.0)
    }

    fn add(&mut self, key: u64, x: f64) {
        let Some(e) = self.entries.get_mut(key as usize % SLOTS) else {
            return;
        };
        if e.key != key {
            if e.weight >= 1.0 {
                // A key that shares the entry pushes its holder out only as the holder stops
                // answering: each such answer takes one answer and an eighth of the holder's
                // weight, and is itself lost. A stream of prompts that each come once (no
                // template: every prompt its own) so does not evict the templates
                // that keep answering, and a template gone quiet leaves within a few dozen.
                e.weight -= 1.0 + e.weight / 8.0;
                return;
            }
            *e = Entry {
                key,
                ..Entry::default()
            };
        }
        let keep = f64::from(e.weight) * (1.0 - FADE);
        let weight = keep + 1.0;
        let blend = |old: f32, new: f64| ((f64::from(old) * keep + new) / weight) as f32;
        e.mean = blend(e.mean, x);
        e.square = blend(e.square, x * x);
        e.weight = weight as f32;
    }

    /// An answer of `tokens` to a request of `model` (its key, [`model_key`]) whose prompt is of
    /// `template`, that ended by itself.
    pub fn ended(&mut self, model: u64, template: u64, tokens: u64) {
        let x = (tokens as f64 + 1.0).log2();
        self.add(model, x);
        self.add(template, x);
    }

    /// What `template`'s answers say of the next one's length beyond `model`'s (`Own::NONE`
    /// until it has `MIN_ANSWERS`, or while its mean is not surely apart from the model's).
    pub fn own(&self, model: u64, template: u64) -> Own {
        let (Some(m), Some(t)) = (self.find(model), self.find(template)) else {
            return Own::NONE;
        };
        let n = f64::from(t.weight);
        if n < MIN_ANSWERS || model == template {
            return Own::NONE;
        }
        // The spread of a few answers runs short of the lengths': Bessel's correction.
        let spread = (t.spread() * (n / (n - 1.0)).sqrt()).max(MIN_SPREAD);
        let apart = (f64::from(t.mean) - f64::from(m.mean)).powi(2);
        let surely = if apart > 0.0 {
            1.0 - JS * spread * spread / n / apart
        } else {
            0.0
        };
        let weight = surely.min(1.0 - RESIDUAL);
        if weight <= 0.0 {
            return Own::NONE;
        }
        Own {
            mean: t.mean,
            spread: spread as f32,
            weight: weight as f32,
        }
    }
}

/// A model's key in the table: its name's hash, apart from every prompt's (which are seeded by
/// the model's name too, `routing::prefix`).
pub fn model_key(model: &str) -> u64 {
    crate::hash::fnv1a(model.as_bytes()).rotate_left(1)
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::estimate::output_dist::{bucket, OutputDist, BUCKETS};

    /// xorshift64*: the same lengths every run.
    struct Rng(u64);

    impl Rng {
        fn unit(&mut self) -> f64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
        }

        /// A lognormal length of median `median` and log-spread `sigma` (natural log).
        fn length(&mut self, median: f64, sigma: f64) -> u64 {
            // Box–Muller.
            let (u, v) = (self.unit().max(1e-12), self.unit());
            let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
            (median * (sigma * z).exp()).round().max(1.0) as u64
        }
    }

    const MODEL: u64 = 1;
    const SHORT: u64 = 2;
    const LONG: u64 = 3;

    /// The model's distribution learned from `lengths` (all of them ended).
    fn learned(lengths: &[u64]) -> OutputDist {
        let mut ended = [0.0; BUCKETS];
        for &l in lengths {
            ended[bucket(l)] += 1.0;
        }
        OutputDist::learned(&ended, &[0.0; BUCKETS], 256, 0)
    }

    #[test]
    fn two_applications_each_get_their_own_lengths_out_of_the_models_mixture() {
        // A classifier (median 12) and an assistant (median 400) on one model, one answer each
        // in turn; within each, the spread of one chat application (σ 0.5).
        let (mut t, mut rng, mut all) = (Templates::default(), Rng(7), vec![]);
        for i in 0..600 {
            let (template, median) = if i % 2 == 0 {
                (SHORT, 12.0)
            } else {
                (LONG, 400.0)
            };
            let l = rng.length(median, 0.5);
            all.push(l);
            t.ended(MODEL, template, l);
        }
        let model = learned(&all);
        let mixture = model.expected(0, 100_000) as f64;
        let short = model.with_own(t.own(MODEL, SHORT));
        let long = model.with_own(t.own(MODEL, LONG));
        let (es, el) = (
            short.expected(0, 100_000) as f64,
            long.expected(0, 100_000) as f64,
        );
        // The applications' own means are about 14 and 450.
        assert!(
            (10.0..=25.0).contains(&es),
            "short {es} (mixture {mixture})"
        );
        assert!(
            (380.0..=520.0).contains(&el),
            "long {el} (mixture {mixture})"
        );
        // And each is far less spread than the mixture: the assistant's answers are almost all
        // past 150 tokens and before 1,500.
        assert!(long.survival(150.0) > 0.9, "{}", long.survival(150.0));
        assert!(long.survival(1500.0) < 0.05, "{}", long.survival(1500.0));
        assert!(model.survival(150.0) < 0.6, "the mixture itself is not");
    }

    #[test]
    fn a_template_of_the_models_own_lengths_leaves_them_about_as_they_are() {
        // Eight templates drawing from one distribution (chat answers, mean 256, σ 0.8).
        let (mut t, mut rng, mut all) = (Templates::default(), Rng(11), vec![]);
        for i in 0..2_000u64 {
            let l = rng.length(186.0, 0.8);
            all.push(l);
            t.ended(MODEL, 100 + i % 8, l);
        }
        let model = learned(&all);
        let e = model.expected(0, 100_000) as f64;
        for template in 100..108 {
            let d = model.with_own(t.own(MODEL, template));
            let et = d.expected(0, 100_000) as f64;
            assert!(
                (et / e - 1.0).abs() < 0.1,
                "template {template}: {et} against {e}"
            );
            for x in [64.0, 256.0, 1024.0] {
                let (s, st) = (model.survival(x), d.survival(x));
                assert!(
                    (st - s).abs() < 0.05,
                    "template {template} at {x}: {st} against {s}"
                );
            }
        }
    }

    #[test]
    fn a_template_is_its_models_until_it_has_answers_apart_from_them() {
        let mut t = Templates::default();
        assert_eq!(t.own(MODEL, SHORT), Own::NONE, "nothing seen");
        for _ in 0..100 {
            t.ended(MODEL, LONG, 500);
        }
        for _ in 0..7 {
            t.ended(MODEL, SHORT, 5);
        }
        assert_eq!(
            t.own(MODEL, SHORT),
            Own::NONE,
            "seven answers are not enough"
        );
        t.ended(MODEL, SHORT, 5);
        let own = t.own(MODEL, SHORT);
        assert!((f64::from(own.mean) - 6f64.log2()).abs() < 1e-5, "{own:?}");
        // Its mean lies 2.4 doublings from the model's, some twenty standard errors.
        assert!(
            (f64::from(own.weight) - (1.0 - RESIDUAL)).abs() < 1e-6,
            "{own:?}"
        );
        assert!(
            (f64::from(own.spread) - MIN_SPREAD).abs() < 1e-6,
            "one length: the least spread"
        );
        // A template no model was seen for, and the model's own key, are the model's.
        assert_eq!(t.own(99, SHORT), Own::NONE);
        assert_eq!(t.own(MODEL, MODEL), Own::NONE);
        // One-off prompts whose keys share SHORT's entry, one for every four of its answers,
        // leave it there.
        for i in 1..=100 {
            t.ended(MODEL, SHORT + i * SLOTS as u64, 5_000);
            for _ in 0..4 {
                t.ended(MODEL, SHORT, 5);
            }
        }
        assert!((f64::from(t.own(MODEL, SHORT).mean) - 6f64.log2()).abs() < 1e-5);
        // A template whose key shares SHORT's entry takes its place once SHORT stops answering.
        let other = SHORT + SLOTS as u64;
        for _ in 0..30 {
            t.ended(MODEL, other, 5_000);
        }
        assert_eq!(t.own(MODEL, SHORT), Own::NONE);
        assert!(t.own(MODEL, other).mean > 12.0);
        // A template a little apart from its model, by a few standard errors, weighs a little.
        let mut rng = Rng(5);
        for i in 0..4_000 {
            let (template, median) = if i % 2 == 0 {
                (SHORT, 100.0)
            } else {
                (LONG, 110.0)
            };
            t.ended(MODEL, template, rng.length(median, 0.8));
        }
        let w = t.own(MODEL, LONG).weight;
        assert!(w < 0.9, "{w}");
        assert_ne!(model_key("m"), crate::hash::fnv1a(b"m"));
    }
}
