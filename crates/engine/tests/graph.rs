//! Custom graphs (`tboost_engine::op_api::GraphBuilder`): a user block (a host callback, a residual
//! add, RMSNorm, a matmul) equals its host computation; the add + RMSNorm fusion is reported
//! and changes no bit; bad graphs are errors naming the node and the tensor.

use tboost_engine::backend::cpu::CpuBackend;
use tboost_engine::backend::DType;
use tboost_engine::op_api::{Graph, GraphBuilder, MatMulParams, NormParams, OpBackend, OpParams, TensorRef};

const ROWS: usize = 3;
const DIM: usize = 8;
const N: usize = 5;

fn be() -> OpBackend {
    OpBackend::new(Box::new(CpuBackend::new(2).expect("cpu backend")))
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn vals(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| (((i as u32 * 2654435761u32).wrapping_add(seed * 97)) % 1000) as f32 / 500.0 - 1.0).collect()
}

/// Depthwise causal conv over rows (kernel 2 per channel), then `* sigmoid`: the gate.
fn conv_gate(x: &[f32], k: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    for r in 0..ROWS {
        for c in 0..DIM {
            let prev = if r > 0 { x[(r - 1) * DIM + c] } else { 0.0 };
            let s = k[c] * x[r * DIM + c] + k[DIM + c] * prev;
            y[r * DIM + c] = x[r * DIM + c] / (1.0 + (-s).exp());
        }
    }
    y
}

struct Block {
    be: OpBackend,
    graph: Graph,
}

fn block(be: &OpBackend, fuse: bool) -> tboost_engine::Result<Block> {
    let gain = be.upload_weight(DType::F32, &[DIM], bytes(&vals(DIM, 3)))?;
    let w = be.upload_weight(DType::F32, &[N, DIM], bytes(&vals(N * DIM, 4)))?;
    let kernel = vals(2 * DIM, 5);
    let norm = NormParams { dim: DIM, eps: 1e-5, gain: DType::F32, act: DType::F32 };
    let mm = MatMulParams {
        weight: DType::F32,
        n: N,
        k: DIM,
        bias: false,
        precision: tboost_engine::backend::Precision::Exact,
        act: DType::F32,
        tiling: Default::default(),
    };
    let mut g = GraphBuilder::new();
    g.input("x", DType::F32, &[ROWS, DIM]).constant("gain", gain).constant("w", w);
    g.op("proj", OpParams::MatMul(mm), &["y", "w"], &["out"]);
    g.callback(
        "conv",
        &["x"],
        &[("c", &[ROWS, DIM])],
        Box::new(move |ins, outs| {
            outs[0] = conv_gate(ins[0], &kernel);
            Ok(())
        }),
    );
    g.add("residual", DType::F32, "x", "c", "h");
    g.op("norm", OpParams::RmsNorm(norm), &["h", "gain"], &["y"]);
    g.output("h").output("out").fusion(fuse);
    Ok(Block { be: be.clone(), graph: g.build(be)? })
}

fn run(b: &Block, x: &[f32]) -> tboost_engine::Result<(Vec<f32>, Vec<f32>)> {
    let xi = b.be.alloc(DType::F32, &[ROWS, DIM])?;
    let h = b.be.alloc(DType::F32, &[ROWS, DIM])?;
    let out = b.be.alloc(DType::F32, &[ROWS, N])?;
    b.be.write_f32(&xi, x)?;
    b.graph.run(&[xi], &[h.clone(), out.clone()])?;
    Ok((b.be.read_f32(&h)?, b.be.read_f32(&out)?))
}

