//! ascend-sys against the CANN SIMULATOR (ascend-sim/), through the real loading path: every test runs in
//! its own process with ASCEND_HOME_PATH (and TBOOST_SIM_* settings) of its own, and ends with nothing
//! outstanding in the simulator (allocations, handles, executors, queued work).

mod common;

use ascend_sys::aclnn::{
    self, AttnLayout, CubeMathType, ExpertTokens, FiaVersion, FusedInferAttention, GroupListType, MoeFinalizeRouting,
    MoeInitRouting, RopeMode,
};
use ascend_sys::{AclError, Cann, CannVersion, Context, DType, Executor, Phase, SocFamily};
use common::*;
use half::{bf16, f16};

fn ctx(dev: &ascend_sys::Device) -> Context {
    Context::new(dev).unwrap_or_else(|e| panic!("context: {e}"))
}

fn env(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

fn ok<T>(r: ascend_sys::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e}"))
}

const ALL_OPS: [&str; 23] = [
    "aclnnFusedInferAttentionScoreV2",
    "aclnnFusedInferAttentionScoreV3",
    "aclnnFusedInferAttentionScoreV4",
    "aclnnFusedInferAttentionScoreV5",
    "aclnnRotaryPositionEmbedding",
    "aclnnRmsNorm",
    "aclnnAddRmsNorm",
    "aclnnMatmul",
    "aclnnMm",
    "aclnnSwiGlu",
    "aclnnGeluV2",
    "aclnnWeightQuantBatchMatmulV2",
    "aclnnMoeGatingTopKSoftmax",
    "aclnnMoeInitRoutingV2",
    "aclnnGroupedMatmulV4",
    "aclnnMoeFinalizeRoutingV2",
    "aclnnScatterPaKvCache",
    "aclnnEmbedding",
    "aclnnCast",
    "aclnnAdd",
    "aclnnInplaceAdd",
    "aclnnMul",
    "aclnnDiv",
];

// ------------------------------------------------------------------------------------------ loading

#[test]
fn loads_through_ascend_home_path_and_reports_device_facts() {
    isolated("loads_through_ascend_home_path_and_reports_device_facts", &[], || {
        let (cann, dev) = device();
        let home = std::env::var_os("ASCEND_HOME_PATH").expect("set by the harness");
        assert_eq!(cann.lib_dir(), std::path::Path::new(&home).join("lib64"));
        let f = cann.facts();
        assert_eq!(f.soc_name.as_deref(), Some("Ascend910B2"));
        assert_eq!(f.soc, SocFamily::Ascend910B);
        assert!(f.soc.supports_bf16() && f.soc.is_a2_or_a3());
        assert_eq!(f.cann_version_string.as_deref(), Some("8.1.RC1"));
        assert_eq!(f.cann_version, CannVersion::parse("8.1.RC1"));
        assert_eq!(f.acl_api_version, Some((1, 12, 0)));
        assert_eq!(f.device_count, Some(1));
        assert!(f.simulator);
        for op in ALL_OPS {
            assert!(cann.has_op(op), "{op} should be present");
        }
        assert!(!cann.has_op("aclnnNoSuchOp"));
        assert_eq!(cann.op_library("aclnnRmsNorm"), Some(cann.lib_dir().join("libopapi.so")));
        assert_eq!(aclnn::fused_infer_attention_version(&cann), Some(FiaVersion::V4));
        // a second load finds the same instance (one aclInit per process)
        let again = load();
        assert_eq!(again.lib_dir(), cann.lib_dir());
        drop(dev);
        assert_clean(&cann);
    });
}

#[test]
fn finalize_prints_the_simulator_summary_and_ends_the_runtime() {
    let stderr = isolated_output("finalize_prints_the_simulator_summary_and_ends_the_runtime", "main", &[], || {
        let (cann, dev) = device();
        let kept = alloc(&dev, 100);
        ok(cann.finalize(), "finalize");
        let err = cann.device(0).expect_err("after aclFinalize");
        assert_eq!(err.code(), Some(100001), "{err}");
        ok(cann.finalize(), "a second finalize is a no-op (aclFinalize once per process)");
        std::mem::forget((kept, dev)); // the runtime is gone: nothing to free through it
    });
    assert!(
        in_child()
            || (stderr.contains("[ascend-sim SIMULATOR] aclFinalize: outstanding 1 device allocations (100 bytes)")
                && stderr.matches("aclFinalize: outstanding").count() == 1),
        "one summary line expected (the exit handler must not finalize again) in:\n{stderr}"
    );
}

/// `aclFinalize` "must be called before the process exits": ascend-sys calls it once, at exit, after
/// everything was freed, for a runtime it initialised (the simulator prints its summary then).
#[test]
fn acl_finalize_runs_once_at_process_exit() {
    let stderr = isolated_output("acl_finalize_runs_once_at_process_exit", "main", &[], || {
        let (cann, dev) = device();
        let b = alloc(&dev, 64);
        drop((b, dev));
        assert_clean(&cann);
    });
    assert!(
        in_child() || stderr.matches("aclFinalize: outstanding 0 device allocations (0 bytes)").count() == 1,
        "aclFinalize at exit, once, with nothing outstanding, expected in:\n{stderr}"
    );
}

#[test]
fn facts_follow_the_configured_soc_and_version_and_gate_bf16() {
    isolated(
        "facts_follow_the_configured_soc_and_version_and_gate_bf16",
        &env(&[("TBOOST_SIM_SOC", "Ascend310P3"), ("TBOOST_SIM_CANN_VERSION", "8.0.RC2.alpha003")]),
        || {
            let (cann, dev) = device();
            let f = cann.facts();
            assert_eq!(f.soc, SocFamily::Ascend310P);
            assert!(!f.soc.supports_bf16());
            let v = f.cann_version.expect("parsable version");
            assert!(
                v < CannVersion::parse("8.0.RC2").expect("version")
                    && v > CannVersion::parse("8.0.RC1").expect("version")
            );
            // what the gate protects against: bf16 is rejected on 310P with the documented status
            let x = upload(&dev, &to_bf16(&rand_vec(64, 1)));
            let g = upload(&dev, &to_bf16(&rand_vec(64, 2)));
            let y = alloc(&dev, 128);
            let r = alloc(&dev, 4);
            let mut c = ctx(&dev);
            let err = aclnn::rms_norm(
                &mut c,
                &ok(x.view(DType::Bf16, &[1, 64]), "x"),
                &ok(g.view(DType::Bf16, &[64]), "g"),
                1e-6,
                &ok(y.view(DType::Bf16, &[1, 64]), "y"),
                &ok(r.view(DType::F32, &[1, 1]), "r"),
            )
            .expect_err("bf16 on 310P");
            assert_eq!(err.code(), Some(161002));
            assert!(err.message().contains("BFLOAT16") && err.message().contains("Ascend310P3"), "{err}");
            // the attention op has no 310P kernel: 561003
            let q = alloc(&dev, 64);
            let t = ok(q.view(DType::F16, &[1, 1, 1, 16]), "q");
            let a = FusedInferAttention::new(t, t, t, t, 1, 1, 0.25);
            let err = aclnn::fused_infer_attention_score(&mut c, &a).expect_err("no FIA on 310P");
            assert_eq!(err.code(), Some(561003));
            assert!(err.to_string().contains("ACLNN_ERR_INNER_FIND_KERNEL_ERROR"), "{err}");
            drop((x, g, y, r, q, c, dev));
            assert_clean(&cann);
        },
    );
}

#[test]
fn search_order_prefers_ascend_home_path_then_toolkit_then_ld_library_path() {
    let full = sim_home(&[]);
    let no_swiglu = sim_home(&["--omit", "aclnnSwiGlu"]);
    // ASCEND_HOME_PATH wins over LD_LIBRARY_PATH
    isolated_case(
        "search_order_prefers_ascend_home_path_then_toolkit_then_ld_library_path",
        "home",
        &[
            ("ASCEND_HOME_PATH", full.display().to_string()),
            ("LD_LIBRARY_PATH", no_swiglu.join("lib64").display().to_string()),
        ],
        || {
            let cann = load();
            assert!(cann.has_op("aclnnSwiGlu"), "loaded {}", cann.lib_dir().display());
        },
    );
    // a missing ASCEND_HOME_PATH falls through to ASCEND_TOOLKIT_HOME
    isolated_case(
        "search_order_prefers_ascend_home_path_then_toolkit_then_ld_library_path",
        "toolkit",
        &[
            ("ASCEND_HOME_PATH", "/nonexistent/ascend".into()),
            ("ASCEND_TOOLKIT_HOME", no_swiglu.display().to_string()),
            ("LD_LIBRARY_PATH", full.join("lib64").display().to_string()),
        ],
        || {
            let cann = load();
            assert_eq!(cann.lib_dir(), no_swiglu.join("lib64"));
            assert!(!cann.has_op("aclnnSwiGlu"));
        },
    );
    // and then to LD_LIBRARY_PATH
    isolated_case(
        "search_order_prefers_ascend_home_path_then_toolkit_then_ld_library_path",
        "ld",
        &[
            ("ASCEND_HOME_PATH", "".into()),
            ("LD_LIBRARY_PATH", format!("/nonexistent:{}", full.join("lib64").display())),
        ],
        || {
            let cann = load();
            assert_eq!(cann.lib_dir(), full.join("lib64"));
        },
    );
}

#[test]
fn nothing_found_names_every_path_searched() {
    isolated(
        "nothing_found_names_every_path_searched",
        &env(&[
            ("ASCEND_HOME_PATH", "/nonexistent/home"),
            ("ASCEND_TOOLKIT_HOME", "/nonexistent/tk"),
            ("LD_LIBRARY_PATH", "/nonexistent/ld"),
        ]),
        || {
            let err = Cann::load().expect_err("no CANN anywhere");
            assert_eq!(
                err.to_string(),
                "CANN runtime not found; searched: /nonexistent/home/lib64/libascendcl.so, /nonexistent/tk/lib64/libascendcl.so, \
                 /nonexistent/ld/libascendcl.so, /nonexistent/ld/lib64/libascendcl.so, \
                 /usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so"
            );
        },
    );
}

#[test]
fn omitted_op_symbols_are_a_capability_answer_not_a_load_failure() {
    let home = sim_home(&[
        "--omit",
        "aclnnFusedInferAttentionScoreV4,aclnnFusedInferAttentionScoreV3,aclnnSwiGlu,aclsysGetVersionStr",
    ]);
    isolated(
        "omitted_op_symbols_are_a_capability_answer_not_a_load_failure",
        &[("ASCEND_HOME_PATH", home.display().to_string())],
        || {
            let (cann, dev) = device();
            assert!(!cann.has_op("aclnnSwiGlu"));
            assert!(cann.has_op("aclnnRmsNorm"));
            assert_eq!(aclnn::fused_infer_attention_version(&cann), Some(FiaVersion::V2));
            let f = cann.facts();
            assert_eq!(f.cann_version, None, "aclsysGetVersionStr is absent");
            assert_eq!(f.acl_api_version, Some((1, 12, 0)), "aclrtGetVersion still answers");
            let x = upload(&dev, &rand_vec(8, 3));
            let o = alloc(&dev, 16);
            let mut c = ctx(&dev);
            let err = aclnn::swi_glu(
                &mut c,
                &ok(x.view(DType::F32, &[1, 8]), "x"),
                -1,
                &ok(o.view(DType::F32, &[1, 4]), "o"),
            )
            .expect_err("absent op");
            assert!(matches!(&err, AclError::OpUnavailable { op, .. } if op == "aclnnSwiGlu"), "{err}");
            assert!(err.to_string().contains("aclnnSwiGlu is not available"), "{err}");
            // the newest present FIA (V2 here) runs
            let (q, k) = (upload(&dev, &to_f16(&rand_vec(16, 4))), upload(&dev, &to_f16(&rand_vec(32, 5))));
            let out = alloc(&dev, 32);
            let qv = ok(q.view(DType::F16, &[1, 1, 1, 16]), "q");
            let kv = ok(k.view(DType::F16, &[1, 2, 1, 16]), "k");
            let a = FusedInferAttention::new(qv, kv, kv, ok(out.view(DType::F16, &[1, 1, 1, 16]), "o"), 1, 1, 0.25);
            assert_eq!(ok(aclnn::fused_infer_attention_score(&mut c, &a), "fia"), FiaVersion::V2);
            ok(c.synchronize(), "sync");
            drop((x, o, q, k, out, c, dev));
            assert_clean(&cann);
        },
    );
}

