//! The answers this VM started last, per model, those still running included: what the
//! output-length distribution learns besides the finished answers in the shared record
//! (`calibration`). Source of truth: each member is the VM's own stream, noted as it runs (the
//! flow's response side); nothing here is shared.
//!
//! Why: the shared record learns from answers as they finish, and the first to finish are the
//! short ones. Until the longest answers have had time to end (a minute and more for long-tailed
//! chat), the lengths learned so are short of the truth, and the pods' forecasts with them. On a
//! pool of short prompts and long answers (mean 512, lognormal σ 0.8), the answers finished 12 s
//! into the run averaged 383 tokens and those 24 s in 436, against 509 for the whole run, and the
//! pods preempted 54–90 times in 30 s. A cohort of the last answers *started*, with those still
//! running counted as censored at what they have streamed so far, is what Kaplan–Meier needs to
//! see the tail while it is still running: its lengths are unbiased from the start. The shared
//! record, which is unbiased once the pool is steady, is pooled with it (deaths and censorings
//! added per bucket), so a worker that started few answers still learns from all of them.

use crate::estimate::output_dist::{bucket, BUCKETS};
use std::collections::VecDeque;

/// How many starts a cohort remembers: several times the answers a VM streams at once, so most
/// of the cohort has finished and the tail is seen, at 12 bytes a member.
const MEMBERS: usize = 1024;

/// What became of an answer so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Still streaming: censored at what it has streamed.
    Running,
    /// Stopped by itself.
    Ended,
    /// Cut off by its own limit, or its stream was lost: the model would have gone on.
    Censored,
}

#[derive(Debug, Clone, Copy)]
struct Member {
    seq: u32,
    tokens: u32,
    fate: Fate,
}

/// One model's cohort.
#[derive(Debug, Default)]
pub struct Cohort {
    members: VecDeque<Member>,
}

impl Cohort {
    /// A new answer, numbered `seq` (increasing across calls; after 2^32 answers a VM's numbers
    /// wrap, and the notes of the answers running then are missed, which costs those few their
    /// last lengths and nothing else).
    pub fn start(&mut self, seq: u32) {
        if self.members.len() >= MEMBERS {
            self.members.pop_front();
        }
        self.members.push_back(Member {
            seq,
            tokens: 0,
            fate: Fate::Running,
        });
    }

    /// Answer `seq` has streamed `tokens` so far, or has stopped there (`ended`: by itself; else
    /// cut off or lost). An answer already forgotten, or already over, is left as it is.
    pub fn note(&mut self, seq: u32, tokens: u64, over: Option<bool>) {
        let Ok(at) = self.members.binary_search_by_key(&seq, |m| m.seq) else {
            return;
        };
        let Some(m) = self.members.get_mut(at) else {
            return;
        };
        if m.fate != Fate::Running {
            return;
        }
        m.tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
        m.fate = match over {
            None => Fate::Running,
            Some(true) => Fate::Ended,
            Some(false) => Fate::Censored,
        };
    }

    /// Per length bucket, the answers that ended there and those censored there (running ones
    /// at what they have streamed), for `OutputDist::learned`.
    pub fn counts(&self) -> ([f64; BUCKETS], [f64; BUCKETS]) {
        let mut ended = [0.0; BUCKETS];
        let mut censored = [0.0; BUCKETS];
        for m in &self.members {
            let into = if m.fate == Fate::Ended {
                &mut ended
            } else {
                &mut censored
            };
            if let Some(x) = into.get_mut(bucket(u64::from(m.tokens))) {
                *x += 1.0;
            }
        }
        (ended, censored)
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::estimate::output_dist::OutputDist;

    #[test]
    fn running_answers_are_censored_where_they_are_and_ended_ones_count_as_deaths() {
        let mut c = Cohort::default();
        for seq in 0..4 {
            c.start(seq);
        }
        c.note(0, 100, Some(true));
        c.note(1, 50, Some(false));
        c.note(2, 700, None);
        // Over already: a later note does not move it.
        c.note(0, 900, None);
        // Unknown: ignored.
        c.note(9, 10, Some(true));
        let (ended, censored) = c.counts();
        assert_eq!(ended.iter().sum::<f64>(), 1.0);
        assert_eq!(ended[bucket(100)], 1.0);
        assert_eq!(censored[bucket(50)], 1.0);
        assert_eq!(censored[bucket(700)], 1.0);
        // The fourth has streamed nothing yet.
        assert_eq!(censored[bucket(0)], 1.0);
    }

    #[test]
    fn only_the_last_starts_are_kept() {
        let mut c = Cohort::default();
        for seq in 0..(MEMBERS as u32 + 10) {
            c.start(seq);
            c.note(seq, 10, Some(true));
        }
        assert_eq!(c.counts().0.iter().sum::<f64>(), MEMBERS as f64);
        // The first ten are forgotten: noting them does nothing.
        c.note(3, 5000, Some(true));
        assert_eq!(c.counts().0[bucket(5000)], 0.0);
    }

    /// The case this exists for: half the answers are short and ended, half long and still
    /// running. From the ended ones alone every answer is short; with the running ones censored,
    /// half are known to be longer than they have streamed so far.
    #[test]
    fn answers_still_running_keep_the_tail_that_finished_answers_alone_miss() {
        let mut c = Cohort::default();
        for seq in 0..200 {
            c.start(seq);
            if seq % 2 == 0 {
                c.note(seq, 100, Some(true));
            } else {
                c.note(seq, 400, None);
            }
        }
        let (ended, censored) = c.counts();
        let finished_only = OutputDist::learned(&ended, &[0.0; BUCKETS], 256, 0);
        let with_running = OutputDist::learned(&ended, &censored, 256, 0);
        assert!(finished_only.survival(300.0) < 0.05);
        assert!(with_running.survival(300.0) > 0.45);
        assert!(with_running.expected(0, 8192) > 2 * finished_only.expected(0, 8192));
    }
}
