//! Paged KV cache with automatic prefix caching, modelled on vLLM V1's
//! `BlockPool` + `KVCacheManager` (single full-attention KV cache group).
//!
//! * Blocks hold `block_size` tokens. A *full* block is identified by a chained
//!   hash: `hash(parent_block_hash, token ids of the block)` so equal hashes mean
//!   equal whole prefixes.
//! * Free blocks sit in a doubly linked LRU queue. Blocks of finished requests
//!   keep their hash (they stay in the prefix cache with ref count 0) and are only
//!   evicted when a new block is taken from the front of the queue.
//! * A request's blocks are freed tail first, so that the tail of a prefix is
//!   evicted before its head, as in vLLM.

use std::collections::HashMap;

pub type BlockId = u32;
pub type ReqId = u64;

const NIL: u32 = u32::MAX;

/// Root of every hash chain (vLLM's `NONE_HASH`).
pub const ROOT_HASH: u64 = 0x6b76_6761_7465_0001;

/// SplitMix64 finaliser: a cheap, well-mixing 64-bit permutation.
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Hash of one full block chained to its parent's hash.
pub fn hash_block(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = mix64(parent ^ 0x5bd1_e995);
    for &t in tokens {
        h = mix64(h ^ u64::from(t));
    }
    h
}

/// Root hash for a request, salted by `cache_salt` when given (vLLM mixes the
/// salt into the first block's extra keys, so salted prompts never share).
pub fn root_hash(cache_salt: Option<&str>) -> u64 {
    match cache_salt {
        None => ROOT_HASH,
        Some(s) => fold_str(ROOT_HASH, s, 0x5a17),
    }
}

/// The salt an SGLang prompt's blocks are keyed by, from its namespace as SGLang's radix cache
/// keys it: `RadixKey` carries a prompt's `cache_salt` and its `extra_key` as fields of their
/// own (`python/sglang/srt/mem_cache/radix_cache.py`; `Req` gets both from the request, and
/// `Req.__init__` concatenates the adapter's `lora_id` to the `extra_key`, which the engine
/// here keys by `lora_root`), so two prompts share blocks only when both are equal, and a salt
/// is never the same namespace as an `extra_key` of the same text. Without an `extra_key` the
/// salt is keyed as a vLLM salt is; with one, both are spelled out with their presence and the
/// salt's length, so no two namespaces of an `extra_key` meet (one only of a salt could, were
/// the salt itself to begin with this spelling's NUL-led tag).
pub fn sglang_namespace(cache_salt: Option<&str>, extra_key: Option<&str>) -> Option<String> {
    let Some(key) = extra_key else {
        return cache_salt.map(str::to_string);
    };
    let salt = cache_salt.map_or_else(|| "-".to_string(), |s| format!("{}:{s}", s.len()));
    Some(format!("\0extra_key\0{salt}\0{key}"))
}

/// Root hash of a request run with a LoRA adapter: vLLM puts the adapter's
/// name in every block's extra keys (`_gen_lora_extra_hash_keys` in
/// `vllm/v1/core/kv_cache_utils.py`), so a prompt under another adapter, or
/// under the base model, never shares its blocks.
pub fn lora_root(root: u64, lora_name: &str) -> u64 {
    fold_str(root, lora_name, 0x10ad)
}

fn fold_str(mut h: u64, s: &str, tag: u64) -> u64 {
    for b in s.bytes() {
        h = mix64(h ^ u64::from(b));
    }
    mix64(h ^ tag)
}

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    hash: Option<u64>,
    prev: u32,
    next: u32,
    in_free: bool,
}

