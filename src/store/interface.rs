//! The one interface through which kvgate touches state shared between Envoy's worker VMs:
//! shared data (get, compare-and-swap set), shared queues and the clock.
//!
//! The shell implements it with proxy-wasm hostcalls; tests use `store::fake_host` (built for
//! tests and the `fake-host` feature), which keeps Envoy's semantics. Keys cannot be deleted or
//! listed on the real host, so every module that stores state documents a bounded key schema.

/// Why a store operation failed. The host never panics the core: every failure is a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// The value changed since it was read (compare-and-swap lost a race).
    CasMismatch,
    /// A queue id that no VM registered, or that was never resolved.
    NotFound,
    /// Any other host status (its raw code), e.g. a host that does not support the call.
    Host(u32),
}

/// A value read from shared data, with the version to pass back for compare-and-swap.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Versioned {
    pub value: Option<Vec<u8>>,
    pub cas: Option<u32>,
}

pub trait Store {
    /// Reads a key; a missing key is `Ok` with no value and no version.
    fn get(&self, key: &str) -> Result<Versioned, StoreError>;
    /// Writes a key. With `cas`, fails with `CasMismatch` unless the version is current; a CAS on
    /// a missing key is ignored by Envoy and creates the key.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
    /// Registers a queue owned by this VM; the host notifies this VM when something is enqueued.
    fn register_queue(&self, name: &str) -> Result<u32, StoreError>;
    /// Finds a queue by name, registered by any VM of this plugin.
    fn resolve_queue(&self, name: &str) -> Result<Option<u32>, StoreError>;
    fn enqueue(&self, queue: u32, message: &[u8]) -> Result<(), StoreError>;
    fn dequeue(&self, queue: u32) -> Result<Option<Vec<u8>>, StoreError>;
    /// Wall-clock microseconds, from the host: what happens within a millisecond (where a pod
    /// is in an engine step of a few milliseconds, `routing::step_phase`) needs them.
    fn now_us(&self) -> u64;
    /// Wall-clock milliseconds: every other time kvgate keeps.
    fn now_ms(&self) -> u64 {
        self.now_us() / 1_000
    }
}

/// How many times a read-modify-write retries a lost compare-and-swap before giving up. Races are
/// between a handful of worker threads, so a lost race almost always succeeds on the next try.
pub(crate) const CAS_ATTEMPTS: usize = 16;

/// Creates `key` with `initial` if it has no value yet: what every module does with its keys
/// before traffic can touch them (see [`update`]). A blind write, so callers run it where no
/// other VM races them (configure time, or the single writer of the pod set).
pub fn create_if_missing(store: &dyn Store, key: &str, initial: &[u8]) -> Result<(), StoreError> {
    if store.get(key)?.value.is_none() {
        store.set(key, initial, None)?;
    }
    Ok(())
}

/// Reads `key`, applies `change` and writes the result with compare-and-swap, retrying lost races.
/// On a missing key the write is a blind create (Envoy ignores CAS there), so two VMs creating the
/// same key at once can lose one write: modules create their keys before traffic can touch them
/// (at configure time, or when the single pod-set writer publishes a new pod).
/// `change` returns `None` to leave the value as it is (nothing is written); the returned value is
/// what `change` produced on the attempt that stuck.
pub fn update<T>(
    store: &dyn Store,
    key: &str,
    change: impl FnMut(Option<&[u8]>) -> Option<(Vec<u8>, T)>,
) -> Result<Option<T>, StoreError> {
    update_from(store, key, None, change)
}

/// `update` starting from `seen`, the key as read a moment ago (in the same callback), instead of
/// reading it again: when nobody wrote it since, the compare-and-swap succeeds without a read;
/// when somebody did, it fails and the next attempt reads. A value seen without a version (a
/// missing key) is not used: its write would be blind. Only the current value may refuse: when
/// `change` declines the seen one, the key is read again and asked once more.
pub fn update_from<T>(
    store: &dyn Store,
    key: &str,
    seen: Option<Versioned>,
    mut change: impl FnMut(Option<&[u8]>) -> Option<(Vec<u8>, T)>,
) -> Result<Option<T>, StoreError> {
    let mut seen = seen.filter(|v| v.cas.is_some());
    let mut attempts = 0;
    while attempts < CAS_ATTEMPTS {
        let (current, was_seen) = match seen.take() {
            Some(v) => (v, true),
            None => (store.get(key)?, false),
        };
        let Some((bytes, out)) = change(current.value.as_deref()) else {
            if was_seen {
                continue;
            }
            return Ok(None);
        };
        attempts += 1;
        match store.set(key, &bytes, current.cas) {
            Ok(()) => return Ok(Some(out)),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}

/// `update` for a record kept with its own codec: decodes the current value (a default one when
/// the key is missing or unreadable), applies `change` and writes it back, retrying lost races.
pub fn update_record<T: Default>(
    store: &dyn Store,
    key: &str,
    decode: impl Fn(&[u8]) -> Option<T>,
    encode: impl Fn(&T) -> Vec<u8>,
    mut change: impl FnMut(&mut T),
) -> Result<(), StoreError> {
    update(store, key, |bytes| {
        let mut value = bytes.and_then(&decode).unwrap_or_default();
        change(&mut value);
        Some((encode(&value), ()))
    })
    .map(|_| ())
}
