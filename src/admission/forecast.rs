//! A pod's KV forecast: what its in-flight requests will hold over the coming decode steps, and
//! the budget check admission makes against it. The inputs are the requests' entries in the pod's
//! shared record (`pods::record`, the source of truth): each holds `held` tokens now (its prompt,
//! less a prefix another request already holds, plus what it has streamed) and its outlook (the
//! chance it is still running `s` steps ahead, from `output_dist`).
//!
//! Every running sequence grows by one token a step and frees everything when it stops, so `s`
//! steps ahead request `i` holds `held_i + s` tokens if it is still running: certainly not past
//! `left_i` (the steps to its own limit), and otherwise with the chance `p_i` its outlook gives at
//! the step of `output_dist::HORIZON_STEPS` that `s` is (or, between steps, the step before,
//! which errs towards full). The pod then holds, in expectation and variance,
//!
//! ```text
//! E(s) = Σ_{left_i ≥ s} (held_i + s + slack) · p_i
//! Var(s) = Σ_{left_i ≥ s} (held_i + s + slack)² · p_i (1 − p_i) + σ_i² · p_i
//! ```
//!
//! with, for the requests forecast on the output prior's guess (`Load::guessed`), the guess's
//! own error added once over all of them (`peak`: it is one error they share).
//!
//! A request of several answers (`n`, parallel sampling) runs a sequence for each on its prompt,
//! which each extends by a token a step and which it holds while any of them runs; its answers
//! end independently, each with one answer's chance (`Sums` has the terms).
//!
//! (`slack`: what a request holds beyond its entry, its partial blocks at their mean and its
//! stream's lag as measured on the pod, see `Slack`; `σ_i`: how far `held_i` and the slack may be
//! off — the prompt was estimated by rule, with the spread calibration measured, and the slack is
//! anywhere in a block or two — so both are held at their expected size and their uncertainty is
//! paid once per pod, not as a margin on every request). The forecast is the highest
//! `E + z·σ` (never more than all of them still running would hold) at the grid's steps and just
//! before each request's limit, and a request is admitted when it stays within the budget. A
//! request with `max_tokens` is thus counted exactly up to its limit. The sum of
//! many independent requests is far narrower than each one, so a pod is filled near what its
//! requests really take, and a request with `max_tokens` is certainly gone past its limit. Later
//! arrivals are left out: each is checked against the forecast when it comes.

use crate::estimate::output_dist::{Outlook, HORIZON_END, HORIZON_STEPS};
use crate::estimate::reservation::Estimate;

/// How many standard deviations of headroom the forecast keeps (`z`), by kind of request.
///
/// `E + z·σ` bounds the pod's KV at each step ahead on its own, and a pod held at its budget
/// meets each of those bounds a step at a time: the chance that its KV passes the budget at
/// *some* step is larger than at any one, and a pod at its budget for a whole run tries that
/// chance at every step. At 2.5 σ, pods of chat answers with `max_tokens` on every request
/// preempted about once in 100,000 decode steps (6 times in 21 runs of 8 pods, 2026-12-01), and
/// an offline model of the rule with every request's chances known about once in 200,000
/// (`scripts/forecast_ceiling.py`, 600,000 steps); at 3 σ the model never did, for a point less
/// of KV in use, and the engine once in 15 runs. A client's `max_tokens` is a bound kvgate keeps
/// the pod from preempting for, so those requests keep the wider headroom; answers without one
/// have a spread the engine's feedback may show to be narrower (`Snapshot::relief`), and a
/// preemption now and then among them is the price of not leaving their pods' KV idle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Headroom {
    /// For requests with an output limit of their own (`admission.boundedHeadroomSigmas`).
    pub bounded: f64,
    /// For requests without one (`admission.headroomSigmas`), less what the engine's feedback
    /// has given up.
    pub unbounded: f64,
}

impl Headroom {
    /// The same for both kinds.
    #[cfg(test)]
    pub fn uniform(z: f64) -> Headroom {
        Headroom {
            bounded: z,
            unbounded: z,
        }
    }

    /// A pod's `z`: each kind's in the share of its requests that are of that kind, the
    /// unbounded less the `relief` the engine's feedback gave up.
    pub fn sigmas(self, unbounded_share: f64, relief: f64) -> f64 {
        let share = unbounded_share.clamp(0.0, 1.0);
        self.bounded * (1.0 - share) + self.unbounded * (1.0 - relief.clamp(0.0, 1.0)) * share
    }
}

/// One in-flight request as the forecast sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Load {
    pub held: u64,
    /// How far `held` may be off, one standard deviation (its prompt was estimated by rule).
    pub sigma: u64,
    /// Decode steps until its own limit (`max_tokens`, or the output cap) stops it.
    pub left: u64,
    /// Tokens it makes a decode step: its choices (`n`).
    pub rate: u64,
    /// It set its own output limit (`max_tokens`): its pod keeps `Headroom::bounded` for it.
    pub bounded: bool,
    /// Its outlook is the output prior's, a guess nothing has measured (`Estimate::output_guessed`).
    pub guessed: bool,
    /// What of `held` its answers have made so far, over all of them (the rest is its prompt).
    pub streamed: u64,
    /// How far its stream has run past `held`: the tokens its answers made since its entry was
    /// last written, as the entry's age at its pod's pace says (`PodRecord::forecast`); `None`
    /// where that is not known (no token seen yet, the pace unknown). Counted at half a block
    /// at least ([`Slack`]).
    pub ahead: Option<u64>,
    pub outlook: Outlook,
}

