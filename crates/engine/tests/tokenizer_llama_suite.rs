//! llama.cpp's tokenizer suite through the library (`Tokenizer::load`, which reads no weights):
//! the same cases the CLI and C ABI tests run, without a process or the ABI in between.

use tboost_engine::tokenizer::Tokenizer;
use tboost_testkit::llama_vocab::{self, Tally, SUITE};

#[test]
fn tokenizer_load_matches_llama_cpp_on_every_suite_vocabulary() {
    let mut tallies: Vec<Tally> = Vec::new();
    for name in SUITE {
        let v = llama_vocab::load(name);
        let tok = match Tokenizer::load(&v.gguf) {
            Ok(t) => t,
            Err(e) => {
                tallies.push((name, 0, v.cases.len(), vec![format!("load failed: {e}")]));
                continue;
            }
        };
        let mut bad = Vec::new();
        for (text, want) in &v.cases {
            match tok.encode_with(text, false, false) {
                Ok(got) if &got == want => {}
                Ok(got) => bad.push(format!("{text:?}: got {got:?}, llama.cpp {want:?}")),
                Err(e) => bad.push(format!("{text:?}: {e}")),
            }
        }
        tallies.push((name, v.cases.len() - bad.len(), v.cases.len(), bad));
    }
    llama_vocab::assert_all_match("Tokenizer::load", &tallies);
}