#[test]
fn a_missing_required_runtime_symbol_is_a_load_error() {
    let home = sim_home(&["--omit", "aclrtMalloc"]);
    isolated(
        "a_missing_required_runtime_symbol_is_a_load_error",
        &[("ASCEND_HOME_PATH", home.display().to_string())],
        || {
            let err = Cann::load().expect_err("no aclrtMalloc");
            assert!(matches!(err, AclError::MissingSymbol { symbol: "aclrtMalloc", .. }), "{err}");
            assert!(err.to_string().contains("libascendcl.so lacks aclrtMalloc"), "{err}");
        },
    );
}

#[test]
fn split_operator_libraries_are_searched_per_symbol() {
    let home = sim_home(&["--split"]);
    isolated(
        "split_operator_libraries_are_searched_per_symbol",
        &[("ASCEND_HOME_PATH", home.display().to_string())],
        || {
            let (cann, dev) = device();
            let lib = cann.lib_dir().to_path_buf();
            assert_eq!(cann.op_libraries(), vec![lib.join("libopapi.so"), lib.join("libopapi_transformer.so")]);
            assert_eq!(cann.op_library("aclnnRmsNorm"), Some(lib.join("libopapi.so")));
            assert_eq!(cann.op_library("aclnnFusedInferAttentionScoreV2"), Some(lib.join("libopapi_transformer.so")));
            assert_eq!(cann.op_library("aclnnMoeInitRoutingV2"), Some(lib.join("libopapi_transformer.so")));
            // an op from the split library runs
            let x = upload(&dev, &rand_vec(8, 1));
            let cs = upload(&dev, &[1.0f32; 8]);
            let sn = upload(&dev, &[0.0f32; 8]);
            let o = alloc(&dev, 32);
            let mut c = ctx(&dev);
            fn t(b: &ascend_sys::DeviceBuffer) -> ascend_sys::TensorRef<'_> {
                ok(b.view(DType::F32, &[1, 1, 1, 8]), "view")
            }
            ok(aclnn::rotary_position_embedding(&mut c, &t(&x), &t(&cs), &t(&sn), RopeMode::Half, &t(&o)), "rope");
            ok(c.synchronize(), "sync");
            assert_eq!(read::<f32>(&o, 8), read::<f32>(&x, 8), "cos 1, sin 0 is the identity");
            drop((x, cs, sn, o, c, dev));
            assert_clean(&cann);
        },
    );
}

// ------------------------------------------------------------------------------------------ ops

fn rms_ref(x: &[f64], g: &[f64], rows: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let d = g.len();
    let mut y = vec![0.0; rows * d];
    let mut r = vec![0.0; rows];
    for i in 0..rows {
        let row = &x[i * d..(i + 1) * d];
        let rstd = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
        r[i] = rstd;
        for j in 0..d {
            y[i * d + j] = row[j] * rstd * g[j];
        }
    }
    (y, r)
}

#[test]
fn rms_norm_and_add_rms_norm_match_the_reference() {
    isolated("rms_norm_and_add_rms_norm_match_the_reference", &[], || {
        let (cann, dev) = device();
        let mut c = ctx(&dev);
        let (rows, d, eps) = (4usize, 64usize, 1e-6);
        // fp16 x, fp16 gamma
        let x = to_f16(&rand_vec(rows * d, 10));
        let g = to_f16(&rand_vec(d, 11).iter().map(|v| v + 1.0).collect::<Vec<_>>());
        let (xb, gb, yb, rb) = (upload(&dev, &x), upload(&dev, &g), alloc(&dev, rows * d * 2), alloc(&dev, rows * 4));
        ok(
            aclnn::rms_norm(
                &mut c,
                &ok(xb.view(DType::F16, &[rows as i64, d as i64]), "x"),
                &ok(gb.view(DType::F16, &[d as i64]), "g"),
                eps,
                &ok(yb.view(DType::F16, &[rows as i64, d as i64]), "y"),
                &ok(rb.view(DType::F32, &[rows as i64, 1]), "rstd"),
            ),
            "rms_norm f16",
        );
        ok(c.synchronize(), "sync");
        let (want_y, want_r) = rms_ref(&f16_to_f64(&x), &f16_to_f64(&g), rows, eps);
        assert_close("rms_norm y", &f16_to_f64(&read::<f16>(&yb, rows * d)), &round_f16(&want_y), 1e-3, 1e-3);
        assert_close("rms_norm rstd", &f32_to_f64(&read::<f32>(&rb, rows)), &want_r, 0.0, 1e-6);

        // bf16 x with f32 gamma (a documented combination)
        let xb16 = to_bf16(&rand_vec(rows * d, 12));
        let g32: Vec<f32> = rand_vec(d, 13);
        let (xb2, gb2, yb2) = (upload(&dev, &xb16), upload(&dev, &g32), alloc(&dev, rows * d * 2));
        ok(
            aclnn::rms_norm(
                &mut c,
                &ok(xb2.view(DType::Bf16, &[rows as i64, d as i64]), "x"),
                &ok(gb2.view(DType::F32, &[d as i64]), "g"),
                eps,
                &ok(yb2.view(DType::Bf16, &[rows as i64, d as i64]), "y"),
                &ok(rb.view(DType::F32, &[rows as i64, 1]), "rstd"),
            ),
            "rms_norm bf16",
        );
        ok(c.synchronize(), "sync");
        let (want_y, _) = rms_ref(&bf16_to_f64(&xb16), &f32_to_f64(&g32), rows, eps);
        assert_close("rms_norm bf16 y", &bf16_to_f64(&read::<bf16>(&yb2, rows * d)), &round_bf16(&want_y), 1e-2, 8e-3);

        // AddRmsNorm, f32: x_out = x1 + x2, y = rmsnorm(x_out)
        let (a, b, g) = (rand_vec(rows * d, 14), rand_vec(rows * d, 15), rand_vec(d, 16));
        let (ab, bb, gg, yo, xo) = (
            upload(&dev, &a),
            upload(&dev, &b),
            upload(&dev, &g),
            alloc(&dev, rows * d * 4),
            alloc(&dev, rows * d * 4),
        );
        let sh = [rows as i64, d as i64];
        ok(
            aclnn::add_rms_norm(
                &mut c,
                &ok(ab.view(DType::F32, &sh), "x1"),
                &ok(bb.view(DType::F32, &sh), "x2"),
                &ok(gg.view(DType::F32, &[d as i64]), "g"),
                eps,
                &ok(yo.view(DType::F32, &sh), "y"),
                Some(&ok(rb.view(DType::F32, &[rows as i64, 1]), "rstd")),
                Some(&ok(xo.view(DType::F32, &sh), "x_out")),
            ),
            "add_rms_norm",
        );
        ok(c.synchronize(), "sync");
        let sum: Vec<f64> = a.iter().zip(&b).map(|(x, y)| *x as f64 + *y as f64).collect();
        let (want_y, want_r) = rms_ref(&sum, &f32_to_f64(&g), rows, eps);
        assert_close("add_rms_norm x_out", &f32_to_f64(&read::<f32>(&xo, rows * d)), &sum, 1e-6, 1e-6);
        assert_close("add_rms_norm y", &f32_to_f64(&read::<f32>(&yo, rows * d)), &want_y, 1e-5, 1e-5);
        assert_close("add_rms_norm rstd", &f32_to_f64(&read::<f32>(&rb, rows)), &want_r, 0.0, 1e-6);
        // a gamma that does not match x's trailing dim is rejected by the first phase
        let err = aclnn::rms_norm(
            &mut c,
            &ok(ab.view(DType::F32, &sh), "x"),
            &ok(gg.tensor(0, DType::F32, &[d as i64 - 1]), "g"),
            eps,
            &ok(yo.view(DType::F32, &sh), "y"),
            &ok(rb.view(DType::F32, &[rows as i64, 1]), "rstd"),
        )
        .expect_err("gamma mismatch");
        assert!(
            matches!(err, AclError::Op { op: "aclnnRmsNorm", phase: Phase::GetWorkspaceSize, status: 561002, .. }),
            "{err}"
        );
        assert!(err.message().contains("gamma"), "{err}");
        drop((xb, gb, yb, rb, xb2, gb2, yb2, ab, bb, gg, yo, xo, c, dev));
        assert_clean(&cann);
    });
}

fn matmul_ref(x: &[f64], w_nk: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut o = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            o[i * n + j] = (0..k).map(|t| x[i * k + t] * w_nk[j * k + t]).sum();
        }
    }
    o
}

#[test]
fn matmul_with_fp16_and_bf16_transposed_weights_matches_the_reference() {
    isolated("matmul_with_fp16_and_bf16_transposed_weights_matches_the_reference", &[], || {
        let (cann, dev) = device();
        let mut c = ctx(&dev);
        let (m, k, n) = (3usize, 32usize, 24usize);
        let (x, w) = (rand_vec(m * k, 20), rand_vec(n * k, 21)); // w in Hugging Face layout [out, in]
        let out = alloc(&dev, m * n * 2);
        // fp16 through aclnnMatmul, the weight as a transposed view [k, n] of [n, k]
        let (xh, wh) = (to_f16(&x), to_f16(&w));
        let (xb, wb) = (upload(&dev, &xh), upload(&dev, &wh));
        let wt = ok(ok(wb.view(DType::F16, &[n as i64, k as i64]), "w").transpose(0, 1), "wT");
        assert!(!wt.is_contiguous());
        ok(
            aclnn::matmul(
                &mut c,
                &ok(xb.view(DType::F16, &[m as i64, k as i64]), "x"),
                &wt,
                &ok(out.view(DType::F16, &[m as i64, n as i64]), "o"),
                CubeMathType::KeepDtype,
            ),
            "matmul f16",
        );
        ok(c.synchronize(), "sync");
        let want = matmul_ref(&f16_to_f64(&xh), &f16_to_f64(&wh), m, k, n);
        assert_close("matmul f16", &f16_to_f64(&read::<f16>(&out, m * n)), &round_f16(&want), 2e-3, 2e-3);
        // bf16 through aclnnMm
        let (xb16, wb16) = (to_bf16(&x), to_bf16(&w));
        let (xb2, wb2) = (upload(&dev, &xb16), upload(&dev, &wb16));
        let wt2 = ok(ok(wb2.view(DType::Bf16, &[n as i64, k as i64]), "w").transpose(0, 1), "wT");
        ok(
            aclnn::mm(
                &mut c,
                &ok(xb2.view(DType::Bf16, &[m as i64, k as i64]), "x"),
                &wt2,
                &ok(out.view(DType::Bf16, &[m as i64, n as i64]), "o"),
                CubeMathType::KeepDtype,
            ),
            "mm bf16",
        );
        ok(c.synchronize(), "sync");
        let want = matmul_ref(&bf16_to_f64(&xb16), &bf16_to_f64(&wb16), m, k, n);
        assert_close("mm bf16", &bf16_to_f64(&read::<bf16>(&out, m * n)), &round_bf16(&want), 1e-2, 8e-3);
        // mismatched inner dims are the op's to reject
        let err = aclnn::matmul(
            &mut c,
            &ok(xb.view(DType::F16, &[m as i64, k as i64]), "x"),
            &ok(wb.view(DType::F16, &[n as i64, k as i64]), "w"),
            &ok(out.view(DType::F16, &[m as i64, n as i64]), "o"),
            CubeMathType::KeepDtype,
        )
        .expect_err("k mismatch");
        assert_eq!(err.code(), Some(161002), "{err}");
        assert!(c.stats().workspace_bytes > 0, "matmul asks for a workspace");
        drop((out, xb, wb, xb2, wb2, c, dev));
        assert_clean(&cann);
    });
}

