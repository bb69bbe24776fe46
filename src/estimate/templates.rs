//! How long the answers to each of a model's prompt templates run, as every worker has seen
//! them end: what a request's answer is likely to be beyond its model's lengths
//! (`output_dist::Own`). Source of truth: the model's shared calibration record
//! (`calibration`'s `kvgate.cal.<slot>`), which carries a `Templates` beside the model's length
//! histograms; every worker's answers are folded into it at its flush, and every worker reads it
//! with the rest of the record (at most once a second), so a template is learned from all the
//! gateway's answers, not from the share of them one worker streamed.
//!
//! Why: one model serves many applications, and their answers' lengths differ far more between
//! them than within one (a classifier's few tokens, a summary's hundreds, an assistant's long
//! turns). The model's distribution (`calibration`) is their mixture: every request is expected
//! at the mixture's mean, with the mixture's spread, so a pod's forecast reserves long answers
//! for short applications and short ones for long applications, and its headroom pays for the
//! spread between applications on every request. An application's requests start alike: a chat
//! prompt's opening (its tools and system turns, `Request::opening`) names its template.
//!
//! An opening is often its application's only up to a point: a user's profile, retrieved
//! passages or the time close many system prompts, so that no two requests' openings are alike.
//! So a request goes by a few keys (`Keys`, from `routing::prefix::template_keys`, which cover
//! the model and the cache salt): the whole opening, then heads of it, each shorter. An answer is
//! learned under its whole opening, and, while that has not answered enough, under the heads of
//! it that its application's requests share (`Templates::ended` says how they are found); a
//! request is expected by its whole opening where that has answered enough, else by the longest
//! of its heads that has (heads shared by several applications, the house rules they all open
//! with, learn their mixture, and weigh only where nothing longer has answers). Whole openings
//! and heads are kept apart: applications whose openings repeat whole keep their templates as
//! if no head were learned. A prompt without an opening (a completions prompt, often one the
//! application rendered through the model's chat template itself; a chat whose instructions
//! come in its first user turn) goes by heads of its text alone: its application's words still
//! come first, after the template's markers, which every application's prompts share.
//!
//! What is learned: for each template, and for the model over all its templates, the faded
//! mean and variance of `log2(answer + 1)` over the answers that ended by themselves (those cut
//! off by their own `max_tokens` say only that the answer would have gone on, and are left out):
//! a lognormal, the shape answer lengths take within one application. A template's lognormal is
//! blended with the model's lengths by how surely its mean differs from the model's: with the
//! positive-part James–Stein weight `1 − JS · se² / d²` (`d` the difference, `se` its standard
//! error from the template's answers), so that templates whose answers are drawn alike (a model
//! behind many system prompts that do not change its answers) stay with the model's lengths,
//! which pool all their answers, instead of each taking its own sampling noise; and never above
//! `1 − RESIDUAL`, so the model's long tail is never quite given up. At most `MAX_TEMPLATES` whole
//! openings and `MAX_HEADS` heads a model, 24 bytes each in memory and about 50 in the record; a
//! key not kept takes the weakest one's place only as that one stops answering.

use crate::estimate::output_dist::Own;
use serde::{Deserialize, Serialize};

/// Whole openings a model's record keeps at once: applications behind one model, with room for
/// the one-off openings (each request's own context closing its system prompt) that pass
/// through without pushing them out.
const MAX_TEMPLATES: usize = 32;
/// Heads of openings a model's record keeps at once: a few for each application whose openings
/// end apart (those its requests share), with room for the one each request's answer brings of
/// its own.
const MAX_HEADS: usize = 64;
/// Keys a request goes by: its whole opening, the opening to its last full block, and its heads
/// of 64, 32, 16, 8, 4, 2 and 1 blocks (`routing::prefix::template_keys`).
const MAX_KEYS: usize = 9;
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
/// Written in the record as `[key, weight, mean, square]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(from = "(u64, f32, f32, f32)", into = "(u64, f32, f32, f32)")]
struct Entry {
    key: u64,
    weight: f32,
    mean: f32,
    square: f32,
}

impl From<(u64, f32, f32, f32)> for Entry {
    fn from((key, weight, mean, square): (u64, f32, f32, f32)) -> Self {
        Entry {
            key,
            weight,
            mean,
            square,
        }
    }
}

impl From<Entry> for (u64, f32, f32, f32) {
    fn from(e: Entry) -> Self {
        (e.key, e.weight, e.mean, e.square)
    }
}

impl Entry {
    fn spread(&self) -> f64 {
        (f64::from(self.square) - f64::from(self.mean).powi(2))
            .max(0.0)
            .sqrt()
    }

