//! The steps of a pick before its reservation (`Router::route` runs them in order): which pods
//! may take the request (`eligible`: serving its model, up, fresh enough), what the cost formula
//! knows of each (`candidates`, its pace among them included), what the request would hold on
//! each (`charges`), where its model and LoRA adapter stand (`serves`, `adapter_fits`), and
//! whether the pool's KV is about to run short (`kv_short`).
//! Everything here reads: the records as `route` read them, this VM's replicas (prefix index,
//! adapters) and the model lists.

use super::Router;
use crate::admission::forecast::Load;
use crate::admission::line;
use crate::config::{Config, RoutingConfig, StalePolicy};
use crate::estimate::reservation::Estimate;
use crate::models::served::{adapter_id, Served, ServedModel};
use crate::pods::pace;
use crate::pods::record::PodRecord;
use crate::routing::adapters::Fit;
use crate::routing::demand::{pool_key, Reading};
use crate::routing::pick::{copy_weight, prefer, rendezvous_score, Candidate, Scored};
use crate::routing::pod_id::PodId;
use crate::routing::prefix_index::PrefixIndex;
use crate::routing::record_copies::RecordCopies;
use crate::store::interface::Store;
use std::rc::Rc;

/// One pick in progress, as the router's steps need it: the pods' records as read for it, and
/// what the request asks of a pod.
pub(super) struct Ask<'a> {
    pub(super) records: &'a [Rc<PodRecord>],
    pub(super) hashes: &'a [u64],
    /// Its whole prompt, in blocks.
    pub(super) prompt_blocks: usize,
    /// Its expected output, in blocks.
    pub(super) output_blocks: u64,
    pub(super) block_tokens: u64,
    pub(super) now: u64,
    /// The prompt's leading blocks in-flight requests hold on some pod (a hot prefix), and the
    /// share of their prefill a request copying them to another pod pays (`pick::copy_weight`).
    pub(super) hot_blocks: usize,
    pub(super) copy_weight: f64,
    /// The candidates as the demand reads them (`Router::pool`), read once for the pick's sample
    /// and its `kv_short`.
    pub(super) pool: Reading,
}

impl Ask<'_> {
    /// What a pod records of the prompt: nothing where its engine caches no prefixes, so it is
    /// given no prefix credit and its sequences share no blocks.
    pub(super) fn recorded(&self, rec: &PodRecord) -> &[u64] {
        if caches_nothing(rec) {
            &[]
        } else {
            self.hashes
        }
    }
}

fn caches_nothing(rec: &PodRecord) -> bool {
    rec.snapshot.is_some_and(|s| s.no_prefix_caching)
}

/// Whether the pod is believed to cache at least half of the prompt's blocks.
pub(super) fn mostly_cached(c: &Candidate, prompt_blocks: usize) -> bool {
    c.cached_blocks * 2 >= prompt_blocks
}

