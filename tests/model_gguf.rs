//! GGUF reader: real files from /work/shared/models and hand-built broken files.

use std::path::{Path, PathBuf};

use tboost::model::gguf::{self, Value};

fn models_dir() -> PathBuf {
    PathBuf::from("/work/shared/models")
}

/// A shared model file, or a failure saying how to get it.
fn shared_model(name: &str) -> PathBuf {
    let p = models_dir().join(name);
    assert!(p.is_file(), "{} is missing: see /work/shared/models/README.md for its origin and sha256", p.display());
    p
}

#[test]
fn read_metadata_of_llama2_tiny() {
    let md = gguf::read_metadata(&shared_model("llama-2-tiny-random.gguf")).unwrap();
    assert_eq!(md["general.architecture"].as_str(), Some("llama"));
    assert_eq!(md["llama.block_count"].as_u64(), Some(1));
    assert_eq!(md["llama.embedding_length"].as_u64(), Some(8));
    assert_eq!(md["llama.rope.dimension_count"].as_u64(), Some(4));
    assert_eq!(md["tokenizer.ggml.model"].as_str(), Some("llama"));
    let tokens = md["tokenizer.ggml.tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 32000);
    assert_eq!(tokens[1], Value::String("<s>".into()));
    assert_eq!(md["tokenizer.ggml.scores"].as_array().unwrap().len(), 32000);
    assert!(!md.contains_key("llama.rope.freq_base"));
}

#[test]
fn read_metadata_of_missing_file_names_it() {
    let p = Path::new("/nonexistent/dir/model.gguf");
    let e = gguf::read_metadata(p).unwrap_err().to_string();
    assert!(e.contains("/nonexistent/dir/model.gguf"), "{e}");
}

#[test]
fn parse_directory_of_real_files() {
    for (name, n, version) in [("llama-2-tiny-random.gguf", 12, 3), ("stories260K-placeholder-vocab.gguf", 48, 3)] {
        let p = shared_model(name);
        let bytes = std::fs::read(&p).unwrap();
        let f = gguf::parse(&bytes, &p).unwrap();
        assert_eq!(f.tensors.len(), n, "{name}");
        assert_eq!(f.version, version, "{name}");
        assert_eq!(f.data_offset % f.alignment, 0);
        assert!(f.tensors.iter().all(|t| t.size.is_some()), "{name}: every tensor type is supported");
    }
}