impl Load {
    /// A request not yet sent, holding `held` of its pod's KV (its prompt, or what of it the pod
    /// does not hold already) with spread `sigma`: nothing streamed, its whole outlook ahead.
    pub fn fresh(est: &Estimate, held: u64, sigma: u64) -> Load {
        Load {
            held,
            sigma,
            left: est.steps_left(est.choices, 0),
            rate: est.choices,
            bounded: est.bounded,
            guessed: est.output_guessed,
            streamed: 0,
            ahead: None,
            outlook: est.outlook(est.choices, 0),
        }
    }
}

/// The most a request of `sequences` answers may hold beyond its entry's `held`, in tokens, with
/// blocks of `block` tokens: each answer's last block is partly filled (the engine allocates whole
/// blocks, and a prompt's last, partial block is copied to each answer), and an entry is
/// written only when its output crosses a block boundary, so the stream may be up to a block
/// further along than the entry says. Left out, the second made the forecast of a full pod creep
/// past its budget as the entries caught up (by up to a block per request in flight). What the
/// engine's KV shows beyond this is not kvgate's (`feedback::explained`); the forecast counts
/// these parts by their mean and spread ([`Slack`]).
pub fn slack(block: u64, sequences: u64) -> u64 {
    block.saturating_mul(sequences.max(1).saturating_add(1))
}

/// What a request of `sequences` answers holds beyond its entry's `held` as the forecast counts
/// it. It has three parts:
/// - each answer's last block is partly filled (the engine allocates whole blocks): half a
///   block on average;
/// - the entry is written when the request's output crosses a block boundary, so its stream
///   is up to a block further along: half a block on average, once a request, or more where
///   its age at the pod's pace says so (`Load::ahead`). Requests that run in step (a burst of
///   equal prompts, as benchmark clients send) cross their block boundaries in the same
///   decode step, and their entries are rewritten one after another; between the first write
///   and the last, those not yet rewritten looked a block further from their limits than the
///   rewritten one, counted at the mean they were half a block short when it ends, and a
///   request admitted then took the pod past its KV (`tests/e2e/test_budget.py`,
///   `ignore_eos`: 3 runs in 6 preempted). Not less than the mean where the age says less:
///   the pace is the engine's mean inter-token latency, every running answer's gaps
///   averaged, so the busiest steps weigh most and the age reads short; counted by the age
///   alone, pods of short answers preempted 14 times in 4 `chat-short` runs where the mean
///   had 2;
/// - the stream reaches the filter some tokens after the engine made them (the delivery lag):
///   the pod's [`Lag`] an answer.
///
/// The first two are anywhere in a block and independent from request to request, so a pod's
/// sum of them is close to its mean: they are counted by their mean and their variance
/// (`block²/12` each), as the answers' lengths are, not each at its bound ([`slack`]: two blocks
/// a request, which held pods running thirty short requests at 84 % of their KV where this holds
/// them at 89 %, `chat-short`). The lag moves all of a pod's streams together (a learned mean of
/// 11–13 tokens a request preempted 14–26 times in 30 s, BENCHMARKS.md, thirtieth session), so
/// it has no spread to pool: it is counted at a margin. Left out, with the partial blocks at
/// their mean of a block (and 5 % of the pod kept free then), pods of 4k tokens running six
/// requests with every answer's length known preempted 1–3 times at `--concurrency` 2 and 4
/// (`tests/e2e/test_budget.py`).
struct Slack {
    /// Of the prompt's part: the entry's lag behind its stream.
    prompt: f64,
    /// Of each answer's part: its partial block and its stream's lag.
    answer: f64,
    /// Of the partial blocks, one an answer and the entry's: uniform over a block each.
    variance: f64,
}

impl Slack {
    fn of(block: u64, sequences: u64, lag: Lag, ahead: Option<u64>) -> Slack {
        let b = block as f64;
        Slack {
            prompt: ahead.map_or(b / 2.0, |a| (a as f64).max(b / 2.0)),
            answer: b / 2.0 + lag.margin(block) as f64,
            variance: (sequences.max(1) + 1) as f64 * b * b / 12.0,
        }
    }
}

/// How far behind its engine a pod's streams reach the filter, as its requests' entries have seen
/// it: the most output tokens one response-body callback brought an answer (`RequestEntry::lag`),
/// over the pod's requests in flight. A stream that arrives several tokens at once was that far
/// behind the engine, which had allocated their KV (Envoy's worker or buffers busy, an engine
/// that streams every few tokens with vLLM's or SGLang's `--stream-interval`, vLLM's output
/// merging under load). At real speed on an idle proxy it is a token; at
/// `tests/e2e/test_budget.py`'s ten-fold clock, 5–8.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lag {
    /// No stream on the pod has shown one yet.
    Unseen,
    Seen(u64),
}

impl Lag {
    /// The most of `lags` (0: none seen).
    pub fn most(lags: impl Iterator<Item = u64>) -> Lag {
        match lags.max().unwrap_or(0) {
            0 => Lag::Unseen,
            l => Lag::Seen(l),
        }
    }