/// What the request holds on each candidate (`indices` into `ask.records`; `shared`: its
/// leading blocks already held there by in-flight requests), and what it holds there when it
/// shares nothing. A candidate's engine holds one copy of the prompt per answer where it caches
/// no prefixes (vLLM shares a prompt among a request's answers only through its prefix cache),
/// else one.
pub(super) fn charges(
    est: &Estimate,
    indices: &[usize],
    shared: &[usize],
    ask: &Ask,
    safety: f64,
) -> (Vec<Load>, Vec<Load>) {
    let bt = ask.block_tokens as f64;
    // Until calibration has measured the model, its prompts carry the rule's shared bias.
    let safety = safety * est.prompt_margin;
    // A prefix already held by in-flight requests on a pod occupies its KV once: a request
    // holds only what it adds there (kthena PR 928's review objection to per-request token
    // budgets). Blocks are cut by characters, so a held block stands for this prompt's own
    // tokens per block, never more than a block's worth: text denser than
    // `charsPerBlockToken` then does not make the held prefix swallow the rest of the prompt.
    let tokens_per_block = if ask.hashes.is_empty() {
        bt
    } else {
        (est.prompt_tokens as f64 / ask.hashes.len() as f64).min(bt)
    };
    // Computed once: its outlook is the same on every pod.
    let fresh = Load::fresh(est, 0, 0);
    let load = |b: usize, copies: u64, caches: bool| {
        let whole = est.held_prompt_tokens(ask.block_tokens, caches) * safety * copies as f64;
        // The engine shares whole blocks of tokens: the block in which the held prefix ends
        // holds this request's own text after it, so it is this request's (counted as shared,
        // up to a block per request went uncounted, and a burst of a few hundred requests of
        // ten prefixes ran its pods a few hundred tokens past the records).
        let shared = (b as f64 * tokens_per_block / bt).floor() * bt;
        let held = (whole - shared * safety).max(0.0);
        // The estimate's spread, in proportion to the part of the prompt it holds.
        let share = if whole > 0.0 { held / whole } else { 0.0 };
        // (Set field by field: `Load { held, sigma, ..fresh }` captures `fresh` field by field,
        // which rustc 1.95 fails to compile here, an internal compiler error on the outlook's array.)
        let mut load = fresh;
        load.held = held.round() as u64;
        load.sigma = (est.prompt_sigma as f64 * copies as f64 * share).round() as u64;
        load
    };
    let caches = |i: usize| !ask.records.get(i).is_some_and(|r| caches_nothing(r));
    let copies = |i: usize| {
        if caches(i) {
            1
        } else {
            est.answers_per_prompt()
        }
    };
    let sharing = indices
        .iter()
        .zip(shared)
        .map(|(&i, &b)| load(b, copies(i), caches(i)));
    let alone = indices.iter().map(|&i| load(0, copies(i), caches(i)));
    (sharing.collect(), alone.collect())
}

/// What the cost formula (`pick`) knows of each eligible pod (`indices` into `pods`) for
/// this request, `loads` what it would hold on each (`charges`). The wait for each engine's step
/// is left at 0, for the pick to work out where it counts (`Router::step_waits`).
pub(super) fn candidates<'a>(
    (pods, ids): (&'a [String], &[PodId]),
    prefix: &PrefixIndex,
    cfg: &Config,
    indices: &[usize],
    loads: &[Load],
    adapter_fit: &[Option<Fit>],
    ask: &Ask,
) -> Vec<Candidate<'a>> {
    let r = &cfg.routing;
    let now = ask.now;
    // Paces are compared among the candidates, the pods that could serve this model: another
    // model's pods decode at another pace, which says nothing of these ones' speed.
    let factors = if r.learn_decode_cost {
        let paces: Vec<pace::Pace> = indices.iter().map(|&i| ask.records[i].pace()).collect();
        pace::cost_factors(&paces, now, cfg.metrics.interval_ms)
    } else {
        vec![1.0; indices.len()]
    };
    indices
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            let (pod, id, rec) = (&pods[i], ids[i], &ask.records[i]);
            let known = rec.snapshot.filter(|_| rec.is_fresh(now, &cfg.metrics));
            let capacity_blocks = rec.capacity_blocks(ask.block_tokens, r.pod_capacity_blocks);
            let cached_blocks = prefix.matched(id, ask.recorded(rec), now);
            Candidate {
                pod,
                cached_blocks,
                copied_blocks: ask.hot_blocks.saturating_sub(cached_blocks),
                copy_weight: ask.copy_weight,
                pending_blocks: rec.pending_blocks(),
                active_blocks: rec.active_blocks(ask.block_tokens),
                read_blocks: rec.read_blocks(),
                added_blocks: loads[k].held.div_ceil(ask.block_tokens.max(1)) + ask.output_blocks,
                waiting: known.map_or(0.0, |s| {
                    (s.waiting - f64::from(rec.finished_since_scrape)).max(0.0)
                }),
                kv_usage: known.map_or(0.0, |s| {
                    if s.kv_usage.is_finite() {
                        s.kv_usage
                    } else {
                        0.0
                    }
                }),
                capacity_blocks,
                adapter_cost: adapter_fit[k].map_or(0.0, |f| f.cost(&cfg.models)),
                // A pod that caches nothing comes last among equals: new prompts go
                // where their next requests can hit.
                cached_total: if caches_nothing(rec) {
                    usize::MAX
                } else {
                    prefix.blocks_held(id)
                },
                cost_factor: factors[k],
                step_wait_us: 0,
            }
        })
        .collect()
}

