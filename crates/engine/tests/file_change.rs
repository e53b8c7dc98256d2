//! A model file changed under a running engine never kills the host. Rolling deploys
//! truncate or rewrite model files in place; a read of a mapped page past a file's new end
//! raises SIGBUS. The CPU backend copies every weight out of the file map when it uploads
//! it, in both `weight_pages` modes, so a running engine keeps generating the same tokens,
//! and building an engine from a model whose file has shrunk since load is an error naming
//! the file. A truncation during the build itself (after that check) is caught too: every
//! read of a weight while an engine is built is a `pread`, so a short read is an error
//! naming the file, the tensor and both sizes. So is a truncation while `Model::load`
//! parses the file (a test hook cuts it between its map and its parse): the loaders parse
//! headers read with `pread`, never the map. Each case works on its own copy of the file in
//! a temporary directory.

use std::path::{Path, PathBuf};

use tboost_engine::backend::cpu::{convert_weight, CpuBackend};
use tboost_engine::backend::{Backend, DType, Precision};
use tboost_engine::engine::{Engine, EngineConfig, KvSize, WeightPages};
use tboost_engine::formats::files;
use tboost_engine::model::prefault::prefault;
use tboost_engine::model::{Model, Tensor};
use tboost_engine::plan::{PlanOptions, PrecisionPolicy};
use tboost_engine::runner::ModelRunner;
use tboost_engine::sched::Request;
use tboost_testkit::gguf_write;
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