    /// What the forecast counts for it an answer, in tokens: what was seen, the token the engine
    /// is computing (its KV slot is allocated before the step), and one on its way: a steady
    /// delay from the engine to the filter brings a token a chunk, which the chunks' sizes do
    /// not show. Half a block while none was seen. Measured on `chat-short` (pods of thirty
    /// short requests at real speed, where the lag seen is a token): counting what was seen and
    /// one token, the pods preempted 1–3 times in 30 s; with two, 2, 0 and 0 times in three
    /// runs; with half a block, never, at 1.6 % less output (BENCHMARKS.md, forty-first
    /// session).
    fn margin(self, block: u64) -> u64 {
        match self {
            Lag::Unseen => block / 2,
            Lag::Seen(l) => l.saturating_add(2),
        }
    }
}

/// The highest `E + z·σ` over the horizon, in tokens, with blocks of `block` tokens and the
/// pod's streams' `lag`.
///
/// It is taken at each grid step, where each request's chance of running is its outlook's, and
/// at each request's limit, just before it stops, with the chance at the step before (which errs
/// towards full). Between grid steps without a limit the pod's KV moves smoothly, and its chances
/// there are not known any better than by the steps around them. Within an interval, `E(s)`, `Var(s)` and "all still running" are polynomials in `s` over the
/// requests whose limit is at least `s`: `E = A + s·C`, `Var = Q2 + 2s·Q1 + s²·Q0` and
/// `all = H + s·N`. With the requests sorted by limit, each interval is one sweep that drops a
/// request from the sums once `s` passes its limit: `O(n log n)` per pod, not `O(n²)`, which
/// matters on the request path for pods running hundreds of sequences.
///
/// `prior_spread` (`estimator.outputPriorSpread`) is the relative error of the output prior's
/// mean, for the requests whose outlook is that prior's guess (`Load::guessed`): one error they
/// all share, so it is counted once over the pod, the sum of what each request's mean would move
/// if the prior's mean were that much longer. Independent errors add in variance and pool
/// (`√n`); a shared one adds in full (`n`): a pod of one or two such requests keeps about the
/// headroom it had, a pod of thirty admitted at once (a fresh pool's first wave, before any
/// answer has ended) is held to what the guess's error could make of them. For an exponential
/// outlook `p = e^{−s/μ}` the chance moves by `−p·ln p` per unit of `ln μ`, which the outlook's
/// chance alone gives; a request that runs to its limit (`p` 1) moves by none.
pub fn peak(
    loads: impl Iterator<Item = Load>,
    z: f64,
    block: u64,
    lag: Lag,
    prior_spread: f64,
) -> u64 {
    let mut loads: Vec<Term> = loads.map(|l| Term::of(&l, block, lag)).collect();
    loads.sort_unstable_by_key(|l| l.left);
    let mut worst: f64 = 0.0;
    for (j, &start) in HORIZON_STEPS.iter().enumerate() {
        let start = u64::from(start);
        let end = u64::from(HORIZON_STEPS.get(j + 1).copied().unwrap_or(HORIZON_END));
        let first = loads.partition_point(|l| l.left < start);
        let mut sums = Sums {
            prior_spread,
            ..Sums::default()
        };
        for l in &loads[first..] {
            sums.add(l, j, 1.0);
        }
        worst = worst.max(sums.at(start, z));
        // The pod holds most at a grid step or just before one of its requests stops (at its
        // limit, where it is still counted). A limit on the next grid step belongs to this
        // interval too: at that step its request's outlook is 0 (it has stopped), so the next
        // interval never counts it. Left there, the forecast lost that request just before it
        // stops, with every other request's growth since this interval's start (measured: seven
        // answers of 300 tokens forecast at 4,087 tokens took 4,262, and the pod preempted).
        let mut next = first;
        while next < loads.len() && loads[next].left <= end {
            let s = loads[next].left;
            worst = worst.max(sums.at(s, z));
            while next < loads.len() && loads[next].left == s {
                sums.add(&loads[next], j, -1.0);
                next += 1;
            }
        }
        if j + 1 == HORIZON_STEPS.len() {
            // The horizon's end: no grid step after it.
            worst = worst.max(sums.at(end, z));
        }
    }
    // Sizes are whole tokens, and with every chance 0 or 1 (known lengths) so is the forecast:
    // the running sums' rounding must not lift an exact 3891 to 3892 on one worker and not on
    // another.
    (worst - 1e-6).ceil().max(0.0) as u64
}

/// A request as the sweep adds it: what does not change between intervals worked out once (the
/// sweep adds each request to the sums of every interval it may run in). It is a prompt, held
/// while any of its answers runs, and `r` answers of `k` tokens each, each growing a token a step
/// and running on, independently of the others, with the chance its outlook gives.
struct Term {
    left: u64,
    /// The prompt part of `held`, and the entry's lag behind its stream (`Slack`).
    hp: f64,
    /// Answers, each making a token a step.
    r: f64,
    /// With `k` each answer's part (what it has made, and its partly filled last block, its
    /// slack), the products `Sums::add` needs in every interval whatever the chance: `hp²`,
    /// `r·k`, `r·k²` and `2·hp·k`, worked out once a request, not once an interval.
    hp2: f64,
    rk: f64,
    rk2: f64,
    hpk2: f64,
    /// The spread of `held`, squared, and the slack's.
    sigma2: f64,
    guessed: bool,
    outlook: Outlook,
}

