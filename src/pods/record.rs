//! The shared record of one pod (`kvgate.pod.<ip:port>`): its last scraped metrics (with what
//! the engine's own numbers say of kvgate's accounting, `feedback`, and its decode pace, `pace`)
//! and the requests kvgate has in flight on it, each with the tokens it holds, its outlook
//! (`forecast`) and the KV blocks it occupies. Every change is a compare-and-swap, so all workers share one truth, and a request's
//! entry is removed exactly once (removing an absent entry changes nothing). Entries carry an
//! expiry, renewed as their response streams, so those left by a crashed or reloaded VM vanish.
//! Keys are per pod address; a pod that leaves has its record marked down (keys cannot be deleted).

use crate::admission::forecast::{peak, Headroom, Lag, Load};
use crate::config::{Config, MetricsConfig};
use crate::estimate::output_dist::{Outlook, HORIZON_STEPS};
use crate::pods::index_check::HitTotals;
use crate::pods::metrics::ItlTotals;
use crate::pods::pace::Pace;
use crate::store::codec::{Packer, Reader, Writer};
use crate::store::interface::{create_if_missing, update_from, Store, StoreError, Versioned};

const VERSION: u8 = 12;
/// An entry's size in this version's records.
const ENTRY_BYTES: usize = 81 + HORIZON_STEPS.len();
/// A snapshot's size in this version's records.
const SNAPSHOT_BYTES: usize = 186 + SEATS_BYTES;
/// The snapshot's part written by `seats`, at its end.
const SEATS_BYTES: usize = 16;
/// The record's [`Tally`]'s size, between its snapshot and its entries.
const TALLY_BYTES: usize = 24;
/// Records written before snapshots carried the engine's seats (`seats`): read with none learned.
const VERSION_WITHOUT_SEATS: u8 = 11;
/// Records written before entries carried their streams' lag: read with none seen.
const VERSION_WITHOUT_LAG: u8 = 10;
/// Records written before entries carried their choices (`n`): read as one answer each.
const VERSION_WITHOUT_CHOICES: u8 = 9;
/// Records written before they carried what the engine's prefix-cache counters say of the index
/// (`index_check`): read with no tally, no baseline and the index's whole share.
const VERSION_WITHOUT_INDEX_CHECK: u8 = 8;
/// Records written before entries said which entry counts the prefix they share (`leans_on`):
/// read as sharing none.
const VERSION_WITHOUT_LEANING: u8 = 7;
/// Records written before snapshots said when their pace was last moved (`pace`): read as moved
/// at their scrape, so a new module takes over the paces as they were.
const VERSION_WITHOUT_PACE_AGE: u8 = 6;
/// Records written before snapshots carried the engine's inter-token latency (`pace`): read with
/// none known.
const VERSION_WITHOUT_PACE: u8 = 5;
/// Records written before entries carried the prompt blocks their pod had still to compute:
/// read with none.
const VERSION_WITHOUT_PENDING: u8 = 4;
/// Records written before entries carried the spread of what they hold (and snapshots the
/// headroom the engine's feedback gave up): read with none.
const VERSION_WITHOUT_SPREAD: u8 = 3;
/// Records written before entries carried an outlook (and snapshots the engine's feedback): their
/// entries' tokens were whole reservations, read as held with nothing more to come.
const VERSION_WITHOUT_OUTLOOK: u8 = 2;
/// Records written before entries carried their context (and snapshots the engine's prefix
/// caching); still read, so in-flight requests are not lost when a new module takes over.
const VERSION_WITHOUT_CONTEXT: u8 = 1;

/// Which of an entry's fields a record of some version holds.
#[derive(Clone, Copy)]
struct Layout {
    context: bool,
    outlook: bool,
    spread: bool,
    pending: bool,
    leaning: bool,
    choices: bool,
    lag: bool,
}

impl Layout {
    fn of(version: u8) -> Layout {
        Layout {
            context: version >= VERSION_WITHOUT_OUTLOOK,
            outlook: version >= VERSION_WITHOUT_SPREAD,
            spread: version >= VERSION_WITHOUT_PENDING,
            pending: version >= VERSION_WITHOUT_PACE,
            leaning: version > VERSION_WITHOUT_LEANING,
            choices: version > VERSION_WITHOUT_CHOICES,
            lag: version > VERSION_WITHOUT_LAG,
        }
    }

    /// An entry's size.
    fn entry_bytes(self) -> usize {
        40 + 4 * usize::from(self.context)
            + if self.outlook {
                4 + HORIZON_STEPS.len()
            } else {
                0
            }
            + 5 * usize::from(self.spread)
            + 4 * usize::from(self.pending)
            + 20 * usize::from(self.leaning)
            + 2 * usize::from(self.choices)
            + 2 * usize::from(self.lag)
    }
}

/// A pod's metrics as last scraped.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Snapshot {
    /// When the scrape was sent: the engine answered with its state between then and its
    /// answer, and an answer asked for earlier than the record's is not written over it.
    pub at_ms: u64,
    /// False after a scrape that could not connect: the pod is avoided until it answers.
    pub healthy: bool,
    pub running: f64,
    /// Scraped waiting requests, less kvgate's own sent just before the scrape.
    pub waiting: f64,
    /// 0..1, NaN when the server does not say.
    pub kv_usage: f64,
    /// KV capacity in tokens (blocks × block size), 0 when unknown.
    pub capacity_tokens: u64,
    pub block_size: u32,
    /// The engine caches no prefixes (vLLM `--no-enable-prefix-caching`): no prefix credit and
    /// no shared blocks there.
    pub no_prefix_caching: bool,
    /// The engine's preemption counter (`vllm:num_preemptions_total`), NaN when not reported.
    pub preemptions: f64,
    /// The fraction of the budget taken back after preemptions (`feedback`), 0 normally.
    pub backoff: f64,
    /// KV tokens the engine holds beyond what kvgate's entries account for (`feedback`).
    pub unexplained_tokens: u64,
    /// The fraction of the forecast's headroom (`admission.headroomSigmas`) given up while the
    /// engine ran below its target without preempting (`feedback`), 0 normally.
    pub relief: f64,
    /// How far below its most the relief is capped after a preemption showed it was too much
    /// (`feedback`), 0 normally.
    pub relief_lost: f64,
    /// The engine's inter-token latency totals at the scrape that closed the last counted
    /// interval (or the first that had them): the baseline of the next interval, kept over
    /// scrapes until the engine has produced enough tokens since (`pace`).
    pub itl_totals: Option<ItlTotals>,
    /// The pod's smoothed inter-token latency in seconds (`pace`), 0 while unknown.
    pub itl_s: f64,
    /// When a scrape interval last moved `itl_s` (that scrape's `at_ms`): a pace without fresh
    /// samples fades (`pace::kept`).
    pub itl_at_ms: u64,
    /// The engine's prefix-cache counters (and the record's tally) at the scrape that opened the
    /// interval `index_check` compares next; from the scraper, the counters just read.
    pub hit_totals: Option<HitTotals>,
    /// The share of the pod's capacity the prefix index leaves out, from the engine's counters
    /// (`index_check`): 0 normally, so that a snapshot with nothing known keeps all of it.
    pub index_cut: f64,
    /// How many times the engine's counters were seen to start again (`index_check`): each
    /// VM forgets what it believed the pod cached when this moves.
    pub engine_restarts: u32,
    /// The engine's prefix-cache (hits, queries) at the last scrape that had them: against the
    /// next, whether it restarted (`index_check`).
    pub hit_counts: Option<(f64, f64)>,
    /// How many requests the engine runs at once, learned (`seats`): 0 while unknown.
    pub seats: u32,
    /// The most requests the engine was seen running since it (re)started (`seats`).
    pub most_running: u32,
    /// When the scrapes began to show requests waiting in the engine with KV to spare (`seats`):
    /// 0 when the last did not.
    pub queued_since_ms: u64,
}

impl Snapshot {
    /// The share of the pod's capacity the prefix index holds (`index_check`).
    pub fn index_share(&self) -> f64 {
        1.0 - self
            .index_cut
            .clamp(0.0, 1.0 - crate::pods::index_check::MIN_SHARE)
    }
}

/// What kvgate believed of the prompts it routed to the pod, summed since the record was made:
/// against the engine's prefix-cache counters, how right the prefix index is (`index_check`).
/// Added to in the compare-and-swap that reserves each request, so every worker's count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tally {
    pub requests: u64,
    /// Prompt blocks the pod was believed to cache when each request was routed there.
    pub believed_blocks: u64,
    /// The prompts' blocks.
    pub sent_blocks: u64,
}

impl Tally {
    pub fn add(&mut self, believed_blocks: u64, sent_blocks: u64) {
        self.requests = self.requests.wrapping_add(1);
        self.believed_blocks = self
            .believed_blocks
            .wrapping_add(believed_blocks.min(sent_blocks));
        self.sent_blocks = self.sent_blocks.wrapping_add(sent_blocks);
    }
}

/// When a forecast is made (`PodRecord::forecast`): the clock, and the time to live every write
/// gives an entry (`routing.requestTtlMs`), so that an entry's expiry tells when it was written;
/// and the output prior's error for entries on its guess (`estimator.outputPriorSpread`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct At {
    pub now_ms: u64,
    pub ttl_ms: u64,
    pub prior_spread: f64,
}

