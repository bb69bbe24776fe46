//! The answers' decoders (`flow::decode`): arbitrary bytes labelled gzip or brotli, and arbitrary
//! text coded as Envoy's compressors send it (a flush after each piece), both fed in arbitrary
//! pieces.
//!
//! Input layout: byte 0 is the mode (bit 0: the rest is text to code, else raw bytes to decode;
//! bits 1-4: the compression level, 0-9 for gzip and 0-11 for brotli; bit 5: brotli, else gzip;
//! bits 6-7: brotli's window, 10, 16, 18 or 21 bits); byte 1 is the number of cut points k (its
//! low four bits); then k little-endian u16 cut points; the rest is the body. Coded text is
//! flushed at the cut points and its compressed pieces fed as they were flushed, and fed again
//! cut at the same points of the compressed bytes.
//!
//! Invariants: no panic; raw bytes decode to at most the decoder's limit and a piece, and leave
//! nothing of the VM's room held once closed; coded text decodes to exactly the text, however it
//! is cut, and is never broken (a 21-bit window is the whole of a VM's room for brotli windows).
#![no_main]

use std::io::Write;

use kvgate::flow::decode::{Broken, Decoder, Room};
use kvgate_fuzz::{cut_input, pieces};
use libfuzzer_sys::fuzz_target;
use miniz_oxide::deflate::core::{
    compress, create_comp_flags_from_zip_params, CompressorOxide, TDEFLFlush,
};

const HEADER: [u8; 10] = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3];

fn decode(coding: &str, chunks: &[&[u8]]) -> (Vec<u8>, Result<(), Broken>) {
    let mut room = Room::default();
    let mut d = Decoder::open(coding, &mut room).expect("a decoder for the VM's first answer");
    let mut text = Vec::new();
    let mut fed = Ok(());
    for c in chunks {
        fed = d.feed(&mut room, c, &mut |p| text.extend_from_slice(p));
        if fed.is_err() {
            break;
        }
    }
    d.close(&mut room);
    assert_eq!(room.open(), 0, "closed, its room given back");
    (text, fed)
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

/// `text` as one brotli stream of window `lgwin` flushed after each of `cuts`' pieces.
fn brotli(text: &[u8], level: u8, lgwin: u32, cuts: &[(usize, usize)]) -> Vec<Vec<u8>> {
    let mut w = brotli::CompressorWriter::new(Vec::new(), 4096, u32::from(level), lgwin);
    let mut sent = Vec::new();
    for &(a, b) in cuts {
        w.write_all(&text[a..b]).expect("written to memory");
        w.flush().expect("flushed to memory");
        sent.push(std::mem::take(w.get_mut()));
    }
    sent.push(w.into_inner());
    sent
}

fuzz_target!(|data: &[u8]| {
    let Some((mode, _, cuts, body)) = cut_input(data) else {
        return;
    };
    let coding = if mode & 32 == 0 { "gzip" } else { "br" };
    if mode & 1 == 0 {
        let cut = pieces(body.len(), &cuts);
        let chunks: Vec<&[u8]> = cut.iter().map(|&(a, b)| &body[a..b]).collect();
        let (text, _) = decode(coding, &chunks);
        assert!(text.len() <= (64 << 20) + (16 << 10));
        return;
    }
    let level = (mode >> 1) & 15;
    let cut = pieces(body.len(), &cuts);
    let sent = if coding == "gzip" {
        gzip(body, level % 10, &cut)
    } else {
        brotli(body, level % 12, [10, 16, 18, 21][usize::from(mode >> 6)], &cut)
    };
    let as_sent: Vec<&[u8]> = sent.iter().map(Vec::as_slice).collect();
    let all = sent.concat();
    let recut = pieces(all.len(), &cuts);
    let cut_anywhere: Vec<&[u8]> = recut.iter().map(|&(a, b)| &all[a..b]).collect();
    for (how, chunks) in [("flushed pieces", as_sent), ("cut anywhere", cut_anywhere)] {
        let (text, fed) = decode(coding, &chunks);
        assert_eq!(fed, Ok(()), "{coding}, {how}");
        assert!(
            text == body,
            "{coding}, {how}: {} bytes of {}",
            text.len(),
            body.len()
        );
    }
});
