//! llama.cpp's tokenizer suite (`models/ggml-vocab-*.gguf` with `.inp` / `.out`), read in
//! place from the directory `scripts/fetch-llama-vocab.sh` fills (never copied into the repo).

use std::path::{Path, PathBuf};

/// The vocabularies llama.cpp's `tests/CMakeLists.txt` runs `test-tokenizer-0` on.
pub const SUITE: [&str; 15] = [
    "bert-bge",
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
];

const FETCH: &str = "run scripts/fetch-llama-vocab.sh (it downloads llama-cpp-python 0.3.36's source from PyPI and \
                     unpacks llama.cpp's models/ggml-vocab-* into the cache), or set TBOOST_LLAMA_VOCAB to a \
                     directory holding them";

/// `$TBOOST_LLAMA_VOCAB`, else `${TBOOST_CACHE:-$HOME/.cache/tboost}/llama-vocab`. Fails (never
/// skips) with the fetch command when it is missing.
pub fn dir() -> PathBuf {
    let p = match std::env::var_os("TBOOST_LLAMA_VOCAB") {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("TBOOST_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tboost"))
            .join("llama-vocab"),
    };
    assert!(p.is_dir(), "llama.cpp tokenizer suite {} is missing: {FETCH}", p.display());
    p
}

/// One vocabulary of the suite: its GGUF file and its (text, expected ids) cases in file order.
pub struct Vocab {
    pub name: &'static str,
    pub gguf: PathBuf,
    pub cases: Vec<(String, Vec<u32>)>,
}

fn read(p: &Path) -> Vec<u8> {
    assert!(p.is_file(), "{} is missing from the llama.cpp tokenizer suite: {FETCH}", p.display());
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Loads `ggml-vocab-<name>.gguf` and its cases as llama.cpp's `test-tokenizer-0` reads them:
/// `.inp` holds texts separated by `\n__ggml_vocab_test__\n`, `.out` one line of ids per text.
pub fn load(name: &'static str) -> Vocab {
    let d = dir();
    let gguf = d.join(format!("ggml-vocab-{name}.gguf"));
    assert!(gguf.is_file(), "{} is missing from the llama.cpp tokenizer suite: {FETCH}", gguf.display());
    let inp = d.join(format!("ggml-vocab-{name}.gguf.inp"));
    let out = d.join(format!("ggml-vocab-{name}.gguf.out"));
    let raw = String::from_utf8(read(&inp)).unwrap_or_else(|e| panic!("{}: not UTF-8: {e}", inp.display()));
    let outs = String::from_utf8(read(&out)).unwrap_or_else(|e| panic!("{}: not UTF-8: {e}", out.display()));

    const SEP: &str = "\n__ggml_vocab_test__\n";
    let mut texts = Vec::new();
    let mut rest = raw.as_str();
    while !rest.is_empty() {
        match rest.find(SEP) {
            Some(i) => {
                texts.push(rest[..i].to_owned());
                rest = &rest[i + SEP.len()..];
            }
            None => {
                texts.push(rest.to_owned());
                rest = "";
            }
        }
    }
    let ids: Vec<Vec<u32>> = outs
        .lines()
        .enumerate()
        .map(|(n, line)| {
            line.split_whitespace()
                .map(|t| t.parse().unwrap_or_else(|e| panic!("{}:{}: bad id {t:?}: {e}", out.display(), n + 1)))
                .collect()
        })
        .collect();
    assert_eq!(
        texts.len(),
        ids.len(),
        "{} has {} texts but {} has {} lines",
        inp.display(),
        texts.len(),
        out.display(),
        ids.len()
    );
    Vocab { name, gguf, cases: texts.into_iter().zip(ids).collect() }
}

/// Per-vocabulary result of a run: (name, matched, total, first mismatches).
pub type Tally = (&'static str, usize, usize, Vec<String>);

/// Fails with one line per vocabulary (matched / total, first mismatches) unless every case of
/// every vocabulary matched.
pub fn assert_all_match(what: &str, tallies: &[Tally]) {
    let mut report = String::new();
    let (mut ok, mut total) = (0, 0);
    for (name, m, t, bad) in tallies {
        ok += m;
        total += t;
        report.push_str(&format!("  {name}: {m}/{t}\n"));
        for b in bad.iter().take(3) {
            report.push_str(&format!("    {b}\n"));
        }
    }
    eprintln!("{what}: {ok}/{total} strings match over {} vocabularies\n{report}", tallies.len());
    assert!(tallies.len() == SUITE.len() && ok == total, "{what}: {ok}/{total} strings match\n{report}");
}