impl Term {
    fn of(l: &Load, block: u64, lag: Lag) -> Term {
        let slack = Slack::of(block, l.rate, lag, l.ahead);
        let r = l.rate.max(1) as f64;
        let streamed = l.streamed.min(l.held) as f64;
        let k = streamed / r + slack.answer;
        let hp = (l.held as f64 - streamed) + slack.prompt;
        Term {
            left: l.left,
            hp,
            r,
            hp2: hp * hp,
            rk: r * k,
            rk2: r * k * k,
            hpk2: 2.0 * hp * k,
            sigma2: (l.sigma as f64).powi(2) + slack.variance,
            guessed: l.guessed,
            outlook: l.outlook,
        }
    }
}

/// The sums `peak` sweeps, over the requests that may still run in one interval.
///
/// At `s` steps ahead a request holds `hp·B + Σ_j (k + s)·A_j`, its answers running (`A_j`) each
/// with chance `p`, its prompt (`B`) while any does, with chance `P = 1 − (1 − p)^r`. So it adds
/// `hp·P + r·p·(k + s)` to the mean and, with `q = p(1 − p)` and `Cov(B, A_j) = p(1 − P)`,
/// `hp²·P(1 − P) + r·q·(k + s)² + 2·hp·r·p(1 − P)·(k + s)` to the variance: polynomials in `s`.
/// With one answer (`P = p`) this is `(hp + k + s)` held with chance `p`, as a request always was.
#[derive(Default)]
struct Sums {
    /// The mean's constant and `s` coefficient; the variance's constant, half its `s`
    /// coefficient and its `s²` coefficient; everything held now and made a step by all the
    /// requests; their spreads `σ²` by the prompts' chances, and in all. Only requests with
    /// `p > 0`.
    a: f64,
    c: f64,
    q2: f64,
    q1: f64,
    q0: f64,
    h: f64,
    n: f64,
    v: f64,
    w: f64,
    /// What the mean moves by per unit of the output prior's `ln μ`, over the requests on its
    /// guess: its constant and its `s` coefficient; and that guess's relative error.
    dc: f64,
    dn: f64,
    prior_spread: f64,
}

impl Sums {
    fn add(&mut self, t: &Term, interval: usize, sign: f64) {
        let p = f64::from(t.outlook[interval]) / 255.0;
        if p <= 0.0 {
            return;
        }
        let (hp, r) = (t.hp, t.r);
        // The prompt's chance: one answer's, or any of several's.
        let big_p = if r > 1.0 { 1.0 - (1.0 - p).powf(r) } else { p };
        let q = p * (1.0 - p);
        let cov = r * p * (1.0 - big_p);
        self.a += sign * (hp * big_p + t.rk * p);
        self.c += sign * r * p;
        self.q2 += sign * (t.hp2 * big_p * (1.0 - big_p) + t.rk2 * q + t.hpk2 * cov);
        self.q1 += sign * (t.rk * q + hp * cov);
        self.q0 += sign * r * q;
        self.h += sign * (hp + t.rk);
        self.n += sign * r;
        self.v += sign * t.sigma2 * big_p;
        self.w += sign * t.sigma2;
        if t.guessed {
            // `∂p/∂ln μ = −p ln p`; the prompt's chance `P` moves by `r(1 − p)^{r−1}` of it.
            let d = -p * p.ln();
            let dp = if r > 1.0 {
                r * (1.0 - p).powf(r - 1.0)
            } else {
                1.0
            };
            self.dc += sign * d * (hp * dp + t.rk);
            self.dn += sign * d * r;
        }
    }

