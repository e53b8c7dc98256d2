//! Random-weight models of named shapes, built in memory, for benchmarks and tests.
