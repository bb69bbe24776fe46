//! Several gateway replicas (Envoys) sharing each pod's budget through etcd v3, off unless
//! `etcd.cluster` is set. Each replica holds a grant of every pod's budget; the grants sum to at
//! most the budget, and each replica admits locally, within its grant, exactly as one Envoy does
//! within the whole budget. etcd is read and written only by one worker's periodic sync, never on
//! a request's path. The arithmetic (`split`), the wire format of etcd's HTTP/JSON gateway
//! (`gateway`), the sync that applies one to the other (`sync`), the per-pod copy admission
//! reads (`share`), and where each replica sends prompts, told to the others' prefix indexes
//! (`placements`).
//!
//! Source of truth: etcd, under `etcd.keyPrefix` (key schema in `sync`). Each replica's shares
//! (`kvgate.share.<ip:port>`, shared data) and its lease record (`kvgate.replicas`) are copies
//! derived from it, rewritten on every sync.

pub mod gateway;
pub mod placements;
pub mod share;
pub mod split;
pub mod sync;

#[cfg(test)]
mod tests;
