//! Custom graphs: operations (and host callbacks) wired by named tensors, validated and
//! allocated once by [`GraphBuilder::build`], then [`Graph::run`] as often as wanted.
//!
//! ```no_run
//! use tboost_engine::backend::{BackendKind, BackendSpec, DType};
//! use tboost_engine::op_api::{GraphBuilder, NormParams, OpBackend, OpParams};
//! # fn main() -> tboost_engine::Result<()> {
//! let be = OpBackend::open(BackendSpec { kind: BackendKind::Cpu, threads: 2 })?;
//! let gain = be.upload_weight(DType::F32, &[4], [1f32; 4].iter().flat_map(|v| v.to_le_bytes()).collect())?;
//! let norm = NormParams { dim: 4, eps: 1e-6, gain: DType::F32, act: DType::F32 };
//! let mut g = GraphBuilder::new();
//! g.input("x", DType::F32, &[2, 4]).input("r", DType::F32, &[2, 4]).constant("gain", gain);
//! g.add("residual", DType::F32, "x", "r", "h");
//! g.op("norm", OpParams::RmsNorm(norm), &["h", "gain"], &["y"]);
//! g.output("h").output("y");
//! let graph = g.build(&be)?; // fuses add + rmsnorm into one add_rmsnorm
//! assert!(graph.fusions().contains("add_rmsnorm"));
//! # Ok(()) }
//! ```
//!
//! Nodes are an [`OpParams`] each (the same ops as [`super::Operation`], except the in-place
//! `Rope` and `AddRmsNorm`), an elementwise `add`, or a host callback on f32 values with
//! declared output shapes. `build` checks every name, dtype and shape between producer and
//! consumer, orders the nodes (a cycle is an error), refuses outputs nobody reads, asks the
//! backend whether it runs each op, applies the fusions (unless [`GraphBuilder::fusion`] turned
//! them off) and allocates the intermediates.
//!
//! Fusions: an `add` whose result is normalized by an `RmsNorm` runs as one `AddRmsNorm` (the
//! plan's residual fusion; the CPU kernels give the same bits either way). The gate/up matmul +
//! SwiGLU pattern (two bias-free matmuls of one input feeding a swiglu, their outputs read by
//! nothing else) becomes one `matmul_swiglu` node when the backend takes it.

use std::collections::HashMap;

use super::{MatMulParams, OpBackend, OpParams, Operation, TensorRef};
use crate::backend::{DType, Op, OpQuery};
use crate::{Error, Result};

/// A host callback: the input tensors' values (f32, row-major), the outputs to fill (each
/// already sized to its declared shape). An `Err` is the node's error.
pub type Callback = dyn Fn(&[&[f32]], &mut [Vec<f32>]) -> std::result::Result<(), String> + Send + Sync;

enum Kind {
    Op(OpParams),
    Add { act: DType },
    Callback { f: Box<Callback>, shapes: Vec<Vec<usize>> },
}

struct NodeDesc {
    name: String,
    kind: Kind,
    inputs: Vec<String>,
    outputs: Vec<String>,
}

/// Where a tensor comes from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Source {
    Input(usize),
    Constant,
    Node(usize),
}

#[derive(Clone)]
struct Meta {
    dtype: DType,
    shape: Vec<usize>,
    source: Source,
}

/// Collects nodes, inputs, constants and outputs; [`GraphBuilder::build`] checks them.
pub struct GraphBuilder {
    nodes: Vec<NodeDesc>,
    inputs: Vec<(String, DType, Vec<usize>)>,
    constants: Vec<(String, TensorRef)>,
    outputs: Vec<String>,
    fuse: bool,
}

impl Default for GraphBuilder {
    fn default() -> Self {
        Self::new()
    }
}

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

impl GraphBuilder {
    pub fn new() -> GraphBuilder {
        GraphBuilder { nodes: vec![], inputs: vec![], constants: vec![], outputs: vec![], fuse: true }
    }

    /// A graph input: a tensor the caller passes to `run` (in declaration order).
    pub fn input(&mut self, name: &str, dtype: DType, shape: &[usize]) -> &mut Self {
        self.inputs.push((name.to_string(), dtype, shape.to_vec()));
        self
    }

    /// A tensor bound at build time (weights: matmul weights, norm gains, tables; or buffers).
    pub fn constant(&mut self, name: &str, t: TensorRef) -> &mut Self {
        self.constants.push((name.to_string(), t));
        self
    }

