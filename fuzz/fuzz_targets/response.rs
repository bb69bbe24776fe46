//! The response meter: arbitrary bytes, as SSE or as a JSON body, fed in one piece and in
//! arbitrary pieces.
//!
//! Input layout: byte 0 picks the content type (bits 0-1) and, when bits 2-6 are all set, inserts
//! `data: xxx…` of 1 MiB - 1 + (bit 7) bytes at the first cut point, at the meter's line buffer
//! limit (the rest of the line it lands in pushes it over); byte 1 is the number of cut points k
//! (its low four bits) and the answers the meter follows, one more than its high four bits; then
//! k little-endian u16 cut points; the rest is the body. A seed is `\x00\x00` + an SSE stream.
//!
//! Invariants: no panic; `feed` returns exactly the growth of `pieces`, which never
//! decreases; one piece, the given pieces and (for short bodies) byte-by-byte feeding end with
//! the same `pieces`, the same `finish()` usage and the same answers ended; following answers
//! changes neither the pieces nor the usage, and the answers ended are at most those followed,
//! with at most the stream's pieces. A JSON object's usage reads the same behind a megabyte of
//! spaces, walked past the limit the meter keeps (`long_body`).
#![no_main]

use kvgate::openai::response::{EndedAnswers, ResponseMeter, Usage};
use kvgate_fuzz::{cut_input, pieces};
use libfuzzer_sys::fuzz_target;

const CONTENT_TYPES: [Option<&str>; 4] = [
    Some("text/event-stream"),
    Some("application/json"),
    Some("text/event-stream; charset=utf-8"),
    None,
];
/// The meter's MAX_KEPT (private in response.rs).
const MAX_KEPT: usize = 1024 * 1024;

type Read = (u64, Option<Usage>, EndedAnswers);

fn run(content_type: Option<&str>, answers: u64, body: &[u8], cuts: &[(usize, usize)]) -> Read {
    let mut m = ResponseMeter::new(content_type).answering(answers);
    let mut total = 0u64;
    for &(a, b) in cuts {
        let before = m.pieces;
        let n = m.feed(&body[a..b]);
        assert!(m.pieces >= before, "streamed tokens went down");
        assert_eq!(m.pieces - before, n, "feed's return is the growth");
        total += n;
    }
    assert_eq!(total, m.pieces);
    let usage = m.finish();
    let ended = m.ended();
    assert!(
        ended.answers <= answers && ended.pieces <= m.pieces,
        "{ended:?}"
    );
    (m.pieces, usage, ended)
}

fuzz_target!(|data: &[u8]| {
    let Some((mode, count, cuts, body)) = cut_input(data) else {
        return;
    };
    let answers = 1 + u64::from(count >> 4);
    let mut body = body.to_vec();
    if mode & 0x7c == 0x7c {
        // Text just under or at the buffer limit, placed at the first cut point.
        let at = cuts
            .first()
            .map_or(0, |&c| usize::from(c) % (body.len() + 1));
        let len = MAX_KEPT - 1 + usize::from(mode >> 7);
        let mut long = b"data: ".to_vec();
        long.resize(len, b'x');
        body.splice(at..at, long);
    }
    let content_type = CONTENT_TYPES[usize::from(mode & 3)];
    let whole = run(content_type, answers, &body, &[(0, body.len())]);
    let split = run(content_type, answers, &body, &pieces(body.len(), &cuts));
    assert_eq!(whole, split, "one piece vs pieces at {cuts:?}");
    if body.len() <= 256 {
        let bytes: Vec<(usize, usize)> = (0..body.len()).map(|i| (i, i + 1)).collect();
        assert_eq!(
            whole,
            run(content_type, answers, &body, &bytes),
            "one piece vs byte by byte"
        );
    }
    if answers > 1 {
        let one = run(content_type, 1, &body, &[(0, body.len())]);
        assert_eq!((one.0, one.1), (whole.0, whole.1), "following answers");
    }
    // A JSON object past the limit the meter keeps is walked for its usage instead (its value
    // copied up to 4 KB): it reads what the same object kept whole reads.
    let sse = content_type.is_some_and(|c| c.contains("event-stream"));
    let object = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&body);
    if !sse && body.len() < 4096 && object.is_ok() {
        let mut long = vec![b' '; MAX_KEPT];
        long.extend_from_slice(&body);
        let walked = run(content_type, answers, &long, &pieces(long.len(), &cuts));
        assert_eq!(walked.1, whole.1, "walked past the limit vs kept");
    }
});