/// A16W8 and A16W4 per-group (group 32) through aclnnWeightQuantBatchMatmulV2, the weight a transposed
/// view of an `[n, k]` store and the scale `[k/32, n]` a transposed view of `[n, k/32]`; the documented
/// argument rules and the product-support table come back as the op's status codes.
#[test]
fn weight_quant_batch_matmul_v2_int8_and_int4_per_group_match_the_reference() {
    let name = "weight_quant_batch_matmul_v2_int8_and_int4_per_group_match_the_reference";
    let (m, k, n, g) = (3usize, 64usize, 8usize, 32usize);
    let q8: Vec<i8> = (0..n * k).map(|i| ((i * 37 + 11) % 255) as i8).collect(); // [n, k], all of -128..127
    let q4: Vec<i8> = (0..n * k).map(|i| ((i * 7 + 3) % 16) as i8 - 8).collect(); // [n, k] in -8..7
    let packed: Vec<u8> = q4.chunks(2).map(|p| (p[0] as u8 & 0xf) | ((p[1] as u8 & 0xf) << 4)).collect();
    let scale: Vec<f16> = (0..n * (k / g)).map(|i| f16::from_f32(0.01 + 0.003 * i as f32)).collect(); // [n, k/g]
    let offset: Vec<f16> = (0..n * (k / g)).map(|i| f16::from_f32(0.5 - 0.25 * (i % 3) as f32)).collect();
    isolated_case(name, "910B", &[], || {
        let (cann, dev) = device();
        let mut c = ctx(&dev);
        let x = to_f16(&rand_vec(m * k, 30));
        let (xb, wb8, wb4) = (upload(&dev, &x), upload(&dev, &q8), upload(&dev, &packed));
        let (sb, ob, out) = (upload(&dev, &scale), upload(&dev, &offset), alloc(&dev, m * n * 2));
        let xt = ok(xb.view(DType::F16, &[m as i64, k as i64]), "x");
        let yt = ok(out.view(DType::F16, &[m as i64, n as i64]), "y");
        let sv = ok(ok(sb.view(DType::F16, &[n as i64, (k / g) as i64]), "s").transpose(0, 1), "sT");
        let ov = ok(ok(ob.view(DType::F16, &[n as i64, (k / g) as i64]), "o").transpose(0, 1), "oT");
        let dequant = |q: &[i8], off: bool| -> Vec<f64> {
            (0..n * k)
                .map(|i| {
                    let (j, t) = (i / k, i % k);
                    let s = scale[j * (k / g) + t / g].to_f64();
                    let o = if off { offset[j * (k / g) + t / g].to_f64() } else { 0.0 };
                    f16::from_f64((q[i] as f64 + o) * s).to_f64()
                })
                .collect()
        };
        for (what, w, dt, q, off) in
            [("int8", &wb8, DType::I8, &q8, false), ("int4 + offset", &wb4, DType::I4, &q4, true)]
        {
            let wv = ok(ok(w.view(dt, &[n as i64, k as i64]), "w").transpose(0, 1), "wT");
            ok(aclnn::weight_quant_batch_matmul_v2(&mut c, &xt, &wv, &sv, off.then_some(&ov), g as i32, &yt), what);
            ok(c.synchronize(), "sync");
            let want = matmul_ref(&f16_to_f64(&x), &dequant(q, off), m, k, n);
            assert_close(what, &f16_to_f64(&read::<f16>(&out, m * n)), &round_f16(&want), 2e-3, 2e-3);
        }
        let w8 = ok(ok(wb8.view(DType::I8, &[n as i64, k as i64]), "w").transpose(0, 1), "wT");
        // group 16 is not a multiple of 32; group k is outside [32, k-1]
        for bad in [16, k as i32] {
            let err = aclnn::weight_quant_batch_matmul_v2(&mut c, &xt, &w8, &sv, None, bad, &yt).expect_err("group");
            assert_eq!(err.code(), Some(161002), "{err}");
            assert!(err.message().contains("antiquantGroupSize"), "{err}");
        }
        // the scale must be x's dtype
        let sf32 = upload(&dev, &vec![0.5f32; n * (k / g)]);
        let s32 = ok(ok(sf32.view(DType::F32, &[n as i64, (k / g) as i64]), "s").transpose(0, 1), "sT");
        let err = aclnn::weight_quant_batch_matmul_v2(&mut c, &xt, &w8, &s32, None, g as i32, &yt).expect_err("dtype");
        assert_eq!(err.code(), Some(161002), "{err}");
        drop((xb, wb8, wb4, sb, ob, out, sf32, c, dev));
        assert_clean(&cann);
    });
    for soc in ["Ascend310P3", "Ascend310B1", "Ascend910A"] {
        isolated_case(name, soc, &env(&[("TBOOST_SIM_SOC", soc)]), || {
            let (cann, dev) = device();
            let mut c = ctx(&dev);
            let (xb, wb, sb, out) = (
                upload(&dev, &to_f16(&rand_vec(m * k, 31))),
                upload(&dev, &q8),
                upload(&dev, &scale),
                alloc(&dev, m * n * 2),
            );
            let err = aclnn::weight_quant_batch_matmul_v2(
                &mut c,
                &ok(xb.view(DType::F16, &[m as i64, k as i64]), "x"),
                &ok(ok(wb.view(DType::I8, &[n as i64, k as i64]), "w").transpose(0, 1), "wT"),
                &ok(ok(sb.view(DType::F16, &[n as i64, (k / g) as i64]), "s").transpose(0, 1), "sT"),
                None,
                g as i32,
                &ok(out.view(DType::F16, &[m as i64, n as i64]), "y"),
            )
            .expect_err("no A16W8 per-group path on this SoC");
            assert_eq!(err.code(), Some(361001), "{soc}: {err}");
            drop((xb, wb, sb, out, c, dev));
            assert_clean(&cann);
        });
    }
}

