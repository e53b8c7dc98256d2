//! Custom graphs over the C ABI (`::tboost_engine::op_api::GraphBuilder`): operations (from
//! `tboost_op_create`), residual adds and C callbacks on host f32 buffers, wired by tensor
//! names; built once, run many times.

use std::os::raw::{c_char, c_void};
use std::sync::{Arc, Mutex};

use super::guard::guard;
use super::handle::Registry;
use super::op::{
    dims, dtype_of, read_tensor, tboost_backend, tboost_op, tensor_of, tensors, BackendInner, BufferInner, BACKENDS,
    OPS,
};
use super::status::{tboost_status, Failure, FfiResult};
use super::util::{read_cstr, read_slice, require, write_out, write_str};
use ::tboost_engine::op_api::{Graph, GraphBuilder};
use ::tboost_engine::Error;

/// A graph on a backend (`tboost_graph_create`): nodes are added, then `tboost_graph_build`
/// validates it, after which only `tboost_graph_run`, `tboost_graph_fusions` and
/// `tboost_graph_free` apply. Calls on one graph are serialized.
pub struct tboost_graph {
    _opaque: [u8; 0],
}

/// A callback node: `inputs[i]` holds `input_lens[i]` f32 values (row-major) of the node's
/// i-th input; fill `outputs[j]` (`output_lens[j]` values, zeroed). Return 0 on success;
/// any other value makes `tboost_graph_run` fail with `TBOOST_ERR_INVALID_ARGUMENT` naming
/// the node and the value. Called on the thread that called `tboost_graph_run`.
pub type tboost_graph_callback = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        inputs: *const *const f32,
        input_lens: *const usize,
        n_inputs: usize,
        outputs: *const *mut f32,
        output_lens: *const usize,
        n_outputs: usize,
    ) -> i32,
>;

enum State {
    Building(GraphBuilder),
    Built(Graph),
    /// A failed build consumed the builder.
    Broken,
}

pub(crate) struct GraphInner {
    backend: Arc<BackendInner>,
    state: Mutex<(State, usize)>,
    /// Constants' buffers, kept alive while the graph names them.
    keep: Mutex<Vec<Arc<BufferInner>>>,
}

static GRAPHS: Registry<GraphInner> = Registry::new("graph");

/// The host's user data, handed back to its callback (the host promises it may be used from
/// the thread that runs the graph).
struct UserData(*mut c_void);
// SAFETY: the pointer is only passed back to the host's callback; the host's contract.
unsafe impl Send for UserData {}
// SAFETY: as above.
unsafe impl Sync for UserData {}

unsafe fn names<'a>(p: *const *const c_char, n: usize, what: &str) -> FfiResult<Vec<&'a str>> {
    // SAFETY: `n` readable pointers per the contract.
    let raw = unsafe { read_slice(p, n, what) }?;
    raw.iter()
        .enumerate()
        // SAFETY: each NUL-terminated per the contract.
        .map(|(i, &s)| unsafe { read_cstr(s, &format!("{what}[{i}]")) })
        .collect()
}

/// Runs `f` on the builder; `node`: the call adds a node (numbered from 1 in names).
fn with_builder<T>(
    g: &GraphInner,
    node: bool,
    f: impl FnOnce(&mut GraphBuilder, usize) -> FfiResult<T>,
) -> FfiResult<T> {
    let mut st = g.state.lock().map_err(|_| Failure::from(Error::Poisoned))?;
    let (state, count) = &mut *st;
    if node {
        *count += 1;
    }
    match state {
        State::Building(b) => f(b, *count),
        _ => {
            Err(Failure::invalid("the graph is already built (nodes and tensors are added before tboost_graph_build)"))
        }
    }
}

