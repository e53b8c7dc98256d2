//! `tboost synth` / `gguf_write`: a synthetic model written as GGUF reads back as the same
//! config and the same tensors (Q/K rows in llama.cpp's order), runs as the same model, and
//! the CLI writes a loadable file.

use std::process::Command;

use tboost_engine::backend::cpu::CpuBackend;
use tboost_engine::model::{Model, ModelFormat};
use tboost_engine::plan::PlanOptions;
use tboost_engine::runner::ModelRunner;
use tboost_engine::session::Session;
use tboost_ops::{DType, RopeStyle};
use tboost_testkit::gguf_write::{self, permute_qk_rows};
use tboost_testkit::synthetic;

fn write(shape: &str, dtype: DType, dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join(format!("{shape}-{dtype}.gguf"));
    let mut last = (0, 0);
    gguf_write::write_synthetic(shape, dtype, 42, &path, &mut |d, t| last = (d, t)).unwrap();
    assert!(last.1 > 0 && last.0 == last.1, "progress ends at the total: {last:?}");
    path
}

#[test]
fn written_model_reads_back_with_the_same_config_and_tensors_in_every_dtype() {
    let dir = tempfile::tempdir().unwrap();
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q5_0] {
        let want = synthetic::build("small", dtype, 42).unwrap();
        let path = write("small", dtype, dir.path());
        let got = Model::load(&path).unwrap_or_else(|e| panic!("{dtype}: {e}"));
        assert_eq!(got.format, ModelFormat::Gguf);
        let mut cfg = want.config.clone();
        // llama GGUF files use adjacent-pair RoPE; the permuted Q/K rows make it the same model.
        cfg.rope_style = RopeStyle::Adjacent;
        // GGUF stores these as f32, as llama.cpp reads them.
        cfg.rms_eps = cfg.rms_eps as f32 as f64;
        cfg.rope_theta = cfg.rope_theta as f32 as f64;
        assert_eq!(format!("{:?}", got.config), format!("{cfg:?}"), "{dtype}: config");
        let tok = got.tokenizer.as_ref().unwrap_or_else(|| panic!("{dtype}: the vocabulary did not load"));
        assert_eq!(tok.vocab_size(), cfg.vocab_size, "{dtype}");

        let (w, g) = (want.weights.tensors(), got.weights.tensors());
        assert_eq!(w.len(), g.len(), "{dtype}: tensor count");
        for (a, b) in w.iter().zip(&g) {
            assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape), "{dtype}: {} vs {}", a.name, b.name);
            assert!(b.is_mapped(), "{}: read in place from the file", b.name);
            let (_, bytes) = gguf_write::to_gguf(a, &want.config).unwrap();
            assert!(bytes == b.bytes(), "{dtype}: {} differs from {}", b.name, a.name);
            let qk = b.name.ends_with("attn_q.weight") || b.name.ends_with("attn_k.weight");
            assert_eq!(qk, a.bytes() != b.bytes(), "{dtype}: only Q and K rows move ({})", b.name);
        }
    }
}

#[test]
fn qk_row_permutation_is_llama_cpps() {
    // Head of 8 rows: HF rows 0..4 are the first halves of the rotary pairs, 4..8 the second.
    let rows: Vec<u8> = (0..16u8).collect(); // 16 one-byte rows = 2 heads
    let p = permute_qk_rows(&rows, 16, 8);
    assert_eq!(p, [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]);
}

#[test]
fn written_model_computes_what_the_in_memory_model_computes() {
    let dir = tempfile::tempdir().unwrap();
    let path = write("small", DType::F32, dir.path());
    let tokens = [1u32, 17, 300, 4000, 42, 7];
    let logits = |m: &Model| {
        let mut r = ModelRunner::new(m, Box::new(CpuBackend::new(2).unwrap()), &PlanOptions::default(), 2).unwrap();
        r.alloc_kv(4, 16).unwrap();
        let mut s = Session::new(&mut r, tokens.len()).unwrap();
        s.feed(&tokens, true).unwrap()
    };
    let a = logits(&synthetic::build("small", DType::F32, 42).unwrap());
    let b = logits(&Model::load(&path).unwrap());
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    // Only the order of the q·k sums differs (head dims paired differently): f32 rounding.
    assert!(diff <= 1e-4 * scale.max(1.0), "max |diff| {diff} (logit scale {scale})");
}