#[test]
fn swiglu_rope_embedding_cast_add_mul_match_the_reference() {
    isolated("swiglu_rope_embedding_cast_add_mul_match_the_reference", &[], || {
        let (cann, dev) = device();
        let mut c = ctx(&dev);
        // SwiGlu: x = [gate | up] along the last dim
        let (rows, h) = (3usize, 5usize);
        let x = rand_vec(rows * 2 * h, 30);
        let (xb, sw_out) = (upload(&dev, &to_f16(&x)), alloc(&dev, rows * h * 2));
        ok(
            aclnn::swi_glu(
                &mut c,
                &ok(xb.view(DType::F16, &[rows as i64, 2 * h as i64]), "x"),
                -1,
                &ok(sw_out.view(DType::F16, &[rows as i64, h as i64]), "o"),
            ),
            "swiglu",
        );
        ok(c.synchronize(), "sync");
        let xr = f16_to_f64(&to_f16(&x));
        let want: Vec<f64> = (0..rows * h)
            .map(|i| {
                let (r, j) = (i / h, i % h);
                let (a, b) = (xr[r * 2 * h + j], xr[r * 2 * h + h + j]);
                a / (1.0 + (-a).exp()) * b
            })
            .collect();
        assert_close("swiglu", &f16_to_f64(&read::<f16>(&sw_out, rows * h)), &round_f16(&want), 1e-3, 1e-3);

        // RoPE, half and interleave, x [1, T, N, D], cos/sin [1, T, 1, D]
        let (t, nh, d) = (3usize, 2usize, 8usize);
        let xs = rand_vec(t * nh * d, 31);
        let pos_angle = |p: usize, i: usize| p as f64 * 10000f64.powf(-2.0 * i as f64 / d as f64);
        for mode in [RopeMode::Half, RopeMode::Interleave] {
            let mut cs = vec![0f32; t * d];
            let mut sn = vec![0f32; t * d];
            for p in 0..t {
                for j in 0..d {
                    let i = if mode == RopeMode::Half { j % (d / 2) } else { j / 2 };
                    cs[p * d + j] = pos_angle(p + 7, i).cos() as f32;
                    sn[p * d + j] = pos_angle(p + 7, i).sin() as f32;
                }
            }
            let (xb, cb, sb, ob) = (upload(&dev, &xs), upload(&dev, &cs), upload(&dev, &sn), alloc(&dev, xs.len() * 4));
            let sh = [1, t as i64, nh as i64, d as i64];
            let csh = [1, t as i64, 1, d as i64];
            ok(
                aclnn::rotary_position_embedding(
                    &mut c,
                    &ok(xb.view(DType::F32, &sh), "x"),
                    &ok(cb.view(DType::F32, &csh), "cos"),
                    &ok(sb.view(DType::F32, &csh), "sin"),
                    mode,
                    &ok(ob.view(DType::F32, &sh), "o"),
                ),
                "rope",
            );
            ok(c.synchronize(), "sync");
            let mut want = vec![0.0; xs.len()];
            for p in 0..t {
                for hh in 0..nh {
                    let base = (p * nh + hh) * d;
                    let xv = |j: usize| xs[base + j] as f64;
                    for j in 0..d {
                        let rot = match mode {
                            RopeMode::Half if j < d / 2 => -xv(j + d / 2),
                            RopeMode::Half => xv(j - d / 2),
                            _ if j % 2 == 0 => -xv(j + 1),
                            _ => xv(j - 1),
                        };
                        want[base + j] = xv(j) * cs[p * d + j] as f64 + rot * sn[p * d + j] as f64;
                    }
                }
            }
            assert_close(&format!("rope {mode:?}"), &f32_to_f64(&read::<f32>(&ob, xs.len())), &want, 1e-6, 1e-6);
        }

        // Embedding gathers rows; Cast converts; Add/InplaceAdd/Mul broadcast
        let table = rand_vec(10 * 4, 32);
        let ids: Vec<i32> = vec![3, 0, 9, 3, 7];
        let (tb, ib, eb) = (upload(&dev, &to_f16(&table)), upload(&dev, &ids), alloc(&dev, 5 * 4 * 2));
        ok(
            aclnn::embedding(
                &mut c,
                &ok(tb.view(DType::F16, &[10, 4]), "w"),
                &ok(ib.view(DType::I32, &[5]), "ids"),
                &ok(eb.view(DType::F16, &[5, 4]), "o"),
            ),
            "embedding",
        );
        let f32b = alloc(&dev, 5 * 4 * 4);
        ok(
            aclnn::cast(&mut c, &ok(eb.view(DType::F16, &[5, 4]), "e"), &ok(f32b.view(DType::F32, &[5, 4]), "f")),
            "cast f16->f32",
        );
        ok(c.synchronize(), "sync");
        let th = f16_to_f64(&to_f16(&table));
        let want: Vec<f64> = ids.iter().flat_map(|&i| th[i as usize * 4..i as usize * 4 + 4].to_vec()).collect();
        assert_eq!(f32_to_f64(&read::<f32>(&f32b, 20)), want, "embedding then cast");
        let i64s = upload(&dev, &[5i64, -3, 1 << 20]);
        let i32s = alloc(&dev, 12);
        ok(
            aclnn::cast(&mut c, &ok(i64s.view(DType::I64, &[3]), "a"), &ok(i32s.view(DType::I32, &[3]), "b")),
            "cast i64->i32",
        );
        ok(c.synchronize(), "sync");
        assert_eq!(read::<i32>(&i32s, 3), vec![5, -3, 1 << 20]);

        let (a, b) = ([1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [10.0f32, 20.0, 30.0]);
        let (ab, bb, ob) = (upload(&dev, &a), upload(&dev, &b), alloc(&dev, 24));
        ok(
            aclnn::add(
                &mut c,
                &ok(ab.view(DType::F32, &[2, 3]), "a"),
                &ok(bb.view(DType::F32, &[3]), "b"),
                0.5,
                &ok(ob.view(DType::F32, &[2, 3]), "o"),
            ),
            "add",
        );
        ok(c.synchronize(), "sync");
        assert_eq!(read::<f32>(&ob, 6), vec![6.0, 12.0, 18.0, 9.0, 15.0, 21.0]);
        ok(
            aclnn::inplace_add(
                &mut c,
                &ok(ab.view(DType::F32, &[2, 3]), "a"),
                &ok(bb.view(DType::F32, &[3]), "b"),
                1.0,
            ),
            "inplace_add",
        );
        ok(
            aclnn::mul(
                &mut c,
                &ok(ab.tensor(0, DType::F32, &[2, 1]), "a"),
                &ok(bb.view(DType::F32, &[1, 3]), "b"),
                &ok(ob.view(DType::F32, &[2, 3]), "o"),
            ),
            "mul",
        );
        ok(c.synchronize(), "sync");
        assert_eq!(read::<f32>(&ab, 6), vec![11.0, 22.0, 33.0, 14.0, 25.0, 36.0], "inplace add");
        // mul read ab[0..2] = [11, 22] as [2,1] after the inplace add (stream order)
        assert_eq!(read::<f32>(&ob, 6), vec![110.0, 220.0, 330.0, 220.0, 440.0, 660.0], "mul");
        drop((xb, sw_out, ob, tb, ib, eb, f32b, i64s, i32s, ab, bb, c, dev));
        assert_clean(&cann);
    });
}

#[test]
fn an_out_of_range_index_fails_the_synchronize_with_the_ops_message() {
    isolated("an_out_of_range_index_fails_the_synchronize_with_the_ops_message", &[], || {
        let (cann, dev) = device();
        let mut c = ctx(&dev);
        let (tb, ib, eb) = (upload(&dev, &[0f32; 8]), upload(&dev, &[1i32, 12]), alloc(&dev, 16));
        ok(
            aclnn::embedding(
                &mut c,
                &ok(tb.view(DType::F32, &[4, 2]), "w"),
                &ok(ib.view(DType::I32, &[2]), "ids"),
                &ok(eb.view(DType::F32, &[2, 2]), "o"),
            ),
            "launch",
        );
        let err = c.synchronize().expect_err("index 12 of a 4-row table");
        assert!(matches!(err, AclError::Runtime { call: "aclrtSynchronizeStream", code: 500003, .. }), "{err}");
        assert!(err.message().contains("indices[1] = 12 is outside [0, 4)"), "{err}");
        ok(c.synchronize(), "the error is reported once");
        drop((tb, ib, eb, c, dev));
        assert_clean(&cann);
    });
}

// ------------------------------------------------------------------------------------------ KV cache + attention

struct Paged {
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    blocks: usize,
}

impl Paged {
    /// Writes per-sequence K/V (token-major `[len][kv_heads][head_dim]`) into the caches through
    /// aclnnScatterPaKvCache at the slots given by `tables`.
    #[allow(clippy::too_many_arguments)]
    fn fill(
        &self,
        c: &mut Context,
        dev: &ascend_sys::Device,
        kc: &ascend_sys::DeviceBuffer,
        vc: &ascend_sys::DeviceBuffer,
        tables: &[Vec<i32>],
        ks: &[Vec<f16>],
        vs: &[Vec<f16>],
    ) {
        let (kvh, d, bs) = (self.kv_heads, self.head_dim, self.block_size);
        let mut slots = Vec::new();
        let (mut kall, mut vall) = (Vec::new(), Vec::new());
        for (s, table) in tables.iter().enumerate() {
            let len = ks[s].len() / (kvh * d);
            for p in 0..len {
                slots.push(table[p / bs] as i64 * bs as i64 + (p % bs) as i64);
            }
            kall.extend_from_slice(&ks[s]);
            vall.extend_from_slice(&vs[s]);
        }
        let t = slots.len() as i64;
        let (kb, vb, sb) = (upload(dev, &kall), upload(dev, &vall), upload(dev, &slots));
        let csh = [self.blocks as i64, bs as i64, kvh as i64, d as i64];
        ok(
            aclnn::scatter_pa_kv_cache(
                c,
                &ok(kb.view(DType::F16, &[t, kvh as i64, d as i64]), "k"),
                &ok(kc.view(DType::F16, &csh), "kc"),
                &ok(sb.view(DType::I64, &[t]), "slots"),
                &ok(vb.view(DType::F16, &[t, kvh as i64, d as i64]), "v"),
                &ok(vc.view(DType::F16, &csh), "vc"),
            ),
            "scatter",
        );
        ok(c.synchronize(), "sync after scatter");
    }
}

fn rows(v: &[f16], width: usize) -> Vec<Vec<f64>> {
    f16_to_f64(v).chunks(width).map(<[f64]>::to_vec).collect()
}

#[test]
fn paged_decode_attention_reads_through_a_block_table_with_holes_gqa() {
    isolated("paged_decode_attention_reads_through_a_block_table_with_holes_gqa", &[], || {
        let (cann, dev) = device();
        let mut c = ctx(&dev);
        let (nh, kvh, d, bs, blocks) = (4usize, 2usize, 16usize, 128usize, 8usize);
        let p = Paged { kv_heads: kvh, head_dim: d, block_size: bs, blocks };
        // three sequences; blocks out of order, unused blocks (1, 4) and -1 padding in the table
        let lens = [200usize, 60, 300];
        let tables: Vec<Vec<i32>> = vec![vec![5, 2, -1], vec![7, -1, -1], vec![0, 3, 6]];
        let cache_bytes = blocks * bs * kvh * d * 2;
        let (kc, vc) = (alloc(&dev, cache_bytes), alloc(&dev, cache_bytes));
        ok(kc.fill_bytes(0xFF), "poison");
        ok(vc.fill_bytes(0xFF), "poison"); // f16 0xFFFF is NaN: a stray read shows up in the output
        let ks: Vec<Vec<f16>> =
            lens.iter().enumerate().map(|(i, &l)| to_f16(&rand_vec(l * kvh * d, 40 + i as u64))).collect();
        let vs: Vec<Vec<f16>> =
            lens.iter().enumerate().map(|(i, &l)| to_f16(&rand_vec(l * kvh * d, 50 + i as u64))).collect();
        p.fill(&mut c, &dev, &kc, &vc, &tables, &ks, &vs);
        // the cache holds what was scattered: token 130 of sequence 0 is block 2, offset 2
        let row: Vec<f16> = ok(kc.to_vec((2 * bs + 2) * kvh * d * 2, kvh * d), "read cache");
        assert_eq!(row, ks[0][130 * kvh * d..131 * kvh * d].to_vec());

        let b = lens.len();
        let q = to_f16(&rand_vec(b * nh * d, 60));
        let table_flat: Vec<i32> = tables.concat();
        let (qb, tb, ob) = (upload(&dev, &q), upload(&dev, &table_flat), alloc(&dev, b * nh * d * 2));
        let lens_kv: Vec<i64> = lens.iter().map(|&l| l as i64).collect();
        let scale = 1.0 / (d as f64).sqrt();
        let cache3 = [blocks as i64, bs as i64, (kvh * d) as i64];
        let mut outs = Vec::new();
        for version in [FiaVersion::V2, FiaVersion::V3, FiaVersion::V4, FiaVersion::V5] {
            let mut a = FusedInferAttention::new(
                ok(qb.view(DType::F16, &[b as i64, 1, nh as i64, d as i64]), "q"),
                ok(kc.view(DType::F16, &cache3), "kc"),
                ok(vc.view(DType::F16, &cache3), "vc"),
                ok(ob.view(DType::F16, &[b as i64, 1, nh as i64, d as i64]), "o"),
                nh as i64,
                kvh as i64,
                scale,
            );
            a.layout = AttnLayout::Bsnd;
            a.block_table = Some(ok(tb.view(DType::I32, &[b as i64, 3]), "table"));
            a.block_size = bs as i64;
            a.actual_seq_lengths_kv = Some(&lens_kv);
            a.version = Some(version);
            assert_eq!(ok(aclnn::fused_infer_attention_score(&mut c, &a), "decode"), version);
            ok(c.synchronize(), "sync");
            outs.push(f16_to_f64(&read::<f16>(&ob, b * nh * d)));
        }
        let mut want = Vec::new();
        for s in 0..b {
            let (kr, vr) = (rows(&ks[s], kvh * d), rows(&vs[s], kvh * d));
            for h in 0..nh {
                let g = h / (nh / kvh);
                let keys: Vec<Vec<f64>> = kr.iter().map(|r| r[g * d..(g + 1) * d].to_vec()).collect();
                let vals: Vec<Vec<f64>> = vr.iter().map(|r| r[g * d..(g + 1) * d].to_vec()).collect();
                let qrow = f16_to_f64(&q[(s * nh + h) * d..(s * nh + h + 1) * d]);
                want.extend(attend(&qrow, &keys, &vals, scale));
            }
        }
        for (i, got) in outs.iter().enumerate() {
            assert_close(&format!("decode V{}", i + 2), got, &round_f16(&want), 2e-3, 2e-3);
        }
        // a block size the decode branch rejects
        let mut a = FusedInferAttention::new(
            ok(qb.view(DType::F16, &[b as i64, 1, nh as i64, d as i64]), "q"),
            ok(kc.view(DType::F16, &cache3), "kc"),
            ok(vc.view(DType::F16, &cache3), "vc"),
            ok(ob.view(DType::F16, &[b as i64, 1, nh as i64, d as i64]), "o"),
            nh as i64,
            3,
            scale,
        );
        a.block_table = Some(ok(tb.view(DType::I32, &[b as i64, 3]), "table"));
        a.block_size = bs as i64;
        a.actual_seq_lengths_kv = Some(&lens_kv);
        let err = aclnn::fused_infer_attention_score(&mut c, &a).expect_err("4 heads over 3 KV heads");
        assert_eq!(err.code(), Some(161002));
        assert!(err.message().contains("numKeyValueHeads"), "{err}");
        drop((kc, vc, qb, tb, ob, c, dev));
        assert_clean(&cann);
    });
}

#[test]
fn paged_prefill_attention_is_right_down_causal_with_chunking_and_padding() {
    isolated("paged_prefill_attention_is_right_down_causal_with_chunking_and_padding", &[], || {
        let (cann, dev) = device();
        let mut c = ctx(&dev);
        let (nh, kvh, d, bs, blocks) = (4usize, 2usize, 16usize, 128usize, 4usize);
        let p = Paged { kv_heads: kvh, head_dim: d, block_size: bs, blocks };
        // sequence 0: 130 cached tokens + a 6-token chunk (kv 136); sequence 1: a fresh 5-token prompt
        let (lq, lkv) = ([6usize, 5], [136usize, 5]);
        let tables: Vec<Vec<i32>> = vec![vec![3, 1], vec![2, -1]];
        let (kc, vc) = (alloc(&dev, blocks * bs * kvh * d * 2), alloc(&dev, blocks * bs * kvh * d * 2));
        ok(kc.fill_bytes(0xFF), "poison");
        ok(vc.fill_bytes(0xFF), "poison");
        let ks: Vec<Vec<f16>> =
            lkv.iter().enumerate().map(|(i, &l)| to_f16(&rand_vec(l * kvh * d, 70 + i as u64))).collect();
        let vs: Vec<Vec<f16>> =
            lkv.iter().enumerate().map(|(i, &l)| to_f16(&rand_vec(l * kvh * d, 80 + i as u64))).collect();
        p.fill(&mut c, &dev, &kc, &vc, &tables, &ks, &vs);

        let (b, sq) = (2usize, 6usize);
        let q = to_f16(&rand_vec(b * sq * nh * d, 90));
        let mask: Vec<u8> = (0..2048 * 2048).map(|i| ((i % 2048) > (i / 2048)) as u8).collect();
        let (qb, tb, ob, mb) =
            (upload(&dev, &q), upload(&dev, &tables.concat()), alloc(&dev, b * sq * nh * d * 2), upload(&dev, &mask));
        let (lq64, lkv64): (Vec<i64>, Vec<i64>) =
            (lq.iter().map(|&x| x as i64).collect(), lkv.iter().map(|&x| x as i64).collect());
        let scale = 1.0 / (d as f64).sqrt();
        let cache3 = [blocks as i64, bs as i64, (kvh * d) as i64];
        let qsh = [b as i64, sq as i64, nh as i64, d as i64];
        let mut a = FusedInferAttention::new(
            ok(qb.view(DType::F16, &qsh), "q"),
            ok(kc.view(DType::F16, &cache3), "kc"),
            ok(vc.view(DType::F16, &cache3), "vc"),
            ok(ob.view(DType::F16, &qsh), "o"),
            nh as i64,
            kvh as i64,
            scale,
        );
        a.block_table = Some(ok(tb.view(DType::I32, &[b as i64, 2]), "table"));
        a.block_size = bs as i64;
        a.actual_seq_lengths = Some(&lq64);
        a.actual_seq_lengths_kv = Some(&lkv64);
        a.atten_mask = Some(ok(mb.view(DType::U8, &[2048, 2048]), "mask"));
        a.sparse_mode = 3;
        assert_eq!(ok(aclnn::fused_infer_attention_score(&mut c, &a), "prefill"), FiaVersion::V4);
        ok(c.synchronize(), "sync");
        let got = f16_to_f64(&read::<f16>(&ob, b * sq * nh * d));
        for s in 0..b {
            let (kr, vr) = (rows(&ks[s], kvh * d), rows(&vs[s], kvh * d));
            for i in 0..lq[s] {
                let visible = i + lkv[s] - lq[s]; // right-down causal: key j <= i + kv - q
                for h in 0..nh {
                    let g = h / (nh / kvh);
                    let keys: Vec<Vec<f64>> = kr[..=visible].iter().map(|r| r[g * d..(g + 1) * d].to_vec()).collect();
                    let vals: Vec<Vec<f64>> = vr[..=visible].iter().map(|r| r[g * d..(g + 1) * d].to_vec()).collect();
                    let at = ((s * sq + i) * nh + h) * d;
                    let want = attend(&f16_to_f64(&q[at..at + d]), &keys, &vals, scale);
                    assert_close(
                        &format!("prefill seq {s} row {i} head {h}"),
                        &got[at..at + d],
                        &round_f16(&want),
                        2e-3,
                        2e-3,
                    );
                }
            }
        }
        // prefill with a block size the prompt branch rejects (must be a multiple of 128)
        a.block_size = 64;
        let err = aclnn::fused_infer_attention_score(&mut c, &a).expect_err("block size 64");
        assert!(err.message().contains("multiple of 128"), "{err}");
        // sparse mode 3 with a mask that is not the optimized causal mask fails at run time
        a.block_size = bs as i64;
        let zeros = alloc(&dev, 2048 * 2048);
        ok(zeros.fill_bytes(0), "zero mask");
        a.atten_mask = Some(ok(zeros.view(DType::U8, &[2048, 2048]), "mask"));
        ok(aclnn::fused_infer_attention_score(&mut c, &a), "launch");
        let err = c.synchronize().expect_err("wrong mask");
        assert!(err.message().contains("2048x2048 mask"), "{err}");
        drop((kc, vc, qb, tb, ob, mb, zeros, c, dev));
        assert_clean(&cann);
    });
}

// ------------------------------------------------------------------------------------------ MoE

#[test]
fn the_moe_chain_gating_routing_grouped_matmul_finalize_matches_a_dense_reference() {
    isolated("the_moe_chain_gating_routing_grouped_matmul_finalize_matches_a_dense_reference", &[], || {
        let (cann, dev) = device();
        let mut c = ctx(&dev);
        let (n, e, k, h, f) = (5usize, 4usize, 2usize, 8usize, 6usize);
        let logits = rand_vec(n * e, 100);
        let x = rand_vec(n * h, 101);
        let w = rand_vec(e * f * h, 102); // per expert [f, h] (out, in)
        let (lb, xb, wb) = (upload(&dev, &logits), upload(&dev, &x), upload(&dev, &w));
        let (yb, eib, rib) = (alloc(&dev, n * k * 4), alloc(&dev, n * k * 4), alloc(&dev, n * k * 4));
        let nk = (n * k) as i64;
        ok(
            aclnn::moe_gating_top_k_softmax(
                &mut c,
                &ok(lb.view(DType::F32, &[n as i64, e as i64]), "x"),
                None,
                k as i64,
                &ok(yb.view(DType::F32, &[n as i64, k as i64]), "y"),
                &ok(eib.view(DType::I32, &[n as i64, k as i64]), "ei"),
                &ok(rib.view(DType::I32, &[n as i64, k as i64]), "ri"),
            ),
            "gating",
        );
        let (exb, erb, cntb, cnt64) =
            (alloc(&dev, n * k * h * 4), alloc(&dev, n * k * 4), alloc(&dev, e * 4), alloc(&dev, e * 8));
        ok(
            aclnn::moe_init_routing_v2(
                &mut c,
                &MoeInitRouting {
                    x: ok(xb.view(DType::F32, &[n as i64, h as i64]), "x"),
                    expert_idx: ok(eib.view(DType::I32, &[n as i64, k as i64]), "ei"),
                    active_num: 0,
                    expert_capacity: 0,
                    expert_num: e as i64,
                    drop_pad_mode: 0,
                    expert_tokens: ExpertTokens::Cumsum,
                    expanded_x: ok(exb.view(DType::F32, &[nk, h as i64]), "ex"),
                    expanded_row_idx: ok(erb.view(DType::I32, &[nk]), "er"),
                    expert_tokens_out: Some(ok(cntb.view(DType::I32, &[e as i64]), "cnt")),
                    expert_tokens_before_capacity: None,
                },
            ),
            "init routing",
        );
        ok(
            aclnn::cast(
                &mut c,
                &ok(cntb.view(DType::I32, &[e as i64]), "cnt"),
                &ok(cnt64.view(DType::I64, &[e as i64]), "cnt64"),
            ),
            "cast group list",
        );
        let gout = alloc(&dev, n * k * f * 4);
        let wt = ok(ok(wb.view(DType::F32, &[e as i64, f as i64, h as i64]), "w").transpose(1, 2), "wT"); // [e, h, f]
        ok(
            aclnn::grouped_matmul_v4(
                &mut c,
                &ok(exb.view(DType::F32, &[nk, h as i64]), "x"),
                &wt,
                None,
                &ok(cnt64.view(DType::I64, &[e as i64]), "gl"),
                GroupListType::Cumsum,
                &ok(gout.view(DType::F32, &[nk, f as i64]), "o"),
            ),
            "grouped matmul",
        );
        let out = alloc(&dev, n * f * 4);
        ok(
            aclnn::moe_finalize_routing_v2(
                &mut c,
                &MoeFinalizeRouting {
                    expanded_x: ok(gout.view(DType::F32, &[nk, f as i64]), "ex"),
                    expanded_row_idx: ok(erb.view(DType::I32, &[nk]), "er"),
                    x1: None,
                    x2: None,
                    bias: None,
                    scales: Some(ok(yb.view(DType::F32, &[n as i64, k as i64]), "scales")),
                    expert_idx: Some(ok(eib.view(DType::I32, &[n as i64, k as i64]), "ei")),
                    drop_pad_mode: 2,
                    out: ok(out.view(DType::F32, &[n as i64, f as i64]), "out"),
                },
            ),
            "finalize",
        );
        ok(c.synchronize(), "sync");

        // reference: softmax, top-k, dense expert matmuls, weighted sum
        let mut want_idx = Vec::new();
        let mut want_w = Vec::new();
        for i in 0..n {
            let row: Vec<f64> = logits[i * e..(i + 1) * e].iter().map(|&v| v as f64).collect();
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|a, b| row[*b].total_cmp(&row[*a]));
            for &j in &order[..k] {
                want_idx.push(j as i32);
                want_w.push((row[j] - m).exp() / z);
            }
        }
        assert_eq!(read::<i32>(&eib, n * k), want_idx, "top-k experts");
        assert_close("top-k weights", &f32_to_f64(&read::<f32>(&yb, n * k)), &want_w, 1e-6, 1e-6);
        let row_idx = read::<i32>(&rib, n * k);
        for i in 0..n {
            for j in 0..k {
                assert_eq!(row_idx[i * k + j], (j * n + i) as i32, "rowIdx[{i}][{j}]");
            }
        }
        let mut counts = vec![0i32; e];
        want_idx.iter().for_each(|&x| counts[x as usize] += 1);
        let cum: Vec<i32> = counts
            .iter()
            .scan(0, |s, &x| {
                *s += x;
                Some(*s)
            })
            .collect();
        assert_eq!(read::<i32>(&cntb, e), cum, "cumulative tokens per expert");
        let mut want = vec![0.0; n * f];
        for i in 0..n {
            for j in 0..k {
                let ex = want_idx[i * k + j] as usize;
                for o in 0..f {
                    let dot: f64 = (0..h).map(|t| x[i * h + t] as f64 * w[(ex * f + o) * h + t] as f64).sum();
                    want[i * f + o] += want_w[i * k + j] * dot;
                }
            }
        }
        assert_close("moe out", &f32_to_f64(&read::<f32>(&out, n * f)), &want, 1e-5, 1e-5);
        drop((lb, xb, wb, yb, eib, rib, exb, erb, cntb, cnt64, gout, out, c, dev));
        assert_clean(&cann);
    });
}

