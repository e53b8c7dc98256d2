//! GGUF block-quantized weights (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K): scalar dequantize
//! references and matmul kernels that work on the blocks directly (being written).
