//! The only caller of `proxy_wasm::hostcalls` (and of `raw`, for header values): the `Store`
//! implementation and the few request and response calls the HTTP context needs, each returning
//! `Result`/`Option` so no host error can panic the VM.

use super::raw;
use crate::reply::LocalReply;
use crate::store::{Store, StoreError, Versioned};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, Status};
use std::time::UNIX_EPOCH;

fn store_error(s: Status) -> StoreError {
    match s {
        Status::CasMismatch => StoreError::CasMismatch,
        Status::NotFound => StoreError::NotFound,
        other => StoreError::Host(other as u32),
    }
}

/// Shared data, shared queues and the clock of the Envoy process.
pub struct HostStore;

impl Store for HostStore {
    fn get(&self, key: &str) -> Result<Versioned, StoreError> {
        let (value, cas) = hostcalls::get_shared_data(key).map_err(store_error)?;
        Ok(Versioned { value, cas })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        hostcalls::set_shared_data(key, Some(value), cas).map_err(store_error)
    }

    fn register_queue(&self, name: &str) -> Result<u32, StoreError> {
        hostcalls::register_shared_queue(name).map_err(store_error)
    }

    fn resolve_queue(&self, name: &str) -> Result<Option<u32>, StoreError> {
        // Queues are resolved within this plugin's VM id, which is empty unless configured.
        hostcalls::resolve_shared_queue("", name).map_err(store_error)
    }

    fn enqueue(&self, queue: u32, message: &[u8]) -> Result<(), StoreError> {
        hostcalls::enqueue_shared_queue(queue, Some(message)).map_err(store_error)
    }

    fn dequeue(&self, queue: u32) -> Result<Option<Vec<u8>>, StoreError> {
        hostcalls::dequeue_shared_queue(queue).map_err(store_error)
    }

    fn now_ms(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64)
    }
}

/// A header's value as text: bytes that are not UTF-8 (HTTP allows them) become U+FFFD.
fn header(map: MapType, name: &str) -> Option<String> {
    raw::header_value(map, name).map(|v| String::from_utf8_lossy(&v).into_owned())
}

pub fn request_header(name: &str) -> Option<String> {
    header(MapType::HttpRequestHeaders, name)
}

pub fn response_header(name: &str) -> Option<String> {
    header(MapType::HttpResponseHeaders, name)
}

/// The upstream host that served the request (`ip:port`), from Envoy's `upstream.address`.
pub fn upstream_address() -> Option<String> {
    hostcalls::get_property(vec!["upstream", "address"])
        .ok()
        .flatten()
        .and_then(|b| String::from_utf8(b).ok())
}

pub fn remove_request_header(name: &str) {
    let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, name);
}

pub fn set_request_header(name: &str, value: &str) {
    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value));
}

pub fn add_response_header(name: &str, value: &str) {
    let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value);
}

pub fn request_body(size: usize) -> Vec<u8> {
    hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
        .ok()
        .flatten()
        .unwrap_or_default()
}

pub fn response_body(size: usize) -> Vec<u8> {
    hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size)
        .ok()
        .flatten()
        .unwrap_or_default()
}

pub fn resume_request() {
    if let Err(e) = hostcalls::resume_http_request() {
        log::debug!("kvgate: resume failed: {e:?}");
    }
}

/// Makes a parked stream the one later calls act on; false when the stream is gone.
pub fn switch_to(context_id: u32) -> bool {
    hostcalls::set_effective_context(context_id).is_ok()
}

pub fn send_reply(reply: &LocalReply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    if let Err(e) = hostcalls::send_http_response(reply.status, headers, Some(&reply.body)) {
        log::warn!("kvgate: local reply {} failed: {e:?}", reply.status);
    }
}

pub fn plugin_configuration() -> Vec<u8> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
        .ok()
        .flatten()
        .unwrap_or_default()
}

thread_local! {
    /// Envoy metric ids by name, defined on first use (a VM is single-threaded).
    static METRICS: std::cell::RefCell<hashbrown::HashMap<String, u32>> = Default::default();
}

/// Sends the core's buffered stats to Envoy.
pub fn flush_stats(stats: &mut crate::stats::Stats) {
    use crate::stats::Stat;
    use proxy_wasm::types::MetricType;
    METRICS.with(|m| {
        let mut ids = m.borrow_mut();
        for stat in stats.drain() {
            let (name, kind) = match &stat {
                Stat::Counter(n, _) => (n, MetricType::Counter),
                Stat::Gauge(n, _) => (n, MetricType::Gauge),
                Stat::Histogram(n, _) => (n, MetricType::Histogram),
            };
            let id = match ids.get(name) {
                Some(id) => *id,
                None => match hostcalls::define_metric(kind, name) {
                    Ok(id) => {
                        ids.insert(name.clone(), id);
                        id
                    }
                    Err(_) => continue,
                },
            };
            let _ = match stat {
                Stat::Counter(_, by) => hostcalls::increment_metric(id, by as i64),
                Stat::Gauge(_, v) | Stat::Histogram(_, v) => hostcalls::record_metric(id, v),
            };
        }
    });
}

pub fn set_tick_period(ms: u64) {
    let _ = hostcalls::set_tick_period(std::time::Duration::from_millis(ms));
}

/// Sends a GET to `cluster`; returns the callout token.
pub fn dispatch_get(
    cluster: &str,
    path: &str,
    headers: &[(String, String)],
    timeout_ms: u64,
) -> Option<u32> {
    let mut all: Vec<(&str, &str)> = vec![(":method", "GET"), (":path", path)];
    all.extend(headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    hostcalls::dispatch_http_call(
        cluster,
        all,
        None,
        vec![],
        std::time::Duration::from_millis(timeout_ms),
    )
    .ok()
}

/// The status and body of the callout response being delivered.
pub fn call_response(body_size: usize) -> (Option<u32>, Vec<u8>) {
    let status = header(MapType::HttpCallResponseHeaders, ":status").and_then(|s| s.parse().ok());
    let body = if body_size == 0 {
        Vec::new()
    } else {
        // A metrics page larger than this is not worth holding in the VM's memory for good.
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size.min(4 << 20))
            .ok()
            .flatten()
            .unwrap_or_default()
    };
    (status, body)
}
