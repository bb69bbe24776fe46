//! Many models behind one gateway: which models and LoRA adapters each pod serves, and which
//! adapters it is running (`served`), and the public model names clients use mapped to the target
//! models they are sent as (`split`), and the list of both the gateway answers clients with
//! (`listing`). Routing reads `served` to keep a request on pods serving its
//! model and to weigh adapter affinity (`routing::adapters`); the flow answers 404 itself for a
//! model no pod serves and rewrites the body's `model` for a rename or split.
//!
//! Source of truth: each pod's shared record `kvgate.models.<ip:port>` (its last model list and
//! adapter state), written by the lease holder's scraper alone; each VM's `ServedView` is a copy
//! cached for half a second. The split's round-robin credits are per VM.

pub mod listing;
pub mod served;
pub mod split;
