//! The `etcd` section: several gateway replicas sharing each pod's budget (docs/configuration.md;
//! `replicas` for what is done with it).

use super::{invalid, ConfigError};
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
    pub timeout_ms: u64,
    /// The most replicas the fleet runs (the autoscaler's maximum): cut off from etcd, a replica
    /// admits at most a pod's budget divided by this.
    pub max_replicas: u32,
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
            timeout_ms: 1_000,
            max_replicas: 0,
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
        Ok(())
    }
}
