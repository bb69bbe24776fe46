//! A request served by another pod than kvgate's pick (`Router::rehome`): Envoy could not use
//! the pick and its retry went elsewhere, or routing only observes and Envoy's balancer chose.
//! The request's accounting follows it — its entry in the pods' shared records (the source of
//! truth for budgets), and this VM's replicas (active blocks, adapter, prefix index), with a
//! dispatch in the pick log so the other workers' replicas follow too.

use super::{Routed, Router};
use crate::config::Config;
use crate::pods::record;
use crate::routing::pick_log::{Dispatch, Event};
use crate::routing::pod_id::PodId;
use crate::store::interface::{Store, StoreError};

/// Why a request is served by another pod than kvgate's pick ([`Router::rehome`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moved {
    /// Envoy could not use the pick (its retry policy served the request elsewhere).
    PickFailed,
    /// Routing only observes (`routing.mode` `observe`): Envoy's load balancer chose.
    EnvoyChose,
}

impl Router {
    /// The request is served by `served_by`, not by kvgate's pick: its accounting (entry, active
    /// blocks, adapter) moves there, the prompt counts as cached there, and the other workers
    /// learn of the move through the pick log. When Envoy could not use the pick
    /// ([`Moved::PickFailed`]: its retry policy went elsewhere), the pick is also marked down
    /// until its next good scrape, so the next requests avoid it now, not a scrape interval
    /// later; when routing only observes ([`Moved::EnvoyChose`]), the pick is fine.
    pub fn rehome(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        routed: &mut Routed,
        served_by: &str,
        why: Moved,
    ) -> Result<(), StoreError> {
        if served_by == routed.pod || !self.pods.iter().any(|p| p == served_by) {
            return Ok(());
        }
        let now = store.now_ms();
        let (from, to) = (routed.pod_id, PodId::of(served_by));
        if why == Moved::PickFailed {
            let down = record::modify(store, &routed.pod, |rec| {
                let mut down = record::Snapshot {
                    at_ms: now,
                    healthy: false,
                    kv_usage: f64::NAN,
                    ..record::Snapshot::default()
                };
                // A failed pick says nothing of the pod's pace, nor of its cache: it keeps what
                // it learned of both.
                crate::pods::pace::follow(
                    rec.snapshot.as_ref(),
                    &mut down,
                    cfg.metrics.interval_ms,
                );
                crate::pods::index_check::follow(
                    rec.snapshot.as_ref(),
                    &mut down,
                    rec.tally,
                    cfg.routing.index_check,
                );
                rec.snapshot = Some(down);
                Some(rec.clone())
            })?;
            if let Some(down) = down {
                self.copies.wrote(from, down, now);
            }
        }
        let hashes = self
            .active
            .hashes_of(from, routed.request)
            .unwrap_or_default();
        let adapter = self.adapters.adapter_of(from, routed.request);
        let Some(entry) = self.finish(store, routed)? else {
            return Ok(());
        };
        // Nothing there is known to hold its prefix: it counts its whole prompt (the prefix it
        // leaned on before was counted, and stays counted, on its first pod).
        let entry = entry.standing_alone();
        let moved = record::modify(store, served_by, |rec| {
            rec.entries.push(entry);
            Some(rec.clone())
        })?;
        if let Some(moved) = moved {
            self.copies.wrote(to, moved, now);
        }
        routed.pod = served_by.to_string();
        routed.pod_id = to;
        let capacity = super::index_capacity(&self.index_bounds, to, cfg);
        self.prefix.insert(to, &hashes, now, capacity);
        self.adapters.dispatch(to, routed.request, adapter, now);
        let event = Event::Dispatch(Dispatch {
            pod: served_by.to_string(),
            request: routed.request,
            adapter,
            hashes,
        });
        if let Err(e) = self.log.publish(store, self.vm, &event) {
            log::debug!("pick log publish failed: {e:?}");
        }
        if let Event::Dispatch(d) = event {
            self.active.add(to, routed.request, d.hashes, now);
        }
        Ok(())
    }
}