/// Creates an empty graph on `backend`; free it with `tboost_graph_free`.
#[no_mangle]
pub unsafe extern "C" fn tboost_graph_create(
    backend: *mut tboost_backend,
    out: *mut *mut tboost_graph,
) -> tboost_status {
    guard("tboost_graph_create", |_| {
        require(out, "out")?;
        let b = BACKENDS.get(backend, "backend")?;
        let inner = GraphInner {
            backend: b,
            state: Mutex::new((State::Building(GraphBuilder::new()), 0)),
            keep: Mutex::new(vec![]),
        };
        // SAFETY: checked non-null above.
        unsafe { write_out(out, GRAPHS.insert(Arc::new(inner))) };
        Ok(())
    })
}

/// Declares a graph input `name` of `dtype` and `ndim` sizes: `tboost_graph_run` takes one
/// tensor per input, in declaration order.
#[no_mangle]
pub unsafe extern "C" fn tboost_graph_add_input(
    graph: *mut tboost_graph,
    name: *const c_char,
    dtype: i32,
    shape: *const u64,
    ndim: usize,
) -> tboost_status {
    guard("tboost_graph_add_input", |_| {
        let g = GRAPHS.get(graph, "graph")?;
        // SAFETY: per the contract.
        let name = unsafe { read_cstr(name, "name") }?;
        let dtype = dtype_of(dtype, "dtype")?;
        // SAFETY: `ndim` readable elements per the contract.
        let s = dims(unsafe { read_slice(shape, ndim, "shape") }?, "shape")?;
        with_builder(&g, false, |b, _| {
            b.input(name, dtype, &s);
            Ok(())
        })
    })
}

/// Binds `tensor` (a weight such as a matmul weight or norm gain, or a buffer) to `name` for
/// the graph's lifetime (the graph keeps its buffer alive).
#[no_mangle]
pub unsafe extern "C" fn tboost_graph_add_constant(
    graph: *mut tboost_graph,
    name: *const c_char,
    tensor: *const super::op::tboost_tensor,
) -> tboost_status {
    guard("tboost_graph_add_constant", |_| {
        let g = GRAPHS.get(graph, "graph")?;
        // SAFETY: per the contract.
        let name = unsafe { read_cstr(name, "name") }?;
        // SAFETY: per the contract.
        let t = unsafe { read_tensor(tensor, "tensor") }?;
        let (t, keep) = tensor_of(&t, &g.backend, "tensor")?;
        with_builder(&g, false, |b, _| {
            b.constant(name, t);
            Ok(())
        })?;
        g.keep.lock().map_err(|_| Failure::from(Error::Poisoned))?.push(keep);
        Ok(())
    })
}

/// Declares the graph outputs (node outputs, by name): `tboost_graph_run` takes one tensor
/// per output, in declaration order (each call adds to the outputs declared so far).
#[no_mangle]
pub unsafe extern "C" fn tboost_graph_set_outputs(
    graph: *mut tboost_graph,
    names_: *const *const c_char,
    n: usize,
) -> tboost_status {
    guard("tboost_graph_set_outputs", |_| {
        let g = GRAPHS.get(graph, "graph")?;
        // SAFETY: per the contract.
        let outs = unsafe { names(names_, n, "names") }?;
        with_builder(&g, false, |b, _| {
            for o in outs {
                b.output(o);
            }
            Ok(())
        })
    })
}

/// Adds a node running `op` (its parameters are copied; the op handle may be freed after)
/// on the named tensors, in the op's order. The node is named `<op>#<n>` (n counts the nodes
/// added to this graph from 1) in errors and the fusion report.
#[no_mangle]
pub unsafe extern "C" fn tboost_graph_add_op(
    graph: *mut tboost_graph,
    op: *const tboost_op,
    input_names: *const *const c_char,
    n_inputs: usize,
    output_names: *const *const c_char,
    n_outputs: usize,
) -> tboost_status {
    guard("tboost_graph_add_op", |_| {
        let g = GRAPHS.get(graph, "graph")?;
        let o = OPS.get(op, "op")?;
        if !Arc::ptr_eq(&o.backend, &g.backend) {
            return Err(Failure::invalid("`op` was created on another backend than the graph's"));
        }
        // SAFETY: per the contract.
        let ins = unsafe { names(input_names, n_inputs, "input_names") }?;
        // SAFETY: per the contract.
        let outs = unsafe { names(output_names, n_outputs, "output_names") }?;
        let params = *o.op.params();
        with_builder(&g, true, |b, i| {
            b.op(&format!("{}#{i}", params.name()), params, &ins, &outs);
            Ok(())
        })
    })
}