#[test]
fn user_block_equals_host_and_fusion_changes_no_bit() {
    let be = be();
    let fused = block(&be, true).expect("fused graph");
    let unfused = block(&be, false).expect("unfused graph");
    assert!(fused.graph.fusions().contains("add_rmsnorm"), "report: {}", fused.graph.fusions());
    assert!(fused.graph.fusions().contains("'residual' (add) + 'norm' (rmsnorm)"));
    assert_eq!(unfused.graph.fusions(), "");
    assert_eq!(fused.graph.node_names(), ["conv", "residual+norm", "proj"]);
    assert_eq!(unfused.graph.node_names(), ["conv", "residual", "norm", "proj"]);

    let x = vals(ROWS * DIM, 1);
    let (hf, of) = run(&fused, &x).expect("fused run");
    let (hu, ou) = run(&unfused, &x).expect("unfused run");
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&hf), bits(&hu), "fusion changed h");
    assert_eq!(bits(&of), bits(&ou), "fusion changed out");

    // Host computation in f64.
    let c = conv_gate(&x, &vals(2 * DIM, 5));
    let (gain, w) = (vals(DIM, 3), vals(N * DIM, 4));
    for r in 0..ROWS {
        let h: Vec<f64> = (0..DIM).map(|i| x[r * DIM + i] as f64 + c[r * DIM + i] as f64).collect();
        let ms = h.iter().map(|v| v * v).sum::<f64>() / DIM as f64;
        let y: Vec<f64> = (0..DIM).map(|i| h[i] / (ms + 1e-5).sqrt() * gain[i] as f64).collect();
        for i in 0..DIM {
            assert!((hf[r * DIM + i] as f64 - h[i]).abs() < 1e-6, "h[{r},{i}]");
        }
        for n in 0..N {
            let want: f64 = (0..DIM).map(|i| y[i] * w[n * DIM + i] as f64).sum();
            let got = of[r * N + n] as f64;
            assert!((got - want).abs() < 1e-5 * (1.0 + want.abs()), "out[{r},{n}]: {got} vs {want}");
        }
    }
}

fn err_of(r: tboost_engine::Result<Graph>) -> String {
    match r {
        Ok(_) => panic!("the graph built"),
        Err(e) => e.to_string(),
    }
}

fn norm_graph(be: &OpBackend) -> (GraphBuilder, TensorRef) {
    let gain = be.upload_weight(DType::F32, &[DIM], bytes(&[1.0; DIM])).expect("gain");
    let mut g = GraphBuilder::new();
    g.input("x", DType::F32, &[ROWS, DIM]).constant("gain", gain.clone());
    (g, gain)
}

#[test]
fn bad_graphs_name_node_and_tensor() {
    let be = be();
    let norm = OpParams::RmsNorm(NormParams { dim: DIM, eps: 1e-5, gain: DType::F32, act: DType::F32 });

    let (mut g, _) = norm_graph(&be);
    g.op("norm", norm, &["nope", "gain"], &["y"]).output("y");
    let e = err_of(g.build(&be));
    assert!(e.contains("norm") && e.contains("'nope'") && e.contains("unknown"), "{e}");

    let (mut g, _) = norm_graph(&be);
    let wide = OpParams::RmsNorm(NormParams { dim: DIM + 1, eps: 1e-5, gain: DType::F32, act: DType::F32 });
    g.op("n2", wide, &["x", "gain"], &["y"]).output("y");
    let e = err_of(g.build(&be));
    assert!(e.contains("n2") && e.contains("'x'") && e.contains("[3, 8]"), "{e}");

    let (mut g, _) = norm_graph(&be);
    g.add("a", DType::F32, "x", "q", "p").add("b", DType::F32, "x", "p", "q").output("q");
    let e = err_of(g.build(&be));
    assert!(e.contains("cycle") && (e.contains("'p'") || e.contains("'q'")), "{e}");

    let (mut g, _) = norm_graph(&be);
    g.op("norm", norm, &["x", "gain"], &["y"]).add("dead", DType::F32, "x", "x", "z").output("y");
    let e = err_of(g.build(&be));
    assert!(e.contains("dead") && e.contains("'z'") && e.contains("unused"), "{e}");

    let (mut g, _) = norm_graph(&be);
    g.callback("cb", &["x"], &[("c", &[ROWS, DIM])], Box::new(|_, _| Err("no luck".into())));
    g.op("norm", norm, &["c", "gain"], &["y"]).output("y");
    let graph = g.build(&be).expect("callback graph builds");
    let x = be.alloc(DType::F32, &[ROWS, DIM]).expect("x");
    let y = be.alloc(DType::F32, &[ROWS, DIM]).expect("y");
    let e = graph.run(&[x], std::slice::from_ref(&y)).expect_err("callback fails").to_string();
    assert!(e.contains("cb") && e.contains("no luck"), "{e}");
    let e = graph.run(&[y], &[]).expect_err("wrong outputs").to_string();
    assert!(e.contains("outputs"), "{e}");
}

