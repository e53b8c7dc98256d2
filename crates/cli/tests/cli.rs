//! The `tboost` command line: its output formats are part of the contract, and bad input
//! is a one-line error naming what is wrong, with a non-zero exit status.

use tboost_testkit::golden as common;

use std::process::Command;

use common::*;
use serde_json::Value;

fn tboost(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tboost")).args(args).env("RUST_LOG", "warn").output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ok_json(args: &[&str]) -> Value {
    let (ok, out, err) = tboost(args);
    assert!(ok, "tboost {args:?} failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

fn model() -> String {
    golden_dir("llama_gqa").display().to_string()
}

#[test]
fn logits_prints_one_row_per_position_asked() {
    let g = golden("llama_gqa");
    let p7 = &g["prompts"].as_array().unwrap().iter().find(|p| p["name"] == "p7").unwrap();
    let toks: Vec<String> = ids(&p7["token_ids"]).iter().map(u32::to_string).collect();
    let toks = toks.join(",");
    let last = ok_json(&["logits", "--model", &model(), "--tokens", &toks]);
    let rows = last["logits"].as_array().unwrap();
    assert_eq!(rows.len(), 1);
    assert!(max_abs_diff(&floats(&rows[0]), &floats(&p7["last_logits"])) <= 1e-3);
    let all = ok_json(&["logits", "--model", &model(), "--tokens", &toks, "--all-positions"]);
    let rows: Vec<f32> = all["logits"].as_array().unwrap().iter().flat_map(floats).collect();
    let want: Vec<f32> = p7["all_logits"].as_array().unwrap().iter().flat_map(floats).collect();
    assert!(max_abs_diff(&rows, &want) <= 1e-3);
}

#[test]
fn run_json_has_prompt_and_generated_ids() {
    let g = golden("llama_gqa");
    let p = &g["prompts"][1];
    let toks: Vec<String> = ids(&p["token_ids"]).iter().map(u32::to_string).collect();
    let v = ok_json(&[
        "run",
        "--model",
        &model(),
        "--tokens",
        &toks.join(","),
        "-n",
        "16",
        "--temp",
        "0",
        "--ignore-eos",
        "--json",
    ]);
    assert_eq!(ids(&v["prompt_ids"]), ids(&p["token_ids"]));
    assert_eq!(ids(&v["generated_ids"]), ids(&p["greedy"]["tokens_f64"]));
    assert_eq!(v["finish_reason"], "length");
}

#[test]
fn plan_json_lists_every_layer() {
    let v = ok_json(&["plan", "--model", &golden_dir("llama_hd24").display().to_string(), "--json"]);
    let layers = v["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 3);
    for l in layers {
        let d = l["decisions"].as_array().unwrap();
        let pre = d.iter().find(|d| d["slot"] == "attention_prefill").unwrap();
        assert_eq!(pre["choice"], "standard_attention");
        assert_eq!(pre["fallback"], true);
        // Candidates tried, the one chosen, and the structured reason of each rejection.
        let tried = pre["tried"].as_array().unwrap();
        assert_eq!(tried[0]["candidate"], "flash_attention");
        assert_eq!(tried[0]["verdict"], "rejected");
        assert_eq!(tried[0]["why"]["param"], "head_dim");
        assert_eq!(tried[0]["why"]["value"], "24");
        assert_eq!(tried[0]["why"]["need"], "a multiple of 16");
        assert_eq!(tried[0]["query"]["op"], "attention");
        assert_eq!(tried.last().unwrap()["verdict"], "chosen");
        for slot in ["attn_norm", "qkv", "rope", "kv_write", "attention_decode", "o_proj", "ffn_norm", "mlp"] {
            assert!(d.iter().any(|x| x["slot"] == slot), "no {slot} in {l}");
        }
    }
    assert_eq!(v["act_dtype"], "f32");
    assert_eq!(v["device"]["backend"], "cpu");
}

#[test]
fn an_unknown_backend_is_an_error_naming_the_known_ones() {
    let (ok, _, err) =
        tboost(&["plan", "--model", &golden_dir("llama_hd24").display().to_string(), "--backend", "nosuch"]);
    assert!(!ok);
    assert!(err.contains("unknown backend `nosuch`") && err.contains("cpu") && err.contains("ascend"), "{err}");
}

#[test]
fn batch_prints_a_line_per_request_in_order_and_stats() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("r.jsonl");
    std::fs::write(
        &f,
        "{\"tokens\": [5, 6, 7], \"max_tokens\": 4}\n{\"tokens\": [9, 10], \"max_tokens\": 2, \"temperature\": 0.7, \"seed\": 3}\n",
    )
    .unwrap();
    let (ok, out, err) = tboost(&["batch", "--model", &model(), "--requests", f.to_str().unwrap(), "--kv-blocks", "8"]);
    assert!(ok, "{err}");
    let lines: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["index"], 0);
    assert_eq!(lines[0]["generated_ids"].as_array().unwrap().len(), 4);
    assert_eq!(lines[1]["generated_ids"].as_array().unwrap().len(), 2);
    assert_eq!(lines[1]["finish_reason"], "length");
    assert_eq!(lines[2]["stats"]["finished"], 2);
    assert_eq!(lines[2]["stats"]["kv_blocks_used"], 0);
}

/// A line's `grammar` may be llama.cpp's GBNF (`{"gbnf": "..."}`); one that does not convert
/// fails the batch naming the line and the position in the grammar.
#[test]
fn batch_takes_a_gbnf_grammar() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("r.jsonl");
    let m = model_file("llama-2-tiny-random.gguf").display().to_string();
    let line = |g: &str| {
        let grammar = serde_json::json!({ "gbnf": g });
        format!("{{\"tokens\": [1, 450, 4996], \"max_tokens\": 16, \"temperature\": 0.9, \"grammar\": {grammar}}}\n")
    };
    std::fs::write(&f, line("root ::= (\"cat\" | \"dog\") \"-\" [0-9]{3}")).unwrap();
    let (ok, out, err) = tboost(&["batch", "--model", &m, "--requests", f.to_str().unwrap()]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    let text = v["text"].as_str().unwrap();
    assert!(regex_lite_match(text), "{v}");
    assert_eq!(v["finish_reason"], "eos", "{v}");
    std::fs::write(&f, line("root ::= \"a\"\nroot ::= \"b\"")).unwrap();
    let (ok, _, err) = tboost(&["batch", "--model", &m, "--requests", f.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("line 1") && err.contains("grammar (gbnf)") && err.contains("line 2 col 1"), "{err}");
}

/// `cat-123` or `dog-456`.
fn regex_lite_match(t: &str) -> bool {
    t.len() == 7 && (t.starts_with("cat-") || t.starts_with("dog-")) && t[4..].bytes().all(|b| b.is_ascii_digit())
}

/// More requests than the engine keeps finished records of (65,536): every result still
/// comes out, in input order (issue: every result was lost past that count).
#[test]
fn batch_of_more_requests_than_finished_records_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("r.jsonl");
    let n = 70_000;
    let lines: Vec<String> = (0..n).map(|i| format!("{{\"tokens\": [{}], \"max_tokens\": 1}}", 3 + i % 500)).collect();
    std::fs::write(&f, lines.join("\n")).unwrap();
    let path = model_file("stories260K-placeholder-vocab.gguf").display().to_string();
    let args = [
        "batch",
        "--model",
        &path,
        "--requests",
        f.to_str().unwrap(),
        "--max-seqs",
        "512",
        "--max-batched-tokens",
        "512",
    ];
    let (ok, out, err) = tboost(&args);
    assert!(ok, "{err}");
    let mut count = 0;
    for (i, l) in out.lines().take(n).enumerate() {
        let v: Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["index"], i);
        assert_eq!(v["generated_ids"].as_array().unwrap().len(), 1, "{v}");
        count += 1;
    }
    assert_eq!(count, n);
    let stats: Value = serde_json::from_str(out.lines().nth(n).unwrap()).unwrap();
    assert_eq!(stats["stats"]["finished"], n);
}

