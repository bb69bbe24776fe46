//! The answer's gzip decoder (`flow::gunzip`): arbitrary bytes labelled gzip, and arbitrary text
//! gzipped as Envoy's compressor sends it (a flush after each piece), both fed in arbitrary
//! pieces.
//!
//! Input layout: byte 0 is the mode (bit 0: the rest is text to gzip, else raw bytes to decode;
//! bits 1-4: the compression level, 0-9); byte 1 is the number of cut points k (its low four
//! bits); then k little-endian u16 cut points; the rest is the body. Gzipped text is flushed at
//! the cut points and its compressed pieces fed as they were flushed, and fed again cut at the
//! same points of the compressed bytes.
//!
//! Invariants: no panic; raw bytes decode to at most the decoder's limit and a piece; gzipped
//! text decodes to exactly the text, however it is cut, and is never broken.
#![no_main]

use kvgate::flow::gunzip::{Broken, Gunzip};
use kvgate_fuzz::{cut_input, pieces};
use libfuzzer_sys::fuzz_target;
use miniz_oxide::deflate::core::{
    compress, create_comp_flags_from_zip_params, CompressorOxide, TDEFLFlush,
};

const HEADER: [u8; 10] = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3];

fn decode(chunks: &[&[u8]]) -> (Vec<u8>, Result<(), Broken>) {
    let mut g = Gunzip::default();
    let mut text = Vec::new();
    for c in chunks {
        if let Err(e) = g.feed(c, &mut |p| text.extend_from_slice(p)) {
            return (text, Err(e));
        }
    }
    (text, Ok(()))
}

/// `text` as one gzip member flushed after each of `cuts`' pieces: the pieces as sent.
fn gzip(text: &[u8], level: u8, cuts: &[(usize, usize)]) -> Vec<Vec<u8>> {
    let flags = create_comp_flags_from_zip_params(i32::from(level), -15, 0);
    let mut c = CompressorOxide::new(flags);
    let mut sent = vec![HEADER.to_vec()];
    for (i, &(a, b)) in cuts.iter().enumerate() {
        let last = i + 1 == cuts.len();
        let flush = if last {
            TDEFLFlush::Finish
        } else {
            TDEFLFlush::Sync
        };
        let mut input = &text[a..b];
        let mut piece = Vec::new();
        loop {
            let mut out = vec![0u8; 4096];
            let (status, read, wrote) = compress(&mut c, input, &mut out, flush);
            input = &input[read..];
            piece.extend_from_slice(&out[..wrote]);
            assert!(status as i32 >= 0, "compress: {status:?}");
            if input.is_empty() && wrote < out.len() {
                break;
            }
        }
        if last {
            piece.extend_from_slice(&[0; 8]);
        }
        sent.push(piece);
    }
    sent
}

fuzz_target!(|data: &[u8]| {
    let Some((mode, _, cuts, body)) = cut_input(data) else {
        return;
    };
    if mode & 1 == 0 {
        let cut = pieces(body.len(), &cuts);
        let chunks: Vec<&[u8]> = cut.iter().map(|&(a, b)| &body[a..b]).collect();
        let (text, _) = decode(&chunks);
        assert!(text.len() <= (64 << 20) + (16 << 10));
        return;
    }
    let level = (mode >> 1) % 10;
    let sent = gzip(body, level, &pieces(body.len(), &cuts));
    let as_sent: Vec<&[u8]> = sent.iter().map(Vec::as_slice).collect();
    let all = sent.concat();
    let recut = pieces(all.len(), &cuts);
    let cut_anywhere: Vec<&[u8]> = recut.iter().map(|&(a, b)| &all[a..b]).collect();
    for (how, chunks) in [("flushed pieces", as_sent), ("cut anywhere", cut_anywhere)] {
        let (text, fed) = decode(&chunks);
        assert_eq!(fed, Ok(()), "{how}");
        assert!(
            text == body,
            "{how}: {} bytes of {}",
            text.len(),
            body.len()
        );
    }
});