/// Adds `out = a + b` (elementwise, `dtype`, same shapes), named `add#<n>`. An add whose
/// result feeds an RMSNorm node is fused with it at build (see `tboost_graph_fusions`).
#[no_mangle]
pub unsafe extern "C" fn tboost_graph_add_add(
    graph: *mut tboost_graph,
    dtype: i32,
    a: *const c_char,
    b: *const c_char,
    out: *const c_char,
) -> tboost_status {
    guard("tboost_graph_add_add", |_| {
        let g = GRAPHS.get(graph, "graph")?;
        let dtype = dtype_of(dtype, "dtype")?;
        // SAFETY: per the contract.
        let (a, b_, out) = unsafe { (read_cstr(a, "a")?, read_cstr(b, "b")?, read_cstr(out, "out")?) };
        with_builder(&g, true, |bld, i| {
            bld.add(&format!("add#{i}"), dtype, a, b_, out);
            Ok(())
        })
    })
}

/// Adds a callback node on host f32 values, named `callback#<n>`: inputs by name (f32
/// tensors), outputs by name with their shapes — output j has `output_ndims[j]` sizes, taken
/// in turn from `output_shapes` (all outputs' sizes concatenated). `user_data` is passed back
/// unchanged and must stay valid while the graph lives.
#[no_mangle]
pub unsafe extern "C" fn tboost_graph_add_callback(
    graph: *mut tboost_graph,
    callback: tboost_graph_callback,
    user_data: *mut c_void,
    input_names: *const *const c_char,
    n_inputs: usize,
    output_names: *const *const c_char,
    output_ndims: *const usize,
    output_shapes: *const u64,
    n_outputs: usize,
) -> tboost_status {
    guard("tboost_graph_add_callback", |_| {
        let g = GRAPHS.get(graph, "graph")?;
        let Some(cb) = callback else { return Err(Failure::null("callback")) };
        // SAFETY: per the contract.
        let ins = unsafe { names(input_names, n_inputs, "input_names") }?;
        // SAFETY: per the contract.
        let outs = unsafe { names(output_names, n_outputs, "output_names") }?;
        // SAFETY: `n_outputs` readable elements per the contract.
        let nd = unsafe { read_slice(output_ndims, n_outputs, "output_ndims") }?;
        let total = nd
            .iter()
            .try_fold(0usize, |a, &d| a.checked_add(d))
            .ok_or_else(|| Failure::invalid("`output_ndims` overflow"))?;
        // SAFETY: the sum of `output_ndims` readable elements per the contract.
        let flat = unsafe { read_slice(output_shapes, total, "output_shapes") }?;
        let mut shapes = vec![];
        let mut at = 0;
        for (j, &d) in nd.iter().enumerate() {
            shapes.push(dims(&flat[at..at + d], &format!("output_shapes of output {j}"))?);
            at += d;
        }
        let ud = UserData(user_data);
        let f = move |ins: &[&[f32]], outs: &mut [Vec<f32>]| -> std::result::Result<(), String> {
            let ud = &ud;
            let ip: Vec<*const f32> = ins.iter().map(|s| s.as_ptr()).collect();
            let il: Vec<usize> = ins.iter().map(|s| s.len()).collect();
            let op: Vec<*mut f32> = outs.iter_mut().map(|s| s.as_mut_ptr()).collect();
            let ol: Vec<usize> = outs.iter().map(|s| s.len()).collect();
            // SAFETY: every pointer is valid for its length for the call; the host's callback
            // contract.
            let rc = unsafe { cb(ud.0, ip.as_ptr(), il.as_ptr(), ip.len(), op.as_ptr(), ol.as_ptr(), op.len()) };
            if rc == 0 {
                Ok(())
            } else {
                Err(format!("the callback returned {rc}"))
            }
        };
        with_builder(&g, true, |b, i| {
            let o: Vec<(&str, &[usize])> = outs.iter().zip(&shapes).map(|(n, s)| (*n, s.as_slice())).collect();
            b.callback(&format!("callback#{i}"), &ins, &o, Box::new(f));
            Ok(())
        })
    })
}

