//! A brotli-coded answer (RFC 7932) decoded as it streams: `content-encoding: br`, as Envoy's
//! brotli compressor sends it to clients that ask for it. The decoder's window is the stream's
//! own, declared in its first byte: it is charged to the VM's [`super::Room`] before the decoder
//! is made, and a stream whose window does not fit is [`Broken`] for this VM (grown at its pod's
//! pace) rather than let one answer take megabytes of a VM's memory, which never shrinks.

use brotli_decompressor::{BrotliDecompressStream, BrotliResult, BrotliState, StandardAlloc};

use super::{output_for, Broken, Room, MAX_DECODED};

/// Charged at least this for a stream, whatever its window: the decoder's own tables and state.
const MIN_CHARGE: usize = 64 << 10;

type State = BrotliState<StandardAlloc, StandardAlloc, StandardAlloc>;

pub struct Unbrotli {
    /// The decoder, made once the stream's first byte has declared a window the room holds.
    state: Option<Box<State>>,
    /// What this stream's window was charged to the VM's room.
    charged: usize,
    decoded: usize,
    /// `MAX_DECODED`, or less in tests.
    limit: usize,
    /// The stream's last meta-block ended: whatever follows is not text.
    ended: bool,
}

impl Default for Unbrotli {
    fn default() -> Self {
        Unbrotli {
            state: None,
            charged: 0,
            decoded: 0,
            limit: MAX_DECODED,
            ended: false,
        }
    }
}

impl Unbrotli {
    /// What this stream holds of the VM's brotli windows (`Room::MAX_WINDOWS`).
    pub fn charged(&self) -> usize {
        self.charged
    }

    /// Decodes the next piece of the body, handing the text to `each` as it comes, a `PIECE` at
    /// a time at most; `windows` is what the VM's open brotli streams hold.
    pub fn feed(
        &mut self,
        windows: &mut usize,
        bytes: &[u8],
        each: &mut dyn FnMut(&[u8]),
    ) -> Result<(), Broken> {
        let state = match &mut self.state {
            Some(state) => state,
            None => {
                let Some(&first) = bytes.first() else {
                    return Ok(());
                };
                let charge = (1usize << window_bits(first).ok_or(Broken)?).max(MIN_CHARGE);
                if windows.saturating_add(charge) > Room::MAX_WINDOWS {
                    return Err(Broken);
                }
                *windows += charge;
                self.charged = charge;
                // Strict: the large-window extension is not brotli as `content-encoding` names it.
                self.state.insert(Box::new(State::new_strict(
                    StandardAlloc::default(),
                    StandardAlloc::default(),
                    StandardAlloc::default(),
                )))
            }
        };
        let mut input = bytes;
        let mut out = output_for(input);
        while !self.ended {
            let (mut available_in, mut read) = (input.len(), 0);
            let (mut available_out, mut written, mut total) = (out.len(), 0, 0);
            let r = BrotliDecompressStream(
                &mut available_in,
                &mut read,
                input,
                &mut available_out,
                &mut written,
                &mut out,
                &mut total,
                state,
            );
            input = input.get(read..).unwrap_or_default();
            self.decoded = self.decoded.saturating_add(written);
            if self.decoded > self.limit {
                return Err(Broken);
            }
            if let Some(piece) = out.get(..written).filter(|p| !p.is_empty()) {
                each(piece);
            }
            match r {
                BrotliResult::ResultSuccess => self.ended = true,
                // The decoder has taken all of the input into its state.
                BrotliResult::NeedsMoreInput => return Ok(()),
                BrotliResult::NeedsMoreOutput if read == 0 && written == 0 => return Err(Broken),
                BrotliResult::NeedsMoreOutput => {}
                BrotliResult::ResultFailure => return Err(Broken),
            }
        }
        Ok(())
    }
}