#[test]
fn grouped_matmul_fp16_with_counts_and_bias_leaves_rows_past_the_groups_alone() {
    isolated("grouped_matmul_fp16_with_counts_and_bias_leaves_rows_past_the_groups_alone", &[], || {
        let (cann, dev) = device();
        let mut c = ctx(&dev);
        let (m, k, n, e) = (7usize, 16usize, 8usize, 3usize);
        let counts = [2i64, 0, 3]; // 5 rows in groups; rows 5 and 6 belong to none
        let x = to_f16(&rand_vec(m * k, 110));
        let w = to_f16(&rand_vec(e * k * n, 111)); // [e, k, n]
        let bias = to_f16(&rand_vec(e * n, 112));
        let (xb, wb, bb, gb, ob) =
            (upload(&dev, &x), upload(&dev, &w), upload(&dev, &bias), upload(&dev, &counts), alloc(&dev, m * n * 2));
        ok(ob.fill_bytes(0x3C), "sentinel"); // 0x3C3C as f16 = 1.0586
        ok(
            aclnn::grouped_matmul_v4(
                &mut c,
                &ok(xb.view(DType::F16, &[m as i64, k as i64]), "x"),
                &ok(wb.view(DType::F16, &[e as i64, k as i64, n as i64]), "w"),
                Some(&ok(bb.view(DType::F16, &[e as i64, n as i64]), "bias")),
                &ok(gb.view(DType::I64, &[e as i64]), "groups"),
                GroupListType::Count,
                &ok(ob.view(DType::F16, &[m as i64, n as i64]), "out"),
            ),
            "gmm",
        );
        ok(c.synchronize(), "sync");
        let got = f16_to_f64(&read::<f16>(&ob, m * n));
        let (xf, wf, bf) = (f16_to_f64(&x), f16_to_f64(&w), f16_to_f64(&bias));
        let mut row = 0;
        for (g, &cnt) in counts.iter().enumerate() {
            for _ in 0..cnt {
                let want: Vec<f64> = (0..n)
                    .map(|j| (0..k).map(|t| xf[row * k + t] * wf[(g * k + t) * n + j]).sum::<f64>() + bf[g * n + j])
                    .collect();
                assert_close(
                    &format!("gmm row {row} (group {g})"),
                    &got[row * n..(row + 1) * n],
                    &round_f16(&want),
                    2e-3,
                    2e-3,
                );
                row += 1;
            }
        }
        let sentinel = f16::from_bits(0x3C3C).to_f64();
        assert!(
            got[row * n..].iter().all(|&v| v == sentinel),
            "rows past the groups were written: {:?}",
            &got[row * n..]
        );
        // a group list that claims more rows than x has fails when the op runs
        let too_many = upload(&dev, &[4i64, 4, 4]);
        ok(
            aclnn::grouped_matmul_v4(
                &mut c,
                &ok(xb.view(DType::F16, &[m as i64, k as i64]), "x"),
                &ok(wb.view(DType::F16, &[e as i64, k as i64, n as i64]), "w"),
                None,
                &ok(too_many.view(DType::I64, &[e as i64]), "groups"),
                GroupListType::Count,
                &ok(ob.view(DType::F16, &[m as i64, n as i64]), "out"),
            ),
            "launch",
        );
        let err = c.synchronize().expect_err("12 rows claimed, 7 exist");
        assert!(err.message().contains("groupList[1] = 4"), "{err}");
        drop((xb, wb, bb, gb, ob, too_many, c, dev));
        assert_clean(&cann);
    });
}