/// The steps of a pick before the reservation: which pods, and what each looks like.
impl Router {
    /// The prompt's hot prefix: its leading blocks that in-flight requests hold on some eligible
    /// pod (`shared`: per candidate), and the share of their prefill a copy costs one request,
    /// from how many requests in flight hold them (`pick::copy_weight`).
    pub(super) fn hot_prefix(
        &self,
        indices: &[usize],
        shared: &[usize],
        hashes: &[u64],
    ) -> (usize, f64) {
        let hot = shared.iter().copied().max().unwrap_or(0);
        let Some(prefix) = hashes.get(..hot).filter(|p| !p.is_empty()) else {
            return (0, 1.0);
        };
        let holders: u32 = indices
            .iter()
            .map(|&i| self.active.holders(self.pod_ids[i], prefix))
            .sum();
        (hot, copy_weight(holders, indices.len()))
    }

    /// The pool of these candidates as the demand reads it (`routing::demand`): which pods, and
    /// the dispatches to them this VM has seen.
    pub(super) fn pool(&self, indices: &[usize]) -> Reading {
        // Every pod (a gateway of one model): the total, without a lookup per pod.
        let dispatched = if indices.len() == self.pods.len() {
            self.active.dispatched_in_all()
        } else {
            let pods = indices.iter().map(|&i| self.pod_ids[i]);
            pods.map(|pod| self.active.dispatched(pod)).sum()
        };
        Reading {
            key: pool_key(indices, self.pods.len()),
            dispatched,
        }
    }

    /// Whether the pool's KV is about to run short (`routing::demand`) for requests like this one,
    /// `blocks_each` the blocks it would add: the rate of dispatches to the candidates, against
    /// their budgets (`budgets`, tokens), with their pace where scraped. Asked only for a hot
    /// prefix's pick.
    pub(super) fn kv_short(
        &self,
        ask: &Ask,
        indices: &[usize],
        budgets: &[Option<u64>],
        est: &Estimate,
        blocks_each: u64,
    ) -> bool {
        let Some(pool) = budgets.iter().copied().sum::<Option<u64>>() else {
            return false;
        };
        let (mut sum, mut n) = (0.0, 0u32);
        for itl in indices
            .iter()
            .filter_map(|&i| ask.records[i].snapshot.map(|s| s.itl_s))
            .filter(|&itl| itl > 0.0)
        {
            sum += itl;
            n += 1;
        }
        let token_ms = (n > 0).then(|| 1_000.0 * sum / f64::from(n));
        let output = (est.output_tokens, token_ms);
        let budget_blocks = pool / ask.block_tokens.max(1);
        let pods = indices.iter().map(|&i| self.pods[i].as_str());
        self.demand.short(
            ask.now,
            (ask.pool, pods),
            output,
            blocks_each,
            budget_blocks,
        )
    }

    /// For a prompt the best pod mostly caches (the caller checks), among the pods loaded alike that mostly cache it
    /// too, the one whose engine step ends first goes first (`routing::step_phase`). Alike:
    /// within what one more sequence like this request costs a pod (its context read at every
    /// decode step and its blocks held) of the best cost. Such a prompt's own prefill is short,
    /// so the wait for the step under way is much of its first token's time; and a step dominated
    /// by its fixed cost changes little with one sequence more (on a hot prefix's pods, round
    /// robin's even split gave a lower TTFT than kvgate's balance by blocks read). A prompt
    /// mostly still to compute is left to the cost: a new conversation's next turns come back
    /// where its first lands, and placed by phase its pods filled unevenly and more follow-ups
    /// had to leave them (multi-turn: 94.9–97.5 % on the previous turn's pod against 98.9 %), as
    /// they did, less often, when a pod that would compute a follow-up's history again was as
    /// cheap as its busier home (97.6–98 %). The band is one sequence wide, so affinity (a
    /// prefix's prefill) and balance beyond that keep their order.
    pub(super) fn soonest_step(
        r: &RoutingConfig,
        ranked: &mut Vec<Scored>,
        candidates: &[Candidate],
        prompt_blocks: usize,
        own_blocks: u64,
    ) {
        let alike = (r.decode_weight + r.active_weight) * own_blocks as f64;
        // Only pods that mostly cache it too: one that would compute the prompt again, at a
        // cost close to the best only because the best is busier, keeps its place behind.
        prefer(ranked, alike, |s| {
            let c = &candidates[s.index];
            mostly_cached(c, prompt_blocks).then_some(std::cmp::Reverse(c.step_wait_us))
        });
    }