/// A gated MLP written as separate ops (gate matmul, up matmul, swiglu, down matmul) runs its
/// gate/up + SwiGLU as one `matmul_swiglu` (reported), with the same bits as the unfused graph,
/// for f32 and for a GGUF block type; and equals the f64 host computation (f32 weights).
#[test]
fn gate_up_swiglu_is_fused_and_changes_no_bit() {
    const INTER: usize = 64;
    const HID: usize = 32;
    let be = be();
    let mlp = |weight: DType, fuse: bool| -> tboost_engine::Result<(Graph, String, Vec<String>)> {
        let up_w = |seed: u32, rows: usize, cols: usize| -> tboost_engine::Result<TensorRef> {
            let v = vals(rows * cols, seed);
            if weight == DType::F32 {
                be.upload_weight(DType::F32, &[rows, cols], bytes(&v))
            } else {
                let mut b = vec![];
                for r in v.chunks(cols) {
                    b.extend(tboost_kernels::gemm::quant::quantize_row_reference(weight, r).expect("quantize"));
                }
                be.upload_weight(weight, &[rows, cols], b)
            }
        };
        let (wg, wu) = (up_w(11, INTER, HID)?, up_w(12, INTER, HID)?);
        let wd = be.upload_weight(DType::F32, &[HID, INTER], bytes(&vals(HID * INTER, 13)))?;
        let mm = |weight, n, k| MatMulParams {
            weight,
            n,
            k,
            bias: false,
            precision: tboost_engine::backend::Precision::Exact,
            act: DType::F32,
            tiling: Default::default(),
        };
        let mut g = GraphBuilder::new();
        g.input("x", DType::F32, &[ROWS, HID]).constant("wg", wg).constant("wu", wu).constant("wd", wd);
        g.op("gate", OpParams::MatMul(mm(weight, INTER, HID)), &["x", "wg"], &["g"]);
        g.op("up", OpParams::MatMul(mm(weight, INTER, HID)), &["x", "wu"], &["u"]);
        g.op("act", OpParams::SwiGlu { act: DType::F32 }, &["g", "u"], &["a"]);
        g.op("down", OpParams::MatMul(mm(DType::F32, HID, INTER)), &["a", "wd"], &["y"]);
        g.output("y").fusion(fuse);
        let graph = g.build(&be)?;
        let (f, n) = (graph.fusions(), graph.node_names().iter().map(|s| s.to_string()).collect());
        Ok((graph, f, n))
    };
    let x = vals(ROWS * HID, 21);
    let run = |g: &Graph| -> Vec<u32> {
        let xi = be.alloc(DType::F32, &[ROWS, HID]).unwrap();
        let y = be.alloc(DType::F32, &[ROWS, HID]).unwrap();
        be.write_f32(&xi, &x).unwrap();
        g.run(&[xi], std::slice::from_ref(&y)).unwrap();
        be.read_f32(&y).unwrap().iter().map(|v| v.to_bits()).collect()
    };
    for weight in [DType::F32, DType::Q8_0] {
        let (fused, report, names) = mlp(weight, true).expect("fused graph");
        let (unfused, none, _) = mlp(weight, false).expect("unfused graph");
        assert!(report.contains("'gate' (matmul) + 'up' (matmul) + 'act' (swiglu)"), "{weight}: {report}");
        assert_eq!(names, ["gate+up+act", "down"], "{weight}");
        assert_eq!(none, "");
        let (yf, yu) = (run(&fused), run(&unfused));
        assert_eq!(yf, yu, "{weight}: fusion changed a bit");
        if weight == DType::F32 {
            let (wg, wu, wd) = (vals(INTER * HID, 11), vals(INTER * HID, 12), vals(HID * INTER, 13));
            for r in 0..ROWS {
                let xr = &x[r * HID..(r + 1) * HID];
                let dot = |w: &[f32], j: usize| (0..HID).map(|i| w[j * HID + i] as f64 * xr[i] as f64).sum::<f64>();
                let a: Vec<f64> =
                    (0..INTER).map(|j| dot(&wg, j) / (1.0 + (-dot(&wg, j)).exp()) * dot(&wu, j)).collect();
                for o in 0..HID {
                    let want: f64 = (0..INTER).map(|j| a[j] * wd[o * INTER + j] as f64).sum();
                    let got = f32::from_bits(yf[r * HID + o]) as f64;
                    assert!((got - want).abs() < 1e-4 * (1.0 + want.abs()), "y[{r},{o}]: {got} vs {want}");
                }
            }
        }
    }
}