    /// Folds in one answer's `x = log2(tokens + 1)`, older ones faded. (A weight that answers
    /// of other keys took below zero, `take_in`, counts as none.)
    fn add(&mut self, x: f64) {
        let keep = f64::from(self.weight).max(0.0) * (1.0 - FADE);
        let weight = keep + 1.0;
        let blend = |old: f32, new: f64| ((f64::from(old) * keep + new) / weight) as f32;
        self.mean = blend(self.mean, x);
        self.square = blend(self.square, x * x);
        self.weight = weight as f32;
    }
}

/// The keys a request's template goes by, most specific first (`routing::prefix::template_keys`):
/// its whole opening, then heads; or heads alone, for a prompt without an opening.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Keys {
    keys: [u64; MAX_KEYS],
    len: u8,
    /// The first key is not a whole opening but a head (`Keys::headless`).
    headless: bool,
}

impl Keys {
    /// A template known by one key, its whole opening.
    pub fn one(key: u64) -> Self {
        let mut k = Keys::default();
        k.push(key);
        k
    }

    /// The keys of a prompt that has no opening (a completions prompt, a chat without system
    /// turns): every key pushed is a head of the prompt.
    pub fn headless() -> Self {
        Keys {
            headless: true,
            ..Keys::default()
        }
    }

    /// The whole opening's key, if the keys have one.
    fn whole(&self) -> Option<u64> {
        self.iter().next().filter(|_| !self.headless)
    }

    /// The heads, longest first.
    fn heads(&self) -> impl DoubleEndedIterator<Item = u64> + '_ {
        self.iter().skip(usize::from(!self.headless))
    }

    /// Adds a less specific key; one already there, or past `MAX_KEYS`, is left out.
    pub fn push(&mut self, key: u64) {
        let len = usize::from(self.len);
        if len < MAX_KEYS && !self.iter().any(|k| k == key) {
            if let Some(slot) = self.keys.get_mut(len) {
                *slot = key;
                self.len += 1;
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = u64> + ExactSizeIterator + '_ {
        self.keys.iter().take(usize::from(self.len)).copied()
    }
}

/// One model's answers over all its templates, each whole opening's (at most `MAX_TEMPLATES`),
/// and the heads' of openings that do not repeat whole (at most `MAX_HEADS`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Templates {
    model: Entry,
    templates: Vec<Entry>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    heads: Vec<Entry>,
}

/// A list's entry for `key`, if it has answers.
fn find(list: &[Entry], key: u64) -> Option<&Entry> {
    list.iter().find(|e| e.key == key && e.weight > 0.0)
}

/// Folds an answer into `key`'s entry in `list`, if it has one: its weight then.
fn add(list: &mut [Entry], key: u64, x: f64) -> Option<f64> {
    let e = list.iter_mut().find(|e| e.key == key)?;
    e.add(x);
    Some(f64::from(e.weight))
}

/// Takes `key` into a list of at most `max`, with its first answer: in a free place, else in the
/// weakest entry's, only as that one stops answering.
fn take_in(list: &mut Vec<Entry>, max: usize, key: u64, x: f64) {
    let mut fresh = Entry {
        key,
        ..Entry::default()
    };
    fresh.add(x);
    if list.len() < max {
        return list.push(fresh);
    }
    let Some(e) = list.iter_mut().min_by(|a, b| a.weight.total_cmp(&b.weight)) else {
        return;
    };
    if e.weight >= 1.0 {
        // A key not kept pushes the weakest out only as the weakest stops answering: each such
        // answer takes one answer and an eighth of its weight, and is itself lost. A stream of
        // prompts that each come once (no template: every prompt its own) so does not evict the
        // templates that keep answering, and one gone quiet leaves within a few dozen.
        e.weight -= 1.0 + e.weight / 8.0;
        return;
    }
    *e = fresh;
}

impl Templates {
    pub fn is_empty(&self) -> bool {
        self.model.weight <= 0.0
    }

    /// An answer of `tokens` to a prompt going by `keys`, that ended by itself. Its whole
    /// opening learns it; so do its heads, while the whole has not answered enough (an opening
    /// that repeats whole needs none; a prompt without an opening has heads only), from the
    /// shortest: every head already kept, and the shortest not kept yet. So an application's
    /// heads are taken in one longer each answer for as long as its requests share them, and its
    /// requests' own (past where their openings part) take one place in turn, not one each.
    pub fn ended(&mut self, keys: &Keys, tokens: u64) {
        let x = (tokens as f64 + 1.0).log2();
        self.model.add(x);
        if let Some(whole) = keys.whole() {
            match add(&mut self.templates, whole, x) {
                Some(weight) if weight >= MIN_ANSWERS => return,
                Some(_) => {}
                None => take_in(&mut self.templates, MAX_TEMPLATES, whole, x),
            }
        }
        let mut took = false;
        for head in keys.heads().rev() {
            if add(&mut self.heads, head, x).is_none() && !took {
                take_in(&mut self.heads, MAX_HEADS, head, x);
                took = true;
            }
        }
    }