    /// `E + z·σ` at `s` steps ahead, never more than all the requests still able to run would
    /// hold (the normal approximation's tail is unbounded; the pod's is not). A request that
    /// holds `h + σε` (ε standard normal) with chance `p` adds `p(1 − p)·h² + p·σ²` to the
    /// variance; "all running" is uncertain by the prompts' `σ`s alone.
    fn at(&self, s: u64, z: f64) -> f64 {
        let s = s as f64;
        let mean = self.a + s * self.c;
        let shared = self.prior_spread * (self.dc + s * self.dn);
        let var =
            (self.q2 + 2.0 * s * self.q1 + s * s * self.q0 + self.v).max(0.0) + shared * shared;
        let all = self.h + s * self.n + z * self.w.max(0.0).sqrt();
        (mean + z * var.sqrt()).min(all).max(0.0)
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::estimate::output_dist::OutputDist;

    fn load(held: u64, streamed: u64, max: u64) -> Load {
        Load {
            held,
            sigma: 0,
            left: max.saturating_sub(streamed),
            rate: 1,
            bounded: false,
            guessed: false,
            streamed,
            ahead: None,
            outlook: OutputDist::prior(256).outlook(streamed, max),
        }
    }

    #[test]
    fn requests_that_must_stop_soon_forecast_little_more_than_they_hold() {
        // Ten requests of 300 prompt tokens with max_tokens 20: gone within 32 steps.
        let loads = vec![load(300, 0, 20); 10];
        let p = peak(loads.iter().copied(), 2.0, 16, Lag::Unseen, 0.0);
        // Each holds 300 and a block and a half more on average (`Slack`), which spreads by
        // √(2 × 16²/12) = 6.5 tokens a request, 21 for ten.
        assert!(p >= 10 * 324, "never below what they hold now: {p}");
        assert!(
            p <= 10 * (324 + 20) + 2 * 21,
            "never above all of them running to their limit: {p}"
        );
    }

    #[test]
    fn a_request_that_runs_to_its_limit_is_counted_up_to_it() {
        // Two requests known to run 1000 more tokens: between 512 and 1024 steps ahead both
        // still hold 300 + nearly 1000, not 300 + 512; plus where their streams stand beyond
        // their entries, a block and a half each on average, and two σ of that: 2 × √(2 × 2 ×
        // 16²/12) = 18.5.
        let running = |held| Load {
            held,
            sigma: 0,
            left: 1000,
            rate: 1,
            bounded: false,
            guessed: false,
            streamed: 0,
            ahead: None,
            outlook: OutputDist::never_stops().outlook(0, 1000),
        };
        let two = || [running(300), running(300)].into_iter();
        assert_eq!(
            peak(two(), 2.0, 16, Lag::Unseen, 0.0),
            2 * (300 + 1000 + 24) + 19
        );
        // Their streams seen a token behind the engine: each answer counts that token, the one
        // the engine is computing and one on its way, 3, where a lag not seen yet counts half a
        // block, 8: the slack's mean is 8 + 8 + 3. Seen 20 behind (an engine that streams 20
        // tokens a chunk), 8 + 8 + 22.
        assert_eq!(
            peak(two(), 2.0, 16, Lag::Seen(1), 0.0),
            2 * (300 + 1000 + 19) + 19
        );
        assert_eq!(
            peak(two(), 2.0, 16, Lag::Seen(20), 0.0),
            2 * (300 + 1000 + 38) + 19
        );
        assert_eq!(Lag::most([0, 0].into_iter()), Lag::Unseen);
        assert_eq!(Lag::most([0, 3, 1].into_iter()), Lag::Seen(3));
    }

    #[test]
    fn requests_in_step_are_counted_in_full_while_their_entries_are_rewritten() {
        // 23 answers of 76 prompt tokens held to 600 (`ignore_eos`), started in one decode step,
        // 111 tokens made: they cross each block boundary in the same step, and their entries
        // are rewritten one after another. Rewritten, an entry holds 16 tokens more and has 16
        // steps less to go; not yet, its stream is 15 tokens past it (`ahead`). When they end
        // together the engine holds 43 blocks for each, 15,824 tokens, and a 24th request
        // admitted now would hold 36 more blocks then: 16,400 tokens, past a pod of 16,384.
        // Whichever have been rewritten, the forecast says so.
        let running = |streamed: u64, ahead| Load {
            held: 76 + streamed,
            sigma: 0,
            left: 600 - streamed,
            rate: 1,
            bounded: true,
            guessed: false,
            streamed,
            ahead: Some(ahead),
            outlook: OutputDist::never_stops().outlook(streamed, 600),
        };
        let new = Load {
            ahead: None,
            ..running(0, 0)
        };
        let pod = |rewritten: usize| {
            let mut loads = vec![running(112, 0); rewritten];
            loads.resize(23, running(96, 15));
            loads
        };
        let lag = Lag::Seen(1);
        for rewritten in [0, 1, 5, 11, 22, 23] {
            let alone = peak(pod(rewritten).into_iter(), 3.0, 16, lag, 0.0);
            let more = peak(pod(rewritten).into_iter().chain([new]), 3.0, 16, lag, 0.0);
            assert!(alone >= 23 * 43 * 16, "{rewritten} rewritten: {alone}");
            assert!(more > 16_384, "{rewritten} rewritten, and one more: {more}");
        }
        // Counted at half a block each, one entry rewritten made the others look 16 steps
        // further from their end, and the 24th request fitted.
        let unknown = |mut l: Load| {
            l.ahead = None;
            l
        };
        let at_mean = |rewritten| {
            let loads = pod(rewritten).into_iter().map(unknown).chain([new]);
            peak(loads, 3.0, 16, lag, 0.0)
        };
        assert!(at_mean(1) <= 16_384, "{}", at_mean(1));
        assert!(at_mean(23) > 16_384, "{}", at_mean(23));
    }

    #[test]
    fn a_request_of_several_choices_grows_by_each_a_step() {
        // Four answers to 100 tokens each on one prompt beside one answer of 100: at step 100
        // the pod holds both prompts, 400 tokens of the first and 100 of the second. Counted
        // a token a step, the first reached its 400 at step 400, long after the second had
        // gone, and the forecast fell 100 short of the peak.
        let running = |held, rate| Load {
            held,
            sigma: 0,
            left: 100,
            rate,
            bounded: false,
            guessed: false,
            streamed: 0,
            ahead: None,
            outlook: OutputDist::never_stops().outlook(0, 100),
        };
        // Each answer's last block is partly filled and its stream ahead of the entry (a
        // block each on average) and the entry a boundary behind (half a block): four and a half
        // blocks for the four, one and a half for one; and two σ of the seven blocks' spread,
        // 2 × √(7 × 16²/12) = 24.4.
        assert_eq!(
            peak(
                [running(300, 4), running(300, 1)].into_iter(),
                2.0,
                16,
                Lag::Unseen,
                0.0
            ),
            (300 + 400 + 72) + (300 + 100 + 24) + 25
        );
        // Unknown lengths: four answers are expected four times as far as one, and, ending
        // independently, spread twice as far: between two and four times one's growth.
        let unknown = |rate| Load {
            held: 300,
            sigma: 0,
            left: 8_192,
            rate,
            bounded: false,
            guessed: false,
            streamed: 0,
            ahead: None,
            outlook: OutputDist::prior(256).outlook(0, 8_192),
        };
        let one = peak(std::iter::once(unknown(1)), 2.0, 16, Lag::Unseen, 0.0) - 324;
        let four = peak(std::iter::once(unknown(4)), 2.0, 16, Lag::Unseen, 0.0) - 372;
        assert!(2 * one < four && four < 4 * one, "{one} {four}");
    }

    /// The sums' terms for one request of several answers, against its every outcome: its
    /// answers each running or not, its prompt held while any is.
    #[test]
    fn several_answers_end_independently_and_hold_their_prompt_while_any_runs() {
        let (r, p) = (4u32, 0.4f64);
        let chance = (p * 255.0).round() as u8;
        let t = Term::of(
            &Load {
                held: 500,
                sigma: 0,
                left: 1_000,
                rate: u64::from(r),
                bounded: false,
                guessed: false,
                streamed: 200,
                ahead: None,
                outlook: [chance; HORIZON_STEPS.len()],
            },
            16,
            Lag::Unseen,
        );
        let p = f64::from(chance) / 255.0;
        // Each answer: what it streamed, and its last block.
        let k = 200.0 / f64::from(r) + 16.0;
        let s = 30.0;
        let (mut mean, mut square) = (0.0, 0.0);
        for outcome in 0..1u32 << r {
            let running = outcome.count_ones();
            let likely = p.powi(running as i32) * (1.0 - p).powi((r - running) as i32);
            let held = if running > 0 { t.hp } else { 0.0 } + f64::from(running) * (k + s);
            mean += likely * held;
            square += likely * held * held;
        }
        let mut sums = Sums::default();
        sums.add(&t, 0, 1.0);
        let at = |sums: &Sums, z| sums.at(s as u64, z);
        assert!(
            (at(&sums, 0.0) - mean).abs() < 1e-6,
            "{} {mean}",
            at(&sums, 0.0)
        );
        // And the spread of its slack, while it holds its prompt.
        let any = 1.0 - (1.0 - p).powi(r as i32);
        let sd = (square - mean * mean + 5.0 * 16.0 * 16.0 / 12.0 * any).sqrt();
        assert!(
            (at(&sums, 1.0) - (mean + sd)).abs() < 1e-6,
            "{} {}",
            at(&sums, 1.0),
            mean + sd
        );
        // Its parts: the prompt and the entry's lag, and each answer's 50 tokens and its block.
        assert_eq!((t.hp, t.rk), (300.0 + 8.0, 4.0 * 66.0));
    }

    #[test]
    fn a_limit_on_a_grid_step_is_counted_just_before_it() {
        // One answer of 300 tokens 91 steps (a grid step) from its end, beside one just begun:
        // 91 steps ahead both have grown by 91, the first at its last token.
        let bounded = OutputDist::prior(256).of_request(true, 0);
        let at = |held, streamed| Load {
            held,
            sigma: 0,
            left: 300 - streamed,
            rate: 1,
            bounded: false,
            guessed: false,
            streamed: 0,
            ahead: None,
            outlook: bounded.outlook(streamed, 300),
        };
        assert!(HORIZON_STEPS.contains(&91));
        assert_eq!(
            peak(
                [at(309, 209), at(100, 0)].into_iter(),
                2.0,
                16,
                Lag::Unseen,
                0.0
            ),
            (309 + 91 + 24) + (100 + 91 + 24) + 19
        );
    }

    #[test]
    fn many_requests_need_less_headroom_each_than_one() {
        let one = peak(
            [load(300, 0, u64::MAX)].into_iter(),
            2.0,
            16,
            Lag::Unseen,
            0.0,
        );
        let many = peak(
            vec![load(300, 0, u64::MAX); 16].into_iter(),
            2.0,
            16,
            Lag::Unseen,
            0.0,
        );
        assert!(many < 16 * one * 3 / 4, "one {one}, sixteen {many}");
        let bare = peak(
            vec![load(300, 0, u64::MAX); 16].into_iter(),
            0.0,
            16,
            Lag::Unseen,
            0.0,
        );
        assert!(bare < many, "z adds headroom");
    }

    #[test]
    fn short_answers_are_not_held_for_a_tail_they_do_not_have() {
        // Fifteen requests holding 133 tokens each, answers of 33 tokens on average and no
        // max_tokens: their chance of running thousands of tokens more is nil, and so is what
        // the forecast holds for it. An outlook rounded up to the next 255th said each had at
        // least 1 in 255 of still running at the horizon's end, 8,192 tokens on: at that
        // weight the variance of fifteen such requests was a forecast of 5,549 tokens, more
        // than twice what they hold, and a 4k pod was kept half empty (2026-11-30, answers of
        // 32 tokens on average: 56 % of the KV used, 0.69x round robin's throughput).
        let short = load(133, 0, u64::MAX);
        let short = Load {
            outlook: OutputDist::prior(33).outlook(0, u64::MAX),
            ..short
        };
        let held = 15 * (133 + 24);
        let p = peak(vec![short; 15].into_iter(), 2.5, 16, Lag::Unseen, 0.0);
        assert!(p >= held, "never below what they hold: {p}");
        assert!(p <= held * 5 / 4, "{p} for {held} held");
    }

    #[test]
    fn a_prompt_estimates_spread_is_paid_once_per_pod() {
        let exact = |sigma| Load {
            held: 1000,
            sigma,
            left: 10,
            rate: 1,
            bounded: false,
            guessed: false,
            streamed: 0,
            ahead: None,
            outlook: OutputDist::never_stops().outlook(0, 10),
        };
        // (Blocks of no size: no slack to blur the sum.)
        let known = peak(vec![exact(0); 16].into_iter(), 2.0, 0, Lag::Unseen, 0.0);
        let guessed = peak(vec![exact(100); 16].into_iter(), 2.0, 0, Lag::Unseen, 0.0);
        // Sixteen prompts each off by 100 tokens (one σ), independently: the sum is off by
        // 400 (√16 × 100), and two σ of headroom is 800, where a margin on each would be 3,200.
        assert_eq!(guessed - known, 800);
        assert_eq!(
            peak(vec![exact(100); 16].into_iter(), 0.0, 0, Lag::Unseen, 0.0),
            known,
            "no headroom: the expectation alone"
        );
    }

    /// The forecast as defined: at every grid step (and the horizon's end) and every request's
    /// limit, each request summed directly; each answer's stream `lag` tokens behind the
    /// engine.
    fn peak_by_definition(loads: &[Load], z: f64, block: u64, lag: f64) -> f64 {
        let mut worst: f64 = 0.0;
        for (j, &start) in HORIZON_STEPS.iter().enumerate() {
            let end = u64::from(HORIZON_STEPS.get(j + 1).copied().unwrap_or(HORIZON_END));
            let at = |s: u64| {
                let (mut mean, mut var, mut all, mut spread) = (0.0, 0.0, 0.0, 0.0);
                for l in loads {
                    let p = f64::from(l.outlook[j]) / 255.0;
                    if p > 0.0 && l.left >= s {
                        // Its prompt, held while any answer runs, and its answers.
                        let r = l.rate.max(1) as f64;
                        // Each answer's partial block, half a block, and its lag; the entry's
                        // half a block.
                        let b = block as f64;
                        let streamed = l.streamed.min(l.held) as f64;
                        let answer = streamed / r + b / 2.0 + lag;
                        let prompt = l.held as f64 - streamed
                            + l.ahead.map_or(b / 2.0, |a| (a as f64).max(b / 2.0));
                        let size = answer + s as f64;
                        let any = 1.0 - (1.0 - p).powf(r);
                        // The prompt's spread, and the two partial blocks' (uniform in a block).
                        let sigma2 = (l.sigma as f64).powi(2) + (r + 1.0) * b * b / 12.0;
                        mean += prompt * any + r * size * p;
                        var += prompt * prompt * any * (1.0 - any)
                            + r * size * size * p * (1.0 - p)
                            + 2.0 * prompt * r * size * p * (1.0 - any)
                            + sigma2 * any;
                        all += prompt + r * size;
                        spread += sigma2;
                    }
                }
                (mean + z * f64::sqrt(var)).min(all + z * f64::sqrt(spread))
            };
            worst = worst.max(at(u64::from(start)));
            if j + 1 == HORIZON_STEPS.len() {
                worst = worst.max(at(end));
            }
            for l in loads {
                if (u64::from(start)..=end).contains(&l.left) {
                    worst = worst.max(at(l.left));
                }
            }
        }
        worst
    }

    #[test]
    fn the_sweep_computes_the_forecast_as_defined() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..200 {
            let n = 1 + next(40);
            let loads: Vec<Load> = (0..n)
                .map(|_| {
                    let streamed = next(600);
                    let max = if next(2) == 0 {
                        streamed + next(2000)
                    } else {
                        8192
                    };
                    Load {
                        held: next(3000),
                        sigma: next(4) * next(100),
                        left: max - streamed.min(max),
                        rate: 1 + next(3) * next(4),
                        bounded: false,
                        guessed: false,
                        streamed: next(3) * streamed,
                        ahead: (next(2) == 1).then(|| next(16)),
                        outlook: OutputDist::prior(1 + next(500)).outlook(streamed, max),
                    }
                })
                .collect();
            let z = next(4) as f64 * 0.75;
            // Half a block while the pod's lag is unseen, what it saw and two tokens once seen.
            let (lag, margin) = match next(3) {
                0 => (Lag::Unseen, 8.0),
                l => (Lag::Seen(l * 3), (l * 3 + 2) as f64),
            };
            let swept = peak(loads.iter().copied(), z, 16, lag, 0.0) as f64;
            let defined = peak_by_definition(&loads, z, 16, margin);
            assert!(
                (swept - defined.ceil()).abs() <= 1.0 + defined * 1e-9,
                "{swept} vs {defined}"
            );
        }
    }

