#![cfg(not(target_arch = "wasm32"))]
//! The heap a body's parse takes, whatever its shape, a request's or an answer's: every list a
//! request's body may hold (messages,
//! content parts, input items and strings, tool JSON, score inputs, per-prompt sampling
//! parameters) is rendered as it is read, one element at a time (`openai::render`), so a body of
//! the smallest elements a list may hold takes a few times its size at most. Read into lists of
//! structs, a 1 MiB body of empty messages took 144 MiB while it parsed, and a wasm VM's memory,
//! once grown, never shrinks. An answer's body is read for its usage (`ResponseMeter`) without
//! being copied into a tree of values first, which took 25 to 65 times it.
//!
//! Its own test binary: the counting allocator is this process's.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

use kvgate::openai::request::{Api, Request};
use kvgate::openai::response::ResponseMeter;

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
    let _alone = alone();
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
        let (parsed, times) = peak_of(body.len(), || Request::parse(api, &body).map(drop));
        println!("{name:22} {:8} bytes: peak {times:4.1}x", body.len());
        assert!(parsed.is_ok(), "{name}: {:?}", parsed.err());
        if times > 8.0 {
            worst.push((name, times));
        }
    }
    assert!(worst.is_empty(), "parses past 8x their body: {worst:?}");
}

/// One test at a time: tests run on threads of their own, and the count is the process's.
fn alone() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// The peak of live heap while `read` runs, in times `bytes`.
fn peak_of<T>(bytes: usize, read: impl FnOnce() -> T) -> (T, f64) {
    let live = LIVE.load(Relaxed);
    PEAK.store(live, Relaxed);
    let out = read();
    (out, (PEAK.load(Relaxed) - live) as f64 / bytes as f64)
}

#[test]
fn an_answers_usage_is_read_in_a_few_times_its_size_whatever_its_shape() {
    let _alone = alone();
    let answer = r#"{"text":"a","output_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16],"meta_info":{"id":"x","prompt_tokens":10,"completion_tokens":16,"finish_reason":{"type":"length"}}},"#;
    let shapes = [
        ("an SGLang batch of answers", fill("[", answer, "]"), true),
        ("no usage, numbers", fill(r#"{"data":["#, "0,", "]}"), false),
        (
            "no usage, empty objects",
            fill(r#"{"data":["#, "{},", "]}"),
            false,
        ),
        ("a list of empty objects", fill("[", "{},", "]"), false),
        (
            "usage, then numbers",
            fill(r#"{"usage":{"prompt_tokens":1},"data":["#, "0,", "]}"),
            true,
        ),
    ];
    let mut worst = Vec::new();
    for (name, body, has_usage) in shapes {
        let (usage, times) = peak_of(body.len(), || {
            let mut meter = ResponseMeter::new(Some("application/json"));
            body.chunks(16 << 10)
                .for_each(|piece| _ = meter.feed(piece));
            meter.finish()
        });
        println!("{name:28} {:8} bytes: peak {times:4.1}x", body.len());
        assert_eq!(usage.is_some(), has_usage, "{name}");
        if times > 3.0 {
            worst.push((name, times));
        }
    }
    assert!(
        worst.is_empty(),
        "answers read past 3x their body: {worst:?}"
    );
}
