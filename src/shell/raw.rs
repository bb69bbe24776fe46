//! The proxy-wasm ABI (0.2.1) as kvgate calls it: every import returns its status as a plain
//! `u32`, and each wrapper turns it into a `Result` whose error is that status.
//!
//! Why not the SDK's `hostcalls`: proxy-wasm 0.2.5 panics in almost every wrapper on a status it did
//! not expect (`unexpected status`), unwraps `String::from_utf8` on header values (one request with a
//! non-UTF-8 header byte killed the plugin on every worker until Envoy restarted), and its logger
//! unwraps `proxy_log`. Its imports also return the `Status` enum, which lists only some of the
//! ABI's codes (0–12), so a status it does not list is undefined behaviour before any match.
//!
//! Panics that remain possible, all in SDK code kvgate cannot route around, and all needing a host
//! that breaks the ABI's contract:
//! - `hostcalls::dispatch_http_call` (kept in `host::dispatch_get`, see there) panics on a status
//!   other than Ok, BadArgument or InternalFailure; Envoy returns only those.
//! - The SDK's dispatcher, which owns the exported `proxy_on_*` callbacks: it panics on a duplicate
//!   or unknown context id or callout token, when `create_http_context` returns `None` (kvgate's root
//!   does so only when its `on_configure` failed, and the host then creates no stream in it), on
//!   a `RefCell` already borrowed (a host that re-enters the VM from inside a hostcall; Envoy defers
//!   `continue_stream` and local replies until the callback returns), and it calls
//!   `hostcalls::set_effective_context(..).unwrap()` before delivering a callout response to the
//!   root context that made the call, which exists for the VM's whole life.
//! - The SDK's `proxy_on_memory_allocate` panics or aborts when the host asks it for a buffer larger
//!   than the VM can hold; the host asks only for the size of a value it is handing back.

use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, StreamType};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicU64, Ordering};

const OK: u32 = 0;
pub const NOT_FOUND: u32 = 1;
pub const EMPTY: u32 = 7;
pub const CAS_MISMATCH: u32 = 8;