    /// A graph output: a tensor the caller passes to `run` (in declaration order), written
    /// by the node that produces it.
    pub fn output(&mut self, name: &str) -> &mut Self {
        self.outputs.push(name.to_string());
        self
    }

    /// An operation node; inputs and outputs in the op's order (see the op table).
    pub fn op(&mut self, node: &str, params: OpParams, inputs: &[&str], outputs: &[&str]) -> &mut Self {
        self.nodes.push(NodeDesc {
            name: node.into(),
            kind: Kind::Op(params),
            inputs: names(inputs),
            outputs: names(outputs),
        });
        self
    }

    /// `out = a + b`, elementwise, same shape and dtype `act`.
    pub fn add(&mut self, node: &str, act: DType, a: &str, b: &str, out: &str) -> &mut Self {
        self.nodes.push(NodeDesc {
            name: node.into(),
            kind: Kind::Add { act },
            inputs: names(&[a, b]),
            outputs: names(&[out]),
        });
        self
    }

    /// A host callback on f32 tensors; `outputs` are `(name, shape)`.
    pub fn callback(
        &mut self,
        node: &str,
        inputs: &[&str],
        outputs: &[(&str, &[usize])],
        f: Box<Callback>,
    ) -> &mut Self {
        self.nodes.push(NodeDesc {
            name: node.into(),
            kind: Kind::Callback { f, shapes: outputs.iter().map(|(_, s)| s.to_vec()).collect() },
            inputs: names(inputs),
            outputs: outputs.iter().map(|(n, _)| n.to_string()).collect(),
        });
        self
    }

    /// Whether `build` applies the fusions (default on).
    pub fn fusion(&mut self, on: bool) -> &mut Self {
        self.fuse = on;
        self
    }