/// A GGUF without a chat template chats with its family's built-in one (Llama 2's `[INST]`).
#[test]
fn chat_without_a_template_in_the_file_uses_the_built_in_one() {
    let m = model_file("llama-2-tiny-random.gguf").display().to_string();
    let v = ok_json(&["run", "--model", &m, "--chat", "hi", "-n", "2", "--temp", "0", "--json"]);
    let prompt = ids(&v["prompt_ids"]);
    assert_eq!(prompt[0], 1, "BOS written by the template: {v}");
    assert!(prompt.len() > 4, "[INST] hi [/INST]: {v}");
}

#[test]
fn bad_input_is_a_clear_error() {
    for (args, needle) in [
        (vec!["logits", "--model", &model(), "--tokens", "5,640"], "640 is not below the vocabulary size 640"),
        (vec!["logits", "--model", "/nonexistent/model.gguf", "--tokens", "1"], "/nonexistent/model.gguf"),
        (vec!["plan", "--model", &model(), "--disable", "warp"], "unknown op or fusion `warp`"),
        (vec!["run", "--model", &model(), "--prompt", "hello"], "has no tokenizer"),
        (vec!["bench", "--synthetic", "gpt5", "--decode", "1"], "unknown shape `gpt5`"),
    ] {
        let (ok, _, err) = tboost(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: stderr lacks `{needle}`: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}

#[test]
fn tokenize_prints_ids() {
    let v = ok_json(&[
        "tokenize",
        "--model",
        &model_file("llama-2-tiny-random.gguf").display().to_string(),
        "--text",
        "Once upon a time",
        "--json",
    ]);
    assert_eq!(ids(&v["ids"]), [1, 9038, 2501, 263, 931]);
}

#[test]
fn bench_reports_rates_and_the_bandwidth_share() {
    let v = ok_json(&[
        "bench",
        "--synthetic",
        "small",
        "--prefill",
        "8",
        "--decode",
        "4",
        "--repeat",
        "2",
        "--threads",
        "1",
        "--concurrency",
        "1,2",
        "--json",
    ]);
    for k in [
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "memory_bandwidth_bytes_per_s",
        "decode_share_of_bandwidth",
        "peak_rss_bytes",
    ] {
        assert!(v[k].as_f64().unwrap() > 0.0, "{k}: {v}");
    }
    assert_eq!(v["concurrency"].as_array().unwrap().len(), 2);
    // Every repeat's rate, the spread behind the median.
    for k in ["prefill_samples_tokens_per_s", "decode_samples_tokens_per_s"] {
        let s = v[k].as_array().unwrap_or_else(|| panic!("{k}: {v}"));
        assert_eq!(s.len(), 2, "{k}: {v}");
        assert!(s.iter().all(|x| x.as_f64().unwrap() > 0.0), "{k}: {v}");
    }
}

/// `--tp 2` benches the leader's shard (an earlier bench ignored `tp` and ran one whole rank).
#[test]
fn bench_with_tp_2_runs_a_shard() {
    let bench = |tp: &str| {
        let v = ok_json(&[
            "bench",
            "--synthetic",
            "small",
            "--prefill",
            "8",
            "--decode",
            "2",
            "--repeat",
            "1",
            "--threads",
            "2",
            "--tp",
            tp,
            "--json",
        ]);
        v["weight_bytes"].as_f64().unwrap_or_else(|| panic!("weight_bytes: {v}"))
    };
    let (one, two) = (bench("1"), bench("2"));
    assert!(two < 0.6 * one, "rank 0 of tp 2 holds {two} weight bytes, tp 1 {one}");
}

#[test]
fn bench_text_shows_the_spread_of_its_repeats() {
    let args = ["bench", "--synthetic", "small", "--prefill", "8", "--decode", "4", "--threads", "1"];
    let line = |repeat: &str, what: &str| {
        let (ok, out, err) = tboost(&[&args[..], &["--repeat", repeat]].concat());
        assert!(ok, "bench failed: {err}");
        out.lines().find(|l| l.starts_with(what)).unwrap_or_else(|| panic!("no {what} line: {out}")).to_string()
    };
    for what in ["prefill", "decode"] {
        let l = line("3", what);
        assert!(l.contains("min–max "), "{l}");
        // The median lies within the range printed beside it.
        let num = |s: &str| s.trim_matches(|c: char| !c.is_ascii_digit() && c != '.').parse::<f64>().unwrap();
        let median = num(l.split_whitespace().nth(1).unwrap());
        let range = l.split("min–max ").nth(1).unwrap().split([')', ':']).next().unwrap();
        let (lo, hi) = range.split_once('–').unwrap();
        assert!(num(lo) <= median + 0.05 && median <= num(hi) + 0.05, "{l}");
        assert!(!line("1", what).contains("min–max"), "one run has no range");
    }
}

#[test]
fn bench_op_prints_one_row_per_swept_value() {
    // Small sizes: each row is a few milliseconds.
    let common =
        ["--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--repeat", "2", "--threads", "1"];
    let mut args = vec!["bench-op", "flash_attention"];
    args.extend(common);
    args.extend(["--sweep", "tile_kv=16,32,64,128"]);
    let (ok, out, err) = tboost(&args);
    assert!(ok, "bench-op failed: {err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("flash_attention on cpu (1 threads)") && lines[0].contains("GB/s"), "{out}");
    assert!(lines[1].split_whitespace().eq(["tile_kv", "time_ms", "GFLOP/s", "GB/s", "%peak_bw"]), "{out}");
    let rows: Vec<Vec<&str>> = lines[2..].iter().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows.iter().map(|r| r[0]).collect::<Vec<_>>(), ["16", "32", "64", "128"], "{out}");
    for r in &rows {
        assert_eq!(r.len(), 5, "{out}");
        for v in &r[1..4] {
            assert!(v.parse::<f64>().is_ok_and(|x| x > 0.0), "{out}");
        }
        assert!(r[4].ends_with('%'), "{out}");
    }

    let mut args = vec!["bench-op", "flash_attention", "--json"];
    args.extend(common);
    args.extend(["--sweep", "tile_kv=32,64"]);
    let j = ok_json(&args);
    assert_eq!(j["sweep"], "tile_kv");
    assert!(j["peak_bandwidth_gbs"].as_f64().unwrap() > 0.0);
    let rows = j["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (r, want) in rows.iter().zip(["32", "64"]) {
        assert_eq!(r["tile_kv"], want);
        for k in ["time_ms", "gflops", "gbs", "pct_peak_bandwidth"] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{k}: {r}");
        }
    }

    let j = ok_json(&[
        "bench-op",
        "matmul",
        "--rows",
        "64",
        "--cols",
        "256",
        "--dtype",
        "q8_0",
        "--sweep",
        "m=1,4,16",
        "--repeat",
        "2",
        "--threads",
        "1",
        "--json",
    ]);
    let ms: Vec<&str> = j["rows"].as_array().unwrap().iter().map(|r| r["m"].as_str().unwrap()).collect();
    assert_eq!(ms, ["1", "4", "16"]);

    // The matmul's tiling: swept (one row per value, the fixed ones in the shape), and refused
    // out of range naming the parameter and the range.
    let sweep = |extra: &[&str]| {
        let mut args = vec!["bench-op", "matmul", "--rows", "96", "--cols", "256", "--dtype", "q4_k", "--m", "8"];
        args.extend(["--repeat", "2", "--threads", "2"]);
        args.extend_from_slice(extra);
        tboost(&args)
    };
    let (ok, out, err) = sweep(&["--sweep", "panel_rows=16,48,96", "--tiling", "act_rows=4", "--json"]);
    assert!(ok, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["sweep"], "panel_rows");
    assert_eq!(j["shape"]["tiling"]["act_rows"], 4, "{j}");
    let rows: Vec<&str> = j["rows"].as_array().unwrap().iter().map(|r| r["panel_rows"].as_str().unwrap()).collect();
    assert_eq!(rows, ["16", "48", "96"]);
    for key in ["act_rows=1,8", "tasks_per_thread=1,16", "decode_task_min_bytes=4096,65536"] {
        let (ok, out, err) = sweep(&["--sweep", key]);
        assert!(ok && out.lines().count() == 4, "--sweep {key}: {out}{err}");
    }
    let (ok, _, err) = sweep(&["--sweep", "panel_rows=20"]);
    assert!(!ok && err.contains("matmul.panel_rows=20 is not a multiple of 16 in 16..=4096"), "{err}");
    let (ok, _, err) = sweep(&["--tiling", "tasks_per_thread=0"]);
    assert!(!ok && err.contains("tasks_per_thread=0 is not in 1..=64"), "{err}");

    // A tile the kernel does not take: a one-line error naming op, parameter and values.
    let mut args = vec!["bench-op", "flash_attention"];
    args.extend(common);
    args.extend(["--sweep", "tile_kv=48"]);
    let (ok, _, err) = tboost(&args);
    assert!(!ok);
    assert!(err.contains("flash_attention.tile_kv") && err.contains("48 is not a power of two in 16..=256"), "{err}");
}

/// `tboost perplexity` computes llama-perplexity's quantity, recomputed here from the
/// session's all-position logits on a model with a real tokenizer that adds BOS
/// (llama-2-tiny-random: SPM): the text tokenized once, chunks of `-c` tokens each starting
/// with BOS, and only positions c/2+1 .. c-1 of each chunk scored.
#[test]
fn perplexity_scores_the_second_half_of_each_chunk_as_llama_perplexity() {
    use tboost_engine::model::Model;
    use tboost_engine::session::Session;
    let path = model_file("llama-2-tiny-random.gguf");
    let dir = tempfile::tempdir().unwrap();
    let text_file = dir.path().join("text.txt");
    let text = "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. \
                Perplexity is the exponential of the mean negative log-likelihood of a text. "
        .repeat(6);
    std::fs::write(&text_file, &text).unwrap();
    let (ctx, chunks) = (32usize, 3usize);
    let v = ok_json(&[
        "perplexity",
        "--model",
        &path.display().to_string(),
        "-f",
        &text_file.display().to_string(),
        "-c",
        &ctx.to_string(),
        "--chunks",
        &chunks.to_string(),
        "--json",
    ]);

    let model = Model::load(&path).unwrap();
    let tok = model.tokenizer.clone().unwrap();
    let tokens = tok.encode(&text, true).unwrap();
    assert!(tokens.len() >= ctx * chunks && tok.add_bos(), "the text must make {chunks} chunks: {}", tokens.len());
    let bos = tok.bos_id().unwrap();
    let vocab = model.config.vocab_size;
    let mut r = runner(&path);
    let (mut nll, mut count) = (0f64, 0usize);
    for c in 0..chunks {
        let mut p = tokens[c * ctx..(c + 1) * ctx].to_vec();
        p[0] = bos;
        let mut s = Session::new(&mut r, ctx).unwrap();
        let all = s.feed(&p, true).unwrap();
        for i in ctx / 2..ctx - 1 {
            nll -= log_softmax_at(&all[i * vocab..(i + 1) * vocab], p[i + 1]);
            count += 1;
        }
    }
    let want = (nll / count as f64).exp();
    let got = v["ppl"].as_f64().unwrap();
    assert_eq!(v["scored_tokens"].as_u64(), Some(count as u64), "{v}");
    assert_eq!(v["chunks"].as_u64(), Some(chunks as u64), "{v}");
    assert!(
        (got - want).abs() <= 1e-4 * want,
        "tboost perplexity {got} vs {want} recomputed from the session's logits"
    );

    // Too little text for one chunk: an error naming the file and the counts.
    let (ok, _, err) = tboost(&[
        "perplexity",
        "--model",
        &path.display().to_string(),
        "-f",
        &text_file.display().to_string(),
        "-c",
        "100000",
    ]);
    assert!(!ok && err.contains("text.txt") && err.contains("fewer than one chunk"), "{err}");
}
