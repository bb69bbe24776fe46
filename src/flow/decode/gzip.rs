//! A gzip-coded answer (RFC 1952) decoded as it streams: `content-encoding: gzip`, as Envoy's
//! gzip compressor sends it to clients that ask for it (OpenAI's SDKs do). Its decoder holds the
//! deflate window, about 43 KB, while the answer runs.

use miniz_oxide::inflate::stream::{inflate, InflateState};
use miniz_oxide::{DataFormat, MZError, MZFlush, MZStatus};

use super::{output_for, Broken, MAX_DECODED};

/// A gzip member's header is ten bytes, then its optional fields: an extra field of at most
/// 65,535 bytes, a name and a comment. A header longer than this is refused.
const MAX_HEADER: usize = 1 << 17;

pub struct Gunzip {
    /// The member's header as far as it came, until it is whole.
    header: Option<Vec<u8>>,
    state: Box<InflateState>,
    decoded: usize,
    /// `MAX_DECODED`, or less in tests.
    limit: usize,
    /// The deflate stream ended: what follows (the trailer's checksum and length) is not text.
    ended: bool,
}

impl Default for Gunzip {
    fn default() -> Self {
        Gunzip {
            header: Some(Vec::new()),
            state: InflateState::new_boxed(DataFormat::Raw),
            decoded: 0,
            limit: MAX_DECODED,
            ended: false,
        }
    }
}

impl Gunzip {
    /// Decodes the next piece of the body, handing the text to `each` as it comes, a `PIECE`
    /// at a time at most.
    pub fn feed(&mut self, bytes: &[u8], each: &mut dyn FnMut(&[u8])) -> Result<(), Broken> {
        let mut input = bytes;
        if let Some(head) = &mut self.header {
            let before = head.len();
            head.extend_from_slice(bytes);
            let Some(n) = header_len(head)? else {
                return if head.len() > MAX_HEADER {
                    Err(Broken)
                } else {
                    Ok(())
                };
            };
            input = bytes.get(n.saturating_sub(before)..).unwrap_or_default();
            self.header = None;
        }
        let mut out = output_for(input);
        while !self.ended {
            let r = inflate(&mut self.state, input, &mut out, MZFlush::None);
            input = input.get(r.bytes_consumed..).unwrap_or_default();
            self.decoded = self.decoded.saturating_add(r.bytes_written);
            if self.decoded > self.limit {
                return Err(Broken);
            }
            if let Some(piece) = out.get(..r.bytes_written).filter(|p| !p.is_empty()) {
                each(piece);
            }
            // Never return with input left unread while the decoder can take it: a call that
            // only hands out text decoded before (its window's backlog) reads no input.
            match r.status {
                Ok(MZStatus::StreamEnd) => self.ended = true,
                Ok(_) if input.is_empty() && r.bytes_written < out.len() => return Ok(()),
                Ok(_) if r.bytes_consumed == 0 && r.bytes_written == 0 => return Err(Broken),
                Ok(_) => {}
                // No progress without more input: the rest comes in the next chunk.
                Err(MZError::Buf) if input.is_empty() => return Ok(()),
                Err(_) => return Err(Broken),
            }
        }
        Ok(())
    }
}

/// The length of the gzip member header at the start of `b` (RFC 1952, 2.3), `None` while it
/// has not all come.
fn header_len(b: &[u8]) -> Result<Option<usize>, Broken> {
    const MAGIC: [u8; 3] = [0x1f, 0x8b, 8];
    const FHCRC: u8 = 2;
    const FEXTRA: u8 = 4;
    const FNAME: u8 = 8;
    const FCOMMENT: u8 = 16;
    if !b.iter().zip(MAGIC).all(|(x, y)| *x == y) {
        return Err(Broken);
    }
    let Some(&flags) = b.get(3) else {
        return Ok(None);
    };
    if flags & 0xe0 != 0 {
        return Err(Broken);
    }
    let mut at = 10;
    if flags & FEXTRA != 0 {
        let (Some(&lo), Some(&hi)) = (b.get(at), b.get(at + 1)) else {
            return Ok(None);
        };
        at += 2 + usize::from(u16::from_le_bytes([lo, hi]));
    }
    for flag in [FNAME, FCOMMENT] {
        if flags & flag != 0 {
            let Some(zero) = b.get(at..).and_then(|s| memchr::memchr(0, s)) else {
                return Ok(None);
            };
            at += zero + 1;
        }
    }
    if flags & FHCRC != 0 {
        at += 2;
    }
    Ok((b.len() >= at).then_some(at))
}