    /// Validates the graph, orders and fuses its nodes, creates its operations and allocates
    /// its intermediates on `be`.
    pub fn build(self, be: &OpBackend) -> Result<Graph> {
        let GraphBuilder { nodes, inputs, constants, outputs, fuse } = self;
        let err = |what: String, msg: String| Err(Error::invalid(format!("graph.{what}"), msg));
        let mut meta: HashMap<String, Meta> = HashMap::new();
        let claim = |meta: &mut HashMap<String, Meta>, name: &str, m: Meta, by: &str| -> Result<()> {
            if name.is_empty() {
                return Err(Error::invalid(format!("graph.{by}"), "a tensor name is empty"));
            }
            if let Some(old) = meta.get(name) {
                let first = match old.source {
                    Source::Input(_) => "a graph input".to_string(),
                    Source::Constant => "a constant".to_string(),
                    Source::Node(i) => format!("node '{}'", nodes[i].name),
                };
                return Err(Error::invalid(
                    format!("graph.{by}"),
                    format!("tensor '{name}' is already defined by {first}"),
                ));
            }
            meta.insert(name.to_string(), m);
            Ok(())
        };
        for (i, (n, dtype, shape)) in inputs.iter().enumerate() {
            claim(&mut meta, n, Meta { dtype: *dtype, shape: shape.clone(), source: Source::Input(i) }, "inputs")?;
        }
        for (n, t) in &constants {
            claim(
                &mut meta,
                n,
                Meta { dtype: t.dtype, shape: t.shape.clone(), source: Source::Constant },
                "constants",
            )?;
        }
        // Producers first (shapes come later, in order).
        let mut producer: HashMap<&str, usize> = HashMap::new();
        for (i, n) in nodes.iter().enumerate() {
            if n.name.is_empty() || nodes[..i].iter().any(|o| o.name == n.name) {
                return err(format!("node {i}"), format!("node name '{}' is empty or used twice", n.name));
            }
            if let Kind::Op(p @ (OpParams::Rope(_) | OpParams::AddRmsNorm(_))) = &n.kind {
                return err(
                    n.name.clone(),
                    format!(
                        "{} works in place and is not a graph node (write add + rmsnorm: the graph fuses them)",
                        p.name()
                    ),
                );
            }
            for o in &n.outputs {
                if meta.contains_key(o.as_str()) {
                    return err(n.name.clone(), format!("output '{o}' is already a graph input or constant"));
                }
                if let Some(&j) = producer.get(o.as_str()) {
                    return err(
                        n.name.clone(),
                        format!("output '{o}' is already produced by node '{}'", nodes[j].name),
                    );
                }
                producer.insert(o.as_str(), i);
            }
        }
        // Order (Kahn); unknown names first.
        let mut indeg = vec![0usize; nodes.len()];
        let mut users: Vec<Vec<usize>> = vec![vec![]; nodes.len()];
        for (i, n) in nodes.iter().enumerate() {
            for t in &n.inputs {
                if let Some(&p) = producer.get(t.as_str()) {
                    indeg[i] += 1;
                    users[p].push(i);
                } else if !meta.contains_key(t.as_str()) {
                    return err(
                        n.name.clone(),
                        format!("input '{t}' is unknown (no graph input, constant or node output of that name)"),
                    );
                }
            }
        }
        let mut order = vec![];
        let mut ready: Vec<usize> = (0..nodes.len()).filter(|&i| indeg[i] == 0).rev().collect();
        while let Some(i) = ready.pop() {
            order.push(i);
            for &u in users[i].iter().rev() {
                indeg[u] -= 1;
                if indeg[u] == 0 {
                    ready.push(u);
                }
            }
        }
        if order.len() != nodes.len() {
            let i = (0..nodes.len()).find(|&i| indeg[i] > 0).unwrap_or(0);
            let t = nodes[i]
                .inputs
                .iter()
                .find(|t| producer.get(t.as_str()).is_some_and(|&p| indeg[p] > 0))
                .cloned()
                .unwrap_or_default();
            return err(nodes[i].name.clone(), format!("is on a cycle (through its input '{t}')"));
        }
        // Shapes in order.
        for &i in &order {
            let n = &nodes[i];
            let ins: Vec<&Meta> = n.inputs.iter().filter_map(|t| meta.get(t.as_str())).collect();
            let outs = infer(n, &ins)?;
            if outs.len() != n.outputs.len() {
                return err(n.name.clone(), format!("names {} outputs; the node has {}", n.outputs.len(), outs.len()));
            }
            for (o, (dtype, shape)) in n.outputs.iter().zip(outs) {
                meta.insert(o.clone(), Meta { dtype, shape, source: Source::Node(i) });
            }
        }
        // Outputs: known, node-produced, and every node output read by someone.
        for o in &outputs {
            match meta.get(o.as_str()).map(|m| m.source) {
                Some(Source::Node(_)) => {}
                Some(_) => {
                    return err("outputs".into(), format!("'{o}' is a graph input or constant, not a node output"))
                }
                None => return err("outputs".into(), format!("'{o}' is unknown (no node produces it)")),
            }
            if outputs.iter().filter(|x| *x == o).count() > 1 {
                return err("outputs".into(), format!("'{o}' is declared twice"));
            }
        }
        for n in &nodes {
            for o in &n.outputs {
                let read = nodes.iter().any(|m| m.inputs.contains(o)) || outputs.contains(o);
                if !read {
                    return err(
                        n.name.clone(),
                        format!("output '{o}' is unused (no node reads it and it is no graph output)"),
                    );
                }
            }
        }
        for (n, ..) in &inputs {
            if !nodes.iter().any(|m| m.inputs.contains(n)) {
                return err("inputs".into(), format!("'{n}' is unused (no node reads it)"));
            }
        }

        // Fusion: add (a, b -> h) then rmsnorm (h, gain -> y) => add_rmsnorm at the add.
        let mut fused_into: HashMap<usize, usize> = HashMap::new(); // add node -> norm node
        let mut report = vec![];
        if fuse {
            for &i in &order {
                let Kind::Add { act } = nodes[i].kind else { continue };
                let h = &nodes[i].outputs[0];
                let norm = order.iter().copied().find(|&j| {
                    matches!(nodes[j].kind, Kind::Op(OpParams::RmsNorm(p)) if p.act == act)
                        && nodes[j].inputs.first() == Some(h)
                        && !fused_into.values().any(|&k| k == j)
                        && meta.get(nodes[j].inputs[1].as_str()).is_some_and(|m| m.source == Source::Constant)
                });
                if let Some(j) = norm {
                    fused_into.insert(i, j);
                    report.push(format!(
                        "add_rmsnorm: nodes '{}' (add) + '{}' (rmsnorm) on '{h}' -> one add_rmsnorm",
                        nodes[i].name, nodes[j].name
                    ));
                }
            }
        }
        // Fusion: matmul (x, gate -> g) and matmul (x, up -> u) feeding swiglu (g, u -> y) =>
        // one matmul_swiglu at the swiglu, when g and u are read by nothing else and the
        // backend takes the fused case (the CPU kernel gives the same bits either way).
        let mut gate_up: HashMap<usize, (usize, usize)> = HashMap::new(); // swiglu -> (gate mm, up mm)
        if fuse {
            let mm_of = |t: &str| -> Option<(usize, MatMulParams)> {
                match meta.get(t).map(|m| m.source) {
                    Some(Source::Node(k)) => match nodes[k].kind {
                        Kind::Op(OpParams::MatMul(p)) if !p.bias => Some((k, p)),
                        _ => None,
                    },
                    _ => None,
                }
            };
            let read_once = |t: &str| {
                !outputs.iter().any(|o| o == t) && nodes.iter().filter(|m| m.inputs.iter().any(|i| i == t)).count() == 1
            };
            for &i in &order {
                let Kind::Op(OpParams::SwiGlu { act }) = nodes[i].kind else { continue };
                let (g, u) = (&nodes[i].inputs[0], &nodes[i].inputs[1]);
                let (Some((gi, gp)), Some((ui, up))) = (mm_of(g), mm_of(u)) else { continue };
                let fusable = gi != ui
                    && gp == up
                    && gp.act == act
                    && nodes[gi].inputs[0] == nodes[ui].inputs[0]
                    && read_once(g)
                    && read_once(u)
                    && Operation::new(be, OpParams::MatMulSwiGlu(gp)).is_ok_and(|op| op.supports().is_ok());
                if fusable {
                    gate_up.insert(i, (gi, ui));
                    report.push(format!(
                        "matmul_swiglu: nodes '{}' (matmul) + '{}' (matmul) + '{}' (swiglu) on '{}' -> one matmul_swiglu",
                        nodes[gi].name, nodes[ui].name, nodes[i].name, nodes[gi].inputs[0]
                    ));
                }
            }
        }
        let mut skipped: Vec<usize> = fused_into.values().copied().collect();
        skipped.extend(gate_up.values().flat_map(|&(g, u)| [g, u]));

        // Steps, operations, intermediates.
        let mut steps = vec![];
        let mut nodes: Vec<Option<NodeDesc>> = nodes.into_iter().map(Some).collect();
        for &i in &order {
            if skipped.contains(&i) {
                continue;
            }
            let Some(n) = nodes[i].take() else { continue };
            if let Some(&(gi, ui)) = gate_up.get(&i) {
                let (Some(g), Some(u)) = (nodes[gi].take(), nodes[ui].take()) else {
                    return err(n.name.clone(), "fusion lost its matmuls".into());
                };
                let Kind::Op(OpParams::MatMul(p)) = g.kind else {
                    return err(n.name.clone(), "fusion lost its gate matmul".into());
                };
                let op = Operation::new(be, OpParams::MatMulSwiGlu(p))?;
                let name = format!("{}+{}+{}", g.name, u.name, n.name);
                let inputs = vec![g.inputs[0].clone(), g.inputs[1].clone(), u.inputs[1].clone()];
                steps.push((name, inputs, n.outputs.clone(), Step::Op { op }));
                continue;
            }
            let step = match n.kind {
                Kind::Op(p) => {
                    let op = Operation::new(be, p)
                        .map_err(|e| Error::invalid(format!("graph.{}", n.name), e.to_string()))?;
                    op.supports()
                        .map_err(|why| Error::Unsupported(format!("graph.{} ({}): {why}", n.name, p.name())))?;
                    Step::Op { op }
                }
                Kind::Add { act } => {
                    be.lock()?
                        .supports(&OpQuery::Add { act })
                        .map_err(|why| Error::Unsupported(format!("graph.{} (add): {why}", n.name)))?;
                    match fused_into.get(&i) {
                        Some(&j) => {
                            let Some(norm) = nodes[j].take() else {
                                return err(n.name.clone(), "fusion lost its rmsnorm".into());
                            };
                            let Kind::Op(OpParams::RmsNorm(p)) = norm.kind else {
                                return err(n.name.clone(), "fusion lost its rmsnorm".into());
                            };
                            let op = Operation::new(be, OpParams::AddRmsNorm(p))?;
                            op.supports().map_err(|why| {
                                Error::Unsupported(format!("graph.{} (add_rmsnorm): {why}", norm.name))
                            })?;
                            let io = NodeDesc {
                                name: format!("{}+{}", n.name, norm.name),
                                kind: Kind::Add { act },
                                inputs: vec![n.inputs[0].clone(), n.inputs[1].clone(), norm.inputs[1].clone()],
                                outputs: vec![n.outputs[0].clone(), norm.outputs[0].clone()],
                            };
                            steps.push((io.name, io.inputs, io.outputs, Step::AddRmsNorm { op }));
                            continue;
                        }
                        None => Step::Add,
                    }
                }
                Kind::Callback { f, shapes } => Step::Callback { f, shapes },
            };
            steps.push((n.name, n.inputs, n.outputs, step));
        }
        let mut tensors: HashMap<String, TensorRef> = constants.into_iter().collect();
        let mut owned = vec![];
        for (_, _, outs, _) in &steps {
            for o in outs {
                if outputs.contains(o) {
                    continue;
                }
                let m = &meta[o.as_str()];
                let t = be.alloc(m.dtype, &m.shape)?;
                owned.push(t.clone());
                tensors.insert(o.clone(), t);
            }
        }
        let steps =
            steps.into_iter().map(|(name, inputs, outputs, step)| Node { name, inputs, outputs, step }).collect();
        let ins = inputs;
        let outs = outputs
            .into_iter()
            .map(|o| {
                let m = &meta[o.as_str()];
                (o.clone(), m.dtype, m.shape.clone())
            })
            .collect();
        Ok(Graph { be: be.clone(), steps, inputs: ins, outputs: outs, tensors, owned, fusions: report })
    }
}