    /// What the answers of the most specific of `keys` that has `MIN_ANSWERS` say of the next
    /// one's length beyond the model's (`Own::NONE` when none has, or while that key's mean is
    /// not surely apart from the model's: a longer head drawn like its model says more of its
    /// requests than a shorter one apart from it, which other applications share).
    pub fn own(&self, keys: &Keys) -> Own {
        let m = &self.model;
        let answered = |e: &&Entry| f64::from(e.weight) >= MIN_ANSWERS;
        let whole = keys.whole().and_then(|k| find(&self.templates, k));
        let Some(t) = whole.filter(answered).or_else(|| {
            keys.heads()
                .filter_map(|k| find(&self.heads, k))
                .find(answered)
        }) else {
            return Own::NONE;
        };
        let n = f64::from(t.weight);
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
            t.ended(&Keys::one(template), l);
        }
        let model = learned(&all);
        let mixture = model.expected(0, 100_000) as f64;
        let short = model.with_own(t.own(&Keys::one(SHORT)));
        let long = model.with_own(t.own(&Keys::one(LONG)));
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

    /// A classifier (median 12) and an assistant (median 400) answering in turn, each request
    /// going by `keys(application, request)`: a new request of each is expected near its own
    /// application's answers.
    fn two_applications(keys: &dyn Fn(u64, u64) -> Keys, seed: u64) -> Templates {
        let (mut t, mut rng, mut all) = (Templates::default(), Rng(seed), vec![]);
        for i in 0..400 {
            let (app, median) = if i % 2 == 0 { (0, 12.0) } else { (1, 400.0) };
            let l = rng.length(median, 0.5);
            all.push(l);
            t.ended(&keys(app, i), l);
        }
        let model = learned(&all);
        let expect = |own| model.with_own(own).expected(0, 100_000) as f64;
        let (short, long) = (
            expect(t.own(&keys(0, 9_999))),
            expect(t.own(&keys(1, 9_998))),
        );
        assert!((10.0..=25.0).contains(&short), "{short}");
        assert!((380.0..=520.0).contains(&long), "{long}");
        t
    }

    /// Two applications open with the same house rules, then their own words, then each
    /// request's own (a user's profile): no two openings alike. Each request is expected by the
    /// longest head its application's requests share, not by the rules (their mixture), nor by
    /// its own opening, never seen before.
    #[test]
    fn openings_that_end_apart_are_expected_by_the_head_their_application_shares() {
        const RULES: u64 = 7;
        let keys = |app: u64, request: u64| {
            let mut k = Keys::default();
            // The whole opening and its last full block, the request's own; a head of its
            // application's; the rules' heads, every application's.
            [
                1_000_000 + request,
                2_000_000 + request,
                100 + app,
                RULES,
                RULES + 1,
            ]
            .into_iter()
            .for_each(|key| k.push(key));
            k
        };
        let mut t = two_applications(&keys, 3);
        // The rules alone say only what the model does.
        let mut rules = Keys::one(RULES);
        rules.push(RULES + 1);
        assert_eq!(t.own(&rules), Own::NONE);
        // The requests' own keys came once each, and went: the applications' stayed.
        assert!(t.templates.len() <= MAX_TEMPLATES && t.heads.len() <= MAX_HEADS);
        assert!([100, 101, RULES, RULES + 1]
            .iter()
            .all(|&k| find(&t.heads, k).is_some()));
        // A request whose whole opening has answers enough goes by it, before any head.
        for _ in 0..8 {
            t.ended(&keys(1, 5), 3);
        }
        assert!(f64::from(t.own(&keys(1, 5)).mean) < 3.0);
        // A key list holds each key once, and at most `MAX_KEYS`.
        let mut k = Keys::one(0);
        (0..20).for_each(|key| k.push(key));
        assert_eq!(
            k.iter().collect::<Vec<_>>(),
            (0..MAX_KEYS as u64).collect::<Vec<_>>()
        );
    }

    /// Completions prompts that two applications rendered through the chat template
    /// themselves: heads alone, the template's markers (every application's), the application's
    /// words, each request's own. Each is expected by its application's head, and the
    /// requests' own heads take one place in turn.
    #[test]
    fn prompts_without_an_opening_are_expected_by_their_applications_heads() {
        const MARKERS: u64 = 7;
        let keys = |app: u64, request: u64| {
            let mut k = Keys::headless();
            [1_000_000 + request, 100 + app, MARKERS]
                .into_iter()
                .for_each(|key| k.push(key));
            k
        };
        let mut t = two_applications(&keys, 5);
        // No whole was learned, and the markers alone say what the model does.
        assert!(t.templates.is_empty());
        let mut markers = Keys::headless();
        markers.push(MARKERS);
        assert_eq!(t.own(&markers), Own::NONE);
        assert!(t.heads.len() <= MAX_HEADS);
        // A request's own head that comes again answers as a head, never as a whole.
        for _ in 0..8 {
            t.ended(&keys(1, 5), 3);
        }
        assert!(f64::from(t.own(&keys(1, 5)).mean) < 3.0);
        assert!(t.templates.is_empty());
    }