impl At {
    /// A moment no entry was written before (the clock at 0): every entry's stream counted at
    /// half a block past it, as before its pod's pace is known.
    #[cfg(test)]
    pub const UNTIMED: At = At {
        now_ms: 0,
        ttl_ms: 0,
        prior_spread: 0.0,
    };

    pub fn of(cfg: &Config, now_ms: u64) -> At {
        At {
            now_ms,
            ttl_ms: cfg.routing.request_ttl_ms,
            prior_spread: cfg.estimator.output_prior_spread,
        }
    }

    /// How far the entry's stream has run past it (`Load::ahead`): an entry is written with
    /// what its answers have made when their output crosses a block boundary (`Router::grow`),
    /// and each of its answers makes a token a decode step since, at the pod's `pace`, up to
    /// the block after which it is written again. `None` before its first token (its prompt
    /// may still be waiting for its prefill) or while the pod's pace is unknown.
    fn ahead(self, e: &RequestEntry, pace: Pace, block_tokens: u64) -> Option<u64> {
        if e.output_blocks == 0 {
            return None;
        }
        let written = e.expires_ms.checked_sub(self.ttl_ms)?;
        let age_ms = self.now_ms.checked_sub(written)?;
        let made = pace.tokens_made(age_ms as f64 / 1e3, u64::from(e.choices))?;
        Some(made.min(block_tokens.saturating_sub(1)))
    }
}

/// One in-flight request's entry in the pod's record: what it holds there and until when.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestEntry {
    pub id: u64,
    pub expires_ms: u64,
    pub dispatched_ms: u64,
    /// KV tokens the request holds now, by estimate: its prompt less a prefix another request
    /// already held (plus any such prefix inherited since), times the safety factor, plus what it
    /// has streamed.
    pub held_tokens: u64,
    /// How far `held_tokens` may be off, one standard deviation (its prompt was estimated).
    pub held_sigma: u32,
    /// The request set its own output limit (`max_tokens`): the engine's feedback gives up no
    /// headroom on its account (`forecast`).
    pub bounded: bool,
    /// Its outlook is the output prior's, a guess (`Estimate::output_guessed`): the forecast
    /// counts the error all such requests share (`forecast`). Kept in the byte that says
    /// `bounded` (its second bit), which records written before held as 0 or 1: read as not.
    pub output_guessed: bool,
    /// Decode steps until its own limit stops it, and the chance it is still running at the
    /// start of each of the forecast's intervals (`output_dist`).
    pub left: u32,
    pub outlook: Outlook,
    /// Prompt blocks this entry accounts for (its new blocks, plus any inherited).
    pub prompt_blocks: u32,
    pub output_blocks: u32,
    /// The request's whole prompt in blocks, a prefix shared with others included: what each
    /// of its decode steps reads, where `prompt_blocks` is what it adds to the pod's memory (a
    /// batch's: each prompt's share, since each answer reads its own prompt).
    pub context_blocks: u32,
    /// Prompt blocks the pod has still to compute before the request's first token (its prompt
    /// less the prefix the pod was believed to cache), until that token streams; 0 for an answer
    /// that does not stream, whose first token kvgate does not see.
    pub pending_blocks: u32,
    /// The entry on this pod that counts the leading prompt blocks this request shares with it
    /// (0: it shares none), how many (`shared_blocks`), and what they would hold for this request
    /// at its own tokens per block (`shared_tokens`, what it takes on if it must count them). The
    /// record says who counts a shared prefix, not a worker's replica of the pod's blocks: a
    /// worker may still believe in a request another worker has finished, and a prefix leaned on
    /// a finished request was counted by nobody while the engine held it (the `burst` benchmark
    /// ran pods 15 % past kvgate's accounting and preempted).
    pub leans_on: u64,
    pub shared_blocks: u32,
    pub shared_tokens: u64,
    /// Its answers (`n`): the tokens it makes a decode step (`forecast`); 0 reads as 1.
    pub choices: u16,
    /// The most output tokens an answer of its stream brought in one response-body callback so
    /// far: how far behind the engine the stream has been seen to reach the filter
    /// (`forecast::Lag`); 0 until its stream shows one.
    pub lag: u16,
}

impl RequestEntry {
    /// The entry as this version's records hold it.
    fn packed(&self) -> [u8; ENTRY_BYTES] {
        let mut p = Packer::<ENTRY_BYTES>::new();
        p.u64(self.id)
            .u64(self.expires_ms)
            .u64(self.dispatched_ms)
            .u64(self.held_tokens)
            .u32(self.prompt_blocks)
            .u32(self.output_blocks)
            .u32(self.context_blocks)
            .u32(self.left)
            .bytes_raw(&self.outlook)
            .u32(self.held_sigma)
            .u8(u8::from(self.bounded) | u8::from(self.output_guessed) << 1)
            .u32(self.pending_blocks)
            .u64(self.leans_on)
            .u32(self.shared_blocks)
            .u64(self.shared_tokens)
            .u16(self.choices)
            .u16(self.lag);
        *p.packed()
    }

    /// An entry as a record of `layout` holds it.
    fn read(r: &mut Reader, layout: Layout) -> Option<RequestEntry> {
        let mut e = RequestEntry {
            id: r.u64()?,
            expires_ms: r.u64()?,
            dispatched_ms: r.u64()?,
            held_tokens: r.u64()?,
            prompt_blocks: r.u32()?,
            output_blocks: r.u32()?,
            ..RequestEntry::default()
        };
        e.context_blocks = if layout.context {
            r.u32()?
        } else {
            e.prompt_blocks
        };
        if layout.outlook {
            e.left = r.u32()?;
            e.outlook = *r.array()?;
        }
        if layout.spread {
            e.held_sigma = r.u32()?;
            let kind = r.u8()?;
            e.bounded = kind & 1 != 0;
            e.output_guessed = kind & 2 != 0;
        }
        if layout.pending {
            e.pending_blocks = r.u32()?;
        }
        if layout.leaning {
            e.leans_on = r.u64()?;
            e.shared_blocks = r.u32()?;
            e.shared_tokens = r.u64()?;
        }
        if layout.choices {
            e.choices = r.u16()?;
        }
        if layout.lag {
            e.lag = r.u16()?;
        }
        Some(e)
    }

    /// The entry counting its whole prompt itself: what it leaned on another for is added to what
    /// it holds. For a request whose holder is gone without an heir's hand-over (it expired), or
    /// that moves to another pod.
    pub fn standing_alone(mut self) -> RequestEntry {
        self.take_on(self.shared_blocks);
        self
    }