// ------------------------------------------------------------------------------------------ faults

fn norm_args(dev: &ascend_sys::Device) -> [ascend_sys::DeviceBuffer; 4] {
    [upload(dev, &rand_vec(32, 1)), upload(dev, &[1.0f32; 32]), alloc(dev, 128), alloc(dev, 4)]
}
fn run_norm(c: &mut Context, b: &[ascend_sys::DeviceBuffer; 4]) -> ascend_sys::Result<()> {
    aclnn::rms_norm(
        c,
        &b[0].view(DType::F32, &[1, 32])?,
        &b[1].view(DType::F32, &[32])?,
        1e-6,
        &b[2].view(DType::F32, &[1, 32])?,
        &b[3].view(DType::F32, &[1, 1])?,
    )
}

#[test]
fn a_failed_malloc_is_an_error_and_leaves_nothing_allocated() {
    isolated_case(
        "a_failed_malloc_is_an_error_and_leaves_nothing_allocated",
        "direct",
        &env(&[("TBOOST_SIM_FAIL_MALLOC_AT", "3")]),
        || {
            let (cann, dev) = device();
            let a = alloc(&dev, 64);
            let b = alloc(&dev, 64);
            let err = dev.alloc(64).expect_err("third malloc fails");
            assert!(matches!(err, AclError::Runtime { call: "aclrtMalloc", code: 200000, .. }), "{err}");
            assert!(
                err.to_string().contains("ACL_ERROR_BAD_ALLOC")
                    && err.message().contains("TBOOST_SIM_FAIL_MALLOC_AT=3"),
                "{err}"
            );
            let _d = alloc(&dev, 64); // the fourth succeeds
            assert_eq!(stats(&cann).device_allocations, 3);
            drop((a, b, _d, dev));
            assert_clean(&cann);
        },
    );
    // a workspace allocation failing inside an op: the executor is destroyed, nothing leaks
    isolated_case(
        "a_failed_malloc_is_an_error_and_leaves_nothing_allocated",
        "workspace",
        &env(&[("TBOOST_SIM_FAIL_MALLOC_AT", "4")]),
        || {
            let (cann, dev) = device();
            let (x, w, o) = (upload(&dev, &[1.0f32; 4]), upload(&dev, &[1.0f32; 4]), alloc(&dev, 16));
            let mut c = ctx(&dev);
            let err = aclnn::matmul(
                &mut c,
                &ok(x.view(DType::F32, &[2, 2]), "x"),
                &ok(w.view(DType::F32, &[2, 2]), "w"),
                &ok(o.view(DType::F32, &[2, 2]), "o"),
                CubeMathType::KeepDtype,
            )
            .expect_err("the workspace is the 4th malloc");
            assert!(matches!(err, AclError::Runtime { call: "aclrtMalloc", .. }), "{err}");
            assert_eq!(stats(&cann).live_executors, 0);
            assert_eq!(stats(&cann).live_tensors, 0);
            drop((x, w, o, c, dev));
            assert_clean(&cann);
        },
    );
}

#[test]
fn op_status_faults_come_back_with_the_op_name_status_and_message() {
    isolated(
        "op_status_faults_come_back_with_the_op_name_status_and_message",
        &env(&[("TBOOST_SIM_FAIL_OP", "aclnnRmsNorm:2:161002,aclnnRmsNorm:4:561003,aclnnRmsNorm:1:561003:exec")]),
        || {
            let (cann, dev) = device();
            let b = norm_args(&dev);
            let mut c = ctx(&dev);
            // call 1: the first phase passes, the launch fails (exec fault #1)
            let err = run_norm(&mut c, &b).expect_err("exec fault");
            assert!(
                matches!(err, AclError::Op { op: "aclnnRmsNorm", phase: Phase::Execute, status: 561003, .. }),
                "{err}"
            );
            assert_eq!(stats(&cann).live_executors, 0, "the failed execute consumed the executor");
            assert_eq!(stats(&cann).executor_double_frees, 0, "and nothing destroyed it again");
            // call 2: first-phase 161002
            let err = run_norm(&mut c, &b).expect_err("gws fault");
            assert!(
                matches!(err, AclError::Op { op: "aclnnRmsNorm", phase: Phase::GetWorkspaceSize, status: 161002, .. }),
                "{err}"
            );
            assert!(
                err.message()
                    .contains("aclnnRmsNormGetWorkspaceSize: fault injection: call #2 on device 0 returns 161002"),
                "{err}"
            );
            assert!(err.to_string().contains("ACLNN_ERR_PARAM_INVALID"), "{err}");
            ok(run_norm(&mut c, &b), "call 3 passes");
            let err = run_norm(&mut c, &b).expect_err("call 4");
            assert_eq!(err.code(), Some(561003));
            assert!(err.to_string().contains("operator binary package"), "{err}");
            ok(c.synchronize(), "sync");
            drop((b, c, dev));
            assert_clean(&cann);
        },
    );
}

/// The execute phase consumes a one-shot executor whatever it returns (opbase's CommonOpExecutorRun
/// deletes it after Run(), success or not): after an injected execute failure nothing may destroy it
/// again. The simulator consumes it on any execute result and counts a later destroy as a double free.
#[test]
fn an_execute_failure_consumes_the_executor_and_nothing_frees_it_twice() {
    isolated(
        "an_execute_failure_consumes_the_executor_and_nothing_frees_it_twice",
        &env(&[(
            "TBOOST_SIM_FAIL_OP",
            "aclnnRmsNorm:1:561003:exec,aclnnRmsNorm:2:361001:exec,aclnnRmsNorm:4:561000:exec",
        )]),
        || {
            let (cann, dev) = device();
            let b = norm_args(&dev);
            let mut c = ctx(&dev);
            for call in 1..=2 {
                let err = run_norm(&mut c, &b).expect_err("exec fault");
                assert!(matches!(err, AclError::Op { phase: Phase::Execute, .. }), "call {call}: {err}");
                let s = stats(&cann);
                assert_eq!(s.live_executors, 0, "call {call}: the failed execute consumed the executor");
                assert_eq!(s.executor_double_frees, 0, "call {call}: destroyed again after a failed execute");
                assert_eq!(s.rule_violations, 0, "call {call}: {s:?}");
            }
            ok(run_norm(&mut c, &b), "call 3 runs");
            ok(c.synchronize(), "sync");
            // what the simulator reports when a caller does destroy a consumed executor (the old bug)
            let raw_op = cann.raw_op("aclnnRmsNorm").expect("present");
            // SAFETY: the header's type for this op.
            let gws: ascend_sys::raw::aclnnRmsNormGetWorkspaceSize_fn =
                unsafe { std::mem::transmute(raw_op.first_phase) };
            let exec = raw_op.execute.expect("execute twin");
            let ts = [
                ok(b[0].view(DType::F32, &[1, 32]), "x"),
                ok(b[1].view(DType::F32, &[32]), "g"),
                ok(b[2].view(DType::F32, &[1, 32]), "y"),
                ok(b[3].view(DType::F32, &[1, 1]), "r"),
            ];
            let acl: Vec<_> = ts.iter().map(|t| ok(t.to_acl(&cann), "acl")).collect();
            let (mut ws, mut ex) = (0u64, std::ptr::null_mut());
            // SAFETY: live handles and out pointers.
            let st = unsafe {
                gws.expect("gws")(
                    acl[0].as_ptr(),
                    acl[1].as_ptr(),
                    1e-6,
                    acl[2].as_ptr(),
                    acl[3].as_ptr(),
                    &mut ws,
                    &mut ex,
                )
            };
            assert_eq!(st, 0);
            // SAFETY: a live one-shot executor; fault #4 fails its execute.
            assert_eq!(unsafe { exec(std::ptr::null_mut(), 0, ex, c.stream().as_raw()) }, 561000);
            // SAFETY: the simulator looks the pointer up before touching it.
            let guard = unsafe { Executor::from_raw(&cann, "aclnnRmsNorm", ex) }.expect("executor");
            drop(guard); // aclDestroyAclOpExecutor on the consumed executor
            let s = stats(&cann);
            assert_eq!((s.executor_double_frees, s.rule_violations), (1, 1), "{s:?}");
            assert!(s.is_clean() || s.device_allocations > 0, "{s:?}");
            drop((acl, b, c, dev));
            let s = stats(&cann);
            assert!(s.is_clean(), "{s:?}");
        },
    );
}

