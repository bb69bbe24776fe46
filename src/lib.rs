//! kvgate: an LLM-aware admission and routing filter for Envoy, compiled to proxy-wasm.
//!
//! Everything outside `shell` is the host-agnostic core: plain Rust that decides, with all shared
//! state reached through the [`store::Store`] trait so it runs natively under test. `shell` is the
//! only module that knows proxy-wasm; it is compiled for the wasi target alone.

pub mod calibration;
pub mod config;
pub mod estimate;
pub mod flow;
pub mod hash;
pub mod reply;
pub mod request;
pub mod response;
pub mod store;

#[cfg(any(test, feature = "fake-host"))]
pub mod fake_host;

#[cfg(target_os = "wasi")]
mod shell;
