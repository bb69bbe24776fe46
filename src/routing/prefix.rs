//! Prompt blocks for prefix affinity: the canonical prompt text cut into fixed-size character
//! blocks that stand in for the engine's token blocks, each hashed over everything before it
//! (chained), seeded by model and cache salt. Two prompts share a block hash exactly when they
//! share all text up to the end of that block, as an engine's prefix cache requires.

use crate::estimate::templates::Keys;
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
    let mut h = seed(model, cache_salt);
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

/// Hashes of the full blocks of a prompt given as token ids (`Request::ids`, four bytes an id),
/// `block_tokens` ids each: the engine's own blocks, where a text's are its estimate of them. At
/// most `max_blocks` are returned.
pub fn id_block_hashes(
    model: &str,
    cache_salt: Option<&str>,
    ids: &[u8],
    block_tokens: usize,
    max_blocks: usize,
) -> Vec<u64> {
    let mut h = seed(model, cache_salt);
    let blocks = ids.chunks_exact(block_tokens.max(1).saturating_mul(4));
    blocks
        .take(max_blocks)
        .map(|block| {
            h = chain(h, block);
            h
        })
        .collect()
}

/// What every chain starts from: the model and the cache salt, whose caches are apart.
fn seed(model: &str, cache_salt: Option<&str>) -> u64 {
    let h = chain(0, model.as_bytes());
    cache_salt.map_or(h, |salt| chain(h, salt.as_bytes()))
}

/// The heads of an opening, in blocks, that a template also goes by (`estimate::templates`),
/// longest first: doubling, so that the longest head an application's requests share is at
/// least half of what they share (up to 128 blocks: a user's profile or retrieved passages
/// closing each system prompt, after its application's own words and any house rules several
/// applications share).
const TEMPLATE_HEADS: [usize; 7] = [64, 32, 16, 8, 4, 2, 1];

/// The keys of the template of a prompt whose opening (its tools and system turns) is the text's
/// first `opening` bytes, on the same chain as its blocks (`hashes`, `block_hashes` of the same
/// text), most specific first:
/// - the whole opening: the last full block inside it, continued over the bytes after it, so an
///   opening shorter than a block still has a hash of its own, and openings that start alike
///   but end apart hash apart (an opening longer than the hashed blocks is named by them, its
///   first `max_blocks`);
/// - the opening to its last full block, and its heads of `TEMPLATE_HEADS` blocks shorter than
///   that: what its application's requests share when their openings end apart.
///
/// A prompt without an opening (`opening` 0: a completions prompt, a chat without system turns)
/// goes by its heads of `TEMPLATE_HEADS` blocks alone (`Keys::headless`), as many as its hashed
/// blocks hold: its application's words come first in it however it is sent, and a completions
/// prompt the application rendered through the chat template has the template's markers
/// (Llama 3's run to 61 characters) before them, so its first block alone is the same for every
/// application of a model. `opening` must lie on a character boundary (it is where a chat turn
/// ends).
pub fn template_keys(
    model: &str,
    cache_salt: Option<&str>,
    text: &str,
    opening: usize,
    block_chars: usize,
    hashes: &[u64],
) -> Keys {
    let Some(bytes) = text.as_bytes().get(..opening).filter(|o| !o.is_empty()) else {
        let mut keys = Keys::headless();
        push_heads(&mut keys, hashes, usize::MAX);
        return keys;
    };
    let mut keys = Keys::default();
    // Every full block of the opening is one of the text's, hashed unless past `max_blocks`.
    let (mut start, mut full) = (0, 0);
    while full <= hashes.len() {
        let Some(end) = after_chars(bytes, start, block_chars.max(1)) else {
            break;
        };
        (start, full) = (end, full + 1);
    }
    // The bytes after the last full block, when the opening's blocks were all hashed.
    match bytes.get(start..) {
        Some(rest) if !rest.is_empty() && full <= hashes.len() => {
            let last = full.checked_sub(1).and_then(|i| hashes.get(i).copied());
            keys.push(chain(last.unwrap_or_else(|| seed(model, cache_salt)), rest));
        }
        _ => {}
    }
    let full = full.min(hashes.len());
    if let Some(&h) = full.checked_sub(1).and_then(|i| hashes.get(i)) {
        keys.push(h);
    }
    push_heads(&mut keys, hashes, full);
    keys
}

