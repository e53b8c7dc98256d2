//! The per-request random stream.
//!
//! ChaCha8 (`rand_chacha`) is value-stable across versions and platforms, and one block yields
//! eight u64 words, so one draw per token costs a few nanoseconds. The 32-byte key is expanded
//! from the u64 seed with SplitMix64 here rather than by `SeedableRng::seed_from_u64`, so the
//! token stream for a given seed is fixed by this file alone.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug)]
pub(crate) struct RequestRng(ChaCha8Rng);

impl RequestRng {
    pub(crate) fn new(seed: u64) -> Self {
        // SplitMix64 (Steele, Lea, Flood 2014): well-mixed words even for seeds 0, 1, 2, ...
        let mut state = seed;
        let mut key = [0u8; 32];
        for chunk in key.chunks_exact_mut(8) {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            chunk.copy_from_slice(&z.to_le_bytes());
        }
        RequestRng(ChaCha8Rng::from_seed(key))
    }

    /// Uniform in [0, 1) with 53 random bits (every value a multiple of 2^-53).
    pub(crate) fn next_f64(&mut self) -> f64 {
        (self.0.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}