    /// Where a prompt goes among pods within half its prefill of the best (about what its
    /// group's next request saves by finding the prefix there), for affinity beyond the cache
    /// (`home_key`). Under cache pressure a group evicted everywhere otherwise went to whichever
    /// pod was least loaded, so over time every pod computed every group and evicted the others'
    /// (a working set 1.5× the pool's KV: each group on 5.5 pods of 8, 29 % of prompt tokens hit,
    /// against 43–45 % for routers that keep a group on one pod).
    pub(super) fn send_home(
        &self,
        cfg: &Config,
        ranked: &mut Vec<Scored>,
        candidates: &[Candidate],
        ask: &Ask,
    ) {
        let Some(home) = Home::of(cfg, candidates, ask) else {
            return;
        };
        let tolerance = cfg.routing.prefill_weight * ask.prompt_blocks as f64 / 2.0;
        prefer(ranked, tolerance, |s| {
            self.home_key(home, candidates[s.index].pod, ask.now)
        });
    }

    /// The candidate a prompt's group is at home on (the highest `home_key`), when it has one.
    pub(super) fn home(&self, cfg: &Config, candidates: &[Candidate], ask: &Ask) -> Option<usize> {
        let home = Home::of(cfg, candidates, ask)?;
        (0..candidates.len())
            .filter_map(|k| Some((self.home_key(home, candidates[k].pod, ask.now)?, k)))
            .max_by_key(|&(key, _)| key)
            .map(|(_, k)| k)
    }

    /// Whether one of `pods` is a home of the group whose prompts start with `first`, by the
    /// fleet's rule alone (whatever the pods cache): the rendezvous choice among every pod with
    /// several replicas (worked out once, not per pod asked about), any pod the group was sent
    /// to with one. The line's cheap look (`Router::belongs_on`); the pick decides.
    pub(super) fn home_among(&self, cfg: &Config, pods: &[String], first: u64, now: u64) -> bool {
        let home = Home::rule(cfg, first);
        match home {
            Home::Rendezvous(_) => self
                .pods
                .iter()
                .max_by_key(|p| self.home_key(home, p, now))
                .is_some_and(|h| pods.contains(h)),
            Home::LastSent(_) => pods.iter().any(|p| self.home_key(home, p, now).is_some()),
        }
    }

    /// How much at home the prompt's group is on `pod` (higher first), `None` where not at all.
    fn home_key(&self, home: Home, pod: &str, now: u64) -> Option<u64> {
        match home {
            Home::Rendezvous(first) => Some(rendezvous_score(first, pod)),
            Home::LastSent(first) => self.prefix.sent_home(PodId::of(pod), first, now),
        }
    }

    /// The pods a request may go to: those serving its model, less pods down and (with
    /// `metrics.stalePolicy` saturated, while others are fresh) pods whose figures are stale. When
    /// none is left, every pod serving the model (stale ones, and down ones that list it): better
    /// tried than refused, and Envoy's retries do the rest. A down pod that lists nothing serves
    /// nothing, so with every pod down and no lists there is none, and Envoy's own balancing
    /// decides (`Placement::NoPods`).
    pub(super) fn eligible(
        &mut self,
        cfg: &Config,
        model: &str,
        records: &[Rc<PodRecord>],
        now: u64,
    ) -> Vec<usize> {
        let serving = self.served.serving(model, |i| !records[i].is_down());
        let fresh = |rec: &PodRecord| rec.is_fresh(now, &cfg.metrics);
        let any_fresh = records.iter().any(|rec| fresh(rec));
        let eligible = |rec: &PodRecord| match rec.snapshot {
            _ if rec.is_down() => false,
            Some(_) if !fresh(rec) => cfg.metrics.stale_policy == StalePolicy::Ignore || !any_fresh,
            _ => true,
        };
        let indices: Vec<usize> = (0..self.pods.len())
            .filter(|&i| serving[i] && eligible(&records[i]))
            .collect();
        if indices.is_empty() {
            (0..self.pods.len()).filter(|&i| serving[i]).collect()
        } else {
            indices
        }
    }
}

