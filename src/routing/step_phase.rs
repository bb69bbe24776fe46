//! Where each pod's engine stands in its current step, as this VM sees it from the answers it
//! streams, and so how long a request sent there now waits before the engine takes it in.
//!
//! A vLLM engine runs in steps: it schedules at the start of one (prefills of waiting requests,
//! one decode token for each running sequence), runs it, and sends every sequence's new token at
//! its end. A request arriving mid-step waits for that step to end before it is scheduled, so its
//! first token comes a step's remainder plus its own prefill step after it arrives; on an idle
//! engine a step starts at once. Between equally loaded pods that all cache a prompt (one system
//! prompt in front of every request) that remainder is what still tells them apart: uniform over
//! the step on any pod a router cannot see into, about half a step on average, and a few tenths
//! of a millisecond on the pod about to end its step (`Router::soonest_step` orders them by it).
//!
//! Each streamed chunk with tokens marks the end of a step on the pod that sent it: its arrival is
//! the pod's last known step boundary, and the interval since the same stream's previous chunk,
//! per token it carries, a sample of the pod's step time (an average over about eight steps). A
//! request then waits, by this VM's reckoning, the rest of the step begun at the last boundary,
//! with the delay before it reaches the engine taken off ([`expected_wait_us`]).
//!
//! Source of truth: this VM alone. A chunk is seen by the worker carrying its stream, and sharing
//! every chunk's time across workers would cost a shared-data write per token; a pod running a
//! few streams almost always has one on each worker, and where this VM has none lately, the pod's
//! phase is unknown and it is costed at the average (half a step). Nothing here must return to
//! zero: a pod whose streams here ended is unknown again once its phase is out of date, and one
//! that left the pool is forgotten.

use crate::routing::pod_id::{PodId, PodMap};

/// Weight of a new step-time sample in the pod's average: about the last eight steps, which is
/// long enough to smooth one prefill-laden step and short enough to follow a batch that grows.
const STEP_EWMA: f64 = 0.125;
/// Intervals longer than this are not steps (a stall, a preemption, a client reading slowly).
const MAX_STEP_US: u64 = 1_000_000;
/// A phase older than this many steps is out of date: the pod's streams that this VM carried have
/// ended, or its steps changed length, and counting on it would mislead.
const STALE_STEPS: f64 = 4.0;
/// Chunks of one step reach kvgate a little apart (one per stream, each through its own
/// connection and callback): one arriving within this share of a step after the boundary is the
/// same step's.
const SAME_STEP: f64 = 1.0 / 3.0;
/// How far one first token moves the learned delay: up when the request missed a step the delay
/// said it would make, down when it made one the delay said it would miss. Up twice as far: a
/// delay taken too short sends requests to pods whose step they then miss (a whole step more to
/// wait), one taken too long only passes over pods they would have caught.
const DELAY_UP_US: f64 = 50.0;
const DELAY_DOWN_US: f64 = 25.0;

#[derive(Debug, Clone, Copy)]
struct Phase {
    /// When the first chunk of the pod's last known step came: that step's end, as seen here.
    boundary_us: u64,
    /// The boundary before it (the last step's start), 0 when none was seen.
    previous_us: u64,
    /// The pod's step time, smoothed (0 until a stream's second chunk measured one).
    step_us: f64,
}

impl Phase {
    /// Whether a chunk arriving at `now` belongs to the step whose first chunk set the boundary.
    fn same_step(&self, now: u64) -> bool {
        (now.saturating_sub(self.boundary_us) as f64) < SAME_STEP * self.step_us
    }

    /// Where the step that ended with a chunk arriving at `now` started, as seen here, when this
    /// VM saw both of its ends: the last boundary, or the one before when `now` is still within
    /// the last step's chunks.
    fn start_of_step_ending(&self, now: u64) -> Option<u64> {
        if self.step_us <= 0.0 || self.previous_us == 0 {
            return None;
        }
        let (start, before) = if self.same_step(now) {
            (self.previous_us, None)
        } else {
            (self.boundary_us, Some(self.previous_us))
        };
        // The boundaries seen must be consecutive steps (this VM had a stream decoding there
        // all along): a step missed in between would put the start too early.
        let consecutive = before
            .is_none_or(|b| (start.saturating_sub(b) as f64) < (1.0 + SAME_STEP) * self.step_us);
        consecutive.then_some(start)
    }
}

