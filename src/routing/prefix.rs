//! Prompt blocks for prefix affinity: the canonical prompt text cut into fixed-size character
//! blocks that stand in for the engine's token blocks, each hashed over everything before it
//! (chained), seeded by model and cache salt. Two prompts share a block hash exactly when they
//! share all text up to the end of that block, as an engine's prefix cache requires.

use crate::hash::chain;

/// Hashes of the full blocks of `text`, `block_chars` characters each; a trailing partial block
/// is not hashed, as engines cache only full blocks. At most `max_blocks` are returned.
pub fn block_hashes(
    model: &str,
    cache_salt: Option<&str>,
    text: &str,
    block_chars: usize,
    max_blocks: usize,
) -> Vec<u64> {
    let mut h = chain(0, model.as_bytes());
    if let Some(salt) = cache_salt {
        h = chain(h, salt.as_bytes());
    }
    let block_chars = block_chars.max(1);
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity((bytes.len() / block_chars).min(max_blocks));
    let mut start = 0;
    while out.len() < max_blocks {
        let Some(end) = after_chars(bytes, start, block_chars) else {
            break;
        };
        h = chain(h, bytes.get(start..end).unwrap_or_default());
        out.push(h);
        start = end;
    }
    out
}

/// Where the `n` characters of UTF-8 `text` that start at byte `from` end, if there are that many.
fn after_chars(text: &[u8], from: usize, n: usize) -> Option<usize> {
    // A run of n bytes holds n characters exactly when none of them is part of a longer one.
    let bytes = text.get(from..from.checked_add(n)?)?;
    if bytes.is_ascii() {
        return Some(from + n);
    }
    // Otherwise count the bytes that start a character, eight at a time while the count stays
    // within n, then one at a time up to the start of the character after the nth.
    let mut at = from;
    let mut chars = 0;
    while let Some(word) = text.get(at..at + 8).and_then(|w| w.first_chunk()) {
        let starts = 8 - continuation_bytes(u64::from_le_bytes(*word));
        if chars + starts > n {
            break;
        }
        chars += starts;
        at += 8;
    }
    for (i, b) in text.get(at..)?.iter().enumerate() {
        if !is_continuation(*b) {
            if chars == n {
                return Some(at + i);
            }
            chars += 1;
        }
    }
    (chars == n).then_some(text.len())
}

/// UTF-8 continuation bytes are `10xxxxxx`.
fn is_continuation(b: u8) -> bool {
    b & 0xc0 == 0x80
}

/// How many of the eight bytes packed in `word` are continuation bytes.
fn continuation_bytes(word: u64) -> usize {
    // Bit 7 of each byte set and bit 6 clear (shifting left by one lines bit 6 up with bit 7).
    (word & !(word << 1) & 0x8080_8080_8080_8080).count_ones() as usize
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn shared_prefixes_share_leading_hashes() {
        let a = block_hashes("m", None, "abcdefghijXYZ", 4, 100);
        let b = block_hashes("m", None, "abcdefghQQQQ", 4, 100);
        assert_eq!(a.len(), 3);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
    }

    #[test]
    fn model_and_salt_separate_caches() {
        let t = "same text in every request";
        let base = block_hashes("m", None, t, 4, 100);
        assert_ne!(base, block_hashes("other", None, t, 4, 100));
        assert_ne!(base, block_hashes("m", Some("tenant-a"), t, 4, 100));
        assert_eq!(base, block_hashes("m", None, t, 4, 100));
    }

    #[test]
    fn counts_characters_and_caps_blocks() {
        let cjk = "你好世界你好世界";
        assert_eq!(block_hashes("m", None, cjk, 4, 100).len(), 2);
        assert_eq!(block_hashes("m", None, &"x".repeat(1000), 4, 10).len(), 10);
        assert!(block_hashes("m", None, "abc", 4, 10).is_empty());
    }

    #[test]
    fn blocks_end_after_whole_characters() {
        let text = "plain ascii, then 中文和한국어, é and 😀 mixed in: ".repeat(5);
        let starts: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        let count = starts.len();
        for n in [1, 2, 3, 7, 8, 9, 16, 64] {
            let mut from = 0;
            for block in 1..=count / n {
                let end = starts.get(block * n).copied().unwrap_or(text.len());
                assert_eq!(after_chars(text.as_bytes(), from, n), Some(end), "n {n}");
                from = end;
            }
            assert_eq!(after_chars(text.as_bytes(), from, n), None, "n {n}");
        }
    }
}