/// Output dtypes and shapes of a node from its inputs', checking what the node expects.
fn infer(n: &NodeDesc, ins: &[&Meta]) -> Result<Vec<(DType, Vec<usize>)>> {
    let node = &n.name;
    let expect = |i: usize, what: &str, dtype: Option<DType>, shape: &[Option<usize>]| -> Result<()> {
        let Some(m) = ins.get(i) else {
            return Err(Error::invalid(format!("graph.{node}"), format!("input {what} (#{i}) is missing")));
        };
        let ok_shape =
            m.shape.len() == shape.len() && m.shape.iter().zip(shape).all(|(&d, w)| w.is_none_or(|w| w == d));
        if !ok_shape || dtype.is_some_and(|d| d != m.dtype) {
            let text: Vec<String> = shape.iter().map(|w| w.map_or("*".to_string(), |w| w.to_string())).collect();
            let want = dtype.map_or("any dtype".to_string(), |d| d.to_string());
            return Err(Error::invalid(
                format!("graph.{node}"),
                format!(
                    "input {what} '{}' is {} {:?}; the node expects {want} [{}]",
                    n.inputs[i],
                    m.dtype,
                    m.shape,
                    text.join(", ")
                ),
            ));
        }
        Ok(())
    };
    let count = |want: usize| -> Result<()> {
        if n.inputs.len() != want {
            return Err(Error::invalid(
                format!("graph.{node}"),
                format!("names {} inputs; the node takes {want}", n.inputs.len()),
            ));
        }
        Ok(())
    };
    Ok(match &n.kind {
        Kind::Add { act } => {
            count(2)?;
            expect(0, "a", Some(*act), &ins[0].shape.iter().map(|&d| Some(d)).collect::<Vec<_>>())?;
            let same: Vec<Option<usize>> = ins[0].shape.iter().map(|&d| Some(d)).collect();
            expect(1, "b", Some(*act), &same)?;
            vec![(*act, ins[0].shape.clone())]
        }
        Kind::Callback { shapes, .. } => {
            for (i, m) in ins.iter().enumerate() {
                let any: Vec<Option<usize>> = m.shape.iter().map(|_| None).collect();
                expect(i, "value", Some(DType::F32), &any)?;
            }
            shapes.iter().map(|s| (DType::F32, s.clone())).collect()
        }
        Kind::Op(p) => match *p {
            OpParams::MatMul(p) => {
                count(if p.bias { 3 } else { 2 })?;
                expect(0, "x", Some(p.act), &[None, Some(p.k)])?;
                expect(1, "weight", Some(p.weight), &[Some(p.n), Some(p.k)])?;
                if p.bias {
                    expect(2, "bias", None, &[Some(p.n)])?;
                }
                vec![(p.act, vec![ins[0].shape[0], p.n])]
            }
            OpParams::MatMulSwiGlu(p) => {
                count(3)?;
                expect(0, "x", Some(p.act), &[None, Some(p.k)])?;
                expect(1, "gate", Some(p.weight), &[Some(p.n), Some(p.k)])?;
                expect(2, "up", Some(p.weight), &[Some(p.n), Some(p.k)])?;
                vec![(p.act, vec![ins[0].shape[0], p.n])]
            }
            OpParams::RmsNorm(p) => {
                count(2)?;
                expect(0, "x", Some(p.act), &[None, Some(p.dim)])?;
                expect(1, "gain", Some(p.gain), &[Some(p.dim)])?;
                vec![(p.act, ins[0].shape.clone())]
            }
            OpParams::SwiGlu { act } => {
                count(2)?;
                expect(0, "gate", Some(act), &[None, None])?;
                let same: Vec<Option<usize>> = ins[0].shape.iter().map(|&d| Some(d)).collect();
                expect(1, "up", Some(act), &same)?;
                vec![(act, ins[0].shape.clone())]
            }
            OpParams::Embed(p) => {
                count(2)?;
                expect(0, "ids", Some(DType::U32), &[None])?;
                expect(1, "table", Some(p.table), &[Some(p.vocab), Some(p.hidden)])?;
                vec![(p.act, vec![ins[0].shape[0], p.hidden])]
            }
            OpParams::Attention(p) => {
                count(5)?;
                let w = p.heads * p.head_dim;
                expect(0, "q", Some(p.act), &[None, Some(w)])?;
                let pool = [None, Some(p.block_size), Some(p.kv_heads), Some(p.head_dim)];
                expect(1, "k_cache", Some(p.kv_dtype), &pool)?;
                expect(2, "v_cache", Some(p.kv_dtype), &pool)?;
                expect(3, "seqs", Some(DType::U32), &[None, Some(3)])?;
                expect(4, "block_tables", Some(DType::U32), &[None, None])?;
                vec![(p.act, vec![ins[0].shape[0], w])]
            }
            OpParams::MoeRoute(p) => {
                count(1)?;
                expect(0, "logits", Some(p.act), &[None, Some(p.experts)])?;
                let m = ins[0].shape[0];
                vec![(DType::U32, vec![m, p.top_k]), (p.act, vec![m, p.top_k])]
            }
            OpParams::MoeGrouped(p) => {
                count(3 + 3 * p.experts)?;
                expect(0, "x", Some(p.act), &[None, Some(p.hidden)])?;
                let m = ins[0].shape[0];
                expect(1, "ids", Some(DType::U32), &[Some(m), Some(p.top_k)])?;
                expect(2, "weights", Some(p.act), &[Some(m), Some(p.top_k)])?;
                vec![(p.act, vec![m, p.hidden])]
            }
            OpParams::Rope(_) | OpParams::AddRmsNorm(_) => {
                return Err(Error::invalid(format!("graph.{node}"), "in-place ops are not graph nodes"))
            }
        },
    })
}

