//! Host-side block management of the paged KV cache: which physical block holds which
//! positions of which sequence, with prefix caching.
//!
//! - Every physical block is either *free* (on the free list), *in use* (reference count
//!   ≥ 1: one per sequence whose block table names it), or *cached* (count 0, but its
//!   contents are registered under a hash and can be reused until evicted, LRU).
//! - A *full* block is identified by `hash(parent block's hash, its tokens)`, so equal hashes
//!   mean equal prefixes. The tokens are kept beside the hash and compared on a hit, so a
//!   hash collision can never serve wrong K/V.
//! - Allocation takes a free block first, then evicts the least recently used cached block.

use std::collections::{BTreeMap, HashMap};

/// Identity of a full block's contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

impl BlockHash {
    /// FNV-1a over the parent hash and the tokens (stable across runs and platforms).
    pub fn of(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |b: u64| {
            for byte in b.to_le_bytes() {
                h ^= byte as u64;
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        eat(parent.map_or(u64::MAX, |p| p.0));
        for &t in tokens {
            eat(t as u64);
        }
        BlockHash(h)
    }
}

struct BlockInfo {
    refs: u32,
    /// Set once the block is full and registered in the prefix cache.
    hash: Option<BlockHash>,
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
    /// LRU stamp while cached with refs == 0.
    lru: u64,
}

pub struct BlockManager {
    block_size: usize,
    blocks: Vec<BlockInfo>,
    free: Vec<u32>,
    /// Cached, unreferenced blocks by LRU stamp (oldest first).
    evictable: BTreeMap<u64, u32>,
    cache: HashMap<BlockHash, u32>,
    clock: u64,
    prefix_caching: bool,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> BlockManager {
        let blocks = (0..num_blocks)
            .map(|_| BlockInfo { refs: 0, hash: None, parent: None, tokens: Vec::new(), lru: 0 })
            .collect();
        // Pop from the end: hand out low block numbers first (easier to read in traces).
        let free = (0..num_blocks as u32).rev().collect();
        BlockManager {
            block_size,
            blocks,
            free,
            evictable: BTreeMap::new(),
            cache: HashMap::new(),
            clock: 0,
            prefix_caching,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be handed out now (free + evictable cached).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks referenced by at least one sequence.
    pub fn used(&self) -> usize {
        self.total() - self.available()
    }

    /// Cached blocks (referenced or not) registered in the prefix cache.
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    /// Takes one block, evicting the least recently used cached block if none is free.
    pub fn allocate(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (&stamp, &b) = self.evictable.iter().next()?;
                self.evictable.remove(&stamp);
                if let Some(h) = self.blocks[b as usize].hash.take() {
                    self.cache.remove(&h);
                }
                b
            }
        };
        let info = &mut self.blocks[b as usize];
        info.refs = 1;
        info.hash = None;
        info.parent = None;
        info.tokens.clear();
        Some(b)
    }

    /// Drops one reference to each block (a sequence finished, was cancelled or preempted).
    /// Registered blocks stay cached (evictable); the others return to the free list.
    pub fn release(&mut self, table: &[u32]) {
        // Release in reverse so a sequence's last blocks are evicted before its first ones:
        // the first blocks are the prefixes most likely to be shared.
        for &b in table.iter().rev() {
            let info = &mut self.blocks[b as usize];
            debug_assert!(info.refs > 0, "double release of block {b}");
            info.refs = info.refs.saturating_sub(1);
            if info.refs == 0 {
                if info.hash.is_some() {
                    self.clock += 1;
                    info.lru = self.clock;
                    self.evictable.insert(self.clock, b);
                } else {
                    self.free.push(b);
                }
            }
        }
    }

    /// The longest run of cached blocks matching `tokens` from the start, limited to
    /// `max_blocks`; each returned block gains a reference. Returns (blocks, last hash).
    pub fn lookup_prefix(&mut self, tokens: &[u32], max_blocks: usize) -> (Vec<u32>, Option<BlockHash>) {
        let mut out = Vec::new();
        let mut parent = None;
        if !self.prefix_caching {
            return (out, parent);
        }
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let h = BlockHash::of(parent, chunk);
            let Some(&b) = self.cache.get(&h) else { break };
            let info = &self.blocks[b as usize];
            if info.tokens != chunk || info.parent != parent {
                break; // a hash collision: never reuse
            }
            if info.refs == 0 {
                self.evictable.remove(&info.lru);
            }
            self.blocks[b as usize].refs += 1;
            out.push(b);
            parent = Some(h);
        }
        (out, parent)
    }

    /// Registers a just-filled block under its hash so later requests can reuse it.
    /// Returns the hash (the parent of the sequence's next block).
    pub fn register_full(&mut self, block: u32, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let h = BlockHash::of(parent, tokens);
        if self.prefix_caching && !self.cache.contains_key(&h) {
            let info = &mut self.blocks[block as usize];
            info.hash = Some(h);
            info.parent = parent;
            info.tokens.clear();
            info.tokens.extend_from_slice(tokens);
            self.cache.insert(h, block);
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_round_trip_leaves_nothing_used() {
        let mut m = BlockManager::new(4, 2, true);
        let t: Vec<u32> = (0..4).map(|_| m.allocate().unwrap()).collect();
        assert_eq!(m.allocate(), None);
        assert_eq!(m.used(), 4);
        m.release(&t);
        assert_eq!(m.used(), 0);
        assert_eq!(m.available(), 4);
    }

    #[test]
    fn a_cached_prefix_is_found_and_referenced() {
        let mut m = BlockManager::new(4, 2, true);
        let (a, b) = (m.allocate().unwrap(), m.allocate().unwrap());
        let h = m.register_full(a, None, &[7, 8]);
        m.register_full(b, Some(h), &[9, 10]);
        m.release(&[a, b]);
        assert_eq!((m.used(), m.cached()), (0, 2));
        let (hit, _) = m.lookup_prefix(&[7, 8, 9, 10, 11], 2);
        assert_eq!(hit, vec![a, b]);
        assert_eq!(m.used(), 2);
        let (miss, _) = m.lookup_prefix(&[7, 9], 2);
        assert!(miss.is_empty());
    }

    #[test]
    fn eviction_is_least_recently_used_and_forgets_the_hash() {
        let mut m = BlockManager::new(2, 1, true);
        let (a, b) = (m.allocate().unwrap(), m.allocate().unwrap());
        m.register_full(a, None, &[1]);
        m.register_full(b, None, &[2]);
        m.release(&[a]);
        m.release(&[b]);
        assert_eq!(m.allocate(), Some(a)); // a was released first
        assert!(m.lookup_prefix(&[1], 1).0.is_empty());
        assert_eq!(m.lookup_prefix(&[2], 1).0, vec![b]);
    }

    #[test]
    fn without_prefix_caching_nothing_is_cached() {
        let mut m = BlockManager::new(2, 1, false);
        let a = m.allocate().unwrap();
        m.register_full(a, None, &[1]);
        m.release(&[a]);
        assert_eq!(m.cached(), 0);
        assert!(m.lookup_prefix(&[1], 1).0.is_empty());
    }
}
