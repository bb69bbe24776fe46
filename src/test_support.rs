//! What the core's unit tests build alike, so each test states only what it changes: a
//! configuration with static pods, a prompt's block hashes, and two worker VMs.

use crate::config::Config;
use crate::store::fake_host::{FakeHost, FakeVm};

/// The default configuration with `pods` as its static pods.
pub fn with_pods(pods: &[&str]) -> Config {
    Config {
        pods: pods.iter().map(|p| p.to_string()).collect(),
        ..Config::default()
    }
}

/// The block hashes of a prompt of `n` blocks in prefix group `group`: prompts of one group
/// share their leading blocks, of different groups none.
pub fn prompt_blocks(group: u64, n: u64) -> Vec<u64> {
    (0..n).map(|i| group * 1_000_000 + i).collect()
}

/// Two worker VMs on one host (each reaches it through `host()`).
pub fn two_vms() -> (FakeVm, FakeVm) {
    let host = FakeHost::new();
    (host.vm(), host.vm())
}
