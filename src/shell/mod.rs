//! The proxy-wasm shell: binds the core to Envoy. Nothing else in the crate imports proxy_wasm.
//! `root` owns the per-VM lifecycle (configure, tick, queues, callouts), `http` moves one request's
//! data between the host and `flow`, `host` is the one place that calls the host (through `raw`
//! where the SDK's wrapper could panic).

mod host;
mod http;
mod raw;
mod root;

use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // A panic aborts the VM and Envoy disables the plugin on this worker until restart; the code
    // is written not to panic, and this makes sure one that slips through is seen.
    std::panic::set_hook(Box::new(|info| {
        let _ = proxy_wasm::hostcalls::log(LogLevel::Critical, &format!("kvgate panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|_| Box::new(root::Root::default()));
}}
