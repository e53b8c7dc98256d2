//! Per-sequence KV state on the host: each sequence's block table and prefix-hash chain, on
//! top of the block allocator (`blocks`). The scheduler asks it for room and tells it what
//! was computed; the runner gets a per-step layout (positions, slot mapping, sequence
//! lengths, block tables) from it, so no other module computes a slot.

use std::collections::HashMap;

use super::blocks::{BlockHash, BlockManager};

/// Who a block table belongs to (a request id, or a session's fixed id).
pub type SeqKey = u64;

/// Block ids past the end of a sequence's table in `StepLayout::block_tables`.
pub const NO_BLOCK: u32 = u32::MAX;

#[derive(Default)]
struct SeqBlocks {
    /// Block of each run of `block_size` positions; `NO_BLOCK` for blocks behind a sliding
    /// window, given back to the pool.
    table: Vec<u32>,
    /// Leading entries of `table` given back (all `NO_BLOCK`).
    dropped: usize,
    /// Full blocks registered in the prefix cache, and the hash of the last of them.
    hashed: usize,
    last_hash: Option<BlockHash>,
}

/// A prefix-cache hit offered at admission: blocks already referenced for the sequence.
#[derive(Debug)]
#[must_use = "a prefix hit holds block references: admit it or give it back"]
pub struct PrefixHit {
    blocks: Vec<u32>,
    last: Option<BlockHash>,
}

impl PrefixHit {
    /// Positions the hit covers.
    pub fn tokens(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }
}

/// One sequence's part of a step: `n` tokens from position `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqWork {
    pub seq: SeqKey,
    pub start: usize,
    pub n: usize,
}

/// Everything a forward pass needs to know about where K/V live, for one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepLayout {
    /// Absolute position of each token.
    pub positions: Vec<u32>,
    /// Cache slot (block * block_size + row) each token's K/V is written to.
    pub slots: Vec<u32>,
    /// Per sequence `[q_start, q_len, ctx_len]` (rows of the step, new tokens, context after
    /// the step).
    pub seqs: Vec<[u32; 3]>,
    /// `seqs.len() * max_blocks` block ids; a table's unused tail holds `NO_BLOCK`.
    pub block_tables: Vec<u32>,
    pub max_blocks: usize,
}

impl StepLayout {
    pub fn tokens(&self) -> usize {
        self.positions.len()
    }

    pub fn clear(&mut self) {
        self.positions.clear();
        self.slots.clear();
        self.seqs.clear();
        self.block_tables.clear();
        self.max_blocks = 0;
    }
}

pub struct KvManager {
    blocks: BlockManager,
    seqs: HashMap<SeqKey, SeqBlocks>,
    /// Sliding window of every layer (0: none): blocks wholly behind it are given back.
    window: usize,
}

impl KvManager {
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> KvManager {
        KvManager { blocks: BlockManager::new(num_blocks, block_size, prefix_caching), seqs: HashMap::new(), window: 0 }
    }

    /// Every layer attends to at most the last `window` positions (0: all): after each
    /// commit, the blocks no later query can see go back to the pool (registered ones stay in
    /// the prefix cache, evictable). Their table entries become `NO_BLOCK`.
    pub fn set_window(&mut self, window: usize) {
        self.window = window;
    }

