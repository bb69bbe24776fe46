//! Which pod serves a request: the per-VM `router` and its named steps (`router::steps`), the
//! pure cost formula that scores and picks (`pick`), the prompt's chained block hashes
//! (`prefix`), where LoRA adapters stand (`adapters`), and the two replicas a VM routes on: what
//! each pod's prefix cache holds (`prefix_index`) and which blocks in-flight requests occupy
//! (`active_blocks`), both kept current across workers by the `pick_log`, and the copies of the pod
//! records it ranks on (`record_copies`), each of these tables keyed by the pod's id (`pod_id`);
//! and whether the pool's KV is about to run short, from the rate of dispatches to the pods that
//! may take a request (`demand`); and which pod stores a Responses API response its follow-ups
//! must go back to (`stored`), or, where no note says, which pod answers that it does
//! (`stored_ask`).
//!
//! Source of truth: a request's reservation and its active-block counts live in the pod's shared
//! record (`pods::record`), changed only by compare-and-swap; those must return to zero. The prefix
//! index and the active-block membership are per-VM replicas fed by the pick log (shared ring
//! `kvgate.log.<n>`): approximate by design, and a VM that falls behind skips ahead.

pub mod active_blocks;
pub mod adapters;
pub mod demand;
pub mod pick;
pub mod pick_log;
pub mod pod_id;
pub mod prefix;
pub mod prefix_index;
pub mod record_copies;
pub mod router;
pub mod step_phase;
pub mod stored;
pub mod stored_ask;
pub mod unseen_lead;
