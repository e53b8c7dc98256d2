//! llama.cpp's tokenizer suite through the C ABI (`tboost_tokenizer_load` +
//! `tboost_tokenizer_tokenize`): every vocabulary of its `test-tokenizer-0` (vocabulary-only
//! GGUF files, no weights) gives llama.cpp's ids on every string, tokenized as llama.cpp's test
//! does (add_special and parse_special false).

use std::ffi::CString;
use std::os::raw::c_char;
use std::ptr::null_mut;

use tboost::{
    tboost_last_error, tboost_status, tboost_tokenizer, tboost_tokenizer_detokenize, tboost_tokenizer_free,
    tboost_tokenizer_load, tboost_tokenizer_tokenize,
};
use tboost_testkit::llama_vocab::{self, Tally, SUITE};

fn last_error() -> String {
    let mut buf = vec![0u8; 4096];
    let mut needed = 0usize;
    // SAFETY: buffer of buf.len() bytes.
    unsafe { tboost_last_error(buf.as_mut_ptr().cast::<c_char>(), buf.len(), &mut needed) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(0);
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn load(path: &std::path::Path) -> Result<*mut tboost_tokenizer, String> {
    let c = CString::new(path.to_str().expect("UTF-8 path")).unwrap();
    let mut h = null_mut();
    // SAFETY: NUL-terminated path, valid out pointer.
    let st = unsafe { tboost_tokenizer_load(c.as_ptr(), &mut h) };
    if st == tboost_status::TBOOST_OK {
        Ok(h)
    } else {
        Err(format!("{st:?}: {}", last_error()))
    }
}

fn tokenize(h: *mut tboost_tokenizer, text: &str) -> Result<Vec<u32>, String> {
    let mut n = 0usize;
    // First call with no room: the size comes back as BUFFER_TOO_SMALL (or OK for none).
    // SAFETY: text.len() readable bytes; cap 0 with a NULL buffer.
    let st =
        unsafe { tboost_tokenizer_tokenize(h, text.as_ptr().cast(), text.len(), false, false, null_mut(), 0, &mut n) };
    if st == tboost_status::TBOOST_OK {
        return Ok(Vec::new());
    }
    if st != tboost_status::TBOOST_ERR_BUFFER_TOO_SMALL {
        return Err(format!("{st:?}: {}", last_error()));
    }
    let mut ids = vec![0i32; n];
    // SAFETY: `ids` holds n elements.
    let st = unsafe {
        tboost_tokenizer_tokenize(h, text.as_ptr().cast(), text.len(), false, false, ids.as_mut_ptr(), n, &mut n)
    };
    if st != tboost_status::TBOOST_OK {
        return Err(format!("{st:?}: {}", last_error()));
    }
    Ok(ids.into_iter().map(|i| i as u32).collect())
}

#[test]
fn c_abi_tokenize_matches_llama_cpp_on_every_suite_vocabulary() {
    let mut tallies: Vec<Tally> = Vec::new();
    for name in SUITE {
        let v = llama_vocab::load(name);
        let h = match load(&v.gguf) {
            Ok(h) => h,
            Err(e) => {
                tallies.push((name, 0, v.cases.len(), vec![format!("tboost_tokenizer_load failed: {e}")]));
                continue;
            }
        };
        let mut bad = Vec::new();
        for (text, want) in &v.cases {
            match tokenize(h, text) {
                Ok(got) if &got == want => {}
                Ok(got) => bad.push(format!("{text:?}: got {got:?}, llama.cpp {want:?}")),
                Err(e) => bad.push(format!("{text:?}: {e}")),
            }
        }
        assert_eq!(tboost_tokenizer_free(h), tboost_status::TBOOST_OK);
        tallies.push((name, v.cases.len() - bad.len(), v.cases.len(), bad));
    }
    llama_vocab::assert_all_match("C ABI tokenize", &tallies);
}

#[test]
fn c_abi_tokenizer_round_trips_and_rejects_bad_input() {
    let v = llama_vocab::load("llama-bpe");
    let h = load(&v.gguf).expect("vocabulary-only GGUF loads");
    let ids: Vec<i32> = tokenize(h, "Hello world").unwrap().into_iter().map(|i| i as i32).collect();
    assert!(!ids.is_empty());
    let mut buf = vec![0u8; 256];
    let mut needed = 0;
    // SAFETY: ids.len() readable ids, buf.len() writable bytes.
    let st = unsafe {
        tboost_tokenizer_detokenize(h, ids.as_ptr(), ids.len(), buf.as_mut_ptr().cast(), buf.len(), &mut needed)
    };
    assert_eq!(st, tboost_status::TBOOST_OK);
    assert_eq!(&buf[..needed - 1], b"Hello world");
    // Invalid UTF-8 text is an argument error naming `text`.
    let mut n = 0;
    // SAFETY: 2 readable bytes.
    let st =
        unsafe { tboost_tokenizer_tokenize(h, b"\xff\xfe".as_ptr().cast(), 2, false, false, null_mut(), 0, &mut n) };
    assert_eq!(st, tboost_status::TBOOST_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("text"));
    assert_eq!(tboost_tokenizer_free(h), tboost_status::TBOOST_OK);
    // A freed handle is reported, never dereferenced.
    assert_eq!(tboost_tokenizer_free(h), tboost_status::TBOOST_ERR_INVALID_HANDLE);
    // A missing file fails with the path in the message.
    let err = load(std::path::Path::new("/nonexistent/vocab.gguf")).unwrap_err();
    assert!(err.contains("/nonexistent/vocab.gguf"), "{err}");
}
