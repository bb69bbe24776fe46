//! State shared between Envoy's worker VMs, and how it is kept: the `Store` trait every module
//! reaches shared data, queues and the clock through (`interface`), the binary codec records are
//! packed with (`codec`), the one elected worker (`lease`), and the in-memory host with Envoy's
//! real semantics that tests and fuzz targets run on (`fake_host`).
//!
//! Source of truth: the host's shared data itself. Nothing here caches; each record's owner
//! (`pods::record`, `admission::line`, ...) documents its key schema, bounded because keys cannot
//! be deleted or listed.

pub mod codec;
pub mod interface;
pub mod lease;

#[cfg(any(test, feature = "fake-host"))]
pub mod fake_host;
