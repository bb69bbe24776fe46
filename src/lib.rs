//! kvgate: an LLM-aware admission and routing filter for Envoy, compiled to proxy-wasm.
//!
//! Everything outside `shell` is the host-agnostic core: plain Rust that decides, with all shared
//! state reached through the [`store::interface::Store`] trait so it runs natively under test. `shell` is the
//! only module that knows proxy-wasm; it is compiled for the wasi target alone.

pub mod admission;
pub mod config;
pub mod drive;
pub mod estimate;
pub mod flow;
pub mod gate;
pub mod hash;
pub mod models;
pub mod observe;
pub mod openai;
pub mod pods;
pub mod replicas;
pub mod routing;
pub mod stats;
pub mod status;
pub mod store;
#[cfg(test)]
mod test_support;

#[cfg(target_os = "wasi")]
mod shell;