/// Whether `pod` is not marked down, as this VM's copy of its record says (the pick reads the
/// same copies); a record that cannot be read is no reason to think it down.
fn up(copies: &mut RecordCopies, store: &dyn Store, pod: (PodId, &str), now: u64) -> bool {
    copies
        .get(store, pod, now, false)
        .map_or(true, |(r, _)| !r.is_down())
}

/// The model step of a pick: which pods serve the request's model (`models::served`), and where
/// its LoRA adapter stands on each (`routing::adapters`).
impl Router {
    /// Whether some pod may serve `model` (false only once every pod's model list is known and
    /// none lists it). With no pods known, Envoy's own balancing decides: true.
    pub fn serves(&mut self, store: &dyn Store, cfg: &Config, model: &str) -> bool {
        let now = self.refresh_lists(store, cfg);
        if self.pods.is_empty() {
            return true;
        }
        // Health is read only for pods without a list, and only when no list names the model;
        // from this VM's copies of the records, as the pick reads them.
        let (pods, ids, copies) = (&self.pods, &self.pod_ids, &mut self.copies);
        self.served
            .serving_any(model, |i| up(copies, store, (ids[i], &pods[i]), now))
    }

    /// Every model the pods' lists, as last read, name (in pod order; a name once per pod), for
    /// the gateway's own `GET /v1/models` (`models::listing`); `None` while no list is known.
    pub fn listed_models(&mut self, store: &dyn Store, cfg: &Config) -> Option<Vec<ServedModel>> {
        self.refresh_lists(store, cfg);
        let lists: Vec<&Served> = self
            .pods
            .iter()
            .filter_map(|p| self.served.get(p))
            .filter(|s| s.listed_ms.is_some())
            .collect();
        (!lists.is_empty()).then(|| {
            lists
                .iter()
                .flat_map(|s| s.models.iter().cloned())
                .collect()
        })
    }

    /// The model a request that names none is for. An engine serves its own then (vLLM and
    /// SGLang take a missing `model` as the one they were started with), so the pool's one base
    /// model, as the pods' lists name it: `Ok(None)` while no list is known (every pod is taken
    /// to serve every model), `Err` with the models when the lists name several (which pod
    /// would answer decides which model does).
    pub fn default_model(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
    ) -> Result<Option<String>, Vec<String>> {
        let mut listed = self.base_models(store, cfg);
        match listed.len() {
            0 => Ok(None),
            1 => Ok(listed.pop()),
            _ => Err(listed),
        }
    }

    /// The base models (not their adapters) the pods' lists name, sorted: what the status page
    /// and the per-model gauges report on.
    pub fn base_models(&mut self, store: &dyn Store, cfg: &Config) -> Vec<String> {
        self.refresh_lists(store, cfg);
        self.served
            .base_models()
            .into_iter()
            .map(str::to_string)
            .collect()
    }

    /// The pods a request for `model` may be sent to, as the line's reach (`line::pod_bits`):
    /// those whose model lists, as last read, name it, or, when none does, every pod without a
    /// list (down or not: the reach only says whom a waiting request competes with, and a pod
    /// may come back). `line::ANYWHERE` while no pod is known.
    pub fn reach(&mut self, store: &dyn Store, model: &str) -> u64 {
        let serving = self.serving(store, model);
        let reach = self
            .pod_bits
            .iter()
            .zip(serving)
            .filter(|(_, serves)| *serves)
            .fold(0, |reach, (bit, _)| reach | bit);
        if reach == 0 {
            line::ANYWHERE
        } else {
            reach
        }
    }

    /// The pods a request for `model` may be sent to, as `reach` counts them: those whose model
    /// lists name it, or, when none does, every pod without a list.
    pub fn serving_pods(&mut self, store: &dyn Store, model: &str) -> Vec<String> {
        let serving = self.serving(store, model);
        self.pods
            .iter()
            .zip(serving)
            .filter(|(_, serves)| *serves)
            .map(|(pod, _)| pod.clone())
            .collect()
    }

    /// Whether the pods' model lists, as last read, differ: where a request goes then decides
    /// whether its model is served (`flow::other_path`).
    pub fn models_differ(&mut self, store: &dyn Store, cfg: &Config) -> bool {
        self.refresh_lists(store, cfg);
        self.served.differ()
    }