    /// Thirty applications whose long openings repeat whole: each is learned under its opening as
    /// if no head were (each request brings eight heads besides, which would crowd the list).
    #[test]
    fn applications_whose_openings_repeat_whole_keep_their_templates() {
        let keys = |app: u64| {
            let mut k = Keys::one(1_000 + app);
            (0..8).for_each(|level| k.push(app * 100 + level));
            k
        };
        let mut t = Templates::default();
        for round in 0..30 {
            for app in 0..30 {
                t.ended(&keys(app), if app % 2 == 0 { 5 } else { 500 } + round % 3);
            }
        }
        for app in 0..30 {
            // Answers of 5–7 tokens, or 500–502: log2(answer + 1) about 2.8, or 9.0.
            let own = t.own(&keys(app));
            let at = if app % 2 == 0 { 2.8 } else { 9.0 };
            assert!((f64::from(own.mean) - at).abs() < 0.1, "{app}: {own:?}");
        }
        assert!(t.heads.len() <= MAX_HEADS);
    }

    #[test]
    fn a_template_of_the_models_own_lengths_leaves_them_about_as_they_are() {
        // Eight templates drawing from one distribution (chat answers, mean 256, σ 0.8).
        let (mut t, mut rng, mut all) = (Templates::default(), Rng(11), vec![]);
        for i in 0..2_000u64 {
            let l = rng.length(186.0, 0.8);
            all.push(l);
            t.ended(&Keys::one(100 + i % 8), l);
        }
        let model = learned(&all);
        let e = model.expected(0, 100_000) as f64;
        for template in 100..108 {
            let d = model.with_own(t.own(&Keys::one(template)));
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
        assert_eq!(t.own(&Keys::one(SHORT)), Own::NONE, "nothing seen");
        for _ in 0..100 {
            t.ended(&Keys::one(LONG), 500);
        }
        for _ in 0..7 {
            t.ended(&Keys::one(SHORT), 5);
        }
        assert_eq!(
            t.own(&Keys::one(SHORT)),
            Own::NONE,
            "seven answers are not enough"
        );
        t.ended(&Keys::one(SHORT), 5);
        let own = t.own(&Keys::one(SHORT));
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
        assert_eq!(t.own(&Keys::one(99)), Own::NONE, "a template never seen");
        // The list full of templates that keep answering, twenty answers each.
        let others = 10..(10 + MAX_TEMPLATES as u64 - 2);
        for other in others.clone() {
            for _ in 0..20 {
                t.ended(&Keys::one(other), 300);
            }
        }
        assert_eq!(t.templates.len(), MAX_TEMPLATES);
        // One-off prompts, one for every four answers of each template, leave them all there.
        for i in 1..=100 {
            t.ended(&Keys::one(1_000 + i), 5_000);
            for k in [SHORT, LONG].into_iter().chain(others.clone()) {
                for _ in 0..4 {
                    t.ended(&Keys::one(k), if k == SHORT { 5 } else { 300 });
                }
            }
        }
        assert!((f64::from(t.own(&Keys::one(SHORT)).mean) - 6f64.log2()).abs() < 1e-5);
        assert!(others.clone().all(|k| find(&t.templates, k).is_some()));
        assert!((1_001..=1_100).all(|k| find(&t.templates, k).is_none()));
        // A new template that keeps answering takes the weakest's place.
        let weakest = t
            .templates
            .iter()
            .min_by(|a, b| a.weight.total_cmp(&b.weight));
        let weakest = weakest.map(|e| e.key).unwrap();
        for _ in 0..60 {
            t.ended(&Keys::one(99), 5_000);
        }
        assert!(t.own(&Keys::one(99)).mean > 12.0);
        assert!(find(&t.templates, weakest).is_none());
        assert_eq!(t.templates.len(), MAX_TEMPLATES);
        // Written and read back as the record carries it.
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<Templates>(&json).unwrap(), t);
        assert!(json.len() < 60 * (MAX_TEMPLATES + 1), "{}", json.len());
        // A template a little apart from its model, by a few standard errors, weighs a little.
        let mut rng = Rng(5);
        for i in 0..4_000 {
            let (template, median) = if i % 2 == 0 {
                (SHORT, 100.0)
            } else {
                (LONG, 110.0)
            };
            t.ended(&Keys::one(template), rng.length(median, 0.8));
        }
        let w = t.own(&Keys::one(LONG)).weight;
        assert!(w < 0.9, "{w}");
    }
}