/// Each pod's step phase, as this VM's streams show it, and the delay from a pick to the engine.
#[derive(Debug)]
pub struct StepPhases {
    pods: PodMap<Phase>,
    /// The delay from a pick to the engine's scheduler, in µs, as learned from first tokens.
    delay_us: f64,
}

impl StepPhases {
    /// With the delay assumed until first tokens have measured it.
    pub fn new(assumed_delay_us: f64) -> StepPhases {
        StepPhases {
            pods: PodMap::default(),
            delay_us: assumed_delay_us.max(0.0),
        }
    }

    /// A chunk carrying `tokens` output tokens came from `pod` at `now_us`; `previous_us` is when
    /// the same stream's previous chunk came (none for its first token: the interval since the
    /// request was sent is its prefill and queueing, not a step), `dispatched_us` when kvgate
    /// sent the request.
    ///
    /// A first token brackets the delay: its request was taken in at the start of the step that
    /// ends with it (its prefill's step), so it reached the engine before that start and after
    /// the step before began (else that step would have taken it). The delay is as the chunks
    /// see it (their own way back included), which is what [`expected_wait_us`] compares it with.
    /// Each bracket moves the delay a little towards itself ([`DELAY_UP_US`]): a mean over
    /// requests would not do, since the bracket's width is a whole step.
    pub fn tokens(
        &mut self,
        pod: PodId,
        tokens: u64,
        previous_us: Option<u64>,
        dispatched_us: u64,
        now_us: u64,
    ) {
        if tokens == 0 {
            return;
        }
        // The delay is a field apart from the map, so the pod's phase is looked up once.
        let delay_us = &mut self.delay_us;
        let Some(phase) = self.pods.get_mut(&pod) else {
            self.pods.insert(
                pod,
                Phase {
                    boundary_us: now_us,
                    previous_us: 0,
                    step_us: 0.0,
                },
            );
            return;
        };
        match previous_us {
            Some(p) => {
                let gap = now_us.saturating_sub(p);
                if gap > 0 && gap <= MAX_STEP_US {
                    let s = gap as f64 / tokens as f64;
                    phase.step_us = if phase.step_us > 0.0 {
                        phase.step_us + STEP_EWMA * (s - phase.step_us)
                    } else {
                        s
                    };
                }
            }
            None => {
                let bracket = phase
                    .start_of_step_ending(now_us)
                    .filter(|&start| start > dispatched_us)
                    .map(|start| {
                        let made = (start - dispatched_us) as f64;
                        (made - phase.step_us, made)
                    });
                if let Some((missed, made)) = bracket {
                    if *delay_us > made {
                        *delay_us = (*delay_us - DELAY_DOWN_US).max(0.0);
                    } else if *delay_us <= missed {
                        *delay_us = (*delay_us + DELAY_UP_US).min(MAX_STEP_US as f64);
                    }
                }
            }
        }
        if !phase.same_step(now_us) && now_us > phase.boundary_us {
            phase.previous_us = phase.boundary_us;
            phase.boundary_us = now_us;
        }
    }

    /// Forgets the pods that left the pool.
    pub fn retain_pods(&mut self, keep: impl Fn(PodId) -> bool) {
        self.pods.retain(|pod, _| keep(*pod));
    }

    /// The delay from a pick to the engine's scheduler, in µs, as learned so far.
    pub fn delay_us(&self) -> f64 {
        self.delay_us
    }

    /// `pod`'s step time and how long ago its last step ended, when this VM knows them and they
    /// are not out of date.
    fn phase(&self, pod: PodId, now_us: u64) -> Option<(f64, f64)> {
        let p = self.pods.get(&pod).filter(|p| p.step_us > 0.0)?;
        let since = now_us.saturating_sub(p.boundary_us) as f64;
        (since < STALE_STEPS * p.step_us).then_some((p.step_us, since))
    }