enum Step {
    Op {
        op: Operation,
    },
    Add,
    /// `h = a; h += b` then `y = rmsnorm(h)` in one op: inputs `a, b, gain`, outputs `h, y`.
    AddRmsNorm {
        op: Operation,
    },
    Callback {
        f: Box<Callback>,
        shapes: Vec<Vec<usize>>,
    },
}

struct Node {
    name: String,
    inputs: Vec<String>,
    outputs: Vec<String>,
    step: Step,
}

/// A built graph: its nodes in execution order, its operations and intermediates.
pub struct Graph {
    be: OpBackend,
    steps: Vec<Node>,
    inputs: Vec<(String, DType, Vec<usize>)>,
    outputs: Vec<(String, DType, Vec<usize>)>,
    /// Constants and intermediates by name.
    tensors: HashMap<String, TensorRef>,
    owned: Vec<TensorRef>,
    fusions: Vec<String>,
}

impl Graph {
    /// The fusions `build` applied, one a line (empty: none).
    pub fn fusions(&self) -> String {
        self.fusions.join("\n")
    }

    /// The nodes in execution order (fused nodes are named `add+norm`).
    pub fn node_names(&self) -> Vec<&str> {
        self.steps.iter().map(|s| s.name.as_str()).collect()
    }

    /// Declared inputs `(name, dtype, shape)` in `run` order.
    pub fn inputs(&self) -> &[(String, DType, Vec<usize>)] {
        &self.inputs
    }

