//! A model file changed under a running engine never kills the host. Rolling deploys
//! truncate or rewrite model files in place; a read of a mapped page past a file's new end
//! raises SIGBUS. The CPU backend copies every weight out of the file map when it uploads
//! it, in both `weight_pages` modes, so a running engine keeps generating the same tokens,
//! and building an engine from a model whose file has shrunk since load is an error naming
//! the file. Each case works on its own copy of the file in a temporary directory.

use std::path::{Path, PathBuf};

use tboost_engine::engine::{Engine, EngineConfig, KvSize, WeightPages};
use tboost_engine::model::Model;
use tboost_engine::plan::{PlanOptions, PrecisionPolicy};
use tboost_engine::runner::ModelRunner;
use tboost_engine::sched::Request;
use tboost_testkit::golden::{golden_dir, shared_dir};

/// A private copy of a model: the golden HF directory, or a GGUF file of `../shared/models`.
fn copy_model(dir: &Path, source: &str) -> (PathBuf, PathBuf) {
    if source.ends_with(".gguf") {
        let from = shared_dir().join("models").join(source);
        let to = dir.join(source);
        std::fs::copy(&from, &to).unwrap_or_else(|e| panic!("{}: {e} (the shared test data)", from.display()));
        return (to.clone(), to);
    }
    for f in ["config.json", "model.safetensors"] {
        let from = golden_dir(source).join(f);
        std::fs::copy(&from, dir.join(f)).unwrap_or_else(|e| panic!("{}: {e} (the shared test data)", from.display()));
    }
    (dir.to_path_buf(), dir.join("model.safetensors"))
}

fn config(pages: WeightPages) -> EngineConfig {
    EngineConfig {
        threads: 2,
        kv_size: KvSize::Blocks(64),
        weight_pages: pages,
        // Exact precision uses the stored tensors (nothing repacked): the case a file map
        // would serve.
        precision: PrecisionPolicy::Exact,
        ..Default::default()
    }
}

fn request() -> Request {
    Request { ignore_eos: true, ..Request::new(vec![5, 9, 17, 3, 42, 7], 24) }
}

fn generate(path: &Path, pages: WeightPages) -> Vec<u32> {
    let e = Engine::new(config(pages)).unwrap();
    e.load(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    let id = e.enqueue(request()).unwrap();
    e.run_to_completion().unwrap();
    e.output(id).unwrap().tokens
}

/// Truncates `file` to nothing in place (the same inode, as `truncate -s 0` or an
/// `open(O_TRUNC)` rewrite does).
fn truncate(file: &Path) {
    std::fs::OpenOptions::new().write(true).open(file).unwrap().set_len(0).unwrap();
}

fn truncated_mid_generation(source: &str, pages: WeightPages) {
    let dir = tempfile::tempdir().unwrap();
    let (path, file) = copy_model(dir.path(), source);
    let want = generate(&path, pages);
    assert_eq!(want.len(), 24);

    let e = Engine::new(config(pages)).unwrap();
    e.load(&path).unwrap();
    let id = e.enqueue(request()).unwrap();
    for _ in 0..4 {
        e.step().unwrap();
    }
    truncate(&file);
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 0);
    // Any read of the old map would be SIGBUS here and end this test process.
    e.run_to_completion().unwrap();
    let got = e.output(id).unwrap().tokens;
    assert_eq!(got, want, "{source} ({pages:?}): the tokens changed after the file was truncated");
    // The engine keeps serving new requests.
    let again = e.enqueue(request()).unwrap();
    e.run_to_completion().unwrap();
    assert_eq!(e.output(again).unwrap().tokens, want, "{source} ({pages:?}): a request after the truncation");

    // Loading the file as it is now is a clear error, not a crash.
    let err = Engine::new(config(pages)).unwrap().load(&path).expect_err("an empty model file loads");
    eprintln!("{source} ({pages:?}) reloaded after truncation: {err}");
}

#[test]
fn safetensors_truncated_mid_generation_with_huge_weight_pages() {
    truncated_mid_generation("llama_gqa", WeightPages::Huge);
}

#[test]
fn safetensors_truncated_mid_generation_with_small_weight_pages() {
    truncated_mid_generation("llama_gqa", WeightPages::Small);
}

#[test]
fn gguf_truncated_mid_generation_with_huge_weight_pages() {
    truncated_mid_generation("llama-2-tiny-random.gguf", WeightPages::Huge);
}

#[test]
fn gguf_truncated_mid_generation_with_small_weight_pages() {
    truncated_mid_generation("llama-2-tiny-random.gguf", WeightPages::Small);
}

/// Between `Model::load` (which maps the file) and building a runner on it (which reads the
/// map to shard and upload), a truncation is caught before any read.
#[test]
fn a_model_whose_file_shrank_since_load_is_an_error_naming_the_file() {
    for source in ["llama_gqa", "llama-2-tiny-random.gguf"] {
        let dir = tempfile::tempdir().unwrap();
        let (path, file) = copy_model(dir.path(), source);
        let model = Model::load(&path).unwrap();
        let len = std::fs::metadata(&file).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(len / 2).unwrap();
        let be = tboost_engine::backend::cpu::CpuBackend::new(1).unwrap();
        let err = match ModelRunner::new(&model, Box::new(be), &PlanOptions::default(), 1) {
            Ok(_) => panic!("{source}: a runner was built over a truncated file"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(&file.display().to_string()), "{source}: the error does not name the file: {err}");
        assert!(err.contains(&format!("shrank from {len} to {} bytes", len / 2)), "{source}: {err}");
    }
}
