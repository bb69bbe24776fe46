//! kvgate: an LLM-aware admission and routing filter for Envoy, compiled to proxy-wasm.
//!
//! Everything outside `shell` is the host-agnostic core: plain Rust that decides, with all shared
//! state reached through the [`store::Store`] trait so it runs natively under test. `shell` is the
//! only module that knows proxy-wasm; it is compiled for the wasi target alone.

pub mod active_blocks;
pub mod admission;
pub mod budget;
pub mod calibration;
pub mod codec;
pub mod config;
pub mod drive;
pub mod estimate;
pub mod feedback;
pub mod flow;
pub mod forecast;
pub mod gate;
pub mod hash;
pub mod output_dist;
pub mod pick;
pub mod pick_log;
pub mod pod_metrics;
pub mod pod_state;
pub mod prefix;
pub mod prefix_index;
pub mod queue;
pub mod reply;
pub mod request;
pub mod response;
pub mod router;
pub mod scrape;
pub mod sessions;
pub mod stats;
pub mod status;
pub mod store;

#[cfg(any(test, feature = "fake-host"))]
pub mod fake_host;

#[cfg(target_os = "wasi")]
mod shell;
