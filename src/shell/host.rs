//! The one place that calls the host: the `Store` implementation, the request and response calls
//! the HTTP context needs, stats, the tick and logging. All of it goes through `raw`, where every
//! host status is an answer, so no host error can panic the VM; the one SDK wrapper left is
//! `hostcalls::dispatch_http_call` (see `dispatch_get`).

use super::raw;
use crate::openai::header_map::HeaderMap;
use crate::openai::reply::LocalReply;
use crate::store::interface::{Store, StoreError, Versioned};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, StreamType};

fn store_error(status: u32) -> StoreError {
    match status {
        raw::CAS_MISMATCH => StoreError::CasMismatch,
        raw::NOT_FOUND => StoreError::NotFound,
        other => StoreError::Host(other),
    }
}

/// Shared data, shared queues and the clock of the Envoy process, for one callback: the clock is
/// read once per callback (a host call each time it was read before, a dozen per request) and
/// the instant stands for the whole callback, which runs in microseconds. Make a new one per
/// callback (`HostStore::default()`); a store kept across callbacks would stop the clock.
#[derive(Default)]
pub struct HostStore {
    now_us: std::cell::Cell<Option<u64>>,
}

impl Store for HostStore {
    fn get(&self, key: &str) -> Result<Versioned, StoreError> {
        match raw::get_shared_data(key) {
            Ok((value, cas)) => Ok(Versioned { value, cas }),
            Err(raw::NOT_FOUND) => Ok(Versioned::default()),
            Err(status) => Err(store_error(status)),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        raw::set_shared_data(key, value, cas).map_err(store_error)
    }

    fn register_queue(&self, name: &str) -> Result<u32, StoreError> {
        raw::register_shared_queue(name).map_err(store_error)
    }

    fn resolve_queue(&self, name: &str) -> Result<Option<u32>, StoreError> {
        // Queues are resolved within this plugin's VM id, which is empty unless configured.
        match raw::resolve_shared_queue("", name) {
            Ok(id) => Ok(Some(id)),
            Err(raw::NOT_FOUND) => Ok(None),
            Err(status) => Err(store_error(status)),
        }
    }

    fn enqueue(&self, queue: u32, message: &[u8]) -> Result<(), StoreError> {
        raw::enqueue_shared_queue(queue, message).map_err(store_error)
    }

    fn dequeue(&self, queue: u32) -> Result<Option<Vec<u8>>, StoreError> {
        match raw::dequeue_shared_queue(queue) {
            Err(raw::EMPTY) => Ok(None),
            other => other.map_err(store_error),
        }
    }

    fn now_us(&self) -> u64 {
        if let Some(now) = self.now_us.get() {
            return now;
        }
        let now = raw::get_current_time_nanoseconds().map_or(0, |ns| ns / 1_000);
        self.now_us.set(Some(now));
        now
    }
}

/// A header's value as text: bytes that are not UTF-8 (HTTP allows them) become U+FFFD.
fn header(map: MapType, name: &str) -> Option<String> {
    let value = raw::get_header_map_value(map, name).ok()?;
    // Valid UTF-8 (nearly every header) is taken as it is, without a second copy.
    Some(
        String::from_utf8(value)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()),
    )
}

/// All the request's headers, in one host call (a request reads up to ten).
pub fn request_headers() -> HeaderMap {
    raw::get_header_map_pairs(MapType::HttpRequestHeaders)
        .map(|bytes| HeaderMap::decode(&bytes))
        .unwrap_or_default()
}

/// One request header, for the rare path that needs one more than `request_headers` kept.
pub fn request_header(name: &str) -> Option<String> {
    header(MapType::HttpRequestHeaders, name)
}

pub fn response_header(name: &str) -> Option<String> {
    header(MapType::HttpResponseHeaders, name)
}

/// Envoy's node id (`--service-node`, or `node.id` in its bootstrap; Istio sets it per pod).
/// Envoy 1.40 names the attribute `xds.node`; a bare `node` is not found.
pub fn node_id() -> Option<String> {
    raw::get_property(&["xds", "node", "id"])
        .ok()
        .flatten()
        .and_then(|b| String::from_utf8(b).ok())
        .filter(|s| !s.is_empty())
}