#[cfg(test)]
pub(crate) mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::super::PIECE;
    use super::*;
    use miniz_oxide::deflate::compress_to_vec;

    /// A gzip member of `text` as Envoy's compressor sends it, with `flags`' optional fields.
    fn gzip(text: &[u8], flags: u8) -> Vec<u8> {
        let mut out = vec![0x1f, 0x8b, 8, flags, 0, 0, 0, 0, 0, 3];
        if flags & 4 != 0 {
            out.extend_from_slice(&[3, 0, b'a', b'b', b'c']);
        }
        if flags & 8 != 0 {
            out.extend_from_slice(b"name\0");
        }
        if flags & 16 != 0 {
            out.extend_from_slice(b"comment\0");
        }
        if flags & 2 != 0 {
            out.extend_from_slice(&[0, 0]);
        }
        out.extend(compress_to_vec(text, 6));
        out.extend_from_slice(&[0; 8]);
        out
    }

    fn decode_in(chunks: &[&[u8]]) -> Result<Vec<u8>, Broken> {
        decode_within(chunks, MAX_DECODED)
    }

    fn decode_within(chunks: &[&[u8]], limit: usize) -> Result<Vec<u8>, Broken> {
        let mut g = Gunzip {
            limit,
            ..Gunzip::default()
        };
        let mut text = Vec::new();
        for c in chunks {
            g.feed(c, &mut |p| text.extend_from_slice(p))?;
        }
        Ok(text)
    }

    /// Whole, a byte at a time, or in chunks of any size, with any of the header's fields; and
    /// where a few bytes decode to many pieces (a long run), so that the decoder has text left
    /// to hand out when a chunk's input is all read.
    #[test]
    fn a_body_decodes_in_chunks_of_any_size_with_any_header() {
        let text = super::super::tests::long_answer();
        for flags in [0, 2, 4, 8, 16, 30] {
            let body = gzip(&text, flags);
            for size in [1, 3, 100, 4096, PIECE, body.len()] {
                let chunks: Vec<&[u8]> = body.chunks(size).collect();
                let got = decode_in(&chunks).unwrap();
                assert!(
                    got == text,
                    "flags {flags}, chunks of {size}: {}",
                    got.len()
                );
            }
            let (head, rest) = body.split_at(4);
            assert_eq!(decode_in(&[head, rest]).unwrap(), text);
        }
    }

    /// A gzip member's header, and a compressor that flushes after each piece it is given, as
    /// Envoy's does after each data frame.
    pub(crate) fn flushing() -> (Vec<u8>, impl FnMut(&[u8]) -> Vec<u8>) {
        use miniz_oxide::deflate::core::{
            compress, create_comp_flags_from_zip_params, CompressorOxide, TDEFLFlush,
        };
        let mut c = CompressorOxide::new(create_comp_flags_from_zip_params(6, -15, 0));
        let header = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3];
        (header, move |text: &[u8]| {
            let mut out = vec![0u8; text.len() + 64];
            let (_, _, n) = compress(&mut c, text, &mut out, TDEFLFlush::Sync);
            out.truncate(n);
            out
        })
    }

    /// Each chunk of a stream compressed with a flush after it (as Envoy's compressor does)
    /// decodes to its own text as it comes.
    #[test]
    fn each_flushed_chunk_decodes_when_it_comes() {
        let (header, mut deflate) = flushing();
        let mut g = Gunzip::default();
        let mut got = Vec::new();
        g.feed(&header, &mut |p| got.extend_from_slice(p)).unwrap();
        for i in 0..50 {
            let line =
                format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"w{i}\"}}}}]}}\n\n");
            got.clear();
            g.feed(&deflate(line.as_bytes()), &mut |p| got.extend_from_slice(p))
                .unwrap();
            assert_eq!(got, line.as_bytes(), "chunk {i}");
        }
    }

    #[test]
    fn what_is_not_gzip_or_decodes_too_far_is_broken() {
        assert_eq!(decode_in(&[b"data: {}\n\n"]), Err(Broken));
        assert_eq!(decode_in(&[&[0x1f, 0x8b, 7]]), Err(Broken), "not deflate");
        assert_eq!(
            decode_in(&[&[0x1f, 0x8b, 8, 0x20]]),
            Err(Broken),
            "reserved flag"
        );
        let mut body = gzip(b"x", 0);
        body[12] ^= 0xff;
        body[13] ^= 0xff;
        assert!(decode_in(&[&body]).map_or(true, |t| t != b"x"));
        // Not a header yet: waits.
        assert_eq!(decode_in(&[&[0x1f, 0x8b]]), Ok(Vec::new()));
        let mut unnamed = vec![0x1f, 0x8b, 8, 8, 0, 0, 0, 0, 0, 3];
        unnamed.resize(MAX_HEADER + 1, b'n');
        assert_eq!(decode_in(&[&unnamed]), Err(Broken), "a name without end");
        let limit = 1 << 20;
        let bomb = gzip(&vec![b' '; limit + 1], 0);
        assert_eq!(decode_within(&[&bomb], limit), Err(Broken));
        assert!(bomb.len() < limit / 500);
        assert_eq!(
            decode_within(&[&bomb], limit + 1).map(|t| t.len()),
            Ok(limit + 1)
        );
    }
}