/// The prompt's heads of `TEMPLATE_HEADS` blocks, those shorter than `below` blocks that its
/// hashes hold, longest first.
fn push_heads(keys: &mut Keys, hashes: &[u64], below: usize) {
    for &k in TEMPLATE_HEADS.iter().filter(|&&k| k < below) {
        if let Some(&h) = k.checked_sub(1).and_then(|i| hashes.get(i)) {
            keys.push(h);
        }
    }
}

/// Where the `n` characters of UTF-8 `text` that start at byte `from` end, if there are that many.
/// Inlined into each block walk (a call a block costs the body path about 2 % of its
/// instructions), with the count of a block that is not ASCII out of line.
#[inline(always)]
fn after_chars(text: &[u8], from: usize, n: usize) -> Option<usize> {
    // A run of n bytes holds n characters exactly when none of them is part of a longer one.
    let bytes = text.get(from..from.checked_add(n)?)?;
    if bytes.is_ascii() {
        return Some(from + n);
    }
    after_chars_counted(text, from, n)
}

/// `after_chars` over a run that holds a longer character.
#[inline(never)]
fn after_chars_counted(text: &[u8], from: usize, n: usize) -> Option<usize> {
    // Count the bytes that start a character, eight at a time while the count stays
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
    fn token_ids_are_hashed_in_the_engines_blocks() {
        let ids = |n: u32, first: u32| -> Vec<u8> {
            (0..n)
                .flat_map(|i| if i == 0 { first } else { i }.to_le_bytes())
                .collect()
        };
        let a = id_block_hashes("m", None, &ids(40, 0), 16, 100);
        // Two full blocks of 16; the last 8 ids are not a block.
        assert_eq!(a.len(), 2);
        // A prompt of the same ids after them shares both; one that starts apart, neither; a
        // salt, a model or the block size change every hash; at most `max_blocks`.
        assert_eq!(id_block_hashes("m", None, &ids(70, 0), 16, 100)[..2], a[..]);
        let apart = id_block_hashes("m", None, &ids(40, 9), 16, 100);
        assert!(apart.iter().all(|h| !a.contains(h)));
        assert_ne!(id_block_hashes("m", Some("s"), &ids(40, 0), 16, 100), a);
        assert_ne!(id_block_hashes("n", None, &ids(40, 0), 16, 100), a);
        assert_eq!(id_block_hashes("m", None, &ids(40, 0), 8, 100).len(), 5);
        assert_eq!(id_block_hashes("m", None, &ids(40, 0), 8, 3).len(), 3);
        assert!(id_block_hashes("m", None, &ids(10, 0), 16, 100).is_empty());
    }

    #[test]
    fn counts_characters_and_caps_blocks() {
        let cjk = "你好世界你好世界";
        assert_eq!(block_hashes("m", None, cjk, 4, 100).len(), 2);
        assert_eq!(block_hashes("m", None, &"x".repeat(1000), 4, 10).len(), 10);
        assert!(block_hashes("m", None, "abc", 4, 10).is_empty());
    }

    #[test]
    fn an_opening_is_hashed_on_its_blocks_chain_whatever_its_length() {
        let of = |text: &str, opening: usize| {
            let hashes = block_hashes("m", None, text, 4, 100);
            template_keys("m", None, text, opening, 4, &hashes)
                .iter()
                .next()
        };
        // Shorter than a block: its own hash, whatever follows it.
        let short = of("<s>\nA\n<u>\nquestion one", 6);
        assert!(short.is_some());
        assert_eq!(short, of("<s>\nA\n<u>\nanother question", 6));
        assert_ne!(short, of("<s>\nB\n<u>\nquestion one", 6));
        // Openings that share their first blocks and end apart hash apart.
        let a = "house rules. App A: terse\n<u>\nq";
        let b = "house rules. App B: verbose\n<u>\nq";
        assert_eq!(
            block_hashes("m", None, a, 4, 100)[..3],
            block_hashes("m", None, b, 4, 100)[..3]
        );
        assert_ne!(of(a, 25), of(b, 27));
        assert_eq!(
            of(a, 25),
            of("house rules. App A: terse\n<u>\nsomething else", 25)
        );
        // Ending on a block boundary, it is that block's hash; a model or salt changes it.
        let text = "abcdefgh and the rest";
        assert_eq!(of(text, 8), Some(block_hashes("m", None, text, 4, 100)[1]));
        let salted = block_hashes("m", Some("s"), "ab and more", 4, 100);
        assert_ne!(
            of("ab and more", 2),
            template_keys("m", Some("s"), "ab and more", 2, 4, &salted)
                .iter()
                .next()
        );
        // Past the hashed blocks, the opening is named by them; empty, it has none.
        let long = "x".repeat(100);
        let capped = block_hashes("m", None, &long, 4, 3);
        assert_eq!(
            template_keys("m", None, &long, 90, 4, &capped)
                .iter()
                .next(),
            capped.last().copied()
        );
        // A text with fewer blocks than its opening has after it: the tail still counts.
        assert_ne!(of("abcdXY", 6), of("abcdXZ", 6));
    }

    #[test]
    fn an_opening_also_goes_by_its_heads_so_openings_that_end_apart_share_their_applications() {
        let keys = |text: &str, opening: usize| {
            let hashes = block_hashes("m", None, text, 4, 100);
            let keys: Vec<u64> = template_keys("m", None, text, opening, 4, &hashes)
                .iter()
                .collect();
            (keys, hashes)
        };
        // 42 characters: 10 full blocks and a tail; the whole opening, then the opening to its
        // tenth block, and its heads of 8, 4, 2 and 1 blocks.
        let system = "You are Acme's agent. User: Ann, plan gold";
        let text = format!("{system}\n<u>\nhi");
        let (k, hashes) = keys(&text, system.len());
        assert_eq!(k.len(), 6, "{k:?}");
        assert_eq!(
            k[1..],
            [hashes[9], hashes[7], hashes[3], hashes[1], hashes[0]]
        );
        // Another user's request shares every head before her name, and only those.
        let other = "You are Acme's agent. User: Bob, plan free";
        let (o, _) = keys(&format!("{other}\n<u>\nhello"), other.len());
        let shared: Vec<u64> = o.iter().filter(|h| k.contains(h)).copied().collect();
        assert_eq!(shared, [hashes[3], hashes[1], hashes[0]]);
        // An opening that ends on a block boundary is its last block once; a one-line opening
        // shorter than a block has its whole only; past the hashed blocks, the heads are theirs.
        let (k, hashes) = keys("abcdefgh and more", 8);
        assert_eq!(k, [hashes[1], hashes[0]]);
        assert_eq!(keys("abc and more", 3).0.len(), 1);
        let long = "x".repeat(300);
        let capped = block_hashes("m", None, &long, 4, 40);
        let k: Vec<u64> = template_keys("m", None, &long, 290, 4, &capped)
            .iter()
            .collect();
        assert_eq!(
            k,
            [capped[39], capped[31], capped[15], capped[7], capped[3], capped[1], capped[0]]
        );
    }

    /// A completions prompt rendered through Llama 3's chat template: the markers fill its first
    /// block, so that block is every application's; its longer heads are its application's.
    #[test]
    fn a_prompt_without_an_opening_goes_by_its_heads_alone() {
        let prompt = |app: &str, question: &str| {
            format!(
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nApplication \
                 {app}: answer in one word, as the examples below.<|eot_id|><|start_header_id|>\
                 user<|end_header_id|>\n\n{question}<|eot_id|><|start_header_id|>assistant\
                 <|end_header_id|>\n\n"
            )
        };
        let keys = |text: &str| {
            let hashes = block_hashes("m", None, text, 64, 100);
            let keys = template_keys("m", None, text, 0, 64, &hashes);
            (keys.iter().collect::<Vec<u64>>(), hashes, keys)
        };
        let (a, hashes, k) = keys(&prompt("A", "Is the sky blue today, and why is that so?"));
        // Four full blocks (and a tail): heads of 4, 2 and 1, and no whole.
        assert_eq!(a, [hashes[3], hashes[1], hashes[0]]);
        assert_eq!(k, {
            let mut h = Keys::headless();
            a.iter().for_each(|&x| h.push(x));
            h
        });
        let (other_question, _, _) =
            keys(&prompt("A", "And the grass, is it green in every season?"));
        let (other_app, _, _) = keys(&prompt("B", "Is the sky blue today, and why is that so?"));
        // The same application's requests share their first two blocks; another's only the
        // first, the template's markers.
        assert_eq!(other_question[1..], a[1..]);
        assert_ne!(other_question[0], a[0]);
        assert_eq!(other_app[2], a[2]);
        assert_ne!(other_app[1], a[1]);
        // Shorter than a block, it has none.
        assert!(keys("hi").0.is_empty());
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