// Parameters exactly as the SDK's own declarations in `hostcalls.rs` (which its dispatcher and
// `dispatch_http_call` still use); only the return differs, and `u32` and its `#[repr(u32)]` `Status`
// are both an i32 in wasm, so the two declare one and the same import.
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: LogLevel, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        size: usize,
        buffer_data: *const u8,
        buffer_size: usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_remove_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_set_property(
        path_data: *const u8,
        path_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_register_shared_queue(
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_resolve_shared_queue(
        vm_id_data: *const u8,
        vm_id_size: usize,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_enqueue_shared_queue(queue_id: u32, value_data: *const u8, value_size: usize) -> u32;
    fn proxy_dequeue_shared_queue(
        queue_id: u32,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_continue_stream(stream_type: StreamType) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: MetricType,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
}

/// Host calls this VM has made (every wrapper below returns through `status`, so each counts once).
/// The HTTP context charges a request with the calls its own callbacks made: kvgate's cost per
/// request is mostly these crossings, and `kvgate.request.host_calls` shows them.
static CALLS: AtomicU64 = AtomicU64::new(0);

pub fn calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

fn status(code: u32) -> Result<(), u32> {
    CALLS.fetch_add(1, Ordering::Relaxed);
    match code {
        OK => Ok(()),
        other => Err(other),
    }
}

/// Runs a call that hands back a buffer through out-parameters; `None` when the host returned none
/// (it allocates nothing for an empty value).
fn read(call: impl FnOnce(*mut *mut u8, *mut usize) -> u32) -> Result<Option<Vec<u8>>, u32> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    status(call(&mut data, &mut size))?;
    if data.is_null() {
        return Ok(None);
    }
    // SAFETY: on Ok the host wrote a buffer it allocated through this module's exported
    // `proxy_on_memory_allocate` (the SDK's: a `Vec<u8>` of exactly `size` bytes, made into a boxed
    // slice), so owning it with that length and capacity frees it with the allocator that made it.
    Ok(Some(unsafe { Vec::from_raw_parts(data, size, size) }))
}

pub fn log(level: LogLevel, message: &str) -> Result<(), u32> {
    // SAFETY: the message is a live slice for the duration of the call.
    status(unsafe { proxy_log(level, message.as_ptr(), message.len()) })
}

pub fn get_current_time_nanoseconds() -> Result<u64, u32> {
    let mut time: u64 = 0;
    // SAFETY: `time` is a live, aligned u64 the host writes.
    status(unsafe { proxy_get_current_time_nanoseconds(&mut time) })?;
    Ok(time)
}

pub fn set_tick_period_milliseconds(period: u32) -> Result<(), u32> {
    // SAFETY: no pointers.
    status(unsafe { proxy_set_tick_period_milliseconds(period) })
}

pub fn get_buffer_bytes(
    buffer: BufferType,
    start: usize,
    max_size: usize,
) -> Result<Option<Vec<u8>>, u32> {
    // SAFETY: the out-parameters come from `read` and are live for the call.
    read(|data, size| unsafe { proxy_get_buffer_bytes(buffer, start, max_size, data, size) })
}

/// Replaces `size` bytes from `start` of a buffer with `data` (the whole body: 0, its size).
pub fn set_buffer_bytes(
    buffer: BufferType,
    start: usize,
    size: usize,
    data: &[u8],
) -> Result<(), u32> {
    // SAFETY: the data is a live slice for the call.
    status(unsafe { proxy_set_buffer_bytes(buffer, start, size, data.as_ptr(), data.len()) })
}

/// A header's value as bytes: HTTP allows bytes that are not UTF-8. Err(NOT_FOUND) when absent.
pub fn get_header_map_value(map: MapType, key: &str) -> Result<Vec<u8>, u32> {
    // SAFETY: the key is a live slice and the out-parameters come from `read`.
    let value = read(|data, size| unsafe {
        proxy_get_header_map_value(map, key.as_ptr(), key.len(), data, size)
    })?;
    Ok(value.unwrap_or_default())
}

/// Every header of a map in one call, serialized (`openai::header_map` reads it).
pub fn get_header_map_pairs(map: MapType) -> Result<Vec<u8>, u32> {
    // SAFETY: the out-parameters come from `read`.
    let value = read(|data, size| unsafe { proxy_get_header_map_pairs(map, data, size) })?;
    Ok(value.unwrap_or_default())
}

pub fn remove_header_map_value(map: MapType, key: &str) -> Result<(), u32> {
    // SAFETY: the key is a live slice for the call.
    status(unsafe { proxy_remove_header_map_value(map, key.as_ptr(), key.len()) })
}

pub fn replace_header_map_value(map: MapType, key: &str, value: &str) -> Result<(), u32> {
    // SAFETY: key and value are live slices for the call.
    status(unsafe {
        proxy_replace_header_map_value(map, key.as_ptr(), key.len(), value.as_ptr(), value.len())
    })
}

/// A property such as `["upstream", "address"]`; the ABI takes the path's parts joined by NUL.
pub fn get_property(path: &[&str]) -> Result<Option<Vec<u8>>, u32> {
    let path = path.join("\0");
    // SAFETY: the path is a live string and the out-parameters come from `read`.
    read(|data, size| unsafe { proxy_get_property(path.as_ptr(), path.len(), data, size) })
}

/// Sets a property of the stream: Envoy keeps a path of one part, `name`, as the stream's filter
/// state `wasm.<name>` (its `Context::setProperty`), which access logs read.
pub fn set_property(path: &[&str], value: &[u8]) -> Result<(), u32> {
    let path = path.join("\0");
    // SAFETY: path and value are live slices for the call.
    status(unsafe { proxy_set_property(path.as_ptr(), path.len(), value.as_ptr(), value.len()) })
}

/// The value (none when empty) and its version; the ABI's version 0 means none.
pub fn get_shared_data(key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), u32> {
    let mut cas: u32 = 0;
    // SAFETY: the key is a live slice, `cas` a live u32, the other out-parameters come from `read`.
    let value = read(|data, size| unsafe {
        proxy_get_shared_data(key.as_ptr(), key.len(), data, size, &mut cas)
    })?;
    Ok((value, (cas != 0).then_some(cas)))
}

/// Writes a key; `cas` None (the ABI's 0) writes whatever the current version is.
pub fn set_shared_data(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), u32> {
    // SAFETY: key and value are live slices for the call.
    status(unsafe {
        proxy_set_shared_data(
            key.as_ptr(),
            key.len(),
            value.as_ptr(),
            value.len(),
            cas.unwrap_or(0),
        )
    })
}

pub fn register_shared_queue(name: &str) -> Result<u32, u32> {
    let mut id: u32 = 0;
    // SAFETY: the name is a live slice and `id` a live u32 the host writes.
    status(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn resolve_shared_queue(vm_id: &str, name: &str) -> Result<u32, u32> {
    let mut id: u32 = 0;
    // SAFETY: vm id and name are live slices and `id` a live u32 the host writes.
    status(unsafe {
        proxy_resolve_shared_queue(
            vm_id.as_ptr(),
            vm_id.len(),
            name.as_ptr(),
            name.len(),
            &mut id,
        )
    })?;
    Ok(id)
}

pub fn enqueue_shared_queue(queue: u32, message: &[u8]) -> Result<(), u32> {
    // SAFETY: the message is a live slice for the call.
    status(unsafe { proxy_enqueue_shared_queue(queue, message.as_ptr(), message.len()) })
}

/// The next message, or Err(EMPTY) when there is none.
pub fn dequeue_shared_queue(queue: u32) -> Result<Option<Vec<u8>>, u32> {
    // SAFETY: the out-parameters come from `read` and are live for the call.
    read(|data, size| unsafe { proxy_dequeue_shared_queue(queue, data, size) })
}

pub fn continue_stream(stream: StreamType) -> Result<(), u32> {
    // SAFETY: no pointers.
    status(unsafe { proxy_continue_stream(stream) })
}

pub fn set_effective_context(context_id: u32) -> Result<(), u32> {
    // SAFETY: no pointers.
    status(unsafe { proxy_set_effective_context(context_id) })
}

/// Answers the current stream locally (not as gRPC: the ABI's grpc_status -1), with no details.
pub fn send_local_response(
    status_code: u32,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(), u32> {
    let headers = serialize_map(headers);
    // SAFETY: body and serialized headers are live slices for the call; a null details pointer
    // with size 0 is how the ABI (and the SDK) says "none".
    status(unsafe {
        proxy_send_local_response(
            status_code,
            null(),
            0,
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            -1,
        )
    })
}

pub fn define_metric(kind: MetricType, name: &str) -> Result<u32, u32> {
    let mut id: u32 = 0;
    // SAFETY: the name is a live slice and `id` a live u32 the host writes.
    status(unsafe { proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn increment_metric(id: u32, offset: i64) -> Result<(), u32> {
    // SAFETY: no pointers.
    status(unsafe { proxy_increment_metric(id, offset) })
}

pub fn record_metric(id: u32, value: u64) -> Result<(), u32> {
    // SAFETY: no pointers.
    status(unsafe { proxy_record_metric(id, value) })
}

/// The ABI's header map: the pair count, each pair's name and value lengths (u32, little endian),
/// then each name and value followed by a NUL. The SDK's serializer is private to it.
fn serialize_map(pairs: &[(&str, &str)]) -> Vec<u8> {
    let text: usize = pairs.iter().map(|(n, v)| n.len() + v.len() + 2).sum();
    let mut bytes = Vec::with_capacity(4 + pairs.len() * 8 + text);
    // Lengths fit in u32: a wasm32 slice is shorter than 4 GiB.
    bytes.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (name, value) in pairs {
        bytes.extend_from_slice(&(name.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(value.len() as u32).to_le_bytes());
    }
    for (name, value) in pairs {
        bytes.extend_from_slice(name.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(value.as_bytes());
        bytes.push(0);
    }
    bytes
}
