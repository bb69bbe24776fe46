//! The one sync a replica runs against etcd, on the tick of its elected worker (the scrape lease
//! holder, `store::lease`), every `syncIntervalMs`, or `busySyncIntervalMs` while credit or
//! stored responses must move between replicas (`Sync::due`): keep the replica's lease alive,
//! read every key under the prefix in one range, work out each pod's next grant (`split`), write
//! them in at most one txn (with the replica's placements and stored responses, `placements`),
//! copy the outcome into the pods' shares (`share`) that admission reads, and now and then
//! compact etcd's history (`note_history`). Requests never wait for any of it.
//!
//! Keys under `etcd.keyPrefix` (the source of truth for every replica's grants):
//! - `<prefix>/alive/<replica>`: under the replica's lease; gone when the lease lapses.
//! - `<prefix>/pod/<ip:port>/grant/<replica>`: its grant, demand and the KV its requests hold there
//!   (JSON), with no lease, so a lapsed replica's grant outlives its lease: it may still be
//!   admitting, cut off from etcd. Another replica deletes it once it has seen the lease gone for
//!   `reclaimGraceMs` (its own clock), in a txn that checks the replica did not come back, and
//!   keeps its credit out of the split until a scrape has read the engine since (`Ghost`).
//! - `<prefix>/pod/<ip:port>/guard`: written by every txn that grows a grant on the pod, and
//!   compared by the next: two replicas cannot hand out the same free credit.
//! - `<prefix>/placed/<replica>`: under the replica's lease, the prompts it sent the pods lately
//!   and the responses they stored (`placements`), for the others' prefix indexes and stored
//!   responses' follow-ups.
//!
//! The lease id and when it was last renewed live in shared data (`kvgate.replicas`), so a worker
//! taking the election over carries on with the same lease.

use crate::config::Config;
use crate::pods::record::At;
use crate::pods::scrape::{Call, Target};
use crate::replicas::gateway::{self, Compare, Kv, Op};
use crate::replicas::placements::{Batch, Inbox, Outbox};
use crate::replicas::share;
use crate::replicas::split::{self, Holder};
use crate::stats::{self, Stats};
use crate::store::codec::{Reader, Writer};
use crate::store::interface::{Store, StoreError};
use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

const LEASE_KEY: &str = "kvgate.replicas";
/// How early a tick may come and still run the sync due then. The tick's period divides the
/// sync's interval, and the wall clock, read in whole milliseconds, may have a tick a
/// millisecond early against Envoy's monotonic timer: that would put the sync off a whole tick.
const EARLY_MS: u64 = 5;
/// How long a pod's order between replicas for a request none of them holds more of (`rank`)
/// stands before it is drawn again.
const RANK_PERIOD_MS: u64 = 5_000;

/// What the sync needs to know of a pod, from this replica's records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    pub pod: String,
    /// The pod's budget as this replica's scrapes correct it (`admission::budget`); pods without
    /// one (unlimited, admission off) take no part.
    pub budget: Option<u64>,
    /// The forecast of this replica's reservations there: what its grant must cover. Read before
    /// etcd's answer came; the sync reads it again where it shrinks the grant (`plan_pod`).
    pub in_use: u64,
    /// The block size admission forecasts the pod's reservations in (`in_use`'s).
    pub block_tokens: u64,
    /// What it asks for: `in_use` and its share of the requests waiting in its line, each at
    /// what it needs of a pod (`line::Ticket::asks`).
    pub demand: u64,
    /// What the next request it would admit needs of a pod (the head of its line), 0 when none
    /// waits.
    pub unit: u64,
    /// The KV its requests hold there (`admission::feedback::explained`), for the other
    /// replicas' unexplained-KV feedback.
    pub explained: u64,
    /// When this replica's scrapes last read the engine's KV in use there (None: never, or the
    /// last scrape had no such figure): from then on its feedback counts a reclaimed replica's
    /// requests (`Ghost`).
    pub kv_read_ms: Option<u64>,
}

/// A grant's value in etcd.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
struct Published {
    grant: u64,
    #[serde(default)]
    in_use: u64,
    demand: u64,
    #[serde(default)]
    unit: u64,
    explained: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Grant,
    KeepAlive,
    Range,
    Txn,
    Compact,
}

