//! The model-server pods: who they are (`pool`), the shared record of each (`record`), the scraper that discovers them
//! and fills their records under a lease (`scrape`), the reading of their Prometheus metrics
//! (`metrics`), each pod's decode pace learned from them (`pace`), what the engines'
//! prefix-cache counters say of kvgate's prefix index (`index_check`), and how many requests
//! each engine runs at once (`seats`).
//!
//! Source of truth: each pod's shared record `kvgate.pod.<ip:port>` (its last scrape and the
//! requests in flight on it), changed only by compare-and-swap; the pod list `kvgate.pods`, written
//! by the lease holder alone. Each VM's `Router` caches the pod list for a second; everything else a
//! VM knows of a pod is read from its record when needed.

pub mod index_check;
pub mod metrics;
pub mod pace;
pub mod pool;
pub mod record;
pub mod scrape;
pub mod seats;
