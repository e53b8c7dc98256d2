//! Structured output on the demo model: JSON-schema, regex and Lark requests sampled in one
//! batch beside unconstrained ones produce output that parses and validates; llama.cpp's own
//! JSON grammar in GBNF gives JSON; a bad grammar is an error naming it and the position, and
//! the engine goes on; speculative decoding keeps a constrained greedy request's tokens.

use tboost_testkit::golden as common;

use common::*;
use serde_json::Value;
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::sample::{FinishReason, Grammar, SamplingParams};
use tboost_engine::sched::Request;

const SCHEMA: &str = r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
  "age": {"type": "integer", "minimum": 0, "maximum": 150}, "tags": {"type": "array",
  "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3}},
  "required": ["name", "age", "tags"], "additionalProperties": false}"#;

/// llama.cpp's `grammars/json.gbnf` (llama-cpp-python 0.3.36 sdist), as a llama.cpp user sends it.
const JSON_GBNF: &str = include_str!("data/json.gbnf");

fn engine(spec: usize) -> Engine {
    let cfg =
        EngineConfig { threads: 2, kv_size: KvSize::Blocks(256), max_seqs: 32, spec_ngram: spec, ..Default::default() };
    let e = Engine::new(cfg).unwrap();
    e.load(&demo_model()).unwrap();
    e
}

fn chat(e: &Engine, user: &str) -> Vec<u32> {
    let text = format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n");
    e.tokenize(&text, false).unwrap()
}

fn sampled(prompt: Vec<u32>, seed: u64, grammar: Option<Grammar>) -> Request {
    Request {
        sampling: SamplingParams { temperature: 0.9, top_p: 0.95, seed, ..SamplingParams::default() },
        grammar,
        ..Request::new(prompt, 64)
    }
}

/// The schema's rules, checked by hand on the parsed value.
fn valid_person(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    keys == ["age", "name", "tags"]
        && o["name"].as_str().is_some_and(|s| s.chars().count() <= 20)
        && o["age"].as_i64().is_some_and(|a| (0..=150).contains(&a))
        && o["tags"]
            .as_array()
            .is_some_and(|t| t.len() <= 3 && t.iter().all(|x| matches!(x.as_str(), Some("red" | "green" | "blue"))))
}

#[test]
fn constrained_requests_validate_beside_unconstrained_ones() {
    let e = engine(0);
    let json = Grammar::JsonSchema(SCHEMA.into());
    let phone = Grammar::Regex(r"\(\d{3}\) \d{3}-\d{4}".into());
    let answer = Grammar::Lark("start: (\"yes\" | \"no\") \", because \" /[a-z ]{1,30}/ \".\"".into());
    let p_json = chat(&e, "Describe a fictional person as JSON with name, age and tags.");
    let p_phone = chat(&e, "Write a US phone number.");
    let p_yes = chat(&e, "Is water wet? Answer yes or no and say why.");
    let p_free = chat(&e, "Write a haiku about the sea.");
    let mut reqs = Vec::new();
    for i in 0..8u64 {
        reqs.push(("json", sampled(p_json.clone(), i, Some(json.clone()))));
        reqs.push(("free", sampled(p_free.clone(), 100 + i, None)));
        if i < 4 {
            reqs.push(("phone", sampled(p_phone.clone(), 200 + i, Some(phone.clone()))));
            reqs.push(("lark", sampled(p_yes.clone(), 300 + i, Some(answer.clone()))));
        }
    }
    let ids: Vec<u64> = reqs.iter().map(|(_, r)| e.enqueue(r.clone()).unwrap()).collect();
    e.run_to_completion().unwrap();
    let tok = e.tokenizer().unwrap();
    let phone_re = regex::Regex::new(r"^\(\d{3}\) \d{3}-\d{4}$").unwrap();
    let lark_re = regex::Regex::new(r"^(yes|no), because [a-z ]{1,30}\.$").unwrap();
    let mut free_texts = Vec::new();
    for ((kind, _), id) in reqs.iter().zip(&ids) {
        let out = e.output(*id).unwrap();
        let text = tok.decode(&out.tokens).unwrap();
        let text = text.trim_end_matches("<|im_end|>").to_string();
        match *kind {
            "json" => {
                assert_eq!(out.finish, Some(FinishReason::Eos), "request {id} did not complete its JSON: {text:?}");
                let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("request {id}: {e}: {text:?}"));
                assert!(valid_person(&v), "request {id}: {v} does not validate");
            }
            "phone" => assert!(phone_re.is_match(&text), "request {id}: {text:?}"),
            "lark" => assert!(lark_re.is_match(&text), "request {id}: {text:?}"),
            _ => free_texts.push(text),
        }
    }
    // The unconstrained requests were not held to anyone's grammar.
    assert!(free_texts.iter().all(|t| serde_json::from_str::<Value>(t).is_err()), "{free_texts:?}");
    let st = e.stats().unwrap();
    assert!(st.grammar_masks > 0, "{st:?}");
    eprintln!(
        "{} masks, {:.3} ms of host time each; {:.2} ms per step on average",
        st.grammar_masks,
        st.grammar_mask_ms / st.grammar_masks as f64,
        st.total_step_ms / st.steps as f64
    );
}