/// A pod's outcome, applied to its share when the txn succeeds.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Planned {
    pod: String,
    grant: u64,
    /// What it may reserve there (`split::Next::cap`): at most `grant`.
    cap: u64,
    granted: u64,
}

/// What one range read found under the prefix, and when (this VM's clock).
struct RangeRead<'a> {
    at_ms: u64,
    /// Replicas whose alive key stands.
    alive: Vec<&'a str>,
    /// Pod → its guard key's revision.
    guards: HashMap<&'a str, i64>,
    /// Pod → (replica, its grant, the grant key's revision).
    grants: HashMap<&'a str, Vec<(&'a str, Published, i64)>>,
    /// Replica → what it placed lately (`placements`).
    placed: Vec<(&'a str, &'a [u8])>,
}

impl<'a> RangeRead<'a> {
    /// Sorts the keys of the range by what each says (keys of no known shape are passed over).
    fn parse(kvs: &'a [Kv], prefix: &str, at_ms: u64) -> RangeRead<'a> {
        let alive_prefix = alive_key(prefix, "");
        let placed_prefix = placed_key(prefix, "");
        let pod_prefix = format!("{prefix}/pod/");
        let mut read = RangeRead {
            at_ms,
            alive: Vec::new(),
            guards: HashMap::new(),
            grants: HashMap::new(),
            placed: Vec::new(),
        };
        for kv in kvs {
            if let Some(replica) = kv.key.strip_prefix(&alive_prefix) {
                read.alive.push(replica);
            } else if let Some(replica) = kv.key.strip_prefix(&placed_prefix) {
                read.placed.push((replica, &kv.value));
            } else if let Some(rest) = kv.key.strip_prefix(&pod_prefix) {
                if let Some(pod) = rest.strip_suffix("/guard") {
                    read.guards.insert(pod, kv.mod_revision);
                } else if let Some((pod, replica)) = rest.split_once("/grant/") {
                    let value = serde_json::from_slice(&kv.value).unwrap_or_default();
                    read.grants
                        .entry(pod)
                        .or_default()
                        .push((replica, value, kv.mod_revision));
                }
            }
        }
        read
    }
}

/// The txn a sync writes: the revisions it checks, its writes, and the lapsed replicas whose
/// grants it deletes.
#[derive(Default)]
struct Txn<'a> {
    compares: Vec<Compare>,
    ops: Vec<Op>,
    reclaimed: Vec<&'a str>,
}

fn alive_key(prefix: &str, replica: &str) -> String {
    format!("{prefix}/alive/{replica}")
}

fn grant_key(prefix: &str, pod: &str, replica: &str) -> String {
    format!("{prefix}/pod/{pod}/grant/{replica}")
}

fn placed_key(prefix: &str, replica: &str) -> String {
    format!("{prefix}/placed/{replica}")
}

fn guard_key(prefix: &str, pod: &str) -> String {
    format!("{prefix}/pod/{pod}/guard")
}

/// A replica seen without its alive key: since when (this VM's clock), and its grant on each pod
/// as last read.
struct Lapsed {
    since: u64,
    grants: HashMap<String, u64>,
}

/// The grant of a lapsed replica on a pod, deleted from etcd (reclaimed), which this replica
/// keeps out of the pod's split until its scrapes have read the engine's KV since `at_ms`.
///
/// Why: a replica whose lease lapsed may be alive, cut off from etcd, and its requests still hold
/// KV (up to its grant; it admits within its fallback meanwhile). Once its grant is deleted,
/// nothing in etcd counts them: handed out at once, its credit was admitted against by the
/// others before any scrape had shown the engine holding the lapsed replica's requests, and the
/// pod ran past its budget by up to that grant. From the first scrape after the deletion, those
/// requests are KV no live replica explains, taken off the budget by the feedback
/// (`admission::feedback`), so the ghost can go. A pod whose engine gives no KV figure keeps it
/// for as long as a request may live (`routing.requestTtlMs`).
struct Ghost {
    replica: String,
    pod: String,
    tokens: u64,
    at_ms: u64,
}

