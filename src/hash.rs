//! Stable hashing shared by every worker VM and every Envoy restart: the same bytes give the same
//! value everywhere, which Rust's randomly seeded hashers do not. FNV-1a for short keys (model
//! and tenant names, label sets); `chain` for prompt blocks, the one long input hashed on every
//! request.

/// 64-bit FNV-1a.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_from(0xcbf2_9ce4_8422_2325, bytes)
}

/// FNV-1a continued from an earlier state, so a hash can cover several pieces without joining them.
pub fn fnv1a_from(state: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(state, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

// XXH64's primes.
const P1: u64 = 0x9e37_79b1_85eb_ca87;
const P2: u64 = 0xc2b2_ae3d_27d4_eb4f;
const P3: u64 = 0x1656_67b1_9e37_79f9;
const P4: u64 = 0x85eb_ca77_c2b2_ae63;
const P5: u64 = 0x27d4_eb2f_1656_67c5;

/// The hash of `bytes` continued from `state` (the hash of everything before them), fully mixed,
/// so a chain of pieces gives each piece a hash of all text up to its end. XXH64's rounds over
/// one accumulator: eight bytes per multiply-rotate step where FNV-1a takes one byte per
/// multiply. The length is mixed in, so where one piece ends and the next begins counts too.
pub fn chain(state: u64, bytes: &[u8]) -> u64 {
    let mut h = state.wrapping_add(P5).wrapping_add(bytes.len() as u64);
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        let lane = word.first_chunk().map_or(0, |w| u64::from_le_bytes(*w));
        h ^= lane.wrapping_mul(P2).rotate_left(31).wrapping_mul(P1);
        h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
    }
    for b in words.remainder() {
        h ^= u64::from(*b).wrapping_mul(P5);
        h = h.rotate_left(11).wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn known_vectors_and_continuation() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_from(fnv1a(b"ab"), b"cd"), fnv1a(b"abcd"));
    }

    /// Every VM and every build must cut and hash alike: the value for a given input is fixed.
    #[test]
    fn chain_is_stable() {
        assert_eq!(chain(0, b""), 0xef46_db37_51d8_e999);
        assert_eq!(chain(0, b"abcdefgh12345"), 0xdf23_0656_9768_d3af);
        assert_eq!(chain(7, b"abcdefgh12345"), 0x27fc_08f0_4223_c89a);
    }

    #[test]
    fn chain_separates_pieces_states_and_lengths() {
        let ab_c = chain(chain(0, b"ab"), b"c");
        assert_ne!(ab_c, chain(chain(0, b"a"), b"bc"));
        assert_ne!(chain(0, b"a"), chain(0, b"a\0"));
        assert_ne!(chain(0, b""), chain(1, b""));
        // Flipping any one bit of a block changes about half of the hash's bits.
        let block = [0x5au8; 64];
        let base = chain(0, &block);
        for bit in 0..block.len() * 8 {
            let mut flipped = block;
            if let Some(b) = flipped.get_mut(bit / 8) {
                *b ^= 1 << (bit % 8);
            }
            let changed = (chain(0, &flipped) ^ base).count_ones();
            assert!(
                (12..=52).contains(&changed),
                "bit {bit}: {changed} bits changed"
            );
        }
    }
}