/// The upstream host that served the request (`ip:port`), from Envoy's `upstream.address`.
pub fn upstream_address() -> Option<String> {
    raw::get_property(&["upstream", "address"])
        .ok()
        .flatten()
        .and_then(|b| String::from_utf8(b).ok())
}

pub fn remove_request_header(name: &str) {
    let _ = raw::remove_header_map_value(MapType::HttpRequestHeaders, name);
}

pub fn set_request_header(name: &str, value: &str) {
    let _ = raw::replace_header_map_value(MapType::HttpRequestHeaders, name, value);
}

/// Sets (not appends) a response header: kvgate's own `x-kvgate-*` answers replace any copy an
/// upstream sent under the same name, so a pod cannot speak for kvgate.
pub fn set_response_header(name: &str, value: &str) {
    let _ = raw::replace_header_map_value(MapType::HttpResponseHeaders, name, value);
}

/// The request's report for access logs (`accessLog`): Envoy keeps it as the stream's filter
/// state `wasm.kvgate`, which a log format reads as `%FILTER_STATE(wasm.kvgate:PLAIN)%`.
pub fn set_access_log(line: &str) {
    if let Err(status) = raw::set_property(&["kvgate"], line.as_bytes()) {
        log::debug!("access log property not set: status {status}");
    }
}

/// Up to `max_size` bytes of a buffer from its start; empty when there is none or on any error.
fn buffer(kind: BufferType, max_size: usize) -> Vec<u8> {
    raw::get_buffer_bytes(kind, 0, max_size)
        .ok()
        .flatten()
        .unwrap_or_default()
}

pub fn request_body(size: usize) -> Vec<u8> {
    buffer(BufferType::HttpRequestBody, size)
}

/// Replaces the buffered request body (its first `old_size` bytes: all of it) with `body`.
pub fn replace_request_body(old_size: usize, body: &[u8]) {
    if let Err(status) = raw::set_buffer_bytes(BufferType::HttpRequestBody, 0, old_size, body) {
        log::warn!("rewriting the request body failed: status {status}");
    }
}

pub fn response_body(size: usize) -> Vec<u8> {
    buffer(BufferType::HttpResponseBody, size)
}

pub fn resume_request() {
    if let Err(status) = raw::continue_stream(StreamType::HttpRequest) {
        log::debug!("resume failed: status {status}");
    }
}

/// Makes a parked stream the one later calls act on; false when the stream is gone.
pub fn switch_to(context_id: u32) -> bool {
    raw::set_effective_context(context_id).is_ok()
}

pub fn send_reply(reply: &LocalReply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    if let Err(status) = raw::send_local_response(reply.status, &headers, &reply.body) {
        log::warn!("local reply {} failed: status {status}", reply.status);
    }
}

pub fn plugin_configuration() -> Vec<u8> {
    buffer(BufferType::PluginConfiguration, usize::MAX)
}

thread_local! {
    /// When this VM last sent its stats (`flush_stats`), in ms.
    static LAST_FLUSH_MS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The longest a finished request's stats wait to be sent while its VM has other requests open.
const STATS_BATCH_MS: u64 = 50;
/// Stats buffered before they are sent regardless (bounds the buffer under any load).
const STATS_BATCH_MAX: usize = 4096;

/// Sends a finished request's stats, or keeps them for a later send while other requests of this
/// VM are open and the last send is recent: under load one send then carries many requests'
/// counters, summed, a host call per name instead of one per request and name. The last request
/// to finish sends everything, so a stat is never held once traffic stops.
pub fn flush_stats_batched(stats: &mut crate::stats::Stats, now_ms: u64, others_open: bool) {
    let recent = now_ms.saturating_sub(LAST_FLUSH_MS.get()) < STATS_BATCH_MS;
    if others_open && recent && stats.len() < STATS_BATCH_MAX {
        return;
    }
    LAST_FLUSH_MS.set(now_ms);
    flush_stats(stats);
}

/// Sends the core's buffered stats to Envoy (`Stats::send`: counters summed by name, gauges at
/// their last value, every histogram sample), each metric defined on its first send.
pub fn flush_stats(stats: &mut crate::stats::Stats) {
    use crate::stats::Kind;
    use proxy_wasm::types::MetricType;
    stats.send(|sent| {
        let id = match *sent.host_id {
            Some(id) => id,
            None => {
                let kind = match sent.kind {
                    Kind::Counter => MetricType::Counter,
                    Kind::Gauge => MetricType::Gauge,
                    Kind::Histogram => MetricType::Histogram,
                };
                match raw::define_metric(kind, sent.name) {
                    Ok(id) => *sent.host_id.insert(id),
                    Err(_) => return,
                }
            }
        };
        let _ = match sent.kind {
            Kind::Counter => raw::increment_metric(id, sent.value as i64),
            Kind::Gauge | Kind::Histogram => raw::record_metric(id, sent.value),
        };
    });
}

/// kvgate's `log` backend, in place of the SDK's (`proxy_wasm::set_log_level`), which unwraps every
/// `proxy_log` status.
struct HostLog;

static HOST_LOG: HostLog = HostLog;

impl log::Log for HostLog {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Trace => LogLevel::Trace,
            log::Level::Debug => LogLevel::Debug,
            log::Level::Info => LogLevel::Info,
            log::Level::Warn => LogLevel::Warn,
            log::Level::Error => LogLevel::Error,
        };
        // A line Envoy refuses is lost; there is nowhere else to report it.
        let _ = raw::log(level, &record.args().to_string());
    }

    fn flush(&self) {}
}