#[derive(Default)]
pub struct Sync {
    /// The call outstanding and its deadline: one at a time.
    waiting: Option<(Step, u64)>,
    /// When the last sync started (this VM's clock); `None`: one is due at the next tick.
    started_ms: Option<u64>,
    /// The last range read found a replica asking for more than its grant on some pod: credit
    /// must move, so every replica syncs at the busy pace until it has.
    contended: bool,
    /// Replicas seen holding grants without their alive key.
    lapsed: HashMap<String, Lapsed>,
    /// Grants of lapsed replicas deleted from etcd, still held out of the split (`Ghost`).
    ghosts: Vec<Ghost>,
    planned: Vec<Planned>,
    reclaiming: u64,
    /// This replica's placements and stored responses for the others, and theirs applied here.
    outbox: Outbox,
    /// The txn in flight writes the outbox's value.
    placing: bool,
    inbox: Inbox,
    /// What the others placed and stored, as the last range reads found it, for the gate
    /// (`take_received`).
    received: Batch,
    /// The last range read found another replica live.
    peers: bool,
    /// The last txn grew this replica's grant on a pod (`take_grew`).
    grew: bool,
    /// The last call failed: until a read succeeds, the slow pace (the busy one would retry an
    /// unreachable etcd many times as often).
    failing: bool,
    /// A revision read at some time (this VM's clock): etcd's history up to it is compacted once
    /// it is `compactionIntervalMs` old.
    history: Option<(u64, i64)>,
    /// The compaction to send after the sync's txn.
    compact_to: Option<i64>,
    /// The last revision this replica compacted to: a fleet that wrote nothing since has no
    /// history to compact (etcd refuses a compaction to a revision already compacted).
    compacted: i64,
}

/// The lease as shared between this replica's workers: its id and when it was last renewed.
fn read_lease(store: &dyn Store) -> Result<Option<(i64, u64)>, StoreError> {
    Ok(store.get(LEASE_KEY)?.value.and_then(|b| {
        let mut r = Reader(&b);
        Some((r.u64()? as i64, r.u64()?))
    }))
}

fn write_lease(store: &dyn Store, lease: Option<(i64, u64)>) -> Result<(), StoreError> {
    let (id, at) = lease.unwrap_or((0, 0));
    let mut w = Writer::new();
    w.u64(id as u64).u64(at);
    store.set(LEASE_KEY, &w.0, None)
}

fn call(cfg: &Config, path: &str, body: Vec<u8>) -> Call {
    Call {
        target: Target::Etcd,
        cluster: cfg.etcd.cluster.clone(),
        path: path.into(),
        headers: vec![
            (":authority".into(), cfg.etcd.cluster.clone()),
            ("content-type".into(), "application/json".into()),
        ],
        body: Some(body),
        timeout_ms: cfg.etcd.timeout_ms,
    }
}

impl Sync {
    /// The call due on this tick, if any: a lease grant, a renewal, or the range read that starts
    /// a sync. Syncs come every `syncIntervalMs`, or every `busySyncIntervalMs` while credit must
    /// move between replicas (`busy_here`, asked only then, says this replica's line has requests
    /// waiting, and the last read may have shown another's), or stored responses (`notes_due`).
    pub fn due(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        busy_here: impl FnOnce() -> bool,
    ) -> Result<Vec<Call>, StoreError> {
        let now = store.now_ms();
        if let Some((_, deadline)) = self.waiting {
            // Envoy answers every callout by its timeout; this only guards a lost answer.
            if now < deadline.saturating_add(1_000) {
                return Ok(Vec::new());
            }
            self.waiting = None;
        }
        if let Some(started) = self.started_ms {
            let since = now.saturating_add(EARLY_MS).saturating_sub(started);
            let busy = cfg.etcd.busy_sync_interval_ms;
            let due = since >= cfg.etcd.sync_interval_ms
                || (busy > 0
                    && since >= busy
                    && !self.failing
                    && (self.contended || busy_here() || self.notes_due(store)?));
            if !due {
                return Ok(Vec::new());
            }
        }
        self.started_ms = Some(now);
        let lease = read_lease(store)?.filter(|&(id, _)| id != 0);
        let renew_every = u64::from(cfg.etcd.lease_ttl_seconds) * 1_000 / 3;
        let (step, path, body) = match lease {
            None => (
                Step::Grant,
                gateway::LEASE_GRANT,
                gateway::lease_grant(cfg.etcd.lease_ttl_seconds),
            ),
            Some((id, at)) if now.saturating_sub(at) >= renew_every => (
                Step::KeepAlive,
                gateway::LEASE_KEEPALIVE,
                gateway::lease_keepalive(id),
            ),
            Some(_) => (
                Step::Range,
                gateway::RANGE,
                gateway::range_prefix(&format!("{}/", cfg.etcd.key_prefix)),
            ),
        };
        Ok(vec![self.send(cfg, now, step, path, body)])
    }