/// Fixed pool of KV blocks with an LRU free queue and a hash → block map.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<u64, Vec<BlockId>>,
    num_cached_blocks: usize,
    /// Cached blocks dropped from the prefix cache to make room.
    pub evictions: u64,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        let n = num_blocks.min(NIL as usize - 1);
        let mut blocks = Vec::with_capacity(n);
        for i in 0..n {
            blocks.push(Block {
                ref_cnt: 0,
                hash: None,
                prev: if i == 0 { NIL } else { i as u32 - 1 },
                next: if i + 1 == n { NIL } else { i as u32 + 1 },
                in_free: true,
            });
        }
        BlockPool {
            blocks,
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n as u32 - 1 },
            num_free: n,
            cached: HashMap::new(),
            num_cached_blocks: 0,
            evictions: 0,
        }
    }

    /// Blocks that can be handed out: unused ones plus cached ones with ref 0.
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Blocks referenced by at least one running request.
    pub fn num_used(&self) -> usize {
        self.blocks.len() - self.num_free
    }

    /// Blocks currently registered in the prefix cache (in use or not).
    pub fn num_cached(&self) -> usize {
        self.num_cached_blocks
    }

    /// vLLM's `kv_cache_usage_perc`: fraction of blocks held by requests.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            0.0
        } else {
            1.0 - self.num_free as f64 / self.blocks.len() as f64
        }
    }

    pub fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks.get(id as usize).map_or(0, |b| b.ref_cnt)
    }

    fn unlink(&mut self, id: u32) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        b.in_free = false;
        self.num_free -= 1;
    }

    fn push_back(&mut self, id: u32) {
        let tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
            b.in_free = true;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    /// First cached block holding this hash, if any.
    pub fn get_cached(&self, hash: u64) -> Option<BlockId> {
        self.cached.get(&hash).and_then(|v| v.first().copied())
    }

    /// Take references on cache-hit blocks; blocks with ref 0 leave the free queue.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            if self.blocks[id as usize].ref_cnt == 0 && self.blocks[id as usize].in_free {
                self.unlink(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
    }

    fn evict_hash(&mut self, id: BlockId) {
        if let Some(h) = self.blocks[id as usize].hash.take() {
            if let Some(v) = self.cached.get_mut(&h) {
                v.retain(|&b| b != id);
                if v.is_empty() {
                    self.cached.remove(&h);
                }
            }
            self.num_cached_blocks -= 1;
            self.evictions += 1;
        }
    }

    /// Pop `n` blocks from the front of the free queue (least recently used),
    /// evicting their cached contents. `None` when not enough are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            self.evict_hash(id);
            self.blocks[id as usize].ref_cnt = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Drop one reference from each block, in the given order; blocks reaching
    /// ref 0 are appended to the free queue (keeping their cached hash).
    pub fn free_blocks<I: IntoIterator<Item = BlockId>>(&mut self, ids: I) {
        for id in ids {
            let b = &mut self.blocks[id as usize];
            if b.ref_cnt == 0 {
                continue;
            }
            b.ref_cnt -= 1;
            if b.ref_cnt == 0 {
                self.push_back(id);
            }
        }
    }

    /// Register a full block in the prefix cache.
    pub fn cache_block(&mut self, id: BlockId, hash: u64) {
        let b = &mut self.blocks[id as usize];
        if b.hash.is_some() {
            return;
        }
        b.hash = Some(hash);
        self.cached.entry(hash).or_default().push(id);
        self.num_cached_blocks += 1;
    }

    /// Drop every cached hash; fails (false) while any block is in use, as vLLM's
    /// `reset_prefix_cache` does.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_used() != 0 {
            return false;
        }
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.cached.clear();
        self.num_cached_blocks = 0;
        true
    }
}

#[derive(Debug, Default, Clone)]
struct ReqBlocks {
    blocks: Vec<BlockId>,
    num_cached: usize,
}

/// Per-request block tables on top of the pool (vLLM's `KVCacheManager`).
#[derive(Debug)]
pub struct KvCacheManager {
    pub pool: BlockPool,
    pub block_size: usize,
    pub enable_caching: bool,
    pub max_model_len: usize,
    reqs: HashMap<ReqId, ReqBlocks>,
}