#[test]
fn rows_that_are_not_whole_blocks_are_refused_before_the_file_is_created() {
    // `small` has ffn 1408, not a multiple of the 256-value K-quant super-block.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("k.gguf");
    let e = gguf_write::write_synthetic("small", DType::Q4K, 42, &path, &mut |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("blk.0.ffn_down.weight") && e.contains("q4_k"), "{e}");
    assert!(!path.exists());
}

#[test]
fn moe_shapes_are_refused_with_the_shape_named() {
    let dir = tempfile::tempdir().unwrap();
    let e = gguf_write::write_synthetic("tiny-moe", DType::F32, 42, &dir.path().join("m.gguf"), &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("tiny-moe") && e.contains("dense llama"), "{e}");
}

#[test]
fn synth_command_writes_a_loadable_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("small-q8_0.gguf");
    let run = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_tboost")).args(args).output().unwrap();
    let o = run(&["synth", "--shape", "small", "--dtype", "q8_0", "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = Model::load(&out).unwrap();
    assert_eq!(m.weights.layers[0].q.dtype, DType::Q8_0);
    assert_eq!(m.weights.layers[0].attn_norm.dtype, DType::F32);

    let o = run(&["synth", "--shape", "small", "--dtype", "iq2_xxs", "--out", out.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("dtype") && err.contains("iq2_xxs"), "{err}");
    // A type the shape cannot hold (small's intermediate 1408 is not whole 256-value K blocks)
    // names the tensor, its shape and the type.
    let o = run(&["synth", "--shape", "small", "--dtype", "q3_k", "--out", out.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("ffn_down") && err.contains("1408") && err.contains("q3_k"), "{err}");
    let o = run(&["synth", "--shape", "huge", "--dtype", "f16", "--out", dir.path().join("x.gguf").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("huge") && err.contains("tinyllama-1.1b"), "{err}");
    assert!(!dir.path().join("x.gguf").exists(), "no partial file is left behind");
}

/// `ModelRunner::reserve` sizes the activation buffers at load: a step it covers allocates
/// nothing (its memory was faulted in before, not inside the step), and the logits are the
/// same as with buffers grown by the step itself.
#[test]
fn a_reserved_step_allocates_nothing_and_computes_the_same() {
    let model = synthetic::build("small", DType::Q8_0, 7).unwrap();
    let tokens: Vec<u32> = (0..40).map(|i| 3 + (i * 97) % 4000).collect();
    let run = |reserve: bool| {
        let mut r =
            ModelRunner::new(&model, Box::new(CpuBackend::new(2).unwrap()), &PlanOptions::default(), 2).unwrap();
        r.alloc_kv(8, 16).unwrap();
        if reserve {
            r.reserve(tokens.len(), 1, 1, 8).unwrap();
        }
        let before = r.backend().allocated_bytes();
        let logits = Session::new(&mut r, tokens.len() + 1).unwrap().feed(&tokens, false).unwrap();
        (r.backend().allocated_bytes() - before, logits)
    };
    let (grew_reserved, reserved) = run(true);
    let (grew_lazy, lazy) = run(false);
    assert_eq!(grew_reserved, 0, "a step inside the reserved capacity allocated {grew_reserved} bytes");
    assert!(grew_lazy > 0, "without reserve the step must allocate its buffers (else this test shows nothing)");
    assert_eq!(reserved, lazy);
}

/// The CPU backend zeroes each buffer itself (to fault it in at allocation): new buffers
/// read as zeros even where the allocator hands back memory a freed buffer wrote.
#[test]
fn cpu_buffers_start_zeroed_even_in_reused_memory() {
    use tboost_engine::backend::{Backend, View};
    let mut be = CpuBackend::new(2).unwrap();
    // Small (one piece) and large (zeroed in parallel pieces, with a partial last piece).
    for len in [1000usize, (3 << 20) + 12345] {
        for round in 0..3 {
            let b = be.alloc(DType::U8, len).unwrap();
            let mut got = vec![7u8; len];
            be.read(View::new(b, 0, len), &mut got).unwrap();
            assert!(got.iter().all(|&x| x == 0), "{len} bytes, round {round}: a new buffer is not zeroed");
            be.write(View::new(b, 0, len), &vec![0xA5u8; len]).unwrap();
            be.free(b);
        }
    }
}
