//! Prompt blocks for prefix affinity: the canonical prompt text cut into fixed-size character
//! blocks that stand in for the engine's token blocks, each hashed over everything before it
//! (chained), seeded by model and cache salt. Two prompts share a block hash exactly when they
//! share all text up to the end of that block, as an engine's prefix cache requires.

use crate::hash::{fnv1a, fnv1a_from};

/// Hashes of the full blocks of `text`, `block_chars` characters each; a trailing partial block
/// is not hashed, as engines cache only full blocks. At most `max_blocks` are returned.
pub fn block_hashes(
    model: &str,
    cache_salt: Option<&str>,
    text: &str,
    block_chars: usize,
    max_blocks: usize,
) -> Vec<u64> {
    let mut seed = fnv1a(model.as_bytes());
    if let Some(salt) = cache_salt {
        seed = fnv1a_from(fnv1a_from(seed, b"\0salt\0"), salt.as_bytes());
    }
    let block_chars = block_chars.max(1);
    let mut out = Vec::with_capacity((text.len() / block_chars).min(max_blocks));
    let mut h = seed;
    let mut chars = 0;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        chars += 1;
        if chars == block_chars {
            let end = i + c.len_utf8();
            h = fnv1a_from(h, &text.as_bytes()[start..end]);
            // Mix the block boundary in, so "ab|c" and "a|bc" differ.
            h = fnv1a_from(h, &[0xff]);
            out.push(h);
            if out.len() >= max_blocks {
                break;
            }
            start = end;
            chars = 0;
        }
    }
    out
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
}