/// What `allocate_slots` needs to know about a request.
pub struct SlotRequest<'a> {
    pub id: ReqId,
    /// `request.num_tokens`: prompt plus generated tokens so far.
    pub num_tokens: usize,
    /// Tokens whose KV is already computed (before this step's cache hits).
    pub num_computed_tokens: usize,
    /// Chained hashes of the request's full blocks.
    pub block_hashes: &'a [u64],
}

impl KvCacheManager {
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        enable_caching: bool,
        max_model_len: usize,
    ) -> Self {
        KvCacheManager {
            pool: BlockPool::new(num_blocks),
            block_size: block_size.max(1),
            enable_caching,
            max_model_len,
            reqs: HashMap::new(),
        }
    }

    pub fn num_blocks_of(&self, id: ReqId) -> usize {
        self.reqs.get(&id).map_or(0, |r| r.blocks.len())
    }

    #[cfg(test)]
    pub fn blocks_of(&self, id: ReqId) -> Vec<BlockId> {
        self.reqs
            .get(&id)
            .map(|r| r.blocks.clone())
            .unwrap_or_default()
    }

    /// Longest run of cached full blocks from the start of `hashes`, limited to
    /// `max_tokens` tokens (callers pass `num_tokens - 1` so that at least the
    /// last token is recomputed to produce logits).
    pub fn find_longest_cache_hit(&self, hashes: &[u64], max_tokens: usize) -> Vec<BlockId> {
        if !self.enable_caching {
            return Vec::new();
        }
        let max_blocks = max_tokens / self.block_size;
        let mut hit = Vec::new();
        for &h in hashes.iter().take(max_blocks) {
            match self.pool.get_cached(h) {
                Some(b) => hit.push(b),
                None => break,
            }
        }
        hit
    }

    fn num_blocks_to_allocate(
        &self,
        id: ReqId,
        num_tokens: usize,
        new_computed: &[BlockId],
    ) -> usize {
        let required = num_tokens.div_ceil(self.block_size);
        let have = self.num_blocks_of(id) + new_computed.len();
        let new = required.saturating_sub(have);
        // Cache hits sitting in the free queue stop being free once touched.
        let evictable = new_computed
            .iter()
            .filter(|&&b| self.pool.ref_cnt(b) == 0)
            .count();
        new + evictable
    }

    /// vLLM's `allocate_slots`: reserve room for `num_new_tokens` more tokens
    /// after `num_computed_tokens` (+ the new cache hits), and register newly
    /// filled blocks in the prefix cache. `None` if the pool is too small now.
    pub fn allocate_slots(
        &mut self,
        req: &SlotRequest<'_>,
        num_new_tokens: usize,
        new_computed: &[BlockId],
    ) -> Option<Vec<BlockId>> {
        let bs = self.block_size;
        let computed = req.num_computed_tokens + new_computed.len() * bs;
        let need = (computed + num_new_tokens).min(self.max_model_len.max(1));
        let n = self.num_blocks_to_allocate(req.id, need, new_computed);
        if n > self.pool.num_free() {
            return None;
        }
        self.pool.touch(new_computed);
        let entry = self.reqs.entry(req.id).or_default();
        if entry.blocks.is_empty() {
            entry.num_cached = new_computed.len();
        }
        entry.blocks.extend_from_slice(new_computed);
        let have = entry.blocks.len();
        let required = need.div_ceil(bs);
        let new_blocks = if required > have {
            self.pool.allocate(required - have)?
        } else {
            Vec::new()
        };
        let entry = self.reqs.entry(req.id).or_default();
        entry.blocks.extend_from_slice(&new_blocks);
        if self.enable_caching {
            let to_cache = (computed + num_new_tokens).min(req.num_tokens);
            let full = (to_cache / bs).min(entry.blocks.len());
            let start = entry.num_cached;
            let pairs: Vec<(BlockId, u64)> = (start..full)
                .filter_map(|i| Some((entry.blocks[i], *req.block_hashes.get(i)?)))
                .collect();
            entry.num_cached = entry.num_cached.max(start + pairs.len());
            for (b, h) in pairs {
                self.pool.cache_block(b, h);
            }
        }
        Some(new_blocks)
    }

    /// Release all blocks of a request, tail first (so tails are evicted first).
    pub fn free(&mut self, id: ReqId) {
        if let Some(r) = self.reqs.remove(&id) {
            self.pool.free_blocks(r.blocks.into_iter().rev());
        }
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(tokens: &[u32], bs: usize, salt: Option<&str>) -> Vec<u64> {
        let mut out = Vec::new();
        let mut parent = root_hash(salt);
        for chunk in tokens.chunks(bs) {
            if chunk.len() < bs {
                break;
            }
            parent = hash_block(parent, chunk);
            out.push(parent);
        }
        out
    }

    fn admit(m: &mut KvCacheManager, id: ReqId, tokens: &[u32]) -> usize {
        let hs = hashes(tokens, m.block_size, None);
        let hit = m.find_longest_cache_hit(&hs, tokens.len() - 1);
        let hit_tokens = hit.len() * m.block_size;
        let req = SlotRequest {
            id,
            num_tokens: tokens.len(),
            num_computed_tokens: 0,
            block_hashes: &hs,
        };
        m.allocate_slots(&req, tokens.len() - hit_tokens, &hit)
            .expect("room");
        hit_tokens
    }

    /// SGLang's namespace: a salt alone keys as vLLM's salt does; an `extra_key` is a namespace
    /// of its own, apart from a salt of the same text, and every (salt, key) pair is distinct.
    #[test]
    fn sglang_namespaces_are_distinct_pairs() {
        assert_eq!(sglang_namespace(None, None), None);
        assert_eq!(sglang_namespace(Some("t"), None).as_deref(), Some("t"));
        let pairs = [
            (None, Some("t")),
            (Some("t"), Some("t")),
            (Some(""), Some("t")),
            (Some("a"), Some("bt")),
            (Some("ab"), Some("t")),
            (Some("a\0b"), Some("t")),
            (Some("a"), Some("b\0t")),
            (Some("t"), Some("")),
        ];
        let mut seen: Vec<Option<String>> = vec![sglang_namespace(Some("t"), None)];
        for (salt, key) in pairs {
            let ns = sglang_namespace(salt, key);
            assert!(ns.is_some());
            assert!(!seen.contains(&ns), "{salt:?} {key:?}");
            seen.push(ns);
        }
    }

    #[test]
    fn prefix_is_reused_after_free_and_last_token_recomputed() {
        let mut m = KvCacheManager::new(64, 4, true, 1 << 20);
        let prompt: Vec<u32> = (0..16).collect();
        assert_eq!(admit(&mut m, 1, &prompt), 0);
        assert_eq!(m.pool.num_used(), 4);
        assert_eq!(m.pool.num_cached(), 4);
        m.free(1);
        assert_eq!(m.pool.num_used(), 0);
        assert_eq!(m.pool.num_cached(), 4, "finished blocks stay cached");
        // Same 16 tokens: only 3 blocks may hit because the last token must be
        // recomputed and hits are whole blocks.
        assert_eq!(admit(&mut m, 2, &prompt), 12);
        m.free(2);
        // Longer prompt sharing the 16-token prefix hits all 4 blocks.
        let longer: Vec<u32> = (0..23).collect();
        assert_eq!(admit(&mut m, 3, &longer), 16);
        // Diverging prompt: hits only up to the divergence.
        let mut other = prompt.clone();
        other[9] = 999;
        assert_eq!(admit(&mut m, 4, &other), 8);
    }

    #[test]
    fn shared_blocks_are_ref_counted() {
        let mut m = KvCacheManager::new(64, 4, true, 1 << 20);
        let a: Vec<u32> = (0..13).collect();
        admit(&mut m, 1, &a);
        let b: Vec<u32> = (0..13).collect();
        assert_eq!(admit(&mut m, 2, &b), 12);
        let shared = m.blocks_of(1);
        for &blk in &shared[..3] {
            assert_eq!(m.pool.ref_cnt(blk), 2);
        }
        // 4 blocks for A, 1 new block for B's last partial block.
        assert_eq!(m.pool.num_used(), 5);
        m.free(1);
        for &blk in &shared[..3] {
            assert_eq!(m.pool.ref_cnt(blk), 1, "still held by B");
        }
        assert_eq!(m.pool.num_used(), 4);
        m.free(2);
        assert_eq!(m.pool.num_used(), 0);
        assert_eq!(m.pool.num_free(), 64);
    }

    #[test]
    fn lru_eviction_takes_oldest_freed_and_tails_first() {
        // 8 blocks of 4 tokens.
        let mut m = KvCacheManager::new(8, 4, true, 1 << 20);
        let a: Vec<u32> = (0..16).collect(); // 4 blocks
        let b: Vec<u32> = (100..116).collect(); // 4 blocks
        admit(&mut m, 1, &a);
        admit(&mut m, 2, &b);
        assert_eq!(m.pool.num_free(), 0);
        m.free(1); // A freed first: least recently used
        m.free(2);
        assert_eq!(m.pool.num_cached(), 8);
        // A new 9-token request needs 3 blocks: they come from A, tail first.
        let c: Vec<u32> = (500..509).collect();
        admit(&mut m, 3, &c);
        let ha = hashes(&a, 4, None);
        let hb = hashes(&b, 4, None);
        assert!(m.pool.get_cached(ha[0]).is_some(), "A's head survives");
        assert!(m.pool.get_cached(ha[1]).is_none());
        assert!(m.pool.get_cached(ha[3]).is_none(), "A's tail evicted first");
        for h in &hb {
            assert!(m.pool.get_cached(*h).is_some(), "B is more recent");
        }
        assert_eq!(m.pool.evictions, 3);
        m.free(3);
        // A cache hit moves B's blocks out of the free queue (touch), so the
        // next allocation evicts what is left of A and C instead.
        let hit = admit(&mut m, 4, &(100..117).collect::<Vec<u32>>());
        assert_eq!(hit, 16);
        let d: Vec<u32> = (900..912).collect(); // 3 blocks
        admit(&mut m, 5, &d);
        for h in &hb {
            assert!(
                m.pool.get_cached(*h).is_some(),
                "touched blocks are not evicted"
            );
        }
    }

    #[test]
    fn allocation_fails_without_room_and_counts_evictable_hits() {
        let mut m = KvCacheManager::new(4, 4, true, 1 << 20);
        let a: Vec<u32> = (0..16).collect();
        admit(&mut m, 1, &a);
        let hs = hashes(&(0..40).collect::<Vec<u32>>(), 4, None);
        let req = SlotRequest {
            id: 2,
            num_tokens: 40,
            num_computed_tokens: 0,
            block_hashes: &hs,
        };
        assert!(m.allocate_slots(&req, 40, &[]).is_none());
        assert_eq!(m.num_blocks_of(2), 0, "failed allocation leaves no trace");
        m.free(1);
        // 3 cached hits (ref 0, evictable) + 1 new block = all 4 free blocks.
        let hit = m.find_longest_cache_hit(&hs[..4], 15);
        assert_eq!(hit.len(), 3);
        let req = SlotRequest {
            id: 3,
            num_tokens: 16,
            num_computed_tokens: 0,
            block_hashes: &hs[..4],
        };
        assert!(m.allocate_slots(&req, 4, &hit).is_some());
        assert_eq!(m.pool.num_free(), 0);
    }

    #[test]
    fn salt_separates_caches_and_disabled_caching_never_hits() {
        let t: Vec<u32> = (0..32).collect();
        assert_ne!(hashes(&t, 4, None)[0], hashes(&t, 4, Some("tenant"))[0]);
        let mut m = KvCacheManager::new(16, 4, false, 1 << 20);
        admit(&mut m, 1, &t);
        m.free(1);
        assert_eq!(admit(&mut m, 2, &t), 0);
        assert_eq!(m.pool.num_cached(), 0);
    }
}