    #[test]
    fn an_empty_pod_forecasts_nothing() {
        assert_eq!(peak(std::iter::empty(), 2.0, 16, Lag::Unseen, 0.0), 0);
        let last = Load {
            held: 500,
            sigma: 0,
            left: 0,
            rate: 1,
            bounded: false,
            guessed: false,
            streamed: 0,
            ahead: None,
            outlook: [255; HORIZON_STEPS.len()],
        };
        assert_eq!(
            peak([last].into_iter(), 2.0, 16, Lag::Unseen, 0.0),
            500 + 24 + 14,
            "a request at its limit holds its KV now (and its slack, with two σ of it), and \
             nothing after"
        );
    }

    /// What the replicas' e2e check allows (tests/e2e/replicas.py, `held`): entries are written
    /// at block boundaries (`Router::grow`), so between writes each request's `held` and `left`
    /// lag its real progress by up to a block, and as they are rewritten the forecast of
    /// requests already admitted moves. It rises by at most a block per other request in
    /// flight: requests of known length whose ends the lag lines up differently.
    #[test]
    fn rewriting_entries_at_block_boundaries_raises_the_forecast_by_at_most_a_block_per_other_request(
    ) {
        // As `output_dist` sees a request with `max_tokens`: running until its limit, certainly
        // gone at it.
        let bounded = OutputDist::prior(256).of_request(true, 0);
        let mut rng = crate::routing::pick::Rng::new(7);
        let mut draw = |n: f64| (rng.next_f64() * n) as u64;
        let mut worst = [0i64; 7];
        for _ in 0..2_000 {
            let n = 1 + draw(6.0) as usize;
            let prompts: Vec<u64> = (0..n).map(|_| 330 + draw(40.0)).collect();
            let starts: Vec<u64> = (0..n).map(|_| draw(300.0)).collect();
            // The forecast at step `t`: each request (max 300 tokens, one a step) as its entry
            // was last written, at its last block boundary.
            let at = |t: u64| {
                let loads: Vec<Load> = (0..n)
                    .filter_map(|i| {
                        let out = t.checked_sub(starts[i]).filter(|&o| o < 300)?;
                        let written = if out == 0 { 0 } else { (out - 1) / 16 * 16 + 1 };
                        Some(Load {
                            held: prompts[i] + written,
                            sigma: 0,
                            left: 300 - written,
                            rate: 1,
                            bounded: false,
                            guessed: false,
                            streamed: 0,
                            ahead: None,
                            outlook: bounded.outlook(written, 300),
                        })
                    })
                    .collect();
                (
                    loads.len(),
                    peak(loads.into_iter(), 0.0, 16, Lag::Unseen, 0.0) as i64,
                )
            };
            let t0 = 300 + draw(300.0);
            let (n0, f0) = at(t0);
            for dt in (1..300).step_by(3) {
                let (n1, f1) = at(t0 + dt);
                if n1 == n0 {
                    worst[n0] = worst[n0].max(f1 - f0);
                }
            }
        }
        for (n, &w) in worst.iter().enumerate().skip(1) {
            assert!(w <= 16 * (n as i64 - 1), "{n} in flight: rose by {w}");
        }
        assert!(worst[3] > 0, "the rise is real: {worst:?}");
    }