/// Runs `body` in a child process (this test binary, running only the test `name`): a read
/// of the file map past the end of a truncated file is SIGBUS, which would end the whole test
/// binary; from a child it fails this test, naming the signal.
fn in_child(name: &str, body: impl FnOnce()) {
    const CHILD: &str = "TBOOST_FILE_CHANGE_CHILD";
    if std::env::var_os(CHILD).is_some() {
        return body();
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    #[cfg(unix)]
    if let Some(sig) = std::os::unix::process::ExitStatusExt::signal(&out.status) {
        panic!(
            "{name}: killed by signal {sig} (SIGBUS is {}): a weight was read from the file map\n{log}",
            libc::SIGBUS
        );
    }
    assert!(out.status.success(), "{name}: {}\n{log}", out.status);
    assert!(log.contains("1 passed"), "{name}: the child ran no test\n{log}");
}

/// A fresh synthetic Q8_0 GGUF model (`small`: 4096 x 512 embedding and output, 512-wide
/// layers), loaded, and its file.
fn fresh_model(dir: &Path) -> (Model, PathBuf) {
    let path = dir.join("small.gguf");
    gguf_write::write_synthetic("small", DType::Q8_0, 7, &path, &mut |_, _| {}).unwrap();
    (Model::load(&path).unwrap(), path)
}

/// Truncates `file` in place to the middle of `t`'s bytes (its first pages stay, the rest
/// are gone); returns the file's length before and after.
fn truncate_inside(file: &Path, t: &Tensor) -> (u64, u64) {
    let (_, at) = t.mapped_from().expect("a tensor mapped from the file");
    let before = std::fs::metadata(file).unwrap().len();
    let cut = (at + t.bytes().len() / 2) as u64;
    std::fs::OpenOptions::new().write(true).open(file).unwrap().set_len(cut).unwrap();
    (before, cut)
}

fn assert_names(err: &str, file: &Path, t: &Tensor, (before, after): (u64, u64), what: &str) {
    assert!(err.contains(&file.display().to_string()), "{what}: the error does not name the file: {err}");
    assert!(err.contains(&format!("`{}`", t.name)), "{what}: the error does not name the tensor: {err}");
    assert!(err.contains(&format!("shrank from {before} to {after} bytes")), "{what}: {err}");
}

/// Each path of an engine build that reads a mapped tensor's bytes, driven past the size
/// check (`Tensor::check_source`) on a file truncated inside that tensor: before, each read
/// the file map and died of SIGBUS.
#[test]
fn a_file_truncated_during_the_build_is_an_error_naming_file_tensor_and_sizes() {
    in_child("a_file_truncated_during_the_build_is_an_error_naming_file_tensor_and_sizes", || {
        type Pick = fn(&Model) -> &Tensor;
        type Read = fn(&Tensor) -> Result<(), String>;
        let paths: [(&str, Pick, Read); 6] = [
            (
                "a stored tensor copied by the CPU backend",
                |m| &m.weights.embed,
                |t| CpuBackend::new(2).unwrap().upload_weight(t).map(drop).map_err(|e| e.to_string()),
            ),
            (
                "a matrix packed by the CPU backend (in parts)",
                |m| &m.weights.lm_head,
                |t| CpuBackend::new(2).unwrap().upload_packed(t, Precision::Fast).map(drop).map_err(|e| e.to_string()),
            ),
            (
                "a weight converted at upload",
                |m| &m.weights.layers[1].o,
                |t| convert_weight(t, DType::F32).map(drop).map_err(|e| e.to_string()),
            ),
            (
                "columns cut for a tensor-parallel rank",
                |m| &m.weights.layers[1].o,
                |t| t.cols(0..256).map(drop).map_err(|e| e.to_string()),
            ),
            (
                "a device backend's host staging",
                |m| &m.weights.lm_head,
                |t| t.owned_copy().map(drop).map_err(|e| e.to_string()),
            ),
            (
                "a norm gain's values (read at load for Gemma's 1 + w)",
                |m| &m.weights.norm,
                |t| t.to_f32().map(drop).map_err(|e| e.to_string()),
            ),
        ];
        for (what, pick, read) in paths {
            let dir = tempfile::tempdir().unwrap();
            let (model, file) = fresh_model(dir.path());
            let t = pick(&model);
            // Intact, the path reads the tensor.
            read(t).unwrap_or_else(|e| panic!("{what}: {e}"));
            let sizes = truncate_inside(&file, t);
            let err = read(t).expect_err(what);
            eprintln!("{what}: {err}");
            assert_names(&err, &file, t, sizes, what);
        }
    });
}

/// `prefault` of a model whose file shrank since load reads what is left and skips the rest
/// (its fallback used to touch each page, SIGBUS past the end).
#[test]
fn prefault_of_a_file_truncated_since_load_skips_what_is_gone() {
    in_child("prefault_of_a_file_truncated_since_load_skips_what_is_gone", || {
        let dir = tempfile::tempdir().unwrap();
        let (model, file) = fresh_model(dir.path());
        truncate_inside(&file, &model.weights.layers[2].q);
        let mut last = (0, 1);
        assert!(prefault(&model.weights, &mut |d, t| {
            last = (d, t);
            true
        }));
        assert_eq!(last.0, last.1, "progress ends at the total");
    });
}

/// Loads `path` (`Model::load`) with `file` truncated in place to `cut` bytes between its
/// map and its parse (the test hook [`files::set_after_map_hook`]), the race of a deploy that
/// rewrites the file while a host loads it; returns the error. Before, the parse read the
/// header through the map (and Gemma's norm gains), past the new end: SIGBUS.
fn load_cut_after_map(path: &Path, file: &Path, cut: u64) -> String {
    let target = file.to_path_buf();
    files::set_after_map_hook(Some(Box::new(move |p: &Path| {
        if p == target {
            std::fs::OpenOptions::new().write(true).open(p).unwrap().set_len(cut).unwrap();
        }
    })));
    let got = Model::load(path);
    files::set_after_map_hook(None);
    match got {
        Ok(_) => panic!("{}: loaded with {} cut to {cut} bytes during the load", path.display(), file.display()),
        Err(e) => e.to_string(),
    }
}

/// Cuts at each of `cuts` (a page boundary: the pages past it are gone, a read of them
/// through the map is SIGBUS) of a fresh copy made by `copy`; each load must fail naming
/// the file.
fn cut_during_load(what: &str, copy: impl Fn(&Path) -> (PathBuf, PathBuf), cuts: &[(&str, u64)]) {
    for &(where_, cut) in cuts {
        assert_eq!(cut % 4096, 0, "{what}: cut {cut} is not on a page boundary");
        let dir = tempfile::tempdir().unwrap();
        let (path, file) = copy(dir.path());
        let len = std::fs::metadata(&file).unwrap().len();
        assert!(cut < len, "{what}: cut {cut} of a {len}-byte file");
        Model::load(&path).unwrap_or_else(|e| panic!("{what}: the intact copy: {e}"));
        let err = load_cut_after_map(&path, &file, cut);
        eprintln!("{what} cut {where_} ({cut} of {len} bytes): {err}");
        assert!(
            err.contains(&file.display().to_string()),
            "{what} ({where_}): the error does not name the file: {err}"
        );
        assert!(err.contains(&format!("shrank from {len} to {cut} bytes")), "{what} ({where_}): {err}");
    }
}

/// `n` rounded down to a page boundary.
fn page_floor(n: u64) -> u64 {
    n / 4096 * 4096
}

/// A GGUF file truncated while `Model::load` parses it: inside its metadata (the
/// vocabulary), and inside its tensor data.
#[test]
fn a_gguf_truncated_during_model_load_is_an_error_naming_the_file() {
    in_child("a_gguf_truncated_during_model_load_is_an_error_naming_the_file", || {
        let source = "llama-2-tiny-random.gguf";
        let bytes = std::fs::read(shared_dir().join("models").join(source)).unwrap();
        let parsed = tboost_engine::formats::gguf::parse(&bytes, Path::new(source)).unwrap();
        assert!(parsed.data_offset > 3 * 4096, "the metadata spans pages");
        let data = page_floor(parsed.data_offset) + 2 * 4096;
        cut_during_load("GGUF", |d| copy_model(d, source), &[("in the metadata", 4096), ("in the tensor data", data)]);
    });
}

/// The offset in `file` of tensor `name`'s bytes (a safetensors file).
fn safetensors_offset(file: &Path, name: &str) -> u64 {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    (st.tensor(name).unwrap().data().as_ptr() as usize - bytes.as_ptr() as usize) as u64
}

/// A Gemma 3 safetensors checkpoint (its norm gains are read at load, `1 + w`) truncated
/// while `Model::load` parses it: inside its header, and just before a norm gain.
#[test]
fn a_safetensors_file_truncated_during_model_load_is_an_error_naming_the_file() {
    in_child("a_safetensors_file_truncated_during_model_load_is_an_error_naming_the_file", || {
        let dir = tempfile::tempdir().unwrap();
        let (_, file) = copy_model(dir.path(), "gemma3");
        let header = u64::from_le_bytes(std::fs::read(&file).unwrap()[..8].try_into().unwrap());
        assert!(header > 4096, "the header spans pages");
        let gain = page_floor(safetensors_offset(&file, "model.layers.0.input_layernorm.weight"));
        cut_during_load(
            "safetensors",
            |d| copy_model(d, "gemma3"),
            &[("in the header", 4096), ("before a norm gain", gain)],
        );
    });
}

/// The same in the second shard of a sharded copy (an index and two files).
#[test]
fn a_safetensors_shard_truncated_during_model_load_is_an_error_naming_the_shard() {
    in_child("a_safetensors_shard_truncated_during_model_load_is_an_error_naming_the_shard", || {
        let shard = |dir: &Path| -> (PathBuf, PathBuf) {
            let src = golden_dir("gemma3");
            let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
            names.sort();
            std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
            let mut weight_map = serde_json::Map::new();
            let half = names.len() / 2;
            for (k, part) in [&names[..half], &names[half..]].into_iter().enumerate() {
                let file = format!("model-{:05}-of-00002.safetensors", k + 1);
                let views: Vec<_> = part.iter().map(|n| (n.clone(), st.tensor(n).unwrap())).collect();
                std::fs::write(dir.join(&file), safetensors::serialize(views, None).unwrap()).unwrap();
                for n in part {
                    weight_map.insert(n.clone(), serde_json::json!(file));
                }
            }
            let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
            std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
            (dir.to_path_buf(), dir.join("model-00002-of-00002.safetensors"))
        };
        let dir = tempfile::tempdir().unwrap();
        let (_, file) = shard(dir.path());
        let gain = page_floor(safetensors_offset(&file, "model.norm.weight"));
        cut_during_load("a shard", shard, &[("to nothing", 0), ("before a norm gain", gain)]);
    });
}