    /// Declared outputs `(name, dtype, shape)` in `run` order.
    pub fn outputs(&self) -> &[(String, DType, Vec<usize>)] {
        &self.outputs
    }

    /// Runs the nodes in order. `inputs` / `outputs`: one tensor per declared input / output,
    /// of the declared dtype and shape. Work is enqueued on the backend's stream (a callback
    /// node waits for its inputs); `read_f32` or `synchronize` waits for the end.
    pub fn run(&self, inputs: &[TensorRef], outputs: &[TensorRef]) -> Result<()> {
        let mut map: HashMap<&str, &TensorRef> = self.tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        for (what, decl, given) in [("inputs", &self.inputs, inputs), ("outputs", &self.outputs, outputs)] {
            if decl.len() != given.len() {
                return Err(Error::invalid(
                    format!("graph.run.{what}"),
                    format!("got {} tensors, the graph declares {}", given.len(), decl.len()),
                ));
            }
            for ((n, d, s), t) in decl.iter().zip(given) {
                if t.dtype != *d || t.shape != *s {
                    return Err(Error::invalid(
                        format!("graph.run.{n}"),
                        format!("{} {:?}: the graph declares {d} {s:?}", t.dtype, t.shape),
                    ));
                }
                map.insert(n.as_str(), t);
            }
        }
        let get = |n: &str| -> Result<TensorRef> {
            map.get(n)
                .map(|t| (*t).clone())
                .ok_or_else(|| Error::invalid("graph.run", format!("tensor '{n}' is unbound")))
        };
        for node in &self.steps {
            let ins = node.inputs.iter().map(|n| get(n)).collect::<Result<Vec<_>>>()?;
            let mut outs = node.outputs.iter().map(|n| get(n)).collect::<Result<Vec<_>>>()?;
            let named = |e: Error| match e {
                Error::InvalidArgument { param, msg } => {
                    Error::InvalidArgument { param: format!("graph.{}: {param}", node.name), msg }
                }
                e => e,
            };
            match &node.step {
                Step::Op { op } => op.execute(&ins, &mut outs, None).map_err(named)?,
                Step::Add => self.add_into(&outs[0], &ins[0], Some(&ins[1])).map_err(named)?,
                Step::AddRmsNorm { op } => {
                    self.add_into(&outs[0], &ins[0], None).map_err(named)?;
                    op.execute(&[ins[1].clone(), ins[2].clone()], &mut outs, None).map_err(named)?
                }
                Step::Callback { f, shapes } => {
                    let values = ins.iter().map(|t| self.be.read_f32(t)).collect::<Result<Vec<_>>>()?;
                    let slices: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
                    let mut res: Vec<Vec<f32>> = shapes.iter().map(|s| vec![0f32; s.iter().product()]).collect();
                    f(&slices, &mut res).map_err(|msg| {
                        Error::invalid(format!("graph.{}", node.name), format!("callback failed: {msg}"))
                    })?;
                    for (i, (v, t)) in res.iter().zip(&outs).enumerate() {
                        let want: usize = shapes[i].iter().product();
                        if v.len() != want {
                            return Err(Error::invalid(
                                format!("graph.{}", node.name),
                                format!(
                                    "callback left output '{}' with {} values, its shape holds {want}",
                                    node.outputs[i],
                                    v.len()
                                ),
                            ));
                        }
                        self.be.write_f32(t, v)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// `dst = a (+ b)` on the backend's stream.
    fn add_into(&self, dst: &TensorRef, a: &TensorRef, b: Option<&TensorRef>) -> Result<()> {
        let mut be = self.be.lock()?;
        let d = OpBackend::view_of(be.as_ref(), dst, "add.out")?;
        let av = OpBackend::view_of(be.as_ref(), a, "add.a")?;
        be.launch(&Op::Zero { dst: d })?;
        be.launch(&Op::Add { dst: d, src: av })?;
        if let Some(b) = b {
            let bv = OpBackend::view_of(be.as_ref(), b, "add.b")?;
            be.launch(&Op::Add { dst: d, src: bv })?;
        }
        Ok(())
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.be.synchronize();
        for t in &self.owned {
            let _ = self.be.free(t);
        }
    }
}