    /// A fresh pool's first wave: requests of 200 prompt tokens admitted on the prior's guess
    /// (exponential, mean 256) before any answer has ended. The guess's error is theirs
    /// together: thirty of them are forecast for answers about twice as long as the guess at a
    /// spread of a half, where one alone keeps most of the headroom it had; an answer that runs
    /// to its limit has no guess to be wrong about, and a spread of 0 takes the guess as known.
    #[test]
    fn a_guess_shared_by_many_requests_is_counted_once_over_them() {
        let guessed = |on| Load {
            guessed: on,
            ..load(200, 0, 8192)
        };
        let pod = |n, on, spread| {
            peak(
                std::iter::repeat_n(guessed(on), n),
                2.5,
                16,
                Lag::Unseen,
                spread,
            ) as f64
        };
        let (thirty, one) = (pod(30, false, 0.5), pod(1, false, 0.5));
        assert_eq!(pod(30, true, 0.0), thirty);
        let (thirty_guessed, one_guessed) = (pod(30, true, 0.5), pod(1, true, 0.5));
        assert!(one_guessed <= 1.1 * one, "{one} -> {one_guessed}");
        assert!(
            thirty_guessed >= 1.3 * thirty,
            "{thirty} -> {thirty_guessed}"
        );
        // Thirty answers of 512 on average, known to be: the guess at a spread of a half holds
        // about what they would take.
        let known = |n| {
            peak(
                std::iter::repeat_n(
                    Load {
                        outlook: OutputDist::prior(512).outlook(0, 8192),
                        ..load(200, 0, 8192)
                    },
                    n,
                ),
                2.5,
                16,
                Lag::Unseen,
                0.0,
            ) as f64
        };
        assert!(
            thirty_guessed >= 0.9 * known(30),
            "{thirty_guessed} against {}",
            known(30)
        );
        // Runs to its limit: nothing guessed moves.
        let bounded = Load {
            guessed: true,
            outlook: OutputDist::never_stops().outlook(0, 300),
            left: 300,
            ..load(200, 0, 300)
        };
        let runs = |spread| {
            peak(
                std::iter::repeat_n(bounded, 30),
                2.5,
                16,
                Lag::Unseen,
                spread,
            )
        };
        assert_eq!(runs(0.5), runs(0.0));
    }
}