/// Whether `tboost_graph_build` fuses (default true).
#[no_mangle]
pub extern "C" fn tboost_graph_set_fusion(graph: *mut tboost_graph, on: bool) -> tboost_status {
    guard("tboost_graph_set_fusion", |_| {
        let g = GRAPHS.get(graph, "graph")?;
        with_builder(&g, false, |b, _| {
            b.fusion(on);
            Ok(())
        })
    })
}

/// Validates the graph (unknown tensor names, dtype/shape mismatches between producer and
/// consumer, cycles, unused outputs: `TBOOST_ERR_INVALID_ARGUMENT` naming the node and the
/// tensor), fuses, and allocates its intermediates. A failed build leaves the graph unusable
/// (free it).
#[no_mangle]
pub extern "C" fn tboost_graph_build(graph: *mut tboost_graph) -> tboost_status {
    guard("tboost_graph_build", |_| {
        let g = GRAPHS.get(graph, "graph")?;
        let mut st = g.state.lock().map_err(|_| Failure::from(Error::Poisoned))?;
        match std::mem::replace(&mut st.0, State::Broken) {
            State::Building(b) => {
                st.0 = State::Built(b.build(&g.backend.be)?);
                Ok(())
            }
            State::Built(x) => {
                st.0 = State::Built(x);
                Err(Failure::invalid("the graph is already built"))
            }
            State::Broken => Err(Failure::invalid("an earlier tboost_graph_build failed; create the graph again")),
        }
    })
}

/// The fusions the build applied, one a line ("" when none), into `buf` (buffer rules as in
/// `tboost_last_error`).
#[no_mangle]
pub unsafe extern "C" fn tboost_graph_fusions(
    graph: *const tboost_graph,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> tboost_status {
    guard("tboost_graph_fusions", |_| {
        let g = GRAPHS.get(graph, "graph")?;
        let st = g.state.lock().map_err(|_| Failure::from(Error::Poisoned))?;
        let State::Built(x) = &st.0 else { return Err(Failure::invalid("the graph is not built")) };
        let text = x.fusions();
        // SAFETY: `cap` writable bytes at `buf` per the contract.
        unsafe { write_str(&text, buf, cap, needed) }
    })
}

/// Runs the built graph: one tensor per declared input and output, of the declared dtype and
/// shape. Work is enqueued on the backend (`tboost_backend_copy` / `_synchronize` waits).
#[no_mangle]
pub unsafe extern "C" fn tboost_graph_run(
    graph: *mut tboost_graph,
    inputs: *const super::op::tboost_tensor,
    n_inputs: usize,
    outputs: *const super::op::tboost_tensor,
    n_outputs: usize,
) -> tboost_status {
    guard("tboost_graph_run", |_| {
        let g = GRAPHS.get(graph, "graph")?;
        // SAFETY: per the contract.
        let (ins, _k1) = unsafe { tensors(inputs, n_inputs, &g.backend, "inputs") }?;
        // SAFETY: per the contract.
        let (outs, _k2) = unsafe { tensors(outputs, n_outputs, &g.backend, "outputs") }?;
        let st = g.state.lock().map_err(|_| Failure::from(Error::Poisoned))?;
        let State::Built(x) = &st.0 else {
            return Err(Failure::invalid("the graph is not built (tboost_graph_build)"));
        };
        x.run(&ins, &outs)?;
        Ok(())
    })
}

/// Frees a graph (its intermediates after queued work). NULL is a no-op.
#[no_mangle]
pub extern "C" fn tboost_graph_free(graph: *mut tboost_graph) -> tboost_status {
    guard("tboost_graph_free", |_| {
        if !graph.is_null() {
            GRAPHS.remove(graph, "graph")?;
        }
        Ok(())
    })
}
