//! A header map as proxy-wasm hands it over in one call (`proxy_get_header_map_pairs`): a `u32`
//! count, a `u32` name length and value length per pair, then each name and value followed by a
//! NUL, all little-endian. The shell fetches a request's headers this way once (one host call
//! instead of one per header read) and the flow reads them here; decoding lives in the core so it
//! is tested natively. Names arrive lower-cased from Envoy; lookups ignore case all the same.

/// The headers of one message, in the order the host gave them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct HeaderMap {
    pairs: Vec<(String, String)>,
    /// Every pair the host said it sent was read.
    whole: bool,
}

impl HeaderMap {
    /// Decodes the serialized pairs; a truncated or inconsistent buffer yields the pairs read
    /// before the fault (the host does not send one, and a partial map is still the best answer).
    /// Bytes that are not UTF-8 (HTTP allows them in values) become U+FFFD.
    pub fn decode(bytes: &[u8]) -> Self {
        let word = |at: usize| -> Option<usize> {
            let b = bytes.get(at..at.checked_add(4)?)?;
            Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        };
        let mut pairs = Vec::new();
        let Some(declared) = word(0) else {
            return Self::default();
        };
        // Each pair takes at least its 8 length bytes and 2 NULs: a count above that is corrupt.
        let count = declared.min(bytes.len() / 10);
        let mut text = 4 + count * 8;
        for i in 0..count {
            let (Some(name_len), Some(value_len)) = (word(4 + i * 8), word(8 + i * 8)) else {
                break;
            };
            let Some(name) = field(bytes, text, name_len) else {
                break;
            };
            let value_at = text + name_len + 1;
            let Some(value) = field(bytes, value_at, value_len) else {
                break;
            };
            pairs.push((name, value));
            text = value_at + value_len + 1;
        }
        Self {
            whole: pairs.len() == declared,
            pairs,
        }
    }

    /// The first value of `name` (as the host's single-header read returns), any case.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Whether the message is known to carry none of `names`, in any case: every pair was read
    /// and none is one of them. A map read in part (or not at all) may hold anything.
    pub fn lacks(&self, names: &[&str]) -> bool {
        self.whole
            && !self
                .pairs
                .iter()
                .any(|(n, _)| names.iter().any(|m| n.eq_ignore_ascii_case(m)))
    }
}

/// `len` bytes at `at` followed by a NUL, as text.
fn field(bytes: &[u8], at: usize, len: usize) -> Option<String> {
    let end = at.checked_add(len)?;
    if bytes.get(end) != Some(&0) {
        return None;
    }
    let raw = bytes.get(at..end)?;
    Some(String::from_utf8_lossy(raw).into_owned())
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    /// The ABI's serialization, as Envoy writes it.
    fn encode(pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
        let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
        for (n, v) in pairs {
            out.extend((n.len() as u32).to_le_bytes());
            out.extend((v.len() as u32).to_le_bytes());
        }
        for (n, v) in pairs {
            out.extend(*n);
            out.push(0);
            out.extend(*v);
            out.push(0);
        }
        out
    }

    #[test]
    fn reads_every_pair_and_the_first_of_a_repeated_name() {
        let map = HeaderMap::decode(&encode(&[
            (b":method", b"POST"),
            (b":path", b"/v1/chat/completions"),
            (b"x-tenant", b"a"),
            (b"x-tenant", b"b"),
            (b"empty", b""),
        ]));
        assert_eq!(map.get(":method"), Some("POST"));
        assert_eq!(map.get(":path"), Some("/v1/chat/completions"));
        assert_eq!(map.get("X-Tenant"), Some("a"));
        assert_eq!(map.get("empty"), Some(""));
        assert_eq!(map.get("content-type"), None);
    }

    #[test]
    fn a_map_lacks_a_name_only_when_read_whole_without_it() {
        let pairs: [(&[u8], &[u8]); 2] = [
            (b":path", b"/"),
            (b"X-Gateway-Destination-Endpoint", b"\xff"),
        ];
        let whole = encode(&pairs);
        assert!(HeaderMap::decode(&encode(&pairs[..1])).lacks(&["x-gateway-destination-endpoint"]));
        let map = HeaderMap::decode(&whole);
        assert!(!map.lacks(&[
            "x-envoy-original-dst-host",
            "x-gateway-destination-endpoint"
        ]));
        assert!(map.lacks(&["x-envoy-original-dst-host"]));
        // Cut short, or never read: anything may be missing from it.
        assert!(!HeaderMap::decode(&whole[..whole.len() - 1]).lacks(&["x-envoy-original-dst-host"]));
        assert!(!HeaderMap::default().lacks(&["x-envoy-original-dst-host"]));
        let mut huge = encode(&pairs[..1]);
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(!HeaderMap::decode(&huge).lacks(&["x-envoy-original-dst-host"]));
    }

    #[test]
    fn non_utf8_values_are_kept_lossily() {
        let map = HeaderMap::decode(&encode(&[(b"x-session", b"ab\xffcd")]));
        assert_eq!(map.get("x-session"), Some("ab\u{fffd}cd"));
    }

    #[test]
    fn corrupt_buffers_yield_what_was_read_before_the_fault() {
        let whole = encode(&[(b"a", b"1"), (b"b", b"2")]);
        assert_eq!(HeaderMap::decode(&[]), HeaderMap::default());
        assert_eq!(HeaderMap::decode(&whole[..3]), HeaderMap::default());
        // The second value's NUL cut off.
        let cut = HeaderMap::decode(&whole[..whole.len() - 1]);
        assert_eq!(cut.get("a"), Some("1"));
        assert_eq!(cut.get("b"), None);
        // A count far above what the bytes can hold.
        let mut huge = whole.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        let _ = HeaderMap::decode(&huge);
        // A length that runs past the end.
        let mut long = whole;
        long[4..8].copy_from_slice(&1_000_000u32.to_le_bytes());
        assert_eq!(HeaderMap::decode(&long), HeaderMap::default());
    }
}
