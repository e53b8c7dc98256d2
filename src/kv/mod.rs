//! The paged KV cache: device pools (`pool`), and on the host the block allocator, block
//! tables and prefix cache that decide which block each sequence's positions live in.

pub mod blocks;
pub mod pool;

pub use blocks::{BlockHash, BlockManager};
pub use pool::KvPools;