/// One decode-shaped FIA call over contiguous KV (`[1, 1, 1, 16]` each), pinned to `version`.
fn tiny_fia(c: &mut Context, dev: &ascend_sys::Device, version: Option<FiaVersion>) -> ascend_sys::Result<FiaVersion> {
    let (q, k, v, o) = (
        upload(dev, &to_f16(&rand_vec(16, 1))),
        upload(dev, &to_f16(&rand_vec(16, 2))),
        upload(dev, &to_f16(&rand_vec(16, 3))),
        alloc(dev, 32),
    );
    let shape = [1i64, 1, 1, 16];
    let mut a = FusedInferAttention::new(
        q.view(DType::F16, &shape)?,
        k.view(DType::F16, &shape)?,
        v.view(DType::F16, &shape)?,
        o.view(DType::F16, &shape)?,
        1,
        1,
        0.25,
    );
    a.version = version;
    let r = aclnn::fused_infer_attention_score(c, &a);
    c.synchronize()?;
    r
}

/// The SoC profiles of the simulator (each rule cites its op doc in ascend-sim/src/ops_common.h):
/// Ascend950 refuses FIA V1..V4 with 361001 and runs V5; 200I/500 A2 (310B) has no RmsNorm kernel
/// (561003); bf16 exists only on A2/A3 and 950.
#[test]
fn soc_profiles_gate_kernels_fia_versions_and_bf16() {
    let name = "soc_profiles_gate_kernels_fia_versions_and_bf16";
    isolated_case(name, "950", &env(&[("TBOOST_SIM_SOC", "Ascend950PR")]), || {
        let (cann, dev) = device();
        assert_eq!(cann.soc(), SocFamily::Ascend950);
        assert!(cann.soc().supports_bf16());
        assert_eq!(aclnn::fused_infer_attention_version(&cann), Some(FiaVersion::V5));
        let mut c = ctx(&dev);
        let err = tiny_fia(&mut c, &dev, Some(FiaVersion::V4)).expect_err("V4 on 950");
        assert_eq!(err.code(), Some(361001), "{err}");
        assert!(err.message().contains("no longer supported on Ascend950"), "{err}");
        assert_eq!(ok(tiny_fia(&mut c, &dev, None), "V5 on 950"), FiaVersion::V5);
        drop((c, dev));
        assert_clean(&cann);
    });
    isolated_case(name, "310B", &env(&[("TBOOST_SIM_SOC", "Ascend310B1")]), || {
        let (cann, dev) = device();
        assert!(!cann.soc().supports_bf16());
        assert_eq!(aclnn::fused_infer_attention_version(&cann), Some(FiaVersion::V4));
        let b = norm_args(&dev);
        let mut c = ctx(&dev);
        let err = run_norm(&mut c, &b).expect_err("no RmsNorm kernel on 310B");
        assert_eq!(err.code(), Some(561003), "{err}");
        assert!(err.message().contains("Ascend310B1"), "{err}");
        drop((b, c, dev));
        assert_clean(&cann);
    });
    for soc in ["Ascend910A", "Ascend910ProA", "Ascend310P3"] {
        isolated_case(name, soc, &env(&[("TBOOST_SIM_SOC", soc)]), || {
            let (cann, dev) = device();
            assert!(!cann.soc().supports_bf16(), "{soc}");
            let (x, o) = (upload(&dev, &to_bf16(&rand_vec(4, 1))), alloc(&dev, 8));
            let mut c = ctx(&dev);
            let err = aclnn::matmul(
                &mut c,
                &ok(x.view(DType::Bf16, &[2, 2]), "x"),
                &ok(x.view(DType::Bf16, &[2, 2]), "w"),
                &ok(o.view(DType::Bf16, &[2, 2]), "o"),
                CubeMathType::KeepDtype,
            )
            .expect_err("bf16 matmul");
            assert_eq!(err.code(), Some(161002), "{soc}: {err}");
            drop((x, o, c, dev));
            assert_clean(&cann);
        });
    }
}

/// aclnnMm follows CANN's dtype promotion (互推导关系): f16 x f32 promotes to f32, and out may take
/// the promoted dtype; the simulator is not stricter than CANN.
#[test]
fn matmul_promotes_mixed_float_operands_like_cann() {
    isolated("matmul_promotes_mixed_float_operands_like_cann", &[], || {
        let (cann, dev) = device();
        let xs = rand_vec(4, 7);
        let (x, w, o) = (upload(&dev, &to_f16(&xs)), upload(&dev, &[1.0f32, 0.0, 0.0, 1.0]), alloc(&dev, 16));
        let mut c = ctx(&dev);
        ok(
            aclnn::mm(
                &mut c,
                &ok(x.view(DType::F16, &[2, 2]), "x"),
                &ok(w.view(DType::F32, &[2, 2]), "w"),
                &ok(o.view(DType::F32, &[2, 2]), "o"),
                CubeMathType::KeepDtype,
            ),
            "f16 x f32 -> f32",
        );
        ok(c.synchronize(), "sync");
        let got = f32_to_f64(&read::<f32>(&o, 4));
        assert_close("identity", &got, &f16_to_f64(&to_f16(&xs)), 1e-6, 1e-6);
        drop((x, w, o, c, dev));
        assert_clean(&cann);
    });
}

/// aclrtMemcpyAsync: "The source address and destination address passed to this call must be 64-byte
/// aligned." The simulator refuses an on-chip copy at any other address, as a rule violation.
#[test]
fn device_to_device_async_copies_need_64_byte_aligned_addresses() {
    isolated("device_to_device_async_copies_need_64_byte_aligned_addresses", &[], || {
        let (cann, dev) = device();
        let (a, b) = (upload(&dev, &[7u8; 256]), alloc(&dev, 256));
        let c = ctx(&dev);
        // SAFETY: both buffers outlive the synchronize below.
        ok(unsafe { c.stream().copy_device_async(&a, 64, &b, 128, 64) }, "aligned copy");
        for (src_at, dst_at) in [(2, 0), (0, 32), (96, 130)] {
            // SAFETY: refused before anything is queued.
            let err = unsafe { c.stream().copy_device_async(&a, src_at, &b, dst_at, 64) }.expect_err("misaligned");
            assert_eq!(err.code(), Some(100000), "{src_at}->{dst_at}: {err}");
            assert!(err.message().contains("64-byte aligned"), "{err}");
        }
        ok(c.stream().synchronize(), "sync");
        assert_eq!(read::<u8>(&b, 256)[128..192], [7u8; 64]);
        assert_eq!(stats(&cann).rule_violations, 3);
        drop((a, b, c, dev));
        assert!(stats(&cann).is_clean());
    });
}

/// aclrtSetDevice "sets the compute device in the current thread": a thread that never set one gets
/// 107002 (context is null) from the runtime; `Device::make_current` binds it.
#[test]
fn the_current_device_belongs_to_the_thread_that_set_it() {
    isolated("the_current_device_belongs_to_the_thread_that_set_it", &[], || {
        let (cann, dev) = device();
        std::thread::scope(|s| {
            s.spawn(|| {
                let err = dev.alloc(64).expect_err("no device on this thread");
                assert_eq!(err.code(), Some(107002), "{err}");
                assert!(err.to_string().contains("ACL_ERROR_RT_CONTEXT_NULL"), "{err}");
                ok(dev.make_current(), "bind this thread");
                ok(dev.make_current(), "already current: no second aclrtSetDevice");
                let b = ok(dev.alloc(64), "alloc after binding");
                let mut c = ctx(&dev);
                let bb = norm_args(&dev);
                ok(run_norm(&mut c, &bb), "an op on the second thread");
                ok(c.synchronize(), "sync");
                drop((b, bb, c));
            });
        });
        drop(dev);
        assert_clean(&cann);
    });
}

#[test]
fn a_failing_synchronize_is_reported_and_the_next_one_recovers() {
    isolated(
        "a_failing_synchronize_is_reported_and_the_next_one_recovers",
        &env(&[("TBOOST_SIM_FAIL_SYNC_AT", "2")]),
        || {
            let (cann, dev) = device();
            let b = norm_args(&dev);
            let mut c = ctx(&dev);
            ok(run_norm(&mut c, &b), "launch");
            ok(c.synchronize(), "sync 1");
            ok(run_norm(&mut c, &b), "launch");
            let err = c.synchronize().expect_err("sync 2");
            assert!(matches!(err, AclError::Runtime { call: "aclrtSynchronizeStream", code: 500003, .. }), "{err}");
            assert!(err.message().contains("TBOOST_SIM_FAIL_SYNC_AT=2"), "{err}");
            ok(c.synchronize(), "sync 3");
            drop((b, c, dev));
            assert_clean(&cann);
        },
    );
}

// ------------------------------------------------------------------------------------------ rules