    /// The wait, in µs, before a request sent to each of `pods` now would be taken into a step
    /// (`busy[k]`: whether the pod is running anything; an idle engine starts a step at once).
    /// A busy pod whose phase this VM does
    /// not know is costed at half the known pods' average step; when no pod's is known, every
    /// wait is 0: nothing tells the pods apart.
    pub fn waits(&self, pods: &[PodId], busy: &[bool], now_us: u64) -> Vec<f64> {
        let phases: Vec<Option<(f64, f64)>> = pods.iter().map(|&p| self.phase(p, now_us)).collect();
        let (sum, known) = phases
            .iter()
            .flatten()
            .fold((0.0, 0usize), |(sum, n), &(step, _)| (sum + step, n + 1));
        if known == 0 {
            return vec![0.0; pods.len()];
        }
        let average = sum / known as f64;
        let delay = self.delay_us;
        phases
            .iter()
            .zip(busy)
            .map(|(phase, &busy)| match (busy, phase) {
                (false, _) => 0.0,
                (true, Some((step, since))) => expected_wait_us(*step, *since, delay),
                (true, None) => average / 2.0,
            })
            .collect()
    }
}

/// The expected wait for the next step of a pod whose steps last `step` µs and whose last one
/// ended `since` µs ago (as seen here: a chunk reaches kvgate a little after its step ended), for
/// a request that reaches the engine, on the same clock, between `delay` and 1.5 × `delay` µs
/// from now (uniformly: Envoy's upstream, the network, the engine's HTTP server, and the chunk's
/// own way back). The step under way ends `left = step − since` from now; a request arriving at
/// `a` waits `left − a`, or, arriving after that, `left + step − a` (the next step's end), so on
/// average `left − E[a] + step × P(a > left)`. Past its expected end (a longer step: a prefill in
/// it), the step's end is unknown, and the wait is the average, half a step.
fn expected_wait_us(step: f64, since: f64, delay: f64) -> f64 {
    if since >= step {
        return step / 2.0;
    }
    let left = step - since;
    let (lo, hi) = (delay, 1.5 * delay);
    let late = if left >= hi {
        0.0
    } else if left <= lo {
        1.0
    } else {
        (hi - left) / (hi - lo)
    };
    (left - 1.25 * delay + step * late).max(0.0)
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn pod(name: &str) -> PodId {
        PodId::of(name)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6
    }

    /// `pod` streams one token every `step` µs from `from` to `to`, one stream (sent at 0).
    fn stream(s: &mut StepPhases, pod: PodId, from: u64, step: u64, to: u64) {
        let mut last = None;
        let mut at = from;
        while at <= to {
            s.tokens(pod, 1, last, 0, at);
            last = Some(at);
            at += step;
        }
    }

    #[test]
    fn a_step_is_learned_from_one_streams_chunks_and_its_rest_is_the_wait() {
        let mut s = StepPhases::new(0.0);
        // First token: a boundary, but the time since dispatch is not a step.
        s.tokens(pod("a"), 1, None, 0, 10_000);
        assert_eq!(s.waits(&[pod("a")], &[true], 10_000), vec![0.0]);
        s.tokens(pod("a"), 1, Some(10_000), 0, 16_000);
        // 6 ms steps; 1 ms after the last boundary, 5 ms are left.
        assert!(close(s.waits(&[pod("a")], &[true], 17_000)[0], 5_000.0));
        // A chunk of two tokens spans two steps.
        s.tokens(pod("a"), 2, Some(16_000), 0, 28_000);
        assert!(close(s.waits(&[pod("a")], &[true], 28_000)[0], 6_000.0));
        // Another stream's chunk of the same step does not move the boundary.
        s.tokens(pod("a"), 1, Some(22_900), 0, 28_900);
        assert!(close(s.waits(&[pod("a")], &[true], 29_000)[0], 5_000.0));
    }

    #[test]
    fn the_pod_about_to_end_its_step_waits_least_unless_the_request_arrives_too_late_for_it() {
        let mut s = StepPhases::new(0.0);
        stream(&mut s, pod("early"), 6_000, 6_000, 12_000);
        stream(&mut s, pod("late"), 10_000, 6_000, 16_000);
        // At 17 ms, "early" ended its last step 5 ms ago (1 ms left), "late" 1 ms ago (5 left).
        let w = s.waits(&[pod("early"), pod("late")], &[true, true], 17_000);
        assert!(close(w[0], 1_000.0) && close(w[1], 5_000.0), "{w:?}");
        // A request reaching the engine 1–1.5 ms from now misses early's step end and waits
        // for the next one (1 + 6 − 1.25 ms), and arrives 1.25 ms into late's 5.
        s.delay_us = 1_000.0;
        let w = s.waits(&[pod("early"), pod("late")], &[true, true], 17_000);
        assert!(close(w[0], 5_750.0) && close(w[1], 3_750.0), "{w:?}");
        // 1.25 ms left, half way through the arrival window: the mean arrival is at the step's
        // end, and half the requests wait for the next step, 6 ms.
        let w = s.waits(&[pod("early")], &[true], 16_750);
        assert!(close(w[0], 3_000.0), "{w:?}");
    }

    #[test]
    fn an_idle_pod_starts_at_once_and_an_unknown_or_out_of_date_one_at_half_a_step() {
        let mut s = StepPhases::new(0.0);
        stream(&mut s, pod("a"), 0, 8_000, 8_000);
        let w = s.waits(&[pod("a"), pod("b"), pod("c")], &[true, true, false], 9_000);
        assert!(
            close(w[0], 7_000.0) && close(w[1], 4_000.0) && w[2] == 0.0,
            "{w:?}"
        );
        // Overdue: a longer step is under way, its end unknown.
        assert!(close(s.waits(&[pod("a")], &[true], 17_000)[0], 4_000.0));
        // Four steps without a chunk: this VM's streams there ended; nothing is known.
        assert_eq!(s.waits(&[pod("a")], &[true], 40_000), vec![0.0]);
    }

    #[test]
    fn a_pod_that_left_the_pool_is_forgotten() {
        let mut s = StepPhases::new(0.0);
        stream(&mut s, pod("a"), 0, 6_000, 6_000);
        stream(&mut s, pod("b"), 0, 6_000, 6_000);
        s.retain_pods(|p| p == pod("b"));
        // a's phase is unknown again: half the known pods' step.
        assert_eq!(
            s.waits(&[pod("a"), pod("b")], &[true, true], 7_000),
            vec![3_000.0, 5_000.0]
        );
        assert!(s.pods.get(&pod("a")).is_none());
    }

    #[test]
    fn a_gap_too_long_to_be_a_step_is_no_sample() {
        let mut s = StepPhases::new(0.0);
        stream(&mut s, pod("a"), 0, 6_000, 6_000);
        s.tokens(pod("a"), 1, Some(6_000), 0, 6_000 + 2 * MAX_STEP_US);
        let at = 6_000 + 2 * MAX_STEP_US + 1_000;
        assert!(close(s.waits(&[pod("a")], &[true], at)[0], 5_000.0));
    }

    /// One stream decodes on "a" every 6 ms while `n` requests are sent at random phases and
    /// reach the engine `delay` µs later (as the chunks see it): each is taken in at the first
    /// step boundary after that, and its first token ends that step, a little after the decoding
    /// stream's chunk. Returns the delay learned from `assumed`.
    fn learn(assumed: f64, delay: u64, n: u64) -> f64 {
        let mut s = StepPhases::new(assumed);
        let step = 6_000u64;
        let mut last = None;
        let mut seed = 7u64;
        // (when its first token comes, when it was sent)
        let mut pending: Vec<(u64, u64)> = Vec::new();
        for k in 1..=n {
            let boundary = k * step;
            s.tokens(pod("a"), 1, last, 0, boundary);
            last = Some(boundary);
            for &(_, sent) in pending.iter().filter(|(at, _)| *at == boundary) {
                s.tokens(pod("a"), 1, None, sent, boundary + 50);
            }
            pending.retain(|(at, _)| *at != boundary);
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let sent = boundary + (seed >> 33) % step;
            let start = (sent + delay).div_ceil(step) * step;
            pending.push((start + step, sent));
        }
        s.delay_us()
    }

    #[test]
    fn the_delay_is_learned_from_first_tokens_against_the_step_that_took_them_in() {
        for (assumed, delay) in [(0.0, 1_500), (5_000.0, 1_500), (1_000.0, 3_000)] {
            let learned = learn(assumed, delay, 2_000);
            assert!(
                (learned - delay as f64).abs() < 300.0,
                "from {assumed}: {learned}, not {delay}"
            );
        }
        // Before any first token, the assumed delay stands.
        assert_eq!(learn(1_000.0, 1_500, 1), 1_000.0);
    }
}