    /// Counts `blocks` more of the prefix it shares (the deepest ones), at its own rate.
    fn take_on(&mut self, blocks: u32) {
        let blocks = blocks.min(self.shared_blocks);
        if blocks == 0 {
            return;
        }
        let tokens = if blocks == self.shared_blocks {
            self.shared_tokens
        } else {
            // At most `shared_tokens`; the product is taken wide so that no size overflows it.
            let part = u128::from(self.shared_tokens) * u128::from(blocks)
                / u128::from(self.shared_blocks);
            u64::try_from(part).unwrap_or(self.shared_tokens)
        };
        self.prompt_blocks += blocks;
        self.held_tokens = self.held_tokens.saturating_add(tokens);
        self.shared_blocks -= blocks;
        self.shared_tokens -= tokens;
        if self.shared_blocks == 0 {
            self.leans_on = 0;
        }
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct PodRecord {
    pub snapshot: Option<Snapshot>,
    /// Requests that finished since the snapshot was taken.
    pub finished_since_scrape: u32,
    pub tally: Tally,
    pub entries: Vec<RequestEntry>,
}

pub fn key(pod: &str) -> String {
    // Built on every read and write of a record: a concatenation, not the formatter.
    ["kvgate.pod.", pod].concat()
}

impl PodRecord {
    /// The pod's KV capacity in blocks of `block_tokens`, as its last scrape said (`default`
    /// when it said nothing).
    pub fn capacity_blocks(&self, block_tokens: u64, default: u64) -> u64 {
        self.snapshot
            .filter(|s| s.capacity_tokens > 0)
            .map_or(default, |s| s.capacity_tokens / block_tokens.max(1))
    }

    /// The blocks the prefix index may believe the pod holds: its capacity, less the share the
    /// engine's prefix-cache counters say the index should leave out (`index_check`).
    pub fn index_blocks(&self, block_tokens: u64, default: u64) -> usize {
        let capacity = self.capacity_blocks(block_tokens, default) as f64;
        (capacity * self.snapshot.map_or(1.0, |s| s.index_share())).round() as usize
    }

    /// The KV its in-flight requests hold, in the engine's blocks of `block_tokens` (the
    /// predicted active blocks): each entry's held tokens in whole blocks, as the engine
    /// allocates them, a shared prefix once. Not the prompts' blocks as the prefix index cuts
    /// them (by characters, `charsPerBlockToken` to a token): prose of more characters per token
    /// made those 19 % more than the engines' KV on the `chat` benchmark, where held tokens are
    /// within 4 % of it, and a pod's capacity is counted in the engine's blocks.
    pub fn active_blocks(&self, block_tokens: u64) -> u64 {
        self.entries
            .iter()
            .map(|e| e.held_tokens.div_ceil(block_tokens.max(1)))
            .sum()
    }

    /// Blocks the pod's in-flight sequences read at every decode step: each its whole context,
    /// so a prefix shared by ten requests (or one request's ten choices) counts ten times here
    /// and once in `active_blocks`.
    pub fn read_blocks(&self) -> u64 {
        self.entries
            .iter()
            .map(|e| {
                let sequences = u64::from(e.choices.max(1));
                sequences * u64::from(e.context_blocks) + u64::from(e.output_blocks)
            })
            .sum()
    }

    /// Prompt blocks the pod has still to compute for requests whose first token has not come:
    /// work a new request's first token waits behind.
    pub fn pending_blocks(&self) -> u64 {
        self.entries
            .iter()
            .map(|e| u64::from(e.pending_blocks))
            .sum()
    }

    /// Its learned pace (`pace`): unknown (0) with no snapshot.
    pub fn pace(&self) -> Pace {
        self.snapshot.map_or(Pace::default(), |s| Pace {
            itl_s: s.itl_s,
            at_ms: s.itl_at_ms,
        })
    }

    pub fn held_tokens(&self) -> u64 {
        self.entries.iter().map(|e| e.held_tokens).sum()
    }

    /// How far behind the engine the pod's streams have been seen to reach the filter: the most
    /// any of its requests in flight saw (`forecast::Lag`).
    pub fn lag(&self) -> Lag {
        Lag::most(self.entries.iter().map(|e| u64::from(e.lag)))
    }

    /// The pod's KV forecast (`forecast::peak`) with `extra` added: what admission holds within
    /// the budget, and what the `reserved_tokens` gauge shows. Its headroom is each kind of
    /// request's (`forecast::Headroom`) in the share of its requests (with `extra`) of that
    /// kind, less what the engine's feedback has given up on this pod (`Snapshot::relief`) in
    /// the share that set no output limit: a client's `max_tokens` is a bound kvgate keeps its
    /// whole headroom for (measured, with limits on the forecast's grid counted: relieved, pods
    /// of bounded requests preempted in 2 of 4 runs; with the whole headroom, in none). Every
    /// answer's stream is counted behind the engine by the most any of the pod's streams was
    /// seen behind it (`forecast::Lag`).
    /// Each entry that has streamed is carried on from its last write by its age at the pod's
    /// pace (`Load::ahead`, [`At`]).
    pub fn forecast(
        &self,
        extra: Option<Load>,
        headroom: Headroom,
        block_tokens: u64,
        at: At,
    ) -> u64 {
        let relief = self.snapshot.map_or(0.0, |s| s.relief);
        let unbounded = self.entries.iter().filter(|e| !e.bounded).count()
            + extra.map_or(0, |l| usize::from(!l.bounded));
        let all = self.entries.len() + usize::from(extra.is_some());
        let z = headroom.sigmas(unbounded as f64 / all.max(1) as f64, relief);
        let lag = self.lag();
        let pace = self.pace();
        let loads = self
            .entries
            .iter()
            .map(|e| Load {
                held: e.held_tokens,
                sigma: u64::from(e.held_sigma),
                left: u64::from(e.left),
                rate: u64::from(e.choices.max(1)),
                bounded: e.bounded,
                guessed: e.output_guessed,
                // Streamed to its last block boundary (what `grow` writes at).
                streamed: u64::from(e.output_blocks) * block_tokens,
                ahead: at.ahead(e, pace, block_tokens),
                outlook: e.outlook,
            })
            .chain(extra);
        peak(loads, z, block_tokens, lag, at.prior_spread)
    }

    /// Scraped within `stale_after_ms`: its figures are recent enough to route on. A pod never
    /// scraped is not fresh.
    pub fn is_fresh(&self, now: u64, metrics: &MetricsConfig) -> bool {
        self.snapshot
            .is_some_and(|s| now.saturating_sub(s.at_ms) <= metrics.stale_after_ms)
    }

    /// Not fresh while scraping is on (with no metrics cluster nothing is ever scraped, so no pod
    /// is held to it): what the pool gauge and the status page count.
    pub fn is_stale(&self, now: u64, metrics: &MetricsConfig) -> bool {
        !metrics.cluster.is_empty() && !self.is_fresh(now, metrics)
    }

    /// Avoided: its last scrape could not connect, or a pick to it failed. A pod never scraped is
    /// not held against.
    pub fn is_down(&self) -> bool {
        self.snapshot.is_some_and(|s| !s.healthy)
    }

    pub fn is_live(&self, id: u64) -> bool {
        self.entries.iter().any(|e| e.id == id)
    }

    /// The ids of the requests in flight, sorted: for checking many ids at once.
    pub fn live_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.entries.iter().map(|e| e.id).collect();
        ids.sort_unstable();
        ids
    }

    /// Removes the entry `id` (None when absent), handing what it counted of a prefix others
    /// lean on to the one of them that shares the most of it, its heir: with chained hashes the
    /// heir's prefix contains every other leaner's. The heir counts the blocks the gone entry
    /// counted for it, and leans on whatever the gone entry leaned on for the rest; the other
    /// leaners lean on the heir, or on that same entry when they shared no more than the gone
    /// entry did. So every prefix block an in-flight request holds stays counted once.
    pub fn remove(&mut self, id: u64) -> Option<RequestEntry> {
        let i = self.entries.iter().position(|e| e.id == id)?;
        let gone = self.entries.swap_remove(i);
        let Some(heir) = self.heir_of(gone.id) else {
            return Some(gone);
        };
        for e in self.entries.iter_mut().filter(|e| e.leans_on == gone.id) {
            if e.id == heir {
                // What the gone entry counted of the heir's shared prefix: from where its own
                // sharing ended up to where the heir's ends.
                let counted = e
                    .shared_blocks
                    .min(gone.context_blocks)
                    .saturating_sub(gone.shared_blocks)
                    .min(gone.prompt_blocks);
                e.take_on(counted);
                if e.shared_blocks > 0 {
                    e.leans_on = gone.leans_on;
                }
            } else if e.shared_blocks > gone.shared_blocks {
                e.leans_on = heir;
            } else {
                e.leans_on = gone.leans_on;
            }
            if e.leans_on == 0 && e.shared_blocks > 0 {
                // Nothing left to lean on (a record from before leaning was recorded): it
                // counts the rest itself.
                e.take_on(e.shared_blocks);
            }
        }
        Some(gone)
    }

    /// Of the entries leaning on `holder`, the one sharing the most of its prefix (the lowest id
    /// among equals): with chained hashes, its prefix contains every other leaner's.
    fn heir_of(&self, holder: u64) -> Option<u64> {
        self.entries
            .iter()
            .filter(|e| e.leans_on == holder)
            .max_by_key(|e| (e.shared_blocks, std::cmp::Reverse(e.id)))
            .map(|e| e.id)
    }

    /// Whether an entry has expired by `now`: what `drop_expired` would leave out.
    pub fn has_expired(&self, now: u64) -> bool {
        self.entries.iter().any(|e| e.expires_ms <= now)
    }

    /// Leaves out entries expired by `now`, and has those that leaned on one count its prefix.
    pub fn drop_expired(&mut self, now: u64) {
        if !self.has_expired(now) {
            return;
        }
        self.entries.retain(|e| e.expires_ms > now);
        self.lean_only_on_the_living();
    }

    /// Entries whose holder left without handing its prefix on (it expired) count it
    /// themselves: of those that leaned on one gone entry, the one sharing the most takes its
    /// whole shared prefix on, and the others lean on it. More than the engine holds when the
    /// gone entry had leaned on another for part of it, never less.
    fn lean_only_on_the_living(&mut self) {
        while let Some(missing) = self
            .entries
            .iter()
            .map(|e| e.leans_on)
            .find(|&h| h != 0 && !self.is_live(h))
        {
            let Some(heir) = self.heir_of(missing) else {
                return;
            };
            for e in self.entries.iter_mut().filter(|e| e.leans_on == missing) {
                if e.id == heir {
                    *e = e.standing_alone();
                } else {
                    e.leans_on = heir;
                }
            }
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        // Room for the snapshot and every entry at once (about 100 bytes each), not by doublings.
        let mut w = Writer(Vec::with_capacity(128 + 100 * self.entries.len()));
        w.u8(VERSION);
        match &self.snapshot {
            Some(s) => {
                w.u8(1)
                    .u64(s.at_ms)
                    .u8(u8::from(s.healthy))
                    .f64(s.running)
                    .f64(s.waiting)
                    .f64(s.kv_usage)
                    .u64(s.capacity_tokens)
                    .u32(s.block_size)
                    .u8(u8::from(s.no_prefix_caching))
                    .f64(s.preemptions)
                    .f64(s.backoff)
                    .u64(s.unexplained_tokens)
                    .f64(s.relief)
                    .f64(s.relief_lost);
                // Unknown totals as NaN: they are never a real histogram's.
                let totals = s.itl_totals.unwrap_or(ItlTotals {
                    sum_s: f64::NAN,
                    count: f64::NAN,
                });
                w.f64(totals.sum_s)
                    .f64(totals.count)
                    .f64(s.itl_s)
                    .u64(s.itl_at_ms);
                let hits = s.hit_totals.unwrap_or(HitTotals {
                    hits: f64::NAN,
                    queries: f64::NAN,
                    tally: Tally::default(),
                });
                w.f64(hits.hits).f64(hits.queries);
                write_tally(&mut w, hits.tally);
                w.f64(s.index_cut).u32(s.engine_restarts);
                let (hits, queries) = s.hit_counts.unwrap_or((f64::NAN, f64::NAN));
                w.f64(hits).f64(queries);
                w.u32(s.seats).u32(s.most_running).u64(s.queued_since_ms);
            }
            None => {
                w.u8(0);
            }
        }
        w.u32(self.finished_since_scrape);
        write_tally(&mut w, self.tally);
        w.u32(self.entries.len() as u32);
        for e in &self.entries {
            w.0.extend_from_slice(&e.packed());
        }
        w.0
    }

    /// Decodes a record; an empty, blanked or corrupt one reads as a pod with nothing known.
    pub fn decode(bytes: &[u8]) -> Option<PodRecord> {
        let mut r = Reader(bytes);
        let version = r.u8()?;
        if !(VERSION_WITHOUT_CONTEXT..=VERSION).contains(&version) {
            return None;
        }
        let layout = Layout::of(version);
        let has_pace = version >= VERSION_WITHOUT_PACE_AGE;
        let has_pace_age = version >= VERSION_WITHOUT_LEANING;
        let has_check = version > VERSION_WITHOUT_INDEX_CHECK;
        let snapshot = match r.u8()? {
            0 => None,
            _ => {
                let mut s = Snapshot {
                    at_ms: r.u64()?,
                    healthy: r.u8()? != 0,
                    running: r.f64()?,
                    waiting: r.f64()?,
                    kv_usage: r.f64()?,
                    capacity_tokens: r.u64()?,
                    block_size: r.u32()?,
                    no_prefix_caching: layout.context && r.u8()? != 0,
                    preemptions: f64::NAN,
                    ..Snapshot::default()
                };
                if layout.outlook {
                    s.preemptions = r.f64()?;
                    s.backoff = r.f64()?;
                    s.unexplained_tokens = r.u64()?;
                }
                if layout.spread {
                    s.relief = r.f64()?;
                    s.relief_lost = r.f64()?;
                }
                if has_pace {
                    let (sum_s, count) = (r.f64()?, r.f64()?);
                    s.itl_totals = (sum_s.is_finite() && count.is_finite())
                        .then_some(ItlTotals { sum_s, count });
                    s.itl_s = r.f64()?;
                    s.itl_at_ms = if has_pace_age { r.u64()? } else { s.at_ms };
                }
                if has_check {
                    let (hits, queries) = (r.f64()?, r.f64()?);
                    let tally = read_tally(&mut r)?;
                    s.hit_totals = (hits.is_finite() && queries.is_finite()).then_some(HitTotals {
                        hits,
                        queries,
                        tally,
                    });
                    s.index_cut = r.f64()?;
                    s.engine_restarts = r.u32()?;
                    let (hits, queries) = (r.f64()?, r.f64()?);
                    s.hit_counts =
                        (hits.is_finite() && queries.is_finite()).then_some((hits, queries));
                }
                if version > VERSION_WITHOUT_SEATS {
                    s.seats = r.u32()?;
                    s.most_running = r.u32()?;
                    s.queued_since_ms = r.u64()?;
                }
                Some(s)
            }
        };
        let finished_since_scrape = r.u32()?;
        let tally = if has_check {
            read_tally(&mut r)?
        } else {
            Tally::default()
        };
        let entries = r.list(layout.entry_bytes(), |r| {
            if version == VERSION {
                // An entry of this version is a fixed size: taken whole, then read field by field.
                RequestEntry::read(&mut Reader(r.array::<ENTRY_BYTES>()?), layout)
            } else {
                RequestEntry::read(r, layout)
            }
        })?;
        Some(PodRecord {
            snapshot,
            finished_since_scrape,
            tally,
            entries,
        })
    }
}

fn write_tally(w: &mut Writer, t: Tally) {
    w.u64(t.requests).u64(t.believed_blocks).u64(t.sent_blocks);
}

fn read_tally(r: &mut Reader) -> Option<Tally> {
    Some(Tally {
        requests: r.u64()?,
        believed_blocks: r.u64()?,
        sent_blocks: r.u64()?,
    })
}

/// Reads a pod's record; expired entries are left out (they are dropped from storage on the next
/// write, which may not come soon), and what they counted of a prefix others lean on is counted
/// by those, as that write will.
pub fn read(store: &dyn Store, pod: &str) -> Result<PodRecord, StoreError> {
    read_versioned(store, pod).map(|(rec, _)| rec)
}

/// `read`, with the value as read: a reservation made in the same callback starts its
/// compare-and-swap from it (`modify_from`) instead of reading the record again.
pub fn read_versioned(store: &dyn Store, pod: &str) -> Result<(PodRecord, Versioned), StoreError> {
    let read = store.get(&key(pod))?;
    let mut rec = read
        .value
        .as_deref()
        .and_then(PodRecord::decode)
        .unwrap_or_default();
    rec.drop_expired(store.now_ms());
    Ok((rec, read))
}

/// Creates the pod's record if it has none. Called before any request can be routed to the pod
/// (configure for static pods, discovery for the others), as `interface::update` requires.
pub fn ensure(store: &dyn Store, pod: &str) -> Result<(), StoreError> {
    create_if_missing(store, &key(pod), &PodRecord::default().encode())
}

/// A pod left the pool: what was scraped of it is forgotten and it reads as down, until a scrape
/// after it comes back. Down, not unknown: a VM reads the pool at most once a second, and until
/// then ranks the pod on this record alone; a pod with nothing known takes one request at a time,
/// which Envoy, no longer holding the host, sends to its fallback instead, past that pod's budget
/// (5–16 times a departure, `tests/e2e/test_budget.py`). Its in-flight
/// requests stay until their streams end (or expire): a blind write here would erase them, and a
/// pod that flaps out of the cluster and back would then be filled on top of requests it is still
/// serving.
pub fn depart(store: &dyn Store, pod: &str, now_ms: u64) -> Result<(), StoreError> {
    modify(store, pod, |rec| {
        // No counter is known either: the first scrape after it comes back sets the baseline
        // of its preemptions rather than reading the engine's total as new ones (`feedback`).
        rec.snapshot = Some(Snapshot {
            at_ms: now_ms,
            healthy: false,
            kv_usage: f64::NAN,
            preemptions: f64::NAN,
            ..Snapshot::default()
        });
        rec.finished_since_scrape = 0;
        Some(())
    })
    .map(|_| ())
}

/// Read-modify-write of a pod's record; expired entries are dropped on every write.
pub fn modify<T>(
    store: &dyn Store,
    pod: &str,
    change: impl FnMut(&mut PodRecord) -> Option<T>,
) -> Result<Option<T>, StoreError> {
    modify_from(store, pod, None, change)
}

/// `modify` starting from the record as `seen` in this callback (`read_versioned`): one host
/// call fewer when nobody wrote it since (`interface::update_from`).
pub fn modify_from<T>(
    store: &dyn Store,
    pod: &str,
    seen: Option<Versioned>,
    mut change: impl FnMut(&mut PodRecord) -> Option<T>,
) -> Result<Option<T>, StoreError> {
    let now = store.now_ms();
    update_from(store, &key(pod), seen, |bytes| {
        let mut rec = bytes.and_then(PodRecord::decode).unwrap_or_default();
        rec.drop_expired(now);
        let out = change(&mut rec)?;
        Some((rec.encode(), out))
    })
}

/// Changes one request's entry where it lies in the stored record: a streamed answer's entry
/// grows at each block boundary, and decoding and encoding a busy pod's whole record for that
/// (an entry per request in flight) cost about 40,000 instructions a write at 200 in flight
/// (`examples/request_cost --open 200 --stream 256`). Returns whether it was written. Like
/// `modify`, a compare-and-swap that retries lost races, in which an entry that has expired is
/// not renewed; unlike it, the record's other expired entries stay until the next `modify`
/// (reads leave them out meanwhile). A record of an earlier version goes through `modify`.
pub fn modify_entry(
    store: &dyn Store,
    pod: &str,
    id: u64,
    mut change: impl FnMut(&mut RequestEntry),
) -> Result<bool, StoreError> {
    let now = store.now_ms();
    let mut earlier_version = false;
    let written = update_from(store, &key(pod), None, |bytes| {
        let bytes = bytes?;
        let Some(start) = entries_start(bytes) else {
            earlier_version = true;
            return None;
        };
        let at = (start..bytes.len())
            .step_by(ENTRY_BYTES)
            .find(|&at| bytes.get(at..at + 8) == Some(&id.to_le_bytes()[..]))?;
        let mut e = RequestEntry::read(
            &mut Reader(bytes.get(at..at + ENTRY_BYTES)?),
            Layout::of(VERSION),
        )?;
        if e.expires_ms <= now {
            return None;
        }
        change(&mut e);
        let mut out = bytes.to_vec();
        out.get_mut(at..at + ENTRY_BYTES)?
            .copy_from_slice(&e.packed());
        Some((out, ()))
    })?;
    if !earlier_version {
        return Ok(written.is_some());
    }
    modify(store, pod, |rec| {
        change(rec.entries.iter_mut().find(|e| e.id == id)?);
        Some(())
    })
    .map(|r| r.is_some())
}

/// Where the entries of a record of this version start, from its head alone; `None` for a
/// record of another version, or one whose size is not its entries' count says.
fn entries_start(bytes: &[u8]) -> Option<usize> {
    if *bytes.first()? != VERSION {
        return None;
    }
    let count_at =
        2 + if *bytes.get(1)? != 0 {
            SNAPSHOT_BYTES
        } else {
            0
        } + 4
            + TALLY_BYTES;
    let count = bytes.get(count_at..count_at + 4)?;
    let n = u32::from_le_bytes(count.try_into().ok()?) as usize;
    let start = count_at + 4;
    (n.checked_mul(ENTRY_BYTES)?.checked_add(start)? == bytes.len()).then_some(start)
}

/// Removes a request's entry, exactly once: returns it the first time, `None` after. The prompt
/// blocks (and their reserved tokens) that requests still in flight lean on move to one of them
/// ([`PodRecord::remove`]), so the pod's active count and reservation stay right and still return
/// to exactly zero.
pub fn finish(store: &dyn Store, pod: &str, id: u64) -> Result<Option<RequestEntry>, StoreError> {
    modify(store, pod, |rec| {
        let gone = rec.remove(id)?;
        rec.finished_since_scrape = rec.finished_since_scrape.saturating_add(1);
        Some(gone)
    })
}

/// Stores a scrape's result. Requests kvgate sent within `grace_ms` before it are taken off its
/// waiting count: the engine had not had a step to schedule them, so they are not a queue. A
/// scrape that does not say how large the pod is (a partial page, a pod marked down) keeps the
/// size the last one said: forgetting it would lift the budget. The engine's own numbers are
/// compared with kvgate's accounting (`feedback`).
/// Writes a scrape's snapshot (`grace_ms`: `metrics.waitingGraceMs`), with the engine's
/// feedback on kvgate's accounting (`feedback`, steered by `cfg`'s admission settings).
/// Returns whether the pod was opened by it: its first healthy snapshot, or the first since it
/// was down (a pod taking one request at a time, or none, may now take many).
pub fn write_snapshot(
    store: &dyn Store,
    pod: &str,
    scraped: Snapshot,
    grace_ms: u64,
    cfg: &Config,
) -> Result<bool, StoreError> {
    // With several gateway replicas, the others' requests on the pod are explained too.
    let remote = crate::replicas::share::remote_tokens(store, cfg, pod);
    let (now, interval) = (scraped.at_ms, cfg.metrics.interval_ms);
    let pool_lost = crate::admission::feedback::pool_lost(store, now, interval);
    let (mut raised, mut restarted) = (None, None);
    modify(store, pod, |rec| {
        // Each try starts from the scrape as read: a try that lost its compare-and-swap to a
        // request's write has already taken kvgate's unscheduled requests off the waiting and
        // set the baselines from the record it read, and a second pass over its own output took
        // them off twice (no queue, so no seats learned) and read the old baseline as the
        // engine's counters going back (a restart: seats, index and pace forgotten).
        let mut snapshot = scraped;
        (raised, restarted) = (None, None);
        if rec.snapshot.is_some_and(|prev| snapshot.at_ms < prev.at_ms) {
            // Asked before what the record holds was (the scrape lease moved to another VM while
            // this answer was out, and its answer came first): written over it, the engine's
            // counters would run backwards, which reads as the engine restarting, and its seats,
            // index and pace would be forgotten.
            return None;
        }
        let opened = snapshot.healthy && rec.snapshot.is_none_or(|prev| !prev.healthy);
        if let Some(prev) = rec.snapshot {
            if snapshot.capacity_tokens == 0 {
                snapshot.capacity_tokens = prev.capacity_tokens;
            }
            if snapshot.block_size == 0 {
                snapshot.block_size = prev.block_size;
            }
        }
        let preempted = crate::admission::feedback::follow(
            rec.snapshot.as_ref(),
            &mut snapshot,
            rec,
            cfg,
            remote,
            pool_lost,
        );
        raised = preempted.then_some(snapshot.relief_lost);
        crate::pods::pace::follow(
            rec.snapshot.as_ref(),
            &mut snapshot,
            cfg.metrics.interval_ms,
        );
        let since = snapshot.at_ms.saturating_sub(grace_ms);
        let unscheduled = rec
            .entries
            .iter()
            .filter(|e| e.dispatched_ms >= since)
            .count();
        snapshot.waiting = (snapshot.waiting - unscheduled as f64).max(0.0);
        // After kvgate's own requests not yet scheduled are taken off the waiting: those the
        // engine looks up once, at its next step.
        crate::pods::index_check::follow(
            rec.snapshot.as_ref(),
            &mut snapshot,
            rec.tally,
            cfg.routing.index_check,
        );
        restarted = rec
            .snapshot
            .filter(|p| p.engine_restarts != snapshot.engine_restarts)
            .map(|p| (p.hit_counts, snapshot.hit_counts));
        // After the restarts are counted: a restarted engine's seats are learned again.
        crate::pods::seats::follow(rec.snapshot.as_ref(), &mut snapshot);
        rec.snapshot = Some(snapshot);
        rec.finished_since_scrape = 0;
        Some(opened)
    })
    .map(|opened| opened.unwrap_or(false))
    .inspect(|_| {
        // Only the try that was written.
        if let Some((before, after)) = restarted {
            log::info!(
                "pod {pod}: its engine's prefix-cache counters went back (hits, queries {before:?} to {after:?}): \
                 taken as a restart; its seats, cache index and pace are learned again"
            );
        }
        if let Some(lost) = raised.filter(|&l| l > pool_lost) {
            if let Err(e) = crate::admission::feedback::share_lost(store, lost, now, interval) {
                log::debug!("sharing the relief cap failed: {e:?}");
            }
        }
    })
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::store::fake_host::{FakeHost, FakeVm};

    /// A scrape's write that loses its compare-and-swap to a request's is tried again from the
    /// scrape as read: kvgate's own requests not yet scheduled are taken off the engine's waiting
    /// once, and the baseline the first try kept is not read as the engine's counters going back.
    #[test]
    fn a_scrape_written_after_a_lost_race_is_read_once() {
        use crate::pods::index_check::HitTotals;
        use crate::test_support::Watched;
        let host = FakeHost::new();
        let (vm, other) = (host.vm(), host.vm());
        let cfg = crate::test_support::with_pods(&["a:1"]);
        ensure(&vm, "a:1").unwrap();
        let scrape = |at_ms: u64, queries: f64, waiting: f64| Snapshot {
            at_ms,
            healthy: true,
            running: 4.0,
            waiting,
            kv_usage: 0.2,
            capacity_tokens: 1 << 16,
            block_size: 16,
            hit_totals: Some(HitTotals {
                hits: 0.0,
                queries,
                tally: Tally::default(),
            }),
            ..Snapshot::default()
        };
        let raced = |at_ms: u64, queries: f64, waiting: f64| {
            host.set_now_ms(at_ms);
            let racing = Watched::racing(&vm, || {
                modify(&other, "a:1", |_| Some(())).unwrap();
            });
            write_snapshot(&racing, "a:1", scrape(at_ms, queries, waiting), 250, &cfg).unwrap();
            read(&vm, "a:1").unwrap().snapshot.unwrap()
        };
        for (at, queries) in [(1_000, 200.0), (2_000, 300.0)] {
            host.set_now_ms(at);
            write_snapshot(&vm, "a:1", scrape(at, queries, 0.0), 250, &cfg).unwrap();
        }
        // Too few requests since the baseline (200) for a new one: the first try keeps it.
        let s = raced(3_000, 400.0, 0.0);
        assert_eq!(s.engine_restarts, 0, "the engine did not restart");
        assert_eq!(s.hit_counts, Some((0.0, 400.0)));
        modify(&vm, "a:1", |rec| {
            rec.entries.push(RequestEntry {
                dispatched_ms: 3_900,
                expires_ms: 60_000,
                ..entry(1, 4)
            });
            Some(())
        })
        .unwrap();
        let s = raced(4_000, 500.0, 3.0);
        assert_eq!(
            s.waiting, 2.0,
            "kvgate's one request just sent taken off once"
        );
        assert_eq!(s.engine_restarts, 0);
    }

    fn entry(id: u64, blocks: u32) -> RequestEntry {
        RequestEntry {
            id,
            expires_ms: 1_000,
            dispatched_ms: 1,
            held_tokens: 100,
            prompt_blocks: blocks,
            context_blocks: blocks,
            ..RequestEntry::default()
        }
    }

    #[test]
    fn every_answer_on_a_pod_is_counted_behind_its_engine_by_the_most_any_stream_was_seen() {
        let running = |id, lag| RequestEntry {
            left: 100,
            outlook: [255; HORIZON_STEPS.len()],
            lag,
            ..entry(id, 2)
        };
        let pod = |lags: &[u16]| PodRecord {
            entries: (1..).zip(lags).map(|(id, &l)| running(id, l)).collect(),
            ..PodRecord::default()
        };
        assert_eq!(pod(&[0, 0]).lag(), Lag::Unseen);
        assert_eq!(pod(&[0, 3, 1]).lag(), Lag::Seen(3));
        // Half a block an answer while none is seen; once one is, the most seen and two tokens
        // (`Lag`), 5: 3 tokens less for each of the two, the one that has not streamed yet too.
        assert_eq!(
            pod(&[0, 0]).forecast(None, Headroom::uniform(2.0), 16, At::UNTIMED)
                - pod(&[0, 3]).forecast(None, Headroom::uniform(2.0), 16, At::UNTIMED),
            6
        );
    }

    #[test]
    fn a_streaming_entry_is_carried_on_from_its_write_at_the_pods_pace() {
        let cfg = Config::default();
        let ttl = cfg.routing.request_ttl_ms;
        // Written at 10,000 ms, two blocks of its answer streamed; the pod steps every 10 ms.
        let entry = RequestEntry {
            expires_ms: 10_000 + ttl,
            output_blocks: 2,
            ..RequestEntry::default()
        };
        let ahead = |e: &RequestEntry, now, itl_s| {
            let pace = Pace { itl_s, at_ms: 0 };
            At::of(&cfg, now).ahead(e, pace, 16)
        };
        assert_eq!(ahead(&entry, 10_000, 0.01), Some(0), "as written");
        assert_eq!(
            ahead(&entry, 10_075, 0.01),
            Some(7),
            "seven whole steps since"
        );
        assert_eq!(
            ahead(&entry, 10_500, 0.01),
            Some(15),
            "never a block past it: written again there"
        );
        let two = RequestEntry {
            choices: 2,
            ..entry
        };
        assert_eq!(
            ahead(&two, 10_035, 0.01),
            Some(6),
            "two answers, a token each a step"
        );
        assert_eq!(ahead(&entry, 10_075, f64::NAN), None, "the pace unknown");
        assert_eq!(ahead(&entry, 10_075, 0.0), None);
        let waiting = RequestEntry {
            output_blocks: 0,
            ..entry
        };
        assert_eq!(ahead(&waiting, 10_075, 0.01), None, "no token yet");
        assert_eq!(ahead(&entry, 9_000, 0.01), None, "a write after the clock");
        // In the forecast: half a block (8) as before where it is not known, 15 here.
        let pod = |itl_s: f64| PodRecord {
            entries: vec![RequestEntry {
                held_tokens: 100,
                left: 1,
                outlook: [255; HORIZON_STEPS.len()],
                ..entry
            }],
            snapshot: Some(Snapshot {
                itl_s,
                ..Snapshot::default()
            }),
            ..PodRecord::default()
        };
        let at = At::of(&cfg, 10_500);
        let h = Headroom::uniform(0.0);
        assert_eq!(
            pod(0.01).forecast(None, h, 16, at) - pod(f64::NAN).forecast(None, h, 16, at),
            7
        );
    }

    #[test]
    fn a_pods_headroom_is_each_kinds_in_its_share_with_the_request_asked_about() {
        let outlook = crate::estimate::output_dist::OutputDist::prior(256).outlook(0, 1024);
        let running = |id, bounded| RequestEntry {
            left: 1024,
            outlook,
            bounded,
            ..entry(id, 2)
        };
        let relieved = Snapshot {
            relief: 1.0,
            ..Snapshot::default()
        };
        let pod = |bounded: bool| PodRecord {
            entries: (1..=3).map(|id| running(id, bounded)).collect(),
            snapshot: Some(relieved),
            ..PodRecord::default()
        };
        let asked = |bounded| Load {
            held: 100,
            sigma: 0,
            left: 1024,
            rate: 1,
            bounded,
            guessed: false,
            streamed: 0,
            ahead: None,
            outlook,
        };
        let h = Headroom {
            bounded: 3.0,
            unbounded: 2.0,
        };
        // The forecast at `z` itself: no relief.
        let at = |z: f64, rec: &PodRecord, extra| {
            let unrelieved = PodRecord {
                snapshot: None,
                ..rec.clone()
            };
            unrelieved.forecast(extra, Headroom::uniform(z), 16, At::UNTIMED)
        };
        let expected = |rec: &PodRecord, extra| at(0.0, rec, extra);
        // Unbounded, their headroom all given up: the expectation alone.
        assert_eq!(
            pod(false).forecast(None, h, 16, At::UNTIMED),
            expected(&pod(false), None)
        );
        // Bounded: their own headroom, which no relief gives up.
        assert_eq!(
            pod(true).forecast(None, h, 16, At::UNTIMED),
            at(3.0, &pod(true), None)
        );
        // A bounded request asked about on a relieved pod of three unbounded: a quarter of 3 σ.
        let mixed = Some(asked(true));
        assert_eq!(
            pod(false).forecast(mixed, h, 16, At::UNTIMED),
            at(0.75, &pod(false), mixed)
        );
        assert!(expected(&pod(false), mixed) < at(0.75, &pod(false), mixed));
    }

    #[test]
    fn requests_with_max_tokens_keep_the_wider_headroom_and_a_mix_blends() {
        let h = Headroom {
            bounded: 3.0,
            unbounded: 2.0,
        };
        assert_eq!(h.sigmas(0.0, 0.5), 3.0, "all bounded: no relief applies");
        assert_eq!(h.sigmas(1.0, 0.0), 2.0);
        assert_eq!(h.sigmas(1.0, 0.25), 1.5);
        assert_eq!(h.sigmas(0.5, 0.5), 1.5 + 0.5);
        assert_eq!(Headroom::uniform(2.5).sigmas(0.3, 0.0), 2.5);
    }

    /// The snapshot's part written by `index_check`: the engine's counters and their tally at
    /// the interval's start, the cut, the restarts and the last scrape's counters.
    const CHECK_BYTES: usize = 68;

    /// A record of this version as a module of `version`, whose entries were `entry_bytes` long,
    /// wrote it: each entry less its last `cut` bytes.
    fn cut_entries(bytes: &[u8], version: u8, entry_bytes: usize, cut: usize) -> Vec<u8> {
        let mut b = bytes.to_vec();
        b[0] = version;
        let snapshot = if b[1] != 0 { UNSEATED_BYTES } else { 0 };
        let head = 2 + snapshot + 8 + TALLY_BYTES;
        let entries = (b.len() - head) / entry_bytes;
        for i in (0..entries).rev() {
            let end = head + (i + 1) * entry_bytes;
            b.drain(end - cut..end);
        }
        b
    }

    /// A snapshot's size in records before `seats`.
    const UNSEATED_BYTES: usize = SNAPSHOT_BYTES - SEATS_BYTES;

    /// A record of this version as a module before snapshots carried the engine's seats wrote it.
    fn without_seats(bytes: &[u8]) -> Vec<u8> {
        let mut b = bytes.to_vec();
        b[0] = VERSION_WITHOUT_SEATS;
        if b[1] != 0 {
            b.drain(2 + UNSEATED_BYTES..2 + SNAPSHOT_BYTES);
        }
        b
    }

    /// ... and before entries carried their streams' lag.
    fn without_lag(bytes: &[u8]) -> Vec<u8> {
        cut_entries(&without_seats(bytes), VERSION_WITHOUT_LAG, ENTRY_BYTES, 2)
    }

    /// ... and before they carried their choices.
    fn without_choices(bytes: &[u8]) -> Vec<u8> {
        cut_entries(
            &without_lag(bytes),
            VERSION_WITHOUT_CHOICES,
            ENTRY_BYTES - 2,
            2,
        )
    }

    /// The entries as a record before lags holds them: none seen.
    fn no_lag(entries: &[RequestEntry]) -> Vec<RequestEntry> {
        let each = |e: &RequestEntry| RequestEntry { lag: 0, ..*e };
        entries.iter().map(each).collect()
    }

    /// The entries as a record before choices holds them: one answer each.
    fn one_answer_each(entries: &[RequestEntry]) -> Vec<RequestEntry> {
        let each = |e: &RequestEntry| RequestEntry {
            choices: 0,
            lag: 0,
            ..*e
        };
        entries.iter().map(each).collect()
    }

    /// A record of this version as a module before `index_check` wrote it.
    fn without_index_check(bytes: &[u8]) -> Vec<u8> {
        let mut b = without_choices(bytes);
        b[0] = VERSION_WITHOUT_INDEX_CHECK;
        let snapshot = if b[1] != 0 { UNSEATED_BYTES } else { 0 };
        let tally_at = 2 + snapshot + 4;
        b.drain(tally_at..tally_at + TALLY_BYTES);
        if snapshot > 0 {
            b.drain(2 + UNSEATED_BYTES - CHECK_BYTES..2 + UNSEATED_BYTES);
        }
        b
    }

    #[test]
    fn round_trips_and_rejects_garbage() {
        let rec = PodRecord {
            snapshot: Some(Snapshot {
                at_ms: 5,
                healthy: true,
                running: 2.0,
                waiting: 1.0,
                kv_usage: f64::NAN,
                capacity_tokens: 4096,
                block_size: 16,
                no_prefix_caching: true,
                preemptions: 7.0,
                backoff: 0.1,
                unexplained_tokens: 3,
                relief: 0.25,
                relief_lost: 0.1,
                itl_totals: Some(ItlTotals {
                    sum_s: 12.5,
                    count: 900.0,
                }),
                itl_s: 0.014,
                itl_at_ms: 3,
                hit_totals: Some(HitTotals {
                    hits: 300.0,
                    queries: 1_000.0,
                    tally: Tally {
                        requests: 4,
                        believed_blocks: 10,
                        sent_blocks: 30,
                    },
                }),
                index_cut: 0.25,
                engine_restarts: 2,
                hit_counts: Some((310.0, 1_020.0)),
                seats: 256,
                most_running: 257,
                queued_since_ms: 4,
            }),
            finished_since_scrape: 3,
            tally: Tally {
                requests: 9,
                believed_blocks: 20,
                sent_blocks: 70,
            },
            entries: vec![
                entry(1, 4),
                RequestEntry {
                    output_blocks: 2,
                    left: 40,
                    outlook: std::array::from_fn(|i| 255 - i as u8),
                    held_sigma: 7,
                    bounded: true,
                    output_guessed: true,
                    pending_blocks: 9,
                    leans_on: 1,
                    shared_blocks: 3,
                    shared_tokens: 33,
                    choices: 4,
                    lag: 3,
                    ..entry(2, 5)
                },
            ],
        };
        let back = PodRecord::decode(&rec.encode()).unwrap();
        assert_eq!(back.entries, rec.entries);
        let seats = |r: &PodRecord| {
            r.snapshot
                .map(|s| (s.seats, s.most_running, s.queued_since_ms))
        };
        assert_eq!(seats(&back), Some((256, 257, 4)));
        // As a module before snapshots carried seats wrote it: none learned, the rest as it was.
        let eleven = PodRecord::decode(&without_seats(&rec.encode())).unwrap();
        assert_eq!(seats(&eleven), Some((0, 0, 0)));
        assert_eq!(eleven.entries, rec.entries);
        assert_eq!(
            eleven.snapshot.map(|s| s.hit_counts),
            Some(Some((310.0, 1_020.0)))
        );
        // As a module before entries carried their lag wrote it: none seen.
        let ten = PodRecord::decode(&without_lag(&rec.encode())).unwrap();
        assert_eq!(ten.entries, no_lag(&rec.entries));
        // As a module before entries carried their choices wrote it: one answer each.
        let nine = PodRecord::decode(&without_choices(&rec.encode())).unwrap();
        assert_eq!(nine.entries, one_answer_each(&rec.entries));
        let pace = |r: &PodRecord| r.snapshot.map(|s| (s.itl_totals, s.itl_s, s.itl_at_ms));
        assert_eq!(pace(&back), pace(&rec));
        let check = |r: &PodRecord| {
            r.snapshot.map(|s| {
                (
                    s.hit_totals,
                    s.index_cut,
                    s.engine_restarts,
                    s.hit_counts,
                    r.tally,
                )
            })
        };
        assert_eq!(check(&back), check(&rec));
        let full_head = PodRecord {
            entries: Vec::new(),
            ..rec.clone()
        }
        .encode()
        .len();
        assert_eq!(
            full_head,
            2 + SNAPSHOT_BYTES + 8 + TALLY_BYTES,
            "the snapshot's size"
        );
        // As a module before the index check wrote it: read with none of it.
        let eight = without_index_check(&rec.encode());
        let read = PodRecord::decode(&eight).unwrap();
        assert_eq!(read.entries, one_answer_each(&rec.entries));
        assert_eq!(pace(&read), pace(&rec));
        assert_eq!(
            check(&read),
            Some((None, 0.0, 0, None, Tally::default())),
            "nothing known of the index"
        );
        // The same record as a module before entries leaned on a holder wrote it: each entry less
        // its last 20 bytes, read as sharing nothing.
        let head = full_head - SEATS_BYTES - CHECK_BYTES - TALLY_BYTES;
        let mut bytes = eight;
        bytes[0] = VERSION_WITHOUT_LEANING;
        let entry_len = (bytes.len() - head) / 2;
        // Every field packed, none past the packer's end.
        assert_eq!(entry_len, ENTRY_BYTES - 4);
        for i in (0..2).rev() {
            let end = head + (i + 1) * entry_len;
            bytes.drain(end - 20..end);
        }
        let rec = PodRecord {
            entries: rec
                .entries
                .iter()
                .map(|e| RequestEntry {
                    leans_on: 0,
                    shared_blocks: 0,
                    shared_tokens: 0,
                    choices: 0,
                    lag: 0,
                    ..*e
                })
                .collect(),
            ..rec
        };
        assert_eq!(PodRecord::decode(&bytes).unwrap().entries, rec.entries);
        assert_eq!(back.pending_blocks(), 9);
        // As a module before paces had an age wrote it: the snapshot less the time its pace was
        // last moved (the 8 bytes before the scrape count and the entry count), read as moved
        // at its scrape.
        bytes[0] = VERSION_WITHOUT_PACE_AGE;
        bytes.drain(head - 8 - 8..head - 8);
        let read = PodRecord::decode(&bytes).unwrap();
        assert_eq!(read.entries, rec.entries);
        assert_eq!(
            pace(&read),
            Some((rec.snapshot.unwrap().itl_totals, 0.014, 5))
        );
        // As a module before paces wrote it: the snapshot less its latency totals and pace too
        // (24 bytes more), read with none known.
        let head = head - 8;
        let mut unpaced = rec.clone();
        if let Some(s) = unpaced.snapshot.as_mut() {
            (s.itl_totals, s.itl_s, s.itl_at_ms) = (None, 0.0, 0);
        }
        bytes[0] = VERSION_WITHOUT_PACE;
        bytes.drain(head - 8 - 24..head - 8);
        let read = PodRecord::decode(&bytes).unwrap();
        assert_eq!(read.entries, rec.entries);
        assert_eq!(pace(&read), Some((None, 0.0, 0)));
        // And as a module before pending blocks wrote it: the entries less their pending blocks
        // too (the last four bytes of each), read with none.
        let mut old = unpaced;
        old.entries.iter_mut().for_each(|e| e.pending_blocks = 0);
        bytes[0] = VERSION_WITHOUT_PENDING;
        let head = head - 24;
        let entry_len = (bytes.len() - head) / 2;
        for i in (0..2).rev() {
            let end = head + (i + 1) * entry_len;
            bytes.drain(end - 4..end);
        }
        assert_eq!(PodRecord::decode(&bytes).unwrap().entries, old.entries);
        assert!(back.snapshot.unwrap().kv_usage.is_nan());
        assert!(back.snapshot.unwrap().no_prefix_caching);
        assert_eq!(PodRecord::decode(b""), None);
        assert_eq!(
            PodRecord::decode(&[VERSION, 0, 0, 0, 0, 0, 255, 255, 255, 255]),
            None
        );
    }

    #[test]
    fn a_record_from_before_contexts_reads_its_prompt_as_the_context() {
        let mut w = Writer::new();
        w.u8(VERSION_WITHOUT_CONTEXT).u8(0).u32(0).u32(1);
        w.u64(7).u64(1_000).u64(1).u64(100).u32(12).u32(3);
        let rec = PodRecord::decode(&w.0).unwrap();
        assert_eq!(
            rec.entries,
            vec![RequestEntry {
                output_blocks: 3,
                ..entry(7, 12)
            }]
        );
        assert_eq!(rec.read_blocks(), 15);
    }

    /// A host whose pod `p` holds `entries`, and a VM on it.
    fn pod_with(entries: &[RequestEntry]) -> (FakeHost, FakeVm) {
        let host = FakeHost::new();
        let vm = host.vm();
        ensure(&vm, "p").unwrap();
        modify(&vm, "p", |r| {
            r.entries.extend_from_slice(entries);
            Some(())
        })
        .unwrap();
        (host, vm)
    }

    /// Request `id`: `new` prompt blocks of its own (10 tokens each) after `shared` it leans on
    /// `on` for (10 tokens each at its rate).
    fn leaning(id: u64, new: u32, shared: u32, on: u64) -> RequestEntry {
        RequestEntry {
            held_tokens: 10 * u64::from(new),
            prompt_blocks: new,
            context_blocks: new + shared,
            leans_on: on,
            shared_blocks: shared,
            shared_tokens: 10 * u64::from(shared),
            ..entry(id, 0)
        }
    }

    /// (held tokens, prompt blocks counted) of the pod's record.
    fn counted(vm: &FakeVm) -> (u64, u64) {
        let rec = read(vm, "p").unwrap();
        let blocks = rec.entries.iter().map(|e| u64::from(e.prompt_blocks)).sum();
        (rec.held_tokens(), blocks)
    }

    /// (leans on, shared blocks, prompt blocks) of request `id`'s entry.
    fn leaning_of(vm: &FakeVm, id: u64) -> (u64, u32, u32) {
        let rec = read(vm, "p").unwrap();
        let e = rec.entries.iter().find(|e| e.id == id).unwrap();
        (e.leans_on, e.shared_blocks, e.prompt_blocks)
    }

    #[test]
    fn finish_is_exactly_once_and_hands_shared_blocks_on() {
        // 1 holds a 10-block prefix and 4 blocks of question; 2 and 3 lean on it for 8 and all
        // 10 of those blocks (a shorter and a longer common prefix), with 2 blocks of their own.
        let (_host, vm) = pod_with(&[
            leaning(1, 14, 0, 0),
            leaning(2, 2, 8, 1),
            leaning(3, 2, 10, 1),
        ]);
        assert_eq!(counted(&vm), (180, 18));
        let gone = finish(&vm, "p", 1).unwrap();
        assert_eq!(gone.map(|e| e.id), Some(1));
        assert_eq!(finish(&vm, "p", 1).unwrap(), None);
        assert_eq!(
            counted(&vm),
            (140, 14),
            "the prefix stays counted with the request sharing most of it, once"
        );
        assert_eq!(read(&vm, "p").unwrap().finished_since_scrape, 1);
        assert_eq!(leaning_of(&vm, 3), (0, 0, 12));
        assert_eq!(leaning_of(&vm, 2), (3, 8, 2));
        finish(&vm, "p", 3).unwrap();
        assert_eq!(counted(&vm), (100, 10), "and then with the last one");
        finish(&vm, "p", 2).unwrap();
        assert_eq!(counted(&vm), (0, 0));
    }

    #[test]
    fn a_prefix_counted_along_a_chain_of_requests_stays_counted_whichever_ends_first() {
        // 1 holds blocks 0..10; 2 leans on it for those and holds 10..20 (a conversation's next
        // turn); 3 leans on 2 for all 20 (the turn after).
        let (_host, vm) = pod_with(&[
            leaning(1, 10, 0, 0),
            leaning(2, 10, 10, 1),
            leaning(3, 3, 20, 2),
        ]);
        assert_eq!(counted(&vm), (230, 23));
        finish(&vm, "p", 2).unwrap();
        assert_eq!(
            leaning_of(&vm, 3),
            (1, 10, 13),
            "3 counts what 2 counted and leans on what 2 leaned on"
        );
        assert_eq!(counted(&vm), (230, 23));
        finish(&vm, "p", 1).unwrap();
        assert_eq!(counted(&vm), (230, 23));
        finish(&vm, "p", 3).unwrap();
        assert_eq!(counted(&vm), (0, 0));
    }

    #[test]
    fn a_prefix_whose_holder_expired_is_counted_by_a_request_leaning_on_it() {
        let (host, vm) = pod_with(&[
            RequestEntry {
                expires_ms: 500,
                ..leaning(1, 12, 0, 0)
            },
            leaning(2, 2, 10, 1),
            leaning(3, 2, 8, 1),
        ]);
        host.set_now_ms(600);
        assert_eq!(counted(&vm), (140, 14), "read so before the next write");
        modify(&vm, "p", |_| Some(())).unwrap();
        assert_eq!(leaning_of(&vm, 2), (0, 0, 12), "2 stands alone");
        assert_eq!(leaning_of(&vm, 3).0, 2);
        assert_eq!(counted(&vm), (140, 14));
        finish(&vm, "p", 2).unwrap();
        finish(&vm, "p", 3).unwrap();
        assert_eq!(counted(&vm), (0, 0));
    }

    #[test]
    fn requests_sent_just_before_a_scrape_are_not_a_queue() {
        let sent = |id, at| RequestEntry {
            dispatched_ms: at,
            expires_ms: 10_000,
            ..entry(id, 1)
        };
        let (host, vm) = pod_with(&[sent(1, 100), sent(2, 800), sent(3, 900)]);
        let scraped = |waiting| Snapshot {
            at_ms: 1_000,
            healthy: true,
            waiting,
            ..Snapshot::default()
        };
        host.set_now_ms(1_000);
        write_snapshot(&vm, "p", scraped(3.0), 250, &Config::default()).unwrap();
        let waiting = |vm| read(vm, "p").unwrap().snapshot.unwrap().waiting;
        assert_eq!(waiting(&vm), 1.0, "two were sent within 250 ms: one queued");
        write_snapshot(&vm, "p", scraped(1.0), 250, &Config::default()).unwrap();
        assert_eq!(waiting(&vm), 0.0, "never below zero");
        write_snapshot(&vm, "p", scraped(3.0), 0, &Config::default()).unwrap();
        assert_eq!(waiting(&vm), 3.0, "no grace: the engine's count");
    }

    /// Pods of a pool serve the same traffic: the relief that let one run out is capped on
    /// all of them at once, not learned by each preempting in turn; and regained with time.
    #[test]
    fn a_preemption_on_one_pod_caps_every_pods_relief() {
        let (host, vm) = pod_with(&[]);
        let scraped = |at_ms, preemptions| Snapshot {
            at_ms,
            healthy: true,
            preemptions,
            kv_usage: 0.5,
            capacity_tokens: 4096,
            block_size: 16,
            ..Snapshot::default()
        };
        for pod in ["a", "b"] {
            modify(&vm, pod, |rec| {
                rec.snapshot = Some(Snapshot {
                    relief: 0.3,
                    ..scraped(0, 0.0)
                });
                Some(())
            })
            .unwrap();
        }
        host.set_now_ms(1_000);
        let cfg = Config::default();
        write_snapshot(&vm, "a", scraped(1_000, 1.0), 0, &cfg).unwrap();
        let a = read(&vm, "a").unwrap().snapshot.unwrap();
        assert!(a.relief_lost > 0.0 && a.relief == 0.0, "{a:?}");
        write_snapshot(&vm, "b", scraped(1_000, 0.0), 0, &cfg).unwrap();
        let b = read(&vm, "b").unwrap().snapshot.unwrap();
        // Capped as `a` is, less the step a clean scrape regains.
        assert!(
            b.relief_lost > a.relief_lost - 0.01,
            "b never preempted: {b:?}"
        );
        assert!(b.relief <= 0.3 - b.relief_lost + 1e-9, "{b:?}");
        // Regained as each pod's own is: a step every fifty scrape intervals.
        let interval = cfg.metrics.interval_ms;
        let lost = |now| crate::admission::feedback::pool_lost(&vm, now, interval);
        assert_eq!(lost(1_000), a.relief_lost);
        assert!(lost(1_000 + 10 * interval) < a.relief_lost);
        assert_eq!(lost(1_000 + 1_000 * interval), 0.0);
    }

    #[test]
    fn a_pod_that_leaves_keeps_its_in_flight_entries_until_they_end() {
        let (_host, vm) = pod_with(&[entry(1, 10)]);
        write_snapshot(&vm, "p", Snapshot::default(), 0, &Config::default()).unwrap();
        depart(&vm, "p", 5).unwrap();
        let rec = read(&vm, "p").unwrap();
        let left = rec.snapshot.unwrap();
        assert_eq!(
            (left.healthy, left.capacity_tokens, left.at_ms),
            (false, 0, 5),
            "what was scraped is forgotten, and the pod is down"
        );
        assert!(rec.is_down());
        assert_eq!(
            rec.held_tokens(),
            100,
            "a blind blank erased this: the pod, back in the cluster, was filled on top of it"
        );
        assert!(finish(&vm, "p", 1).unwrap().is_some());
    }

    #[test]
    fn a_scrape_that_does_not_say_how_large_the_pod_is_keeps_the_last_size() {
        let (_host, vm) = pod_with(&[]);
        let sized = Snapshot {
            healthy: true,
            capacity_tokens: 4096,
            block_size: 16,
            ..Snapshot::default()
        };
        write_snapshot(&vm, "p", sized, 0, &Config::default()).unwrap();
        // A partial page, and then a pod marked down: neither may lift the budget.
        for s in [
            Snapshot {
                healthy: true,
                ..Snapshot::default()
            },
            Snapshot::default(),
        ] {
            write_snapshot(&vm, "p", s, 0, &Config::default()).unwrap();
            let kept = read(&vm, "p").unwrap().snapshot.unwrap();
            assert_eq!((kept.capacity_tokens, kept.block_size), (4096, 16));
        }
    }

    #[test]
    fn expired_entries_vanish_on_the_next_write() {
        let (host, vm) = pod_with(&[entry(1, 10)]);
        host.set_now_ms(1_000);
        assert_eq!(
            read(&vm, "p").unwrap().held_tokens(),
            0,
            "not counted once expired"
        );
        assert_eq!(finish(&vm, "p", 1).unwrap(), None);
        write_snapshot(&vm, "p", Snapshot::default(), 250, &Config::default()).unwrap();
        assert_eq!(read(&vm, "p").unwrap().held_tokens(), 0);
    }

    /// An entry changed where it lies: only it, only while it lives, through a compare-and-swap;
    /// a record of an earlier version through `modify`.
    #[test]
    fn an_entry_is_changed_in_place() {
        let (host, vm) = pod_with(&[entry(1, 10), entry(2, 20), entry(3, 30)]);
        modify(&vm, "p", |rec| {
            rec.snapshot = Some(Snapshot {
                capacity_tokens: 4096,
                ..Snapshot::default()
            });
            rec.entries[0].expires_ms = 500;
            Some(())
        })
        .unwrap();
        let before = PodRecord::decode(&vm.get(&key("p")).unwrap().value.unwrap()).unwrap();
        host.set_now_ms(600);
        let grow = |e: &mut RequestEntry| {
            e.held_tokens += 16;
            e.output_blocks += 1;
        };
        assert!(modify_entry(&vm, "p", 2, grow).unwrap());
        let after = PodRecord::decode(&vm.get(&key("p")).unwrap().value.unwrap()).unwrap();
        let mut expect = before.clone();
        grow(&mut expect.entries[1]);
        assert_eq!(
            after, expect,
            "the one entry changed; the expired one not dropped"
        );
        assert_eq!(
            read(&vm, "p").unwrap().entries.len(),
            2,
            "reads leave it out"
        );
        assert!(
            !modify_entry(&vm, "p", 1, grow).unwrap(),
            "expired: not renewed"
        );
        assert!(!modify_entry(&vm, "p", 9, grow).unwrap(), "absent");
        assert!(!modify_entry(&vm, "q", 1, grow).unwrap(), "no record");
        // An earlier version's record.
        let mut bytes = without_index_check(&after.encode());
        bytes[0] = VERSION_WITHOUT_LEANING;
        for i in (0..3).rev() {
            let end = 2 + UNSEATED_BYTES - CHECK_BYTES + 8 + (i + 1) * (ENTRY_BYTES - 4);
            bytes.drain(end - 20..end);
        }
        vm.set(&key("p"), &bytes, None).unwrap();
        assert!(modify_entry(&vm, "p", 3, grow).unwrap());
        let read_back = read(&vm, "p").unwrap();
        assert_eq!(read_back.entries.len(), 2);
        assert_eq!(read_back.entries[1].held_tokens, 116);
        assert_eq!(
            entries_start(&read_back.encode()),
            Some(2 + SNAPSHOT_BYTES + 8 + TALLY_BYTES)
        );
        assert_eq!(entries_start(&bytes), None);
    }
}
