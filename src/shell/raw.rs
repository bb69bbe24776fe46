//! Host calls made through the proxy-wasm ABI directly, where the SDK's wrapper can panic on
//! what a client controls: `hostcalls::get_map_value` unwraps `String::from_utf8` on the header's
//! value (one request with a non-UTF-8 header byte killed the plugin on every worker until Envoy
//! restarted) and panics on any status it did not expect. Here every status is an answer.

use proxy_wasm::types::MapType;
use std::ptr::null_mut;

#[allow(clashing_extern_declarations)] // the SDK declares the same import with its `Status` enum
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
}

const OK: u32 = 0;

/// The value of header `name` in `map`, as bytes; `None` when absent or on any host error.
pub fn header_value(map: MapType, name: &str) -> Option<Vec<u8>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: the key is a live slice for the call; on success the host returns a buffer it
    // allocated through this module's `proxy_on_memory_allocate` (the SDK's, a `Vec<u8>` of
    // exactly `size` bytes), so taking ownership with that length and capacity frees it rightly.
    unsafe {
        let status =
            proxy_get_header_map_value(map, name.as_ptr(), name.len(), &mut data, &mut size);
        if status != OK {
            return None;
        }
        if data.is_null() {
            return Some(Vec::new());
        }
        Some(Vec::from_raw_parts(data, size, size))
    }
}