    /// Blocks of `seq` given back behind its window.
    pub fn dropped_of(&self, seq: SeqKey) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.dropped)
    }

    pub fn block_size(&self) -> usize {
        self.blocks.block_size()
    }

    pub fn total(&self) -> usize {
        self.blocks.total()
    }

    pub fn available(&self) -> usize {
        self.blocks.available()
    }

    pub fn used(&self) -> usize {
        self.blocks.used()
    }

    pub fn cached(&self) -> usize {
        self.blocks.cached()
    }

    /// Blocks `seq` holds (0 for an unknown sequence).
    pub fn blocks_of(&self, seq: SeqKey) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.table.len())
    }

    /// Blocks `seq` still needs to hold `positions` positions.
    pub fn blocks_needed(&self, seq: SeqKey, positions: usize) -> usize {
        positions.div_ceil(self.block_size()).saturating_sub(self.blocks_of(seq))
    }

    /// Grows `seq`'s table to hold `positions` positions; false (and nothing taken) when
    /// not enough blocks are available.
    pub fn grow(&mut self, seq: SeqKey, positions: usize) -> bool {
        let need = self.blocks_needed(seq, positions);
        if need > self.blocks.available() {
            return false;
        }
        let table = &mut self.seqs.entry(seq).or_default().table;
        for _ in 0..need {
            // Cannot fail: `available` counted it.
            if let Some(b) = self.blocks.allocate() {
                table.push(b);
            }
        }
        true
    }

    /// The longest cached prefix of `tokens` in whole blocks, at most `max_blocks`; each
    /// block gains a reference until `admit` takes the hit or `give_back` returns it.
    pub fn lookup_prefix(&mut self, tokens: &[u32], max_blocks: usize) -> PrefixHit {
        let (blocks, last) = self.blocks.lookup_prefix(tokens, max_blocks);
        PrefixHit { blocks, last }
    }

    pub fn give_back(&mut self, hit: PrefixHit) {
        self.blocks.release(&hit.blocks);
    }

    /// Starts `seq` with the prefix hit and room for `positions` positions; false (the hit
    /// given back, nothing taken) when the blocks are not there.
    pub fn admit(&mut self, seq: SeqKey, hit: PrefixHit, positions: usize) -> bool {
        let need = positions.div_ceil(self.block_size()).saturating_sub(hit.blocks.len());
        if need > self.blocks.available() {
            self.give_back(hit);
            return false;
        }
        let hashed = hit.blocks.len();
        let mut s = SeqBlocks { table: hit.blocks, dropped: 0, hashed, last_hash: hit.last };
        for _ in 0..need {
            if let Some(b) = self.blocks.allocate() {
                s.table.push(b);
            }
        }
        if let Some(old) = self.seqs.insert(seq, s) {
            self.blocks.release(&old.table[old.dropped..]);
        }
        true
    }

    /// Drops `seq`'s blocks (finished, cancelled, preempted). Full registered blocks stay
    /// in the prefix cache.
    pub fn release(&mut self, seq: SeqKey) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.blocks.release(&s.table[s.dropped..]);
        }
    }

    /// Gives back `seq`'s blocks beyond what `positions` positions need (the room a rejected
    /// speculative draft took). Registered and window-dropped blocks stay.
    pub fn shrink(&mut self, seq: SeqKey, positions: usize) {
        let bs = self.block_size();
        let Some(s) = self.seqs.get_mut(&seq) else { return };
        let keep = positions.div_ceil(bs).max(s.hashed).max(s.dropped);
        if s.table.len() > keep {
            let tail = s.table.split_off(keep);
            self.blocks.release(&tail);
        }
    }

    /// After a forward pass: `seq` now has `computed` positions of `tokens` in the cache;
    /// registers its newly full blocks in the prefix cache.
    pub fn commit(&mut self, seq: SeqKey, tokens: &[u32], computed: usize) {
        let bs = self.block_size();
        let Some(s) = self.seqs.get_mut(&seq) else { return };
        while s.hashed < computed / bs && s.hashed < s.table.len() {
            let b = s.hashed;
            let h = self.blocks.register_full(s.table[b], s.last_hash, &tokens[b * bs..(b + 1) * bs]);
            s.last_hash = Some(h);
            s.hashed += 1;
        }
        // The next query (position `computed`) sees positions from computed + 1 - window on:
        // blocks wholly before that are done with. Registered blocks stay in the prefix
        // cache (a later request with the same prefix can still take them).
        if self.window > 0 {
            let first_visible = (computed + 1).saturating_sub(self.window);
            let done = (first_visible / bs).min(s.table.len());
            if done > s.dropped {
                self.blocks.release(&s.table[s.dropped..done]);
                s.table[s.dropped..done].fill(NO_BLOCK);
                s.dropped = done;
            }
        }
    }

    /// The layout of one step over `work`, in order (rows of the step follow it). Every
    /// sequence must hold the blocks for `start + n` positions (the scheduler grew them).
    pub fn layout(&self, work: &[SeqWork], out: &mut StepLayout) {
        out.clear();
        let bs = self.block_size();
        out.max_blocks = work.iter().map(|w| (w.start + w.n).div_ceil(bs)).max().unwrap_or(0).max(1);
        let empty = Vec::new();
        for w in work {
            let table = self.seqs.get(&w.seq).map_or(&empty, |s| &s.table);
            let q_start = out.positions.len() as u32;
            for p in w.start..w.start + w.n {
                out.positions.push(p as u32);
                let block = table.get(p / bs).copied().unwrap_or(NO_BLOCK);
                out.slots.push(block.wrapping_mul(bs as u32).wrapping_add((p % bs) as u32));
            }
            out.seqs.push([q_start, w.n as u32, (w.start + w.n) as u32]);
            let used = (w.start + w.n).div_ceil(bs);
            out.block_tables.extend(table.iter().take(used));
            out.block_tables.extend(std::iter::repeat_n(NO_BLOCK, out.max_blocks - used.min(table.len())));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_maps_positions_to_the_sequences_own_blocks() {
        let mut kv = KvManager::new(8, 4, true);
        assert!(kv.grow(1, 6)); // blocks 0, 1
        assert!(kv.grow(2, 3)); // block 2
        let mut l = StepLayout::default();
        kv.layout(&[SeqWork { seq: 2, start: 2, n: 1 }, SeqWork { seq: 1, start: 4, n: 2 }], &mut l);
        assert_eq!(l.positions, vec![2, 4, 5]);
        assert_eq!(l.slots, vec![2 * 4 + 2, 4, 5]);
        assert_eq!(l.seqs, vec![[0, 1, 3], [1, 2, 6]]);
        assert_eq!(l.max_blocks, 2);
        assert_eq!(l.block_tables, vec![2, NO_BLOCK, 0, 1]);
    }

    #[test]
    fn admit_takes_a_prefix_hit_and_release_returns_everything() {
        let mut kv = KvManager::new(4, 2, true);
        let toks = [5, 6, 7, 8, 9];
        assert!(kv.grow(1, 5));
        kv.commit(1, &toks, 5);
        kv.release(1);
        assert_eq!((kv.used(), kv.cached()), (0, 2));
        let hit = kv.lookup_prefix(&toks, 2);
        assert_eq!(hit.tokens(2), 4);
        assert!(kv.admit(2, hit, 5));
        assert_eq!(kv.blocks_of(2), 3);
        let mut l = StepLayout::default();
        kv.layout(&[SeqWork { seq: 2, start: 4, n: 1 }], &mut l);
        assert_eq!(l.seqs, vec![[0, 1, 5]]);
        kv.release(2);
        assert_eq!(kv.used(), 0);
    }

    #[test]
    fn admit_without_room_gives_the_hit_back() {
        let mut kv = KvManager::new(2, 2, true);
        assert!(kv.grow(1, 4));
        let hit = kv.lookup_prefix(&[1, 2, 3], 1);
        assert!(!kv.admit(2, hit, 3));
        assert_eq!(kv.blocks_of(2), 0);
        assert_eq!(kv.used(), 2);
    }
}