    /// The pods whose model lists, as last read, name `model`, those not marked down (all of
    /// them when every one is); none when no list names it: where a request kvgate reads for its
    /// model alone may go (`flow::other_path`).
    pub fn listing_pods(&mut self, store: &dyn Store, cfg: &Config, model: &str) -> Vec<String> {
        let now = self.refresh_lists(store, cfg);
        if !self.served.lists(model) {
            return Vec::new();
        }
        let serving = self.served.serving(model, |_| true);
        let listing: Vec<usize> = (0..self.pods.len()).filter(|&i| serving[i]).collect();
        let (pods, ids, copies) = (&self.pods, &self.pod_ids, &mut self.copies);
        let not_down: Vec<usize> = listing
            .iter()
            .copied()
            .filter(|&i| up(copies, store, (ids[i], &pods[i]), now))
            .collect();
        let chosen = if not_down.is_empty() {
            listing
        } else {
            not_down
        };
        chosen.into_iter().map(|i| pods[i].clone()).collect()
    }

    /// The pod set and their model lists brought up to date, for a question asked outside a
    /// pick; the time they were read at.
    fn refresh_lists(&mut self, store: &dyn Store, cfg: &Config) -> u64 {
        let now = store.now_ms();
        self.refresh_pods(store, cfg, now);
        self.served.refresh(store, now);
        now
    }

    /// Per pod (as `pods` orders them), whether a request for `model` may be sent there.
    fn serving(&mut self, store: &dyn Store, model: &str) -> Vec<bool> {
        self.served.refresh(store, store.now_ms());
        self.served.serving(model, |_| true)
    }

    /// Whether a pod's model list, as last read, names `model`.
    pub fn lists(&mut self, model: &str) -> bool {
        self.served.lists(model)
    }

    /// The base model of `model` when a pod's list, as last read, names it as a LoRA adapter.
    pub fn base_of(&mut self, model: &str) -> Option<&str> {
        self.served.base_of(model)
    }

    /// Per candidate (`indices` into the pods), where the adapter stands, or `None` where
    /// `model` is a base model.
    pub(super) fn adapter_fits(
        &mut self,
        indices: &[usize],
        model: &str,
        records: &[Rc<PodRecord>],
        now: u64,
        cfg: &Config,
    ) -> Vec<Option<Fit>> {
        let id = adapter_id(model);
        let on = self.served.adapter_on(model);
        indices
            .iter()
            .map(|&i| {
                let pod = self.pod_ids[i];
                let served = on.get(i).copied().flatten()?;
                // Adapter state scraped with metrics that are no longer fresh says nothing.
                let lora = served.lora.as_ref().filter(|l| {
                    records[i].is_fresh(now, &cfg.metrics)
                        && now.saturating_sub(l.at_ms) <= cfg.metrics.stale_after_ms
                });
                Some(self.adapters.fit(pod, id, lora))
            })
            .collect()
    }
}

/// Where a prompt's group belongs beyond what the pods cache, named by its first block:
/// - with several replicas, a prompt no pod caches goes where every replica would send it
///   (`pick::rendezvous_score`), without their talking;
/// - with one, the pod its group was last sent to (`PrefixIndex::sent_home`). Not while
///   in-flight requests hold the prompt's first blocks (a hot prefix: its copies are priced by
///   `pick::copy_weight`, and the pod last sent it is no home), nor when every pod caches the
///   first block (a prefix all share, not a group). A prompt's head may outlive the rest of it
///   in a pod's index (as in the engine), so some pods matching a little does not stop it.
#[derive(Debug, Clone, Copy)]
enum Home {
    Rendezvous(u64),
    LastSent(u64),
}

impl Home {
    /// The fleet's rule for the group named by `first`.
    fn rule(cfg: &Config, first: u64) -> Home {
        if cfg.etcd.enabled() {
            Home::Rendezvous(first)
        } else {
            Home::LastSent(first)
        }
    }

    /// The rule, for a prompt it applies to among these candidates.
    fn of(cfg: &Config, candidates: &[Candidate], ask: &Ask) -> Option<Home> {
        let home = Home::rule(cfg, *ask.hashes.first()?);
        match home {
            Home::Rendezvous(_) => candidates.iter().all(|c| c.cached_blocks == 0),
            Home::LastSent(_) => {
                ask.hot_blocks == 0 && candidates.iter().any(|c| c.cached_blocks == 0)
            }
        }
        .then_some(home)
    }
}