    fn send(&mut self, cfg: &Config, now: u64, step: Step, path: &str, body: Vec<u8>) -> Call {
        self.waiting = Some((step, now.saturating_add(cfg.etcd.timeout_ms)));
        call(cfg, path, body)
    }

    fn range(&mut self, cfg: &Config, now: u64) -> Vec<Call> {
        let body = gateway::range_prefix(&format!("{}/", cfg.etcd.key_prefix));
        vec![self.send(cfg, now, Step::Range, gateway::RANGE, body)]
    }

    /// The call could not be sent (no such cluster): try again on the next sync.
    pub fn abandon(&mut self) {
        self.failing = true;
        self.waiting = None;
    }

    /// Reads an answer (`status` None: no response) and returns the next call of the same sync.
    pub fn on_response(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        stats: &mut Stats,
        pods: &[PodView],
        status: Option<u32>,
        body: &[u8],
    ) -> Result<Vec<Call>, StoreError> {
        let Some((step, _)) = self.waiting.take() else {
            return Ok(Vec::new());
        };
        let now = store.now_ms();
        let ok = status == Some(200);
        match step {
            Step::Grant => match gateway::parse_lease_grant(body).filter(|_| ok) {
                Some(id) => {
                    write_lease(store, Some((id, now)))?;
                    Ok(self.range(cfg, now))
                }
                None => Ok(self.failed(stats, body)),
            },
            Step::KeepAlive => match gateway::parse_keepalive(body).filter(|_| ok) {
                Some(true) => {
                    let id = read_lease(store)?.map_or(0, |(id, _)| id);
                    write_lease(store, Some((id, now)))?;
                    Ok(self.range(cfg, now))
                }
                Some(false) => {
                    // The lease lapsed (etcd was out of reach too long, or lost it): a new one,
                    // now. Grants are not leased, so they stand meanwhile.
                    write_lease(store, None)?;
                    let body = gateway::lease_grant(cfg.etcd.lease_ttl_seconds);
                    Ok(vec![self.send(
                        cfg,
                        now,
                        Step::Grant,
                        gateway::LEASE_GRANT,
                        body,
                    )])
                }
                None => Ok(self.failed(stats, body)),
            },
            Step::Range => match gateway::parse_range(body).filter(|_| ok) {
                Some(range) => {
                    let Some((lease, _)) = read_lease(store)? else {
                        return Ok(Vec::new());
                    };
                    self.failing = false;
                    let read = RangeRead::parse(&range.kvs, &cfg.etcd.key_prefix, now);
                    stats.gauge(stats::REPLICAS_LIVE, read.alive.len() as u64);
                    // Demand past both grant and holding is requests waiting for credit.
                    self.contended = read
                        .grants
                        .values()
                        .flatten()
                        .any(|(_, p, _)| p.demand > p.grant.max(p.in_use));
                    self.note_history(cfg, &read, range.revision);
                    let me = cfg.etcd.replica_id.as_str();
                    let others: Vec<_> = read
                        .placed
                        .iter()
                        .filter(|(r, _)| *r != me)
                        .copied()
                        .collect();
                    let batch = self.inbox.take(&others);
                    self.peers = read.alive.iter().any(|r| *r != me);
                    crate::routing::stored::note_peers(store, self.peers)?;
                    self.received.placed.extend(batch.placed);
                    self.received.stored.extend(batch.stored);
                    let txn = self.plan(store, cfg, pods, &read, lease)?;
                    if txn.ops.is_empty() {
                        // Nothing etcd holds would change: the read was the whole sync.
                        return self.applied(store, stats, cfg, now);
                    }
                    let body = gateway::txn(&txn.compares, &txn.ops);
                    Ok(vec![self.send(cfg, now, Step::Txn, gateway::TXN, body)])
                }
                None => Ok(self.failed(stats, body)),
            },
            Step::Compact => {
                if ok {
                    stats.count(stats::REPLICAS_COMPACTIONS, 1);
                } else if !String::from_utf8_lossy(body).contains("has been compacted") {
                    // (A revision etcd already compacted past is refused so: another replica,
                    // or the operator's own compaction, was there first.)
                    self.failed(stats, body);
                }
                Ok(Vec::new())
            }
            Step::Txn => match gateway::parse_txn(body).filter(|_| ok) {
                Some(true) => self.applied(store, stats, cfg, now),
                Some(false) => {
                    // Another replica grew a grant on a pod since the read: read again on the
                    // next tick rather than wait a whole interval.
                    stats.count(stats::REPLICAS_CONFLICTS, 1);
                    self.started_ms = None;
                    Ok(self.compact(cfg, now))
                }
                None => {
                    // Unknown outcome, or a lease etcd no longer has: renew before the next sync.
                    if let Some((id, _)) = read_lease(store)? {
                        write_lease(store, Some((id, 0)))?;
                    }
                    Ok(self.failed(stats, body))
                }
            },
        }
    }

