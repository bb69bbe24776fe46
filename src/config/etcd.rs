//! The `etcd` section: several gateway replicas sharing each pod's budget (docs/configuration.md;
//! `replicas` for what is done with it).

use super::{invalid, ConfigError};
use crate::gate::QUICK_TICK_MS;
use serde::{Deserialize, Serialize};

/// Several gateway replicas sharing each pod's budget through etcd v3 (`replicas`): off while
/// `cluster` is empty, and one Envoy needs none of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct EtcdConfig {
    /// The HTTP/1.1 Envoy cluster reaching etcd's HTTP/JSON gateway; empty turns sharing off.
    pub cluster: String,
    /// Every key kvgate writes starts with this (one prefix per gateway fleet).
    pub key_prefix: String,
    /// This replica's name in etcd; empty takes Envoy's node id.
    pub replica_id: String,
    /// The replica's etcd lease: its grants count as live while it renews it.
    pub lease_ttl_seconds: u32,
    /// A replica whose lease lapsed keeps its grants this long before another reclaims them.
    pub reclaim_grace_ms: u64,
    /// How often the elected worker syncs: one range read, at most one txn.
    pub sync_interval_ms: u64,
    /// How often it syncs while credit must move: its own line has requests waiting, or the last
    /// read showed a replica asking for more than its grant. 0: always `sync_interval_ms`.
    pub busy_sync_interval_ms: u64,
    pub timeout_ms: u64,
    /// The most replicas the fleet runs (the autoscaler's maximum): cut off from etcd, a replica
    /// admits at most a pod's budget divided by this.
    pub max_replicas: u32,
    /// How often etcd's history of kvgate's writes is compacted, by one replica of the fleet, up
    /// to the revision it read that long before; 0: never (the operator's etcd compacts itself).
    pub compaction_interval_ms: u64,
    /// How long a request naming a stored response (a Responses API follow-up, a retrieval) that
    /// this replica has not heard of waits for another replica's note of it; 0: not at all.
    pub follow_up_wait_ms: u64,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            cluster: String::new(),
            key_prefix: "/kvgate".into(),
            replica_id: String::new(),
            lease_ttl_seconds: 10,
            reclaim_grace_ms: 5_000,
            sync_interval_ms: 500,
            busy_sync_interval_ms: 20,
            timeout_ms: 1_000,
            max_replicas: 0,
            compaction_interval_ms: 300_000,
            follow_up_wait_ms: 300,
        }
    }
}

impl EtcdConfig {
    pub fn enabled(&self) -> bool {
        !self.cluster.is_empty()
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let e = |field: &str, reason: &str| Err(invalid(&format!("etcd.{field}"), reason));
        if !self.enabled() {
            return Ok(());
        }
        if self.max_replicas == 0 {
            return e(
                "maxReplicas",
                "must be set (the most replicas the fleet runs) when etcd.cluster is set",
            );
        }
        if !self.key_prefix.starts_with('/') || self.key_prefix.ends_with('/') {
            return e("keyPrefix", "must start with / and not end with /");
        }
        if self.replica_id.contains('/') {
            return e("replicaId", "must not contain /");
        }
        if !(2..=3_600).contains(&self.lease_ttl_seconds) {
            return e("leaseTtlSeconds", "must be in 2..=3600");
        }
        if self.sync_interval_ms == 0 || self.timeout_ms == 0 {
            return e("syncIntervalMs", "the interval and timeoutMs must be > 0");
        }
        if self.sync_interval_ms.saturating_mul(2) > u64::from(self.lease_ttl_seconds) * 1_000 {
            return e(
                "syncIntervalMs",
                "must be at most half the lease TTL (the lease is renewed on the sync)",
            );
        }
        if self.busy_sync_interval_ms != 0
            && !(QUICK_TICK_MS..=self.sync_interval_ms).contains(&self.busy_sync_interval_ms)
        {
            // No tick comes sooner than the quickest.
            return e(
                "busySyncIntervalMs",
                &format!("must be 0 (off) or from {QUICK_TICK_MS} up to syncIntervalMs"),
            );
        }
        if self.compaction_interval_ms != 0
            && !(self.sync_interval_ms..=86_400_000).contains(&self.compaction_interval_ms)
        {
            return e(
                "compactionIntervalMs",
                "must be 0 (off) or from syncIntervalMs up to 86400000 (a day)",
            );
        }
        if self.follow_up_wait_ms > 10_000 {
            return e("followUpWaitMs", "must be at most 10000");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use crate::config::Config;

    /// The field a config with `key` at each of `values` is refused for (`None`: accepted).
    fn refusals(key: &str, values: &[u64]) -> Vec<Option<String>> {
        values
            .iter()
            .map(|v| {
                let json =
                    format!(r#"{{"etcd": {{"cluster": "etcd", "maxReplicas": 3, "{key}": {v}}}}}"#);
                Config::parse(json.as_bytes()).err().map(|e| e.field)
            })
            .collect()
    }

    #[test]
    fn the_busy_sync_is_off_or_between_the_quickest_tick_and_the_sync() {
        let key = "busySyncIntervalMs";
        assert_eq!(refusals(key, &[0, 20, 500]), [None, None, None]);
        let refused = Some(format!("etcd.{key}"));
        assert_eq!(refusals(key, &[19, 501]), [refused.clone(), refused]);
    }

    #[test]
    fn compaction_is_on_by_default_and_bounded_by_the_sync_and_a_day() {
        let on = Config::parse(br#"{"etcd": {"cluster": "etcd", "maxReplicas": 3}}"#);
        assert_eq!(
            on.map(|c| c.etcd.compaction_interval_ms).ok(),
            Some(300_000)
        );
        let key = "compactionIntervalMs";
        assert_eq!(refusals(key, &[0, 500]), [None, None]);
        let refused = Some(format!("etcd.{key}"));
        assert_eq!(
            refusals(key, &[499, 86_400_001]),
            [refused.clone(), refused]
        );
    }
}