/// Sends the `log` macros at `level` and above to Envoy's log, and any panic at critical level.
pub fn install_logging(level: log::LevelFilter) {
    // Fails only when a logger is already set, and nothing else in the module sets one.
    let _ = log::set_logger(&HOST_LOG);
    log::set_max_level(level);
    // A panic aborts the VM and Envoy disables the plugin on this worker until restart; the code
    // is written not to panic, and this makes sure one that slips through is seen.
    std::panic::set_hook(Box::new(|info| {
        let _ = raw::log(LogLevel::Critical, &format!("kvgate panicked: {info}"));
    }));
}

/// Asks the host for the tick the gate wants now, if it changed (`Gate::retick`). From a stream's
/// context too: the host applies it to the VM's root context.
pub fn retick(gate: &mut crate::gate::Gate) {
    if let Some(ms) = gate.retick(&HostStore::default()) {
        let _ = raw::set_tick_period_milliseconds(u32::try_from(ms).unwrap_or(u32::MAX));
    }
}

/// Sends a GET, or a POST when `body` is given, to `cluster`; returns the callout token.
///
/// The one call left on the SDK's wrapper: its dispatcher delivers `on_http_call_response` only for
/// tokens that wrapper registered (`register_callout` is private to the SDK), and panics
/// "invalid token_id" on any other. The wrapper panics only on a status other than Ok, BadArgument
/// (unknown cluster, missing `:path`/`:method`/`:authority`) or InternalFailure, which is all
/// Envoy's `httpCall` returns.
pub fn dispatch(
    cluster: &str,
    path: &str,
    headers: &[(String, String)],
    body: Option<&[u8]>,
    timeout_ms: u64,
) -> Option<u32> {
    let method = if body.is_some() { "POST" } else { "GET" };
    let mut all: Vec<(&str, &str)> = vec![(":method", method), (":path", path)];
    all.extend(headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    hostcalls::dispatch_http_call(
        cluster,
        all,
        body,
        vec![],
        std::time::Duration::from_millis(timeout_ms),
    )
    .ok()
}

/// Sends one of the core's callouts from the current context (whose `on_http_call_response`
/// gets the answer); `None`, logged, when the host refuses it (the cluster is not defined).
pub fn send(call: &crate::pods::scrape::Call) -> Option<u32> {
    let token = dispatch(
        &call.cluster,
        &call.path,
        &call.headers,
        call.body.as_deref(),
        call.timeout_ms,
    );
    if token.is_none() {
        log::warn!("cannot call cluster `{}` (is it defined?)", call.cluster);
    }
    token
}

/// The status and body of the callout response being delivered.
pub fn call_response(body_size: usize) -> (Option<u32>, Vec<u8>) {
    let status = header(MapType::HttpCallResponseHeaders, ":status").and_then(|s| s.parse().ok());
    let body = if body_size == 0 {
        Vec::new()
    } else {
        // A metrics page larger than this is not worth holding in the VM's memory for good.
        buffer(BufferType::HttpCallResponseBody, body_size.min(4 << 20))
    };
    (status, body)
}