    /// The sync's plan is what etcd holds now (its txn applied, or nothing to write): the
    /// planned grants go into the shares admission reads.
    fn applied(
        &mut self,
        store: &dyn Store,
        stats: &mut Stats,
        cfg: &Config,
        now: u64,
    ) -> Result<Vec<Call>, StoreError> {
        if self.placing {
            self.outbox.written();
        }
        for p in &self.planned {
            // Judged by the try that is written: a lost one read an older grant.
            let mut grew = false;
            share::modify(store, &p.pod, |s| {
                grew = p.cap > s.grant;
                s.grant = p.cap;
                s.published = p.grant;
                s.granted = p.granted;
            })?;
            self.grew |= grew;
        }
        stats.count(stats::REPLICAS_SYNCS, 1);
        stats.count(stats::REPLICAS_RECLAIMED, self.reclaiming);
        Ok(self.compact(cfg, now))
    }

    /// Keeps a revision to compact etcd's history to. Once it is `compactionIntervalMs` old, the
    /// fleet's compactor (the first live replica by name: one a fleet, no election of its own)
    /// compacts up to it after its txn, and every replica keeps the revision just read instead.
    /// etcd keeps every value kvgate ever wrote until its history is compacted, and it does not
    /// compact by default: the grants' and placements' writes (tens of KB a sync with
    /// placements) would fill its 2 GB quota within hours, and a full etcd refuses every write.
    /// Compacting to a revision that old follows Kubernetes' API server (every 5 minutes): a
    /// reader of history younger than that loses nothing.
    fn note_history(&mut self, cfg: &Config, read: &RangeRead, revision: i64) {
        let every = cfg.etcd.compaction_interval_ms;
        if every == 0 || revision <= 0 {
            return;
        }
        match self.history {
            Some((at, old)) if read.at_ms.saturating_sub(at) >= every => {
                let me = cfg.etcd.replica_id.as_str();
                if read.alive.iter().min() == Some(&me) && old > self.compacted {
                    self.compact_to = Some(old);
                    self.compacted = old;
                }
                self.history = Some((read.at_ms, revision));
            }
            Some(_) => {}
            None => self.history = Some((read.at_ms, revision)),
        }
    }

    /// The compaction planned by the sync's read, if any.
    fn compact(&mut self, cfg: &Config, now: u64) -> Vec<Call> {
        match self.compact_to.take() {
            Some(revision) => vec![self.send(
                cfg,
                now,
                Step::Compact,
                gateway::COMPACTION,
                gateway::compaction(revision),
            )],
            None => Vec::new(),
        }
    }

    /// Stored responses must move between replicas: this one has some to write and others to
    /// read them, or a request here is held for another's note (`stored::sought`). A follow-up
    /// may come through another replica as soon as its previous answer ended (an agent's next
    /// turn), so a note is written at the busy pace, and read at it while a request waits for
    /// it, not a slow sync or two late; a replica that finds itself alone lets the request go at
    /// that read (`stored::alone_since`). (Read at the busy pace all the while a fleet serves
    /// stored responses, each replica would read etcd up to 50 times a second for follow-ups
    /// that mostly come seconds later.)
    fn notes_due(&mut self, store: &dyn Store) -> Result<bool, StoreError> {
        Ok(
            self.peers && self.outbox.holds_stored(store)?
                || crate::routing::stored::sought(store)?,
        )
    }