#[test]
fn gbnf_json_grammar_gives_json_that_parses() {
    let e = engine(0);
    let p = chat(&e, "Describe a fictional book as a small JSON object: title, author, year.");
    let ids: Vec<u64> = (0..6u64)
        .map(|i| {
            let r = Request { max_tokens: 160, ..sampled(p.clone(), 400 + i, Some(Grammar::Gbnf(JSON_GBNF.into()))) };
            e.enqueue(r).unwrap()
        })
        .collect();
    e.run_to_completion().unwrap();
    let tok = e.tokenizer().unwrap();
    for id in ids {
        let out = e.output(id).unwrap();
        let text = tok.decode(&out.tokens).unwrap();
        let text = text.trim_end_matches("<|im_end|>");
        assert_eq!(out.finish, Some(FinishReason::Eos), "request {id} did not complete its JSON: {text:?}");
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("request {id}: {e}: {text:?}"));
        assert!(v.is_object(), "request {id}: json.gbnf's root is an object: {v}");
    }
    let st = e.stats().unwrap();
    assert!(st.grammar_masks > 0, "{st:?}");
    eprintln!(
        "json.gbnf: {} masks, {:.3} ms of host time each; {:.2} ms per step on average",
        st.grammar_masks,
        st.grammar_mask_ms / st.grammar_masks as f64,
        st.total_step_ms / st.steps as f64
    );
}

#[test]
fn bad_grammars_are_named_errors_and_the_engine_goes_on() {
    let e = engine(0);
    let p = chat(&e, "Say something.");
    let cases = [
        (Grammar::Lark("start: \"a\" | \n  bad ::= )".into()), "grammar (lark)"),
        (Grammar::JsonSchema("{not json".into()), "the schema is not JSON"),
        (Grammar::Regex("(unclosed".into()), "grammar (regex)"),
        // GBNF: the position is in the GBNF text (line 2, the backwards range).
        (Grammar::Gbnf("root ::= \"a\"\n  | [z-a]".into()), "grammar (gbnf)`: line 2 col 6: the range"),
        (Grammar::Gbnf("root ::= item".into()), "grammar (gbnf)`: line 1 col 10: undefined rule `item`"),
        (Grammar::Gbnf("root ::= \"a\" <nope>".into()), "`<nope>` is not one token of the model's vocabulary"),
    ];
    for (g, want) in cases {
        let err = e.enqueue(sampled(p.clone(), 1, Some(g))).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
    let lark = e.enqueue(sampled(p.clone(), 1, Some(Grammar::Lark("start: foo\nfoo: \"x\" bar".into()))));
    let err = lark.unwrap_err().to_string();
    assert!(err.contains("bar") && err.contains("grammar (lark)"), "names the undefined rule: {err}");
    // The engine still serves requests.
    let id = e.enqueue(sampled(p, 2, Some(Grammar::Regex("ok".into())))).unwrap();
    e.run_to_completion().unwrap();
    assert_eq!(e.tokenizer().unwrap().decode(&e.output(id).unwrap().tokens).unwrap(), "ok");
}

#[test]
fn speculation_keeps_a_constrained_greedy_request() {
    let reqs = |e: &Engine| {
        let p = chat(e, "Repeat this JSON exactly: {\"name\": \"Ada\", \"age\": 36, \"tags\": [\"red\", \"blue\"]}");
        vec![Request { grammar: Some(Grammar::JsonSchema(SCHEMA.into())), ..Request::new(p, 64) }]
    };
    let run = |e: &Engine| {
        let ids: Vec<u64> = reqs(e).into_iter().map(|r| e.enqueue(r).unwrap()).collect();
        e.run_to_completion().unwrap();
        ids.iter().map(|&id| e.output(id).unwrap().tokens).collect::<Vec<_>>()
    };
    let want = run(&engine(0));
    let e = engine(6);
    assert_eq!(run(&e), want);
    let st = e.stats().unwrap();
    assert!(st.spec_accepted > 0, "{st:?}");
}