/// The window a stream declares in its first byte (RFC 7932, 9.1: `WBITS`, 10 to 24 bits),
/// `None` for the large-window extension's marker.
fn window_bits(first: u8) -> Option<u32> {
    if first & 1 == 0 {
        return Some(16);
    }
    match (first >> 1) & 7 {
        0 => match (first >> 4) & 7 {
            0 => Some(17),
            1 => None,
            n => Some(8 + u32::from(n)),
        },
        n => Some(17 + u32::from(n)),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use std::io::Write;

    use super::super::PIECE;
    use super::*;

    /// A brotli stream of `text` at `lgwin`, compressed whole.
    fn brotli(text: &[u8], lgwin: u32) -> Vec<u8> {
        let mut out = Vec::new();
        {
            let mut w = brotli::CompressorWriter::new(&mut out, 4096, 5, lgwin);
            w.write_all(text).unwrap();
        }
        out
    }

    fn decode_within(chunks: &[&[u8]], limit: usize) -> Result<Vec<u8>, Broken> {
        let mut b = Unbrotli {
            limit,
            ..Unbrotli::default()
        };
        let mut windows = 0;
        let mut text = Vec::new();
        for c in chunks {
            b.feed(&mut windows, c, &mut |p| text.extend_from_slice(p))?;
        }
        assert_eq!(windows, b.charged());
        Ok(text)
    }

    /// A compressor that flushes after each piece it is given, as Envoy's brotli compressor does
    /// after each data frame (`BROTLI_OPERATION_FLUSH`), at Envoy's default window (18 bits).
    pub(crate) fn flushing() -> impl FnMut(&[u8]) -> Vec<u8> {
        let mut w = brotli::CompressorWriter::new(Vec::new(), 4096, 3, 18);
        move |text: &[u8]| {
            w.write_all(text).unwrap();
            w.flush().unwrap();
            std::mem::take(w.get_mut())
        }
    }

    /// Whole, a byte at a time, or in chunks of any size, at any window; and where a few bytes
    /// decode to many pieces (a long run).
    #[test]
    fn a_body_decodes_in_chunks_of_any_size_at_any_window() {
        let text = super::super::tests::long_answer();
        for lgwin in [10, 16, 17, 18, 21] {
            let body = brotli(&text, lgwin);
            assert_eq!(window_bits(body[0]), Some(lgwin), "its first byte");
            for size in [1, 3, 100, 4096, PIECE, body.len()] {
                let chunks: Vec<&[u8]> = body.chunks(size).collect();
                let got = decode_within(&chunks, MAX_DECODED).unwrap();
                assert!(
                    got == text,
                    "window {lgwin}, chunks of {size}: {}",
                    got.len()
                );
            }
        }
    }

    /// Each chunk of a stream compressed with a flush after it decodes to its own text as it
    /// comes, and the stream's end is kept.
    #[test]
    fn each_flushed_chunk_decodes_when_it_comes() {
        let mut compress = flushing();
        let mut b = Unbrotli::default();
        let mut windows = 0;
        let mut got = Vec::new();
        for i in 0..50 {
            let line =
                format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"w{i}\"}}}}]}}\n\n");
            got.clear();
            let chunk = compress(line.as_bytes());
            b.feed(&mut windows, &chunk, &mut |p| got.extend_from_slice(p))
                .unwrap();
            assert_eq!(got, line.as_bytes(), "chunk {i}");
        }
        assert_eq!(windows, 256 << 10, "Envoy's default window, charged once");
    }

    #[test]
    fn what_is_not_brotli_or_decodes_too_far_or_takes_too_much_is_broken() {
        assert_eq!(
            decode_within(&[b"data: {}\n\n"], MAX_DECODED),
            Err(Broken),
            "plain text"
        );
        let body = brotli(&[b'a'; 100_000], 18);
        assert_eq!(decode_within(&[&body], 1000), Err(Broken), "past the limit");
        let mut cut = body.clone();
        cut[body.len() / 2] ^= 0xff;
        assert_eq!(decode_within(&[&cut], MAX_DECODED), Err(Broken), "corrupt");
        // The large-window extension's marker, and a window past the room.
        assert_eq!(window_bits(0b0001_0001), None);
        let mut b = Unbrotli::default();
        let mut windows = Room::MAX_WINDOWS - (128 << 10);
        assert_eq!(b.feed(&mut windows, &body, &mut |_| {}), Err(Broken));
        assert_eq!((windows, b.charged()), (Room::MAX_WINDOWS - (128 << 10), 0));
        let small = brotli(b"hello", 16);
        let mut text = Vec::new();
        b.feed(&mut windows, &small, &mut |p| text.extend_from_slice(p))
            .unwrap();
        assert_eq!((text.as_slice(), b.charged()), (&b"hello"[..], 64 << 10));
    }
}
