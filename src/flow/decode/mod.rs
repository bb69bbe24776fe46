//! An answer's coding undone as it streams, so that an answer that reaches kvgate compressed is
//! metered as a plain one: its tokens as they come, its `usage`, a Responses API answer's id.
//! That happens when Envoy's compressor filter is listed after kvgate (responses run the filters
//! in reverse order; OpenAI's SDKs ask for gzip, browsers, Node's fetch over HTTPS and httpx with
//! brotli installed for brotli too), which an Istio EnvoyFilter inserting a compressor "before the
//! router" does as readily as not. Envoy's compressor flushes each data frame it encodes
//! (`Compressor::State::Flush`, for gzip and brotli alike), so each chunk decodes to the text it
//! carried, with no wait for the next.
//!
//! The bytes Envoy hands the filter are the source of truth; a decoder keeps only its own state
//! (gzip's deflate window, about 43 KB; brotli's, as large as its stream declares) while the
//! answer runs. [`Room`] is what a VM's open decoders may hold, in the VM's [`crate::gate::Gate`].
//! Other codings (`zstd`, `deflate`) are not decoded: `Flow::on_response_encoded` grows those at
//! the pod's pace.

pub mod brotli;
pub mod gzip;

use brotli::Unbrotli;
use gzip::Gunzip;

/// The most one answer may decode to before kvgate stops reading it: an answer's text is
/// megabytes at most, and a stream that decodes to far more is not one (a decompression bomb
/// would otherwise hold the worker while it inflates).
const MAX_DECODED: usize = 64 << 20;
/// Decoded a piece at a time, each handed to the meter before the next.
const PIECE: usize = 16 << 10;

/// The body is not in the coding it said it was, decodes past `MAX_DECODED`, or (brotli) needs a
/// window past what the VM's [`Room`] has left.
#[derive(Debug, PartialEq, Eq)]
pub struct Broken;

/// The output buffer for one chunk's input: sized to what the chunk likely holds (a streamed
/// token's chunk decodes to a few hundred bytes), so each chunk does not clear a whole piece.
fn output_for(input: &[u8]) -> Vec<u8> {
    vec![0u8; input.len().saturating_mul(8).clamp(1024, PIECE)]
}

/// What a VM's open decoders hold. Each gzip decoder is about 43 KB, so their number is bounded;
/// a brotli decoder's window is the stream's own (1 KB to 16 MB, 256 KB at Envoy's default
/// `window_bits` of 18), so what their windows add up to is.
#[derive(Debug, Default)]
pub struct Room {
    gzips: usize,
    windows: usize,
    brotlis: usize,
}

impl Room {
    /// At most this many gzip decoders a VM: 64 add at most 2.8 MB to it (Envoy's compressor
    /// holds as much per stream on its side). Beyond it an answer is grown at its pod's pace, as
    /// one in a coding not decoded.
    pub const MAX_GZIPS: usize = 64;
    /// At most this much of brotli windows a VM: 8 streams at Envoy's default window, so that
    /// with the gzip decoders' 2.8 MB a VM's decoders hold under 5 MB whatever its answers (a
    /// VM's memory never shrinks). A stream whose window does not fit is grown at its pod's pace.
    pub const MAX_WINDOWS: usize = 2 << 20;

    /// The decoders open in this VM.
    pub fn open(&self) -> usize {
        self.gzips + self.brotlis
    }
}

/// One answer's decoder.
pub enum Decoder {
    Gzip(Gunzip),
    Brotli(Unbrotli),
}

impl Decoder {
    /// A decoder for `coding` (a `content-encoding` value), when it is one this decodes and the
    /// VM has room for it; a brotli stream's window is charged when its first byte declares it.
    pub fn open(coding: &str, room: &mut Room) -> Option<Decoder> {
        let c = coding.trim();
        if c.eq_ignore_ascii_case("gzip") || c.eq_ignore_ascii_case("x-gzip") {
            (room.gzips < Room::MAX_GZIPS).then(|| {
                room.gzips += 1;
                Decoder::Gzip(Gunzip::default())
            })
        } else if c.eq_ignore_ascii_case("br") {
            room.brotlis += 1;
            Some(Decoder::Brotli(Unbrotli::default()))
        } else {
            None
        }
    }

    /// The coding's name, as `content-encoding` gives it.
    pub fn coding(&self) -> &'static str {
        match self {
            Decoder::Gzip(_) => "gzip",
            Decoder::Brotli(_) => "br",
        }
    }

    /// Decodes the next piece of the body, handing the text to `each` as it comes, a `PIECE` at
    /// a time at most.
    pub fn feed(
        &mut self,
        room: &mut Room,
        bytes: &[u8],
        each: &mut dyn FnMut(&[u8]),
    ) -> Result<(), Broken> {
        match self {
            Decoder::Gzip(g) => g.feed(bytes, each),
            Decoder::Brotli(b) => b.feed(&mut room.windows, bytes, each),
        }
    }

    /// Gives back what this decoder held of the VM's room.
    pub fn close(self, room: &mut Room) {
        match self {
            Decoder::Gzip(_) => room.gzips = room.gzips.saturating_sub(1),
            Decoder::Brotli(b) => {
                room.brotlis = room.brotlis.saturating_sub(1);
                room.windows = room.windows.saturating_sub(b.charged());
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    /// A streamed answer's text, with a long run at its end: a few coded bytes decode to many
    /// pieces, so a decoder has text left to hand out when a chunk's input is all read.
    pub(crate) fn long_answer() -> Vec<u8> {
        let mut text: Vec<u8> = (0..3000)
            .flat_map(|i| format!("data: {{\"i\":{i},\"text\":\"tok\"}}\n\n").into_bytes())
            .collect();
        text.extend(std::iter::repeat_n(b' ', 20 * PIECE + 7));
        text.extend_from_slice(b"data: [DONE]\n\n");
        text
    }

    #[test]
    fn gzip_and_brotli_are_decoded_and_nothing_else() {
        let mut room = Room::default();
        for coding in ["gzip", " X-Gzip ", "br", "BR"] {
            let d = Decoder::open(coding, &mut room);
            assert!(d.is_some(), "{coding}");
        }
        assert_eq!(room.open(), 4);
        for coding in ["zstd", "deflate", "identity", "gzip, br", ""] {
            assert!(Decoder::open(coding, &mut room).is_none(), "{coding}");
        }
    }

    /// A VM opens at most `MAX_GZIPS` gzip decoders; each closed gives its place back.
    #[test]
    fn gzip_decoders_are_bounded_in_number() {
        let mut room = Room::default();
        let open: Vec<Decoder> = (0..Room::MAX_GZIPS)
            .filter_map(|_| Decoder::open("gzip", &mut room))
            .collect();
        assert_eq!(open.len(), Room::MAX_GZIPS);
        assert!(Decoder::open("gzip", &mut room).is_none());
        for d in open {
            d.close(&mut room);
        }
        assert_eq!(room.open(), 0);
        assert!(Decoder::open("gzip", &mut room).is_some());
    }
}
