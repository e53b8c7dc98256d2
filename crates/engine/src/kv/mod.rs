//! The paged KV cache. On the device: one K and one V pool per layer (`pool`). On the host:
//! the block allocator with its prefix cache (`blocks`), and per sequence the block table
//! and prefix-hash chain (`manager`), which also builds each step's slot mapping and block
//! tables. The scheduler decides who gets room; this module decides where it is.

pub mod blocks;
pub mod manager;
pub mod pool;

pub use blocks::{BlockHash, BlockManager};
pub use manager::{KvManager, PrefixHit, SeqKey, SeqWork, StepLayout, NO_BLOCK};
pub use pool::KvPools;
