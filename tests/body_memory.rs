#![cfg(not(target_arch = "wasm32"))]
//! The heap a body's parse takes, whatever its shape: every list a body may hold (messages,
//! content parts, input items and strings, tool JSON, score inputs, per-prompt sampling
//! parameters) is rendered as it is read, one element at a time (`openai::render`), so a body of
//! the smallest elements a list may hold takes a few times its size at most. Read into lists of
//! structs, a 1 MiB body of empty messages took 144 MiB while it parsed, and a wasm VM's memory,
//! once grown, never shrinks.
//!
//! Its own test binary: the counting allocator is this process's.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use kvgate::openai::request::{Api, Request};

/// The system allocator, counting the bytes live and the most live at once.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed to the system allocator as it came.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
        PEAK.fetch_max(live, Relaxed);
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const BODY: usize = 1 << 20;

/// A body of about `BODY` bytes: `head`, `element` as many times as fit (its last comma
/// dropped), `tail`.
fn fill(head: &str, element: &str, tail: &str) -> Vec<u8> {
    let n = (BODY - head.len() - tail.len()) / element.len();
    let mut body = String::from(head);
    body.push_str(&element.repeat(n));
    body.pop();
    body.push_str(tail);
    body.into_bytes()
}

#[test]
fn a_bodys_parse_takes_a_few_times_its_size_whatever_its_shape() {
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"#;
    let shapes = [
        (
            "empty messages",
            Api::ChatCompletions,
            fill(r#"{"messages":["#, "{},", "]}"),
        ),
        (
            "empty parts",
            Api::ChatCompletions,
            fill(r#"{"messages":[{"content":["#, "{},", "]}]}"),
        ),
        (
            "empty tool results",
            Api::Messages,
            fill(
                r#"{"max_tokens":1,"messages":[{"content":[{"type":"tool_result","content":["#,
                "{},",
                "]}]}]}",
            ),
        ),
        (
            "empty system blocks",
            Api::Messages,
            fill(r#"{"max_tokens":1,"messages":[{}],"system":["#, "{},", "]}"),
        ),
        (
            "empty items",
            Api::Responses,
            fill(r#"{"input":["#, "{},", "]}"),
        ),
        (
            "empty strings",
            Api::Embeddings,
            fill(r#"{"input":["#, r#""","#, "]}"),
        ),
        (
            "escaped strings",
            Api::Embeddings,
            fill(r#"{"input":["#, r#""\n","#, "]}"),
        ),
        (
            "one-id lists",
            Api::Completions,
            fill(r#"{"prompt":["#, "[1],", "]}"),
        ),
        (
            "tool JSON",
            Api::ChatCompletions,
            fill(&format!(r#"{chat}"tools":["#), "0,", "]}"),
        ),
        (
            "tool calls",
            Api::ChatCompletions,
            fill(r#"{"messages":[{"tool_calls":["#, "0,", "]}]}"),
        ),
        (
            "a flag's list",
            Api::ChatCompletions,
            fill(&format!(r#"{chat}"ignore_eos":["#), "0,", "]}"),
        ),
        (
            "empty documents",
            Api::Score,
            fill(r#"{"query":"q","documents":["#, r#""","#, "]}"),
        ),
        (
            "empty document parts",
            Api::Score,
            fill(r#"{"query":"q","documents":{"content":["#, "{},", "]}}"),
        ),
        (
            "sampling lists",
            Api::Generate,
            fill(r#"{"text":"hi","sampling_params":["#, "{},", "]}"),
        ),
        (
            "adapter lists",
            Api::Generate,
            fill(r#"{"text":"hi","lora_path":["#, "null,", "]}"),
        ),
        (
            "prose",
            Api::ChatCompletions,
            fill(r#"{"messages":[{"content":""#, "word ", r#""}]}"#),
        ),
    ];
    let mut worst = Vec::new();
    for (name, api, body) in shapes {
        let live = LIVE.load(Relaxed);
        PEAK.store(live, Relaxed);
        let parsed = Request::parse(api, &body);
        let peak = PEAK.load(Relaxed) - live;
        let times = peak as f64 / body.len() as f64;
        println!(
            "{name:22} {:8} bytes: peak {peak:9} bytes ({times:4.1}x)",
            body.len()
        );
        assert!(parsed.is_ok(), "{name}: {:?}", parsed.err());
        drop(parsed);
        if times > 8.0 {
            worst.push((name, times));
        }
    }
    assert!(worst.is_empty(), "parses past 8x their body: {worst:?}");
}
