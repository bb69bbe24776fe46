//! The only caller of `proxy_wasm::hostcalls`: the `Store` implementation and the few request and
//! response calls the HTTP context needs, each returning `Result`/`Option` so no host error can
//! panic the VM.

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

pub fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
}

pub fn response_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpResponseHeaders, name)
        .ok()
        .flatten()
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