#[test]
fn executor_rules_repeatable_reuse_second_launch_foreign_and_small_workspace() {
    isolated("executor_rules_repeatable_reuse_second_launch_foreign_and_small_workspace", &[], || {
        let (cann, dev) = device();
        let b = norm_args(&dev);
        let mut c = ctx(&dev);
        // a repeatable executor runs many times; results are right each time
        let ts = [
            ok(b[0].view(DType::F32, &[1, 32]), "x"),
            ok(b[1].view(DType::F32, &[32]), "g"),
            ok(b[2].view(DType::F32, &[1, 32]), "y"),
            ok(b[3].view(DType::F32, &[1, 1]), "r"),
        ];
        let acl: Vec<_> = ts.iter().map(|t| ok(t.to_acl(&cann), "acl")).collect();
        // SAFETY: the header's type for this op.
        let f = ok(
            unsafe { c.first_phase_fn::<ascend_sys::raw::aclnnRmsNormGetWorkspaceSize_fn>("aclnnRmsNorm") },
            "resolve",
        );
        let mut prepared = ok(
            c.prepare("aclnnRmsNorm", |ws, ex| match f {
                // SAFETY: live handles.
                Some(f) => unsafe {
                    f(acl[0].as_ptr(), acl[1].as_ptr(), 1e-6, acl[2].as_ptr(), acl[3].as_ptr(), ws, ex)
                },
                None => -1,
            }),
            "prepare",
        );
        drop(acl); // the executor keeps what it needs
        for _ in 0..3 {
            ok(c.launch_prepared(&mut prepared), "launch prepared");
        }
        ok(c.synchronize(), "sync");
        let x = f32_to_f64(&read::<f32>(&b[0], 32));
        let (want, _) = rms_ref(&x, &[1.0; 32], 1, 1e-6);
        assert_close("repeatable", &f32_to_f64(&read::<f32>(&b[2], 32)), &want, 1e-6, 1e-6);
        assert_eq!(stats(&cann).op_launches, 3);
        drop(prepared);
        assert_eq!(stats(&cann).live_executors, 0);

        // raw misuse, driven by hand: each is refused with a message, counted as a violation
        let raw_op = cann.raw_op("aclnnRmsNorm").expect("present");
        // SAFETY: the header's type for this op.
        let gws: ascend_sys::raw::aclnnRmsNormGetWorkspaceSize_fn = unsafe { std::mem::transmute(raw_op.first_phase) };
        let exec = raw_op.execute.expect("execute twin");
        let acl: Vec<_> = ts.iter().map(|t| ok(t.to_acl(&cann), "acl")).collect();
        let (mut ws, mut ex) = (0u64, std::ptr::null_mut());
        // SAFETY: live handles and out pointers.
        assert_eq!(
            unsafe {
                gws.expect("gws")(
                    acl[0].as_ptr(),
                    acl[1].as_ptr(),
                    1e-6,
                    acl[2].as_ptr(),
                    acl[3].as_ptr(),
                    &mut ws,
                    &mut ex,
                )
            },
            0
        );
        let stream = c.stream().as_raw();
        // SAFETY: a live one-shot executor.
        assert_eq!(unsafe { exec(std::ptr::null_mut(), 0, ex, stream) }, 0, "first launch");
        // SAFETY: the executor is consumed: the simulator refuses it without touching it.
        let st = unsafe { exec(std::ptr::null_mut(), 0, ex, stream) };
        assert_eq!(st, 161002, "second launch of a one-shot executor");
        assert!(cann.recent_error().unwrap_or_default().contains("aclSetAclOpExecutorRepeatable"));
        // execute without a first phase: an address that never was an executor
        let mut bogus = [0u64; 16];
        // SAFETY: the simulator looks the pointer up before using it.
        let st = unsafe { exec(std::ptr::null_mut(), 0, bogus.as_mut_ptr().cast(), stream) };
        assert_eq!(st, 161002);
        assert!(cann.recent_error().unwrap_or_default().contains("was not returned by aclnnRmsNormGetWorkspaceSize"));
        // an executor of one op launched through another op's execute
        let (mut ws2, mut ex2) = (0u64, std::ptr::null_mut());
        // SAFETY: as above.
        assert_eq!(
            unsafe {
                gws.expect("gws")(
                    acl[0].as_ptr(),
                    acl[1].as_ptr(),
                    1e-6,
                    acl[2].as_ptr(),
                    acl[3].as_ptr(),
                    &mut ws2,
                    &mut ex2,
                )
            },
            0
        );
        // SAFETY: ownership of the live executor goes to the guard.
        let guard = unsafe { Executor::from_raw(&cann, "aclnnRmsNorm", ex2) }.expect("executor");
        let mm = cann.raw_op("aclnnMatmul").expect("matmul").execute.expect("exec");
        // SAFETY: refused by the simulator (wrong op).
        assert_eq!(unsafe { mm(std::ptr::null_mut(), 0, guard.as_ptr(), stream) }, 161002);
        assert!(cann.recent_error().unwrap_or_default().contains("belongs to aclnnRmsNorm"));
        // the execute phase consumed the one-shot executor although it failed: not ours to destroy
        let _ = guard.release();
        // a workspace smaller than the first phase asked for
        let mmf = cann.raw_op("aclnnMatmul").expect("matmul");
        // SAFETY: the header's type.
        let mgws: ascend_sys::raw::aclnnMatmulGetWorkspaceSize_fn = unsafe { std::mem::transmute(mmf.first_phase) };
        let sq = [ok(b[0].view(DType::F32, &[4, 4]), "a"), ok(b[2].view(DType::F32, &[4, 4]), "o")];
        let (a2, o2) = (ok(sq[0].to_acl(&cann), "a"), ok(sq[1].to_acl(&cann), "o"));
        let (mut mws, mut mex) = (0u64, std::ptr::null_mut());
        // SAFETY: live handles.
        assert_eq!(unsafe { mgws.expect("gws")(a2.as_ptr(), a2.as_ptr(), o2.as_ptr(), 0, &mut mws, &mut mex) }, 0);
        assert!(mws > 0);
        let small = alloc(&dev, mws as usize);
        // SAFETY: refused (too small); the failed execute consumed the executor.
        assert_eq!(unsafe { mm(small.as_ptr(), mws - 1, mex, stream) }, 161002);
        assert!(cann.recent_error().unwrap_or_default().contains("smaller than"));
        ok(c.synchronize(), "sync");
        assert_eq!(stats(&cann).rule_violations, 4);
        assert_eq!(stats(&cann).executor_double_frees, 0);
        assert_eq!(stats(&cann).live_executors, 0, "failed executes consumed their executors");
        drop((acl, a2, o2, small, b, c, dev));
        let s = stats(&cann);
        assert!(s.is_clean(), "{s:?}");
    });
}

#[test]
fn freeing_a_buffer_before_the_stream_ran_the_op_is_detected() {
    isolated("freeing_a_buffer_before_the_stream_ran_the_op_is_detected", &[], || {
        let (cann, dev) = device();
        let bufs = norm_args(&dev);
        let mut c = ctx(&dev);
        ok(run_norm(&mut c, &bufs), "launch");
        drop(bufs); // with the op still queued
        let err = c.synchronize().expect_err("the inputs were freed with the op still queued");
        assert!(err.message().contains("was freed before the stream ran the op"), "{err}");
        assert_eq!(stats(&cann).rule_violations, 1);
        drop((c, dev));
        let s = stats(&cann);
        assert!(s.is_clean(), "{s:?}");
    });
}

#[test]
fn workspace_grows_only_when_too_small_and_old_ones_wait_for_synchronize() {
    isolated("workspace_grows_only_when_too_small_and_old_ones_wait_for_synchronize", &[], || {
        let (cann, dev) = device();
        let mut c = ctx(&dev);
        let big = 160usize; // matmul's simulated workspace is m*n*8 bytes
        let (a, o) = (upload(&dev, &rand_vec(big * big, 1)), alloc(&dev, big * big * 4));
        let run = |c: &mut Context, m: i64| {
            ok(
                aclnn::matmul(
                    c,
                    &ok(a.tensor(0, DType::F32, &[m, m]), "a"),
                    &ok(a.tensor(0, DType::F32, &[m, m]), "b"),
                    &ok(o.tensor(0, DType::F32, &[m, m]), "o"),
                    CubeMathType::KeepDtype,
                ),
                "matmul",
            )
        };
        run(&mut c, 8);
        run(&mut c, 8);
        assert_eq!(c.stats().workspace_grows, 0);
        let first = c.stats().workspace_bytes;
        run(&mut c, big as i64); // 160*160*8 = 200 KiB > the first 64 KiB workspace
        assert_eq!(c.stats().workspace_grows, 1);
        assert!(c.stats().workspace_bytes > first);
        // the first workspace is still allocated: queued matmuls use it
        assert_eq!(stats(&cann).device_allocations, 2 + 2);
        ok(c.synchronize(), "sync");
        assert_eq!(stats(&cann).device_allocations, 2 + 1, "retired workspace freed after synchronize");
        run(&mut c, 8);
        assert_eq!(c.stats().workspace_grows, 1, "a smaller op reuses the big workspace");
        ok(c.synchronize(), "sync");
        assert_eq!(stats(&cann).rule_violations, 0);
        drop((a, o, c, dev));
        assert_clean(&cann);
    });
}

#[test]
fn events_and_staged_uploads_order_work_across_streams() {
    isolated("events_and_staged_uploads_order_work_across_streams", &[], || {
        let (cann, dev) = device();
        let mut producer = ctx(&dev);
        let mut consumer = ctx(&dev);
        let (a, b) = (alloc(&dev, 16), alloc(&dev, 16));
        let data = vec![1.0f32, 2.0, 3.0, 4.0];
        producer.upload(&data, &a, 0).unwrap_or_else(|e| panic!("upload: {e}"));
        drop(data); // the staging buffer holds the bytes
        let ev = ok(dev.create_event(), "event");
        ok(ev.record(producer.stream()), "record");
        ok(consumer.stream().wait_event(&ev), "wait");
        ok(
            aclnn::add(
                &mut consumer,
                &ok(a.view(DType::F32, &[4]), "a"),
                &ok(a.view(DType::F32, &[4]), "a"),
                1.0,
                &ok(b.view(DType::F32, &[4]), "b"),
            ),
            "add",
        );
        let done = ok(dev.create_event(), "event");
        ok(done.record(consumer.stream()), "record");
        ok(done.synchronize(), "event sync runs the consumer, which first runs the producer up to its event");
        assert_eq!(read::<f32>(&b, 4), vec![2.0, 4.0, 6.0, 8.0]);
        let mut back = [0f32; 4];
        ok(consumer.download(&b, 0, &mut back), "download");
        assert_eq!(back, [2.0, 4.0, 6.0, 8.0]);
        // an asynchronous device-to-host copy lands at the synchronize
        let host = ok(dev.alloc_host(16), "host buffer");
        // SAFETY: host and b stay alive and untouched until the synchronize below.
        ok(unsafe { consumer.stream().copy_to_host_async(&b, 4, &host, 0, 8) }, "async d2h");
        ok(consumer.synchronize(), "sync");
        let got: Vec<f32> =
            host.as_slice()[..8].chunks(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(got, vec![4.0, 6.0]);
        drop(host);
        ok(producer.synchronize(), "sync");
        drop((ev, done, a, b, producer, consumer, dev));
        assert_clean(&cann);
    });
}

#[test]
fn stream_ordered_memset_device_copy_div_and_event_times() {
    isolated("stream_ordered_memset_device_copy_div_and_event_times", &[], || {
        let (cann, dev) = device();
        let mut c = ctx(&dev);
        let (a, b, q) =
            (upload(&dev, &[3.0f32, 6.0, 9.0, 12.0]), upload(&dev, &[1.0f32, 2.0, 3.0, 4.0]), alloc(&dev, 16));
        let (start, end) = (ok(dev.create_event(), "event"), ok(dev.create_event(), "event"));
        ok(start.record(c.stream()), "record");
        ok(
            aclnn::div(
                &mut c,
                &ok(a.view(DType::F32, &[2, 2]), "a"),
                &ok(b.view(DType::F32, &[1, 2]), "b (broadcast)"),
                &ok(q.view(DType::F32, &[2, 2]), "q"),
            ),
            "div",
        );
        ok(end.record(c.stream()), "record");
        // The copy and the memset are ordered after the division on the stream: before the synchronize the
        // destination still holds its old bytes.
        // SAFETY: every buffer outlives the synchronize below.
        unsafe {
            ok(c.stream().copy_device_async(&q, 0, &b, 0, 16), "d2d");
            ok(c.stream().memset_async(&a, 4, 8, 0), "memset");
        }
        assert_eq!(read::<f32>(&b, 4), vec![1.0, 2.0, 3.0, 4.0], "nothing ran before the synchronize");
        let early = end.elapsed_ms_since(&start).expect_err("the events have not completed yet");
        assert!(early.message().contains("completed"), "{early}");
        ok(c.synchronize(), "sync");
        assert_eq!(read::<f32>(&q, 4), vec![3.0, 3.0, 9.0, 6.0]);
        assert_eq!(read::<f32>(&b, 4), vec![3.0, 3.0, 9.0, 6.0], "device-to-device copy of the quotient");
        assert_eq!(read::<f32>(&a, 4), vec![3.0, 0.0, 0.0, 12.0], "bytes 4..12 cleared");
        let ms = ok(end.elapsed_ms_since(&start), "elapsed");
        assert!((0.0..10_000.0).contains(&ms), "{ms} ms");
        // out of range: an error before anything is queued
        // SAFETY: nothing is queued.
        let err = unsafe { c.stream().memset_async(&a, 8, 16, 0) }.expect_err("past the end");
        assert!(err.to_string().contains("outside"), "{err}");
        drop((start, end, a, b, q, c, dev));
        assert_clean(&cann);
    });
}
