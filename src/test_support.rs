//! What the core's unit tests build alike, so each test states only what it changes: a
//! configuration with static pods, a prompt's block hashes, two worker VMs, and a worker's
//! store that counts its reads and can let another worker act between its read and its write.

use std::cell::{Cell, RefCell};

use crate::config::Config;
use crate::store::fake_host::{FakeHost, FakeVm};
use crate::store::interface::{Store, StoreError, Versioned};

/// The default configuration with `pods` as its static pods.
pub fn with_pods(pods: &[&str]) -> Config {
    Config {
        pods: pods.iter().map(|p| p.to_string()).collect(),
        ..Config::default()
    }
}

/// Records that each of `pods`' model lists failed to fetch, for a test that scrapes
/// (`metrics.cluster` set) but is not about lists: each pod serves every model, and no request
/// waits for its first list (`models::served`).
pub fn lists_failed(store: &dyn Store, pods: &[&str]) {
    for pod in pods {
        let written = crate::models::served::write_failure(store, pod, 0);
        assert!(written.is_ok(), "{written:?}");
    }
}

/// The block hashes of a prompt of `n` blocks in prefix group `group`: prompts of one group
/// share their leading blocks, of different groups none.
pub fn prompt_blocks(group: u64, n: u64) -> Vec<u64> {
    (0..n).map(|i| group * 1_000_000 + i).collect()
}

/// Envoy's admin `/clusters?format=json` with the model cluster (`models`) holding `hosts`
/// (`address:port`): what discovery reads.
pub fn clusters_json(hosts: &[&str]) -> Vec<u8> {
    let statuses: Vec<String> = hosts
        .iter()
        .map(|h| {
            let (address, port) = h.rsplit_once(':').unwrap_or((h, "0"));
            format!(r#"{{"address":{{"socket_address":{{"address":"{address}","port_value":{port}}}}}}}"#)
        })
        .collect();
    format!(
        r#"{{"cluster_statuses":[{{"name":"models","host_statuses":[{}]}}]}}"#,
        statuses.join(",")
    )
    .into_bytes()
}

/// Two worker VMs on one host (each reaches it through `host()`).
pub fn two_vms() -> (FakeVm, FakeVm) {
    let host = FakeHost::new();
    (host.vm(), host.vm())
}

/// A worker's view of the store that counts its reads (each a host call in Envoy) and of which
/// keys, and may let another worker act between its read of a pod's record and its
/// compare-and-swap (`racing`): the interleaving two Envoy worker threads can produce.
pub struct Watched<'a> {
    pub vm: &'a FakeVm,
    pub reads: Cell<u32>,
    pub keys: RefCell<Vec<String>>,
    meanwhile: RefCell<Option<Box<dyn FnOnce() + 'a>>>,
    /// The next writes of a key starting with this, as many as the count, fail with that error:
    /// a host refusing one, or other workers winning every race of a compare-and-swap loop.
    fails: Cell<Option<(&'a str, StoreError, usize)>>,
}

impl<'a> Watched<'a> {
    pub fn new(vm: &'a FakeVm) -> Self {
        Watched {
            vm,
            reads: Cell::new(0),
            keys: RefCell::new(Vec::new()),
            meanwhile: RefCell::new(None),
            fails: Cell::new(None),
        }
    }

    /// A worker whose next write of a key starting with `prefix` fails.
    pub fn failing_once(vm: &'a FakeVm, prefix: &'a str) -> Self {
        let w = Watched::new(vm);
        w.fails.set(Some((prefix, StoreError::Host(1), 1)));
        w
    }

    /// A worker that loses every race of its next compare-and-swap loop on a key starting with
    /// `prefix`, as if other workers wrote it between each of its reads and writes.
    pub fn losing_races(vm: &'a FakeVm, prefix: &'a str) -> Self {
        let w = Watched::new(vm);
        w.fails.set(Some((
            prefix,
            StoreError::CasMismatch,
            crate::store::interface::CAS_ATTEMPTS,
        )));
        w
    }

    /// Runs `meanwhile` just before this worker's first compare-and-swap of a pod record.
    pub fn racing(vm: &'a FakeVm, meanwhile: impl FnOnce() + 'a) -> Self {
        let w = Watched::new(vm);
        *w.meanwhile.borrow_mut() = Some(Box::new(meanwhile));
        w
    }

    /// How many times `key` was read.
    pub fn reads_of(&self, key: &str) -> usize {
        self.keys.borrow().iter().filter(|k| *k == key).count()
    }
}

impl Store for Watched<'_> {
    fn get(&self, key: &str) -> Result<Versioned, StoreError> {
        self.reads.set(self.reads.get() + 1);
        self.keys.borrow_mut().push(key.to_string());
        self.vm.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        if let Some((prefix, error, n)) = self.fails.get().filter(|f| key.starts_with(f.0)) {
            self.fails.set((n > 1).then_some((prefix, error, n - 1)));
            return Err(error);
        }
        if key.starts_with("kvgate.pod.") && cas.is_some() {
            if let Some(other) = self.meanwhile.borrow_mut().take() {
                other();
            }
        }
        self.vm.set(key, value, cas)
    }
    fn register_queue(&self, name: &str) -> Result<u32, StoreError> {
        self.vm.register_queue(name)
    }
    fn resolve_queue(&self, name: &str) -> Result<Option<u32>, StoreError> {
        self.vm.resolve_queue(name)
    }
    fn enqueue(&self, queue: u32, message: &[u8]) -> Result<(), StoreError> {
        self.vm.enqueue(queue, message)
    }
    fn dequeue(&self, queue: u32) -> Result<Option<Vec<u8>>, StoreError> {
        self.vm.dequeue(queue)
    }
    fn now_us(&self) -> u64 {
        self.vm.now_us()
    }
}