    /// What the other replicas placed and stored, read since the last call: placements for the
    /// router (`Router::import`), stored responses for `routing::stored`.
    pub fn take_received(&mut self) -> Batch {
        std::mem::take(&mut self.received)
    }

    /// Whether a grant grew since last asked: requests waiting in the line may fit now, and no
    /// release on this replica would tell them.
    pub fn take_grew(&mut self) -> bool {
        std::mem::take(&mut self.grew)
    }

    fn failed(&mut self, stats: &mut Stats, body: &[u8]) -> Vec<Call> {
        self.failing = true;
        stats.count(stats::REPLICAS_ERRORS, 1);
        log::debug!(
            "etcd answered {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        );
        Vec::new()
    }

    /// Works out every pod's next grant from the range read; shrinks take effect in the shares at
    /// once (before etcd hears of them, so credit another replica takes is never still in use
    /// here), growths once the txn succeeds. Returns the txn.
    fn plan<'a>(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        pods: &[PodView],
        read: &RangeRead<'a>,
        lease: i64,
    ) -> Result<Txn<'a>, StoreError> {
        let me = cfg.etcd.replica_id.as_str();
        self.note_lapsed(cfg, read, me);
        let mut txn = Txn::default();
        self.planned.clear();
        for view in pods {
            self.plan_pod(store, cfg, read, view, &mut txn)?;
        }
        self.reclaiming = txn.reclaimed.len() as u64;
        // Read whether or not another replica is live to learn them, so the log does not pile up.
        // Another replica reads at least every sync interval: twice that misses none.
        let keep_ms = cfg.etcd.sync_interval_ms.saturating_mul(2);
        let placed = self.outbox.value(store, keep_ms)?;
        let placed = placed.filter(|_| read.alive.iter().any(|r| *r != me));
        self.placing = placed.is_some();
        if let Some(value) = placed {
            txn.ops.push(Op::Put {
                key: placed_key(&cfg.etcd.key_prefix, me),
                value,
                lease: Some(lease),
            });
        }
        // The alive key lives as long as the lease it was written under: written again only when
        // the read did not find it (a new lease, or the first sync).
        if !read.alive.contains(&me) {
            txn.ops.push(Op::Put {
                key: alive_key(&cfg.etcd.key_prefix, me),
                value: Vec::new(),
                lease: Some(lease),
            });
        }
        Ok(txn)
    }

    /// Keeps when each replica holding grants was first seen without its alive key (this VM's
    /// clock) and its grants as read, and forgets those no longer seen so. A lapsed replica's
    /// grants become ghosts when they are deleted: by this sync (past its grace), or by another
    /// replica's (gone from the read while its alive key is still missing).
    fn note_lapsed(&mut self, cfg: &Config, read: &RangeRead, me: &str) {
        let mut seen: HashMap<&str, HashMap<String, u64>> = HashMap::new();
        for (pod, holders) in &read.grants {
            for (r, value, _) in holders {
                if *r != me && !read.alive.contains(r) {
                    seen.entry(*r)
                        .or_default()
                        .insert(pod.to_string(), value.grant);
                }
            }
        }
        let deleted: Vec<(String, Lapsed)> = self
            .lapsed
            .extract_if(|r, _| !seen.contains_key(r.as_str()))
            .filter(|(r, _)| !read.alive.contains(&r.as_str()))
            .collect();
        for (r, lapsed) in deleted {
            self.haunt(&r, &lapsed.grants, read.at_ms);
        }
        for (r, grants) in seen {
            self.lapsed
                .entry(r.to_string())
                .or_insert(Lapsed {
                    since: read.at_ms,
                    grants: HashMap::new(),
                })
                .grants = grants.clone();
            // This sync deletes them (`holders`).
            if self.reclaimable(r, cfg, read.at_ms) {
                self.haunt(r, &grants, read.at_ms);
            }
        }
        let ttl = cfg.routing.request_ttl_ms;
        self.ghosts
            .retain(|g| read.at_ms.saturating_sub(g.at_ms) < ttl);
    }

    /// Ghosts of `replica`'s deleted grants, the first time each is seen deleted.
    fn haunt(&mut self, replica: &str, grants: &HashMap<String, u64>, at_ms: u64) {
        for (pod, &tokens) in grants {
            if !self
                .ghosts
                .iter()
                .any(|g| g.replica == replica && g.pod == *pod)
            {
                self.ghosts.push(Ghost {
                    replica: replica.to_string(),
                    pod: pod.clone(),
                    tokens,
                    at_ms,
                });
            }
        }
    }

    /// The replica has been seen lapsed for its whole grace: its grants may be deleted.
    fn reclaimable(&self, replica: &str, cfg: &Config, now: u64) -> bool {
        self.lapsed
            .get(replica)
            .is_some_and(|l| now.saturating_sub(l.since) >= cfg.etcd.reclaim_grace_ms)
    }

    /// What the pod's ghosts hold out of its split, once those its scrapes have read the engine
    /// since are let go.
    fn ghosts_on(&mut self, view: &PodView) -> u64 {
        let read = view.kv_read_ms;
        self.ghosts
            .retain(|g| g.pod != view.pod || read.is_none_or(|at| at <= g.at_ms));
        self.ghosts
            .iter()
            .filter(|g| g.pod == view.pod)
            .map(|g| g.tokens)
            .sum()
    }

    /// One pod's part of the plan (none for a pod without a budget): this replica's next grant
    /// there, its writes in the txn, the shrink applied to the pod's share at once, and the
    /// outcome kept for when the txn succeeds.
    fn plan_pod<'a>(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        read: &RangeRead<'a>,
        view: &PodView,
        txn: &mut Txn<'a>,
    ) -> Result<(), StoreError> {
        let Some(budget) = view.budget else {
            return Ok(());
        };
        let prefix = &cfg.etcd.key_prefix;
        let me = cfg.etcd.replica_id.as_str();
        let now = read.at_ms;
        let (mut holders, me_at, remote) = self.holders(cfg, read, &view.pod, txn);
        // Its own line from its records, fresher than what it last published.
        holders[me_at].in_use = view.in_use;
        holders[me_at].demand = view.demand;
        holders[me_at].unit = view.unit;
        let before = holders[me_at].grant;
        let ghosts = self.ghosts_on(view);
        let next = split::next(budget.saturating_sub(ghosts), &holders, me_at);
        let granted_before: u64 = holders.iter().map(|h| h.grant).sum();
        // Admission reads the share's grant inside its compare-and-swap of the pod's record, so
        // the share is lowered first and the record then written (unchanged, its version bumped)
        // with what it holds read in the same swap: a request admitted against the old grant
        // either landed before that write, and is read, or its swap fails on the bumped version
        // and it is checked again against the lowered grant. The grant published covers what
        // was read, so credit another replica takes is really free. (`view.in_use` is older:
        // requests admitted while etcd answered were missed, and the replicas' reservations
        // summed past a budget in the e2e runs.)
        share::modify(store, &view.pod, |s| {
            s.grant = s.grant.min(next.cap).min(before);
            s.published = before;
            s.granted = granted_before;
            s.contact_ms = now;
            s.remote_tokens = remote;
            s.ghost_tokens = ghosts;
        })?;
        let headroom = cfg.admission.headroom();
        let (held, in_flight) = crate::pods::record::modify(store, &view.pod, |rec| {
            Some((
                rec.forecast(None, headroom, view.block_tokens, At::of(cfg, now)),
                rec.entries.len() as u64,
            ))
        })?
        .unwrap_or((0, 0));
        // What those requests hold may still rise with no request admitted, by up to a block per
        // request in flight as their entries are rewritten at block boundaries (`forecast`'s
        // test): the grant kept covers that too, or a grant shrunk to the forecast of the moment
        // was passed a moment later (the e2e check, at the busy pace's many shrinks).
        let kept = held.saturating_add(in_flight.saturating_mul(view.block_tokens));
        let grant = next.grant.max(kept.min(before));
        let granted = granted_before - before + grant;
        if grant > before {
            let guard = guard_key(prefix, &view.pod);
            let revision = read.guards.get(view.pod.as_str()).copied().unwrap_or(0);
            txn.compares
                .push(Compare::ModRevision(guard.clone(), revision));
            txn.ops.push(Op::Put {
                key: guard,
                value: me.as_bytes().to_vec(),
                lease: None,
            });
        }
        let published = Published {
            grant,
            in_use: view.in_use.max(held),
            demand: view.demand,
            unit: view.unit,
            explained: view.explained,
        };
        // A grant key etcd already holds as it would be written is left alone: under contention
        // the busy pace syncs tens of times a second, and most pods' lines did not move since
        // the last (each write costs etcd a revision, and its history).
        let as_read = read.grants.get(view.pod.as_str()).and_then(|holders| {
            holders
                .iter()
                .find(|(replica, _, _)| *replica == me)
                .map(|(_, value, _)| *value)
        });
        if as_read != Some(published) {
            txn.ops.push(Op::Put {
                key: grant_key(prefix, &view.pod, me),
                value: serde_json::to_vec(&published).unwrap_or_default(),
                lease: None,
            });
        }
        self.planned.push(Planned {
            pod: view.pod.clone(),
            grant,
            cap: next.cap.min(grant),
            granted,
        });
        Ok(())
    }

    /// The pod's holders as read, this replica's own among them (an empty one where it holds no
    /// grant yet), where its own stands, and the KV the other replicas' requests hold there. The
    /// grants of replicas lapsed past their grace are left out, and deleted by the txn.
    fn holders<'a>(
        &self,
        cfg: &Config,
        read: &RangeRead<'a>,
        pod: &str,
        txn: &mut Txn<'a>,
    ) -> (Vec<Holder>, usize, u64) {
        let prefix = &cfg.etcd.key_prefix;
        let me = cfg.etcd.replica_id.as_str();
        let mut holders: Vec<Holder> = Vec::new();
        let mut remote = 0;
        let mut mine = None;
        for &(replica, value, revision) in read.grants.get(pod).into_iter().flatten() {
            if replica == me {
                mine = Some(holders.len());
            } else if self.reclaimable(replica, cfg, read.at_ms) {
                let grant_key = grant_key(prefix, pod, replica);
                txn.compares
                    .push(Compare::ModRevision(grant_key.clone(), revision));
                txn.compares
                    .push(Compare::ModRevision(alive_key(prefix, replica), 0));
                txn.ops.push(Op::Delete(grant_key));
                if !txn.reclaimed.contains(&replica) {
                    txn.reclaimed.push(replica);
                }
                continue;
            } else {
                remote += value.explained;
            }
            holders.push(Holder {
                grant: value.grant,
                in_use: value.in_use,
                demand: value.demand,
                unit: value.unit,
                lapsed: replica != me && !read.alive.contains(&replica),
                rank: rank(pod, replica, read.at_ms),
            });
        }
        let me_at = match mine {
            Some(i) => i,
            None => {
                holders.push(Holder {
                    rank: rank(pod, me, read.at_ms),
                    ..Holder::default()
                });
                holders.len() - 1
            }
        };
        (holders, me_at, remote)
    }
}

/// A replica's place on a pod, among replicas given as much of it so far, for a further request
/// (`split::Holder::rank`). A pod's budget rarely splits into equal whole requests: five requests
/// between three replicas give two, two and one. Were the order the same on every pod (etcd's
/// key order, or who held most), the same replica would come out one behind on every pod, and,
/// each replica refilling what ends on it, stay there: a replica started 6 s after another had
/// its clients' answers 71-77 times in 25 s against 126-144 for each of the two others
/// (BENCHMARKS.md, *Replicas served alike*). Drawn per pod, the one behind differs from pod to
/// pod; drawn again each period, the request moves (as its holder's requests end) so that over
/// a few periods each replica has had it as often.
pub(super) fn rank(pod: &str, replica: &str, now_ms: u64) -> u64 {
    let h = crate::hash::fnv1a_from(crate::hash::fnv1a(pod.as_bytes()), replica.as_bytes());
    crate::hash::chain(h, &(now_ms / RANK_PERIOD_MS).to_le_bytes())
}
