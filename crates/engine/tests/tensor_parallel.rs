//! Tensor parallelism on the CPU with the `local` communicator: the collectives themselves
//! (results, timeouts and ranks that leave, each named in the error), every golden case at
//! tp = 2 and tp = 4 within 1e-4 of tp = 1 on logits, the demo model's greedy ids at tp = 2
//! through the engine, and each rank's resident weight bytes; under `mpirun` (this binary as
//! two ranks over Open MPI) a follower engine's `enqueue` is an error and the leader's ids
//! equal one rank's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tboost_testkit::golden as common;

use common::*;
use tboost_engine::backend::cpu::CpuBackend;
use tboost_engine::backend::Backend;
use tboost_engine::comm::{CommKind, Communicator, LocalGroup};
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::model::Model;
use tboost_engine::plan::{PlanOptions, PrecisionPolicy, Slot};
use tboost_engine::runner::{ModelRunner, OpenBackend};
use tboost_engine::sched::Request;
use tboost_engine::session::{argmax, Session};

/// Runs `f(rank, comm)` on every rank of a local group of `world`, one thread each.
fn on_ranks<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(usize, &dyn Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = LocalGroup::new(world, timeout)
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let f = f.clone();
            std::thread::spawn(move || f(r, &c))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn local_collectives_give_every_rank_the_same_result() {
    let out = on_ranks(3, Duration::from_secs(10), |r, c| {
        let mut v = vec![r as f32 + 1.0, 10.0 * r as f32];
        c.all_reduce_sum(&mut v).unwrap();
        let mut all = vec![0.0; 3];
        c.all_gather(&[r as f32 * 2.0], &mut all).unwrap();
        let mut msg = if r == 1 { b"from one".to_vec() } else { b"junk".to_vec() };
        c.broadcast(1, &mut msg).unwrap();
        c.barrier().unwrap();
        (v, all, msg)
    });
    for (v, all, msg) in out {
        assert_eq!(v, vec![6.0, 30.0]);
        assert_eq!(all, vec![0.0, 2.0, 4.0]);
        assert_eq!(msg, b"from one");
    }
}

#[test]
fn a_rank_that_never_arrives_fails_the_collective_naming_it_within_the_timeout() {
    let out = on_ranks(3, Duration::from_millis(300), |r, c| {
        let t = Instant::now();
        if r == 2 {
            // Arrives only after the others gave up.
            std::thread::sleep(Duration::from_millis(900));
        }
        let res = c.all_reduce_sum(&mut [1.0]);
        (r, res.map_err(|e| e.to_string()), t.elapsed())
    });
    for (r, res, took) in out {
        let e = res.expect_err("no rank may see a result");
        if r != 2 {
            assert!(e.contains("rank 2 did not join all_reduce"), "rank {r}: {e}");
            assert!(took < Duration::from_millis(800), "rank {r} waited {took:?}");
        } else {
            assert!(e.contains("broken"), "the late rank learns the group is broken: {e}");
        }
    }
}

#[test]
fn a_rank_that_leaves_fails_the_others_at_once_with_its_reason() {
    let out = on_ranks(2, Duration::from_secs(30), |r, c| {
        let t = Instant::now();
        if r == 1 {
            c.abandon("its model failed to load");
            return (String::new(), t.elapsed());
        }
        let e = c.broadcast(0, &mut vec![1, 2, 3]).unwrap_err().to_string();
        (e, t.elapsed())
    });
    let (e, took) = &out[0];
    assert!(e.contains("rank 1 left the group (its model failed to load)"), "{e}");
    assert!(e.starts_with("tensor-parallel rank 0"), "{e}");
    assert!(*took < Duration::from_secs(5), "waited {took:?} instead of failing at once");
}

fn cpu_open() -> OpenBackend {
    Arc::new(|_| Ok(Box::new(CpuBackend::new(1)?) as Box<dyn Backend>))
}

fn tp_runner(model: &Model, opts: &PlanOptions, world: usize) -> ModelRunner {
    let be = Box::new(CpuBackend::new(1).unwrap());
    let mut r = ModelRunner::new_local_group(model, be, opts, 1, world, Duration::from_secs(60), cpu_open())
        .unwrap_or_else(|e| panic!("tp={world}: {e}"));
    r.alloc_kv(64, opts.block_size).unwrap();
    r
}

/// Prefill (every position's logits) then greedy decode steps: every logit of every step.
fn trace(r: &mut ModelRunner, prompt: &[u32], steps: usize) -> (Vec<f32>, Vec<u32>) {
    let vocab = r.cfg.vocab_size;
    let mut s = Session::new(r, prompt.len() + steps + 1).unwrap();
    let mut all = s.feed(prompt, true).unwrap();
    let mut ids = Vec::new();
    let mut last = all[all.len() - vocab..].to_vec();
    for _ in 0..steps {
        let next = argmax(&last);
        ids.push(next);
        last = s.feed(&[next], false).unwrap();
        all.extend_from_slice(&last);
    }
    (all, ids)
}

#[test]
fn every_golden_case_at_tp_2_and_4_matches_tp_1_within_1e_4() {
    let opts = PlanOptions::default();
    // The new architectures too: q/k norms and Gemma's post norms (after the all-reduce), the
    // embedding scale, LongRoPE factors and Qwen3-MoE experts on every rank.
    for case in CASES.iter().chain(NEW_ARCH_CASES) {
        let g = golden(case);
        let model = Model::load(&golden_dir(case)).unwrap();
        let mut one = runner_with(&golden_dir(case), &opts, 1, 64);
        let prompts: Vec<Vec<u32>> = g["prompts"].as_array().unwrap().iter().map(|p| ids(&p["token_ids"])).collect();
        let base: Vec<_> = prompts.iter().map(|p| trace(&mut one, p, 4)).collect();
        for world in [2, 4] {
            let mut r = tp_runner(&model, &opts, world);
            let tp = r.plan.tp.clone().expect("a tensor-parallel plan reports its shard");
            assert_eq!((tp.shard.world, tp.shard.rank), (world, 0));
            let ar = r.plan.model_slot(Slot::AllReduce).expect("the all-reduce is a slot of the plan");
            assert_eq!(ar.tried.len(), 3, "{case}: fused, device and host candidates: {:?}", ar.tried);
            for (p, (want, want_ids)) in prompts.iter().zip(&base) {
                let (got, got_ids) = trace(&mut r, p, 4);
                let d = max_abs_diff(&got, want);
                eprintln!("{case} tp={world}: prompt of {} tokens, max abs logit diff vs tp=1 {d:.2e}", p.len());
                assert!(d <= 1e-4, "{case} tp={world}: logits differ from tp=1 by {d}");
                assert_eq!(&got_ids, want_ids, "{case} tp={world}: greedy ids");
            }
        }
    }
}

#[test]
fn kv_heads_fewer_than_ranks_are_replicated() {
    // mixtral: 4 query heads over 1 KV head.
    let model = Model::load(&golden_dir("mixtral")).unwrap();
    let r = tp_runner(&model, &PlanOptions::default(), 2);
    let s = &r.plan.tp.as_ref().unwrap().shard;
    assert_eq!((s.heads.clone(), s.kv_heads.clone(), s.kv_replicated), (0..2, 0..1, true));
}

#[test]
fn a_follower_takes_no_work_and_says_so() {
    let model = Model::load(&golden_dir("llama_gqa")).unwrap();
    let mut comms = LocalGroup::new(2, Duration::from_millis(200));
    let c1: Arc<dyn Communicator> = Arc::new(comms.remove(1));
    let be = Box::new(CpuBackend::new(1).unwrap());
    let mut r = ModelRunner::new_rank(&model.config, &model.weights, be, &PlanOptions::default(), 1, c1).unwrap();
    let e = r.alloc_kv(8, 16).unwrap_err().to_string();
    assert!(e.contains("rank 1 is a tensor-parallel follower"), "{e}");
}

/// Set in the processes `mpirun` starts from this test binary: each runs one rank.
const MPI_RANK_ENV: &str = "TBOOST_TEST_MPI_RANK_PROCESS";
const MPI_TEST: &str = "under_mpirun_a_follower_refuses_enqueue_and_the_leader_gets_the_ids_of_one_rank";
const MPI_PROMPT: [u32; 5] = [5, 17, 300, 42, 7];

fn mpi_engine() -> Engine {
    let cfg = EngineConfig {
        threads: 1,
        kv_size: KvSize::Blocks(64),
        comm: CommKind::Mpi,
        comm_timeout_ms: 60_000,
        ..Default::default()
    };
    let e = Engine::new(cfg).unwrap();
    e.load(&golden_dir("llama_gqa")).unwrap();
    e
}

/// One rank of the MPI test: the follower tries to take a request, then follows the leader;
/// the leader serves one request. Each prints what it saw.
fn mpi_rank_process() {
    let e = mpi_engine();
    match e.follower_rank().unwrap() {
        Some(rank) => {
            let err = e.enqueue(Request::new(MPI_PROMPT.to_vec(), 8)).expect_err("a follower took a request");
            println!("rank {rank} enqueue: {err}");
            // A host's usual loop serves a follower: it has work until the leader stops, and
            // its step runs the leader's steps until the leader's engine is dropped.
            let mut steps = 0;
            while e.has_work().unwrap() {
                e.step().unwrap();
                steps += 1;
            }
            // The group has stopped: a later step returns at once with nothing.
            let t = Instant::now();
            assert!(e.step().unwrap().events.is_empty());
            assert!(t.elapsed() < Duration::from_secs(1), "a step after the group stopped waited {:?}", t.elapsed());
            println!("rank {rank} followed to the end in {steps} step(s)");
        }
        None => {
            let id = e.enqueue(Request::new(MPI_PROMPT.to_vec(), 8)).unwrap();
            e.run_to_completion().unwrap();
            println!("leader ids {:?}", e.output(id).unwrap().tokens);
        }
    }
    drop(e);
    tboost_engine::comm::mpi::finalize();
}

/// `mpirun -np 2` on this test's own binary, filtered to this test: the engines of the two
/// processes form a group over Open MPI. A follower's `enqueue` is an error naming its rank
/// and where requests go, and the leader's greedy ids equal one rank's.
#[test]
fn under_mpirun_a_follower_refuses_enqueue_and_the_leader_gets_the_ids_of_one_rank() {
    if std::env::var_os(MPI_RANK_ENV).is_some() {
        return mpi_rank_process();
    }
    let mpirun = std::path::Path::new("/usr/bin/mpirun");
    assert!(mpirun.exists(), "mpirun is missing: run scripts/setup.sh (installs openmpi-bin and libopenmpi-dev)");
    let one = Engine::new(EngineConfig { threads: 1, kv_size: KvSize::Blocks(64), ..Default::default() }).unwrap();
    one.load(&golden_dir("llama_gqa")).unwrap();
    let id = one.enqueue(Request::new(MPI_PROMPT.to_vec(), 8)).unwrap();
    one.run_to_completion().unwrap();
    let want = one.output(id).unwrap().tokens;
    drop(one);

    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new(mpirun)
        .args(["--allow-run-as-root", "--oversubscribe", "-x", MPI_RANK_ENV, "-np", "2"])
        .arg(&exe)
        .args(["--exact", MPI_TEST, "--nocapture", "--test-threads=1"])
        .env(MPI_RANK_ENV, "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Hard limit: the pipes are read on threads so the loop below can time out.
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let (out, err) = (read(Box::new(child.stdout.take().unwrap())), read(Box::new(child.stderr.take().unwrap())));
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(180) {
            // mpirun passes SIGTERM on to its ranks.
            let _ = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
            std::thread::sleep(Duration::from_secs(3));
            let _ = child.kill();
            panic!("mpirun -np 2 still running after 180 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    assert!(status.success(), "mpirun -np 2: {status}\n{out}\n{err}");
    assert!(
        out.contains(
            "rank 1 enqueue: invalid argument `enqueue`: this engine is tensor-parallel rank 1, a follower: requests go to rank 0"
        ),
        "{out}"
    );
    assert!(out.contains("rank 1 followed to the end in 1 step(s)"), "{out}");
    assert!(out.contains(&format!("leader ids {want:?}")), "want {want:?}: {out}");
}

fn demo_ids(tp: usize, prompts: &[Vec<u32>]) -> (Vec<Vec<u32>>, usize) {
    let cfg = EngineConfig {
        threads: 2,
        kv_size: KvSize::Blocks(64),
        precision: PrecisionPolicy::Exact,
        tp,
        ..Default::default()
    };
    let e = Engine::new(cfg).unwrap();
    e.load(&demo_model()).unwrap();
    let plan = e.plan().unwrap();
    let bytes = plan.tp.map_or(0, |t| t.resident_weight_bytes);
    let ids: Vec<u64> = prompts.iter().map(|p| e.enqueue(Request::new(p.clone(), 24)).unwrap()).collect();
    e.run_to_completion().unwrap();
    (ids.into_iter().map(|id| e.output(id).unwrap().tokens).collect(), bytes)
}

#[test]
fn demo_model_greedy_ids_at_tp_2_equal_tp_1_and_each_rank_holds_at_most_0_6_of_the_weights() {
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(shared_dir().join("models/qwen-demo-golden.json")).unwrap())
            .unwrap();
    let prompts: Vec<Vec<u32>> = g["prompts"].as_array().unwrap().iter().map(|p| ids(&p["prompt_ids"])).collect();
    let model = Model::load(&demo_model()).unwrap();
    let whole = model.weights.total_bytes();
    let rank1 = ModelRunner::shard_weight_bytes(&model.config, &model.weights, 2, 1).unwrap();
    drop(model);
    let (one, _) = demo_ids(1, &prompts);
    let (two, rank0) = demo_ids(2, &prompts);
    for (i, (a, b)) in one.iter().zip(&two).enumerate() {
        assert_eq!(a, b, "prompt {i}: tp=2 greedy ids differ from tp=1");
    }
    for (rank, bytes) in [(0, rank0), (1, rank1)] {
        let ratio = bytes as f64 / whole as f64;
        eprintln!("demo model: rank {rank} of 2 holds {bytes} of {whole} weight bytes ({ratio:.3})");
        assert!(ratio <= 0.6, "rank {rank} holds {ratio:.3} of the weights");
    }
}

/// Tokens, their logprobs and the leader's gathered logit bytes of one request (8 tokens) on a
/// `tp`-rank engine over llama_gqa.
fn gathered(tp: usize, logprobs: Option<usize>) -> (Vec<u32>, Vec<f32>, u64) {
    let cfg = EngineConfig { threads: 2, kv_size: KvSize::Blocks(32), tp, ..Default::default() };
    let e = Engine::new(cfg).unwrap();
    e.load(&golden_dir("llama_gqa")).unwrap();
    let mut req = Request { ignore_eos: true, ..Request::new(vec![5, 17, 300, 42, 7], 8) };
    req.sampling.logprobs = logprobs;
    let id = e.enqueue(req).unwrap();
    let (mut tokens, mut lps) = (Vec::new(), Vec::new());
    while e.has_work().unwrap() {
        for ev in e.step().unwrap().events.into_iter().filter(|ev| ev.id == id) {
            if let Some(t) = ev.token {
                tokens.push(t);
                lps.push(ev.logprob.unwrap_or(f32::NAN));
            }
        }
    }
    (tokens, lps, e.stats().unwrap().tp_gathered_logit_bytes)
}

/// A step whose rows are all greedy gathers each rank's best candidate of a row (value and
/// index, 8 bytes) instead of its vocabulary part; a row that reports logprobs still gathers
/// the whole part. Both give tp = 1's tokens (and logprobs within 1e-4).
#[test]
fn greedy_rows_gather_each_ranks_best_candidate_and_logprob_rows_the_whole_row() {
    let vocab = Model::load(&golden_dir("llama_gqa")).unwrap().config.vocab_size;
    let (want, _, none) = gathered(1, None);
    assert_eq!(none, 0, "one rank gathers nothing");
    let (got, _, bytes) = gathered(2, None);
    assert_eq!(got, want, "greedy tokens at tp = 2 (best-candidate gather)");
    assert_eq!(bytes, (8 * 2 * 8) as u64, "8 rows x 2 ranks x (value, index) of 4 bytes each");

    let (want, want_lp, _) = gathered(1, Some(2));
    let (got, got_lp, bytes) = gathered(2, Some(2));
    assert_eq!(got, want, "greedy tokens with logprobs at tp = 2");
    for (i, (a, b)) in got_lp.iter().zip(&want_lp).enumerate() {
        assert!((a - b).abs() <= 1e-4, "token {i}: logprob {a} at tp = 2, {b} at tp = 1");
    }
    assert_eq!(bytes, (8 * 2 * vocab.div_ceil(2) * 4) as u64, "8 rows x 2 ranks x the vocabulary part in f32");
}

/// Stated `rank` and `world` keys are checked against the group: with `local` ranks (threads)
/// this process is rank 0 of `tp`; a contradiction fails the load naming the key.
#[test]
fn stated_rank_and_world_are_checked_against_the_group() {
    let load = |rank: Option<usize>, world: Option<usize>| {
        let cfg = EngineConfig { threads: 2, kv_size: KvSize::Blocks(16), tp: 2, rank, world, ..Default::default() };
        Engine::new(cfg).unwrap().load(&golden_dir("llama_gqa"))
    };
    load(Some(0), Some(2)).expect("rank 0 of 2 is what a local group of tp 2 is");
    let err = load(Some(1), None).unwrap_err().to_string();
    assert!(err.contains("rank = 1") && err.contains("rank 0"), "{err}");
    let err = load(None, Some(4)).unwrap_err().to_string();
    assert!(err.contains("world = 4") && err.contains("2 ranks"), "{err}");
}
