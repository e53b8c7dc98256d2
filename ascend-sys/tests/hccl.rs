//! ascend-sys's HCCL layer against the SIMULATED libhccl.so of ascend-sim (NOT HCCL: ranks are threads of
//! one process, or processes of this machine for root-info groups, each on its own simulated device; the
//! collective runs in host memory when every rank's stream reaches it). Every test runs in its own process (`common::isolated`), with 4 simulated
//! devices.

mod common;

use std::sync::{mpsc, Arc, Barrier};
use std::time::{Duration, Instant};

use ascend_sys::{AclError, Cann, Device, Hccl, HcclComm, HcclDType, SearchOrder, Stream};
use common::*;
use half::f16;

fn env(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    let mut v: Vec<(&'static str, String)> = vec![("TBOOST_SIM_DEVICE_COUNT", "4".into())];
    v.extend(pairs.iter().map(|(k, val)| (*k, val.to_string())));
    v
}

fn ok<T>(r: ascend_sys::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e}"))
}

fn hccl() -> (Cann, Hccl) {
    let cann = load();
    assert!(cann.is_simulator(), "these tests need the CANN SIMULATOR");
    let h = ok(Hccl::load(&cann), "loading libhccl.so");
    (cann, h)
}

/// The HCCL code of a failed call.
fn hccl_code(e: &AclError) -> u32 {
    match e {
        AclError::Hccl { code, .. } => *code,
        other => panic!("expected an HCCL error, got {other}"),
    }
}

/// Runs `body(rank, device, stream, comm)` on one thread per rank (rank i on device i), the comms from
/// `HcclCommInitAll`; returns each rank's result in rank order.
fn on_ranks<T: Send + 'static>(
    cann: &Cann,
    comms: Vec<HcclComm>,
    body: impl Fn(usize, &Device, &Stream, &HcclComm) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let body = Arc::new(body);
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            let (cann, body) = (cann.clone(), body.clone());
            std::thread::spawn(move || {
                let dev = ok(cann.device(r as i32), "aclrtSetDevice");
                let stream = ok(dev.create_stream(), "stream");
                let out = body(r, &dev, &stream, &comm);
                drop(comm);
                drop(stream);
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
}

#[test]
fn collectives_over_root_info_ranks_give_every_rank_the_same_result() {
    isolated("collectives_over_root_info_ranks_give_every_rank_the_same_result", &env(&[]), || {
        let (cann, h) = hccl();
        let n = 4usize;
        // rank 0 makes the root info on its device; every rank joins with it on its own thread
        let (tx, rx) = mpsc::channel();
        let barrier = Arc::new(Barrier::new(n));
        let mut handles = Vec::new();
        let root_sender = Arc::new(std::sync::Mutex::new(Some(tx)));
        let root_rx = Arc::new(std::sync::Mutex::new(rx));
        for r in 0..n {
            let (cann, h, barrier, root_sender, root_rx) =
                (cann.clone(), h.clone(), barrier.clone(), root_sender.clone(), root_rx.clone());
            handles.push(std::thread::spawn(move || {
                let dev = ok(cann.device(r as i32), "aclrtSetDevice");
                let root = if r == 0 {
                    let root = ok(h.root_info(), "HcclGetRootInfo");
                    let tx = root_sender.lock().unwrap().take().unwrap();
                    for _ in 1..n {
                        tx.send(root.as_bytes().to_vec()).unwrap();
                    }
                    root
                } else {
                    let b = root_rx.lock().unwrap().recv().unwrap();
                    ok(ascend_sys::RootInfo::from_bytes(&b), "root info bytes")
                };
                let comm = ok(h.init_rank(n as u32, &root, r as u32), "HcclCommInitRootInfo");
                assert_eq!((comm.rank(), comm.size()), (r as u32, n as u32));
                let stream = ok(dev.create_stream(), "stream");
                let len = 1000;
                let mine = rand_vec(len, r as u64 + 1);
                let buf = ok(dev.upload(&mine), "upload");
                let out = ok(dev.alloc(len * 4), "alloc");
                ok(comm.all_reduce_sum((&buf, 0), (&out, 0), len, HcclDType::F32, &stream), "HcclAllReduce");
                // f16, in place
                let mine16 = to_f16(&mine);
                let b16 = ok(dev.upload(&mine16), "upload f16");
                ok(comm.all_reduce_sum((&b16, 0), (&b16, 0), len, HcclDType::F16, &stream), "HcclAllReduce f16");
                let gathered = ok(dev.alloc(n * len * 4), "alloc");
                ok(comm.all_gather((&buf, 0), (&gathered, 0), len, HcclDType::F32, &stream), "HcclAllGather");
                let bc = ok(dev.upload(&[r as f32; 16]), "upload");
                ok(comm.broadcast((&bc, 0), 16, HcclDType::F32, 2, &stream), "HcclBroadcast");
                ok(comm.barrier(&stream), "HcclBarrier");
                // nothing ran yet: the collectives are stream tasks
                barrier.wait();
                ok(stream.synchronize(), "synchronize");
                let sum: Vec<f32> = ok(out.to_vec(0, len), "read");
                let sum16: Vec<f16> = ok(b16.to_vec(0, len), "read");
                let all: Vec<f32> = ok(gathered.to_vec(0, n * len), "read");
                let bcv: Vec<f32> = ok(bc.to_vec(0, 16), "read");
                (sum, sum16, all, bcv)
            }));
        }
        let results: Vec<_> = handles.into_iter().map(|h| h.join().expect("rank")).collect();
        let len = 1000;
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| rand_vec(len, r as u64 + 1)).collect();
        for (r, (sum, sum16, all, bcv)) in results.iter().enumerate() {
            for i in 0..len {
                let want: f64 = inputs.iter().map(|v| v[i] as f64).sum();
                assert_eq!(sum[i], want as f32, "rank {r}: f32 sum at {i}");
                let want16: f64 = inputs.iter().map(|v| f16::from_f32(v[i]).to_f64()).sum();
                assert!((sum16[i].to_f64() - want16).abs() <= 2e-3, "rank {r}: f16 sum at {i}");
            }
            let cat: Vec<f32> = inputs.concat();
            assert_eq!(all, &cat, "rank {r}: all-gather is every rank's input in rank order");
            assert_eq!(bcv, &vec![2.0f32; 16], "rank {r}: broadcast from root 2");
            assert_eq!(sum, &results[0].0, "every rank holds the same sum");
        }
        assert_eq!(stats(&cann).rule_violations, 0);
    });
}

/// One rank of a group whose ranks are separate processes (two children of this test binary): rank 0 makes
/// the root info and hands it over in the file `root` (as a host hands it over MPI), rank r runs on device r.
/// `body` then runs the rank's collectives.
fn process_rank<T>(
    root: &std::path::Path,
    r: usize,
    n: usize,
    body: impl FnOnce(&Device, &Stream, &HcclComm) -> T,
) -> T {
    let (cann, h) = hccl();
    let dev = ok(cann.device(r as i32), "aclrtSetDevice");
    let info = if r == 0 {
        let info = ok(h.root_info(), "HcclGetRootInfo");
        let tmp = root.with_extension("tmp");
        std::fs::write(&tmp, info.as_bytes()).expect("write the root info");
        std::fs::rename(&tmp, root).expect("publish the root info");
        info
    } else {
        let t = Instant::now();
        let bytes = loop {
            if let Ok(b) = std::fs::read(root) {
                break b;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "rank 0 never published the root info");
            std::thread::sleep(Duration::from_millis(5));
        };
        ok(ascend_sys::RootInfo::from_bytes(&bytes), "root info bytes")
    };
    let comm = ok(h.init_rank(n as u32, &info, r as u32), "HcclCommInitRootInfo");
    assert_eq!((comm.rank(), comm.size()), (r as u32, n as u32));
    let stream = ok(dev.create_stream(), "stream");
    let out = body(&dev, &stream, &comm);
    drop(stream);
    drop(comm);
    out
}

/// Runs `rank(r)` in its own child process for each of `n` ranks at once.
fn in_processes(name: &str, extra: &[(&'static str, &str)], rank: impl Fn(usize) + Sync) {
    let dir = std::env::temp_dir().join(format!("tboost-hccl-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let root = dir.join("root-info");
    let _ = std::fs::remove_file(&root);
    let mut e = env(extra);
    e.push(("TBOOST_TEST_ROOT_FILE", root.display().to_string()));
    if in_child() {
        let r: usize = std::env::var("TBOOST_TEST_RANK").expect("set by the parent").parse().expect("a rank");
        return isolated_case(name, &format!("rank{r}"), &e, || rank(r));
    }
    std::thread::scope(|s| {
        for r in 0..2 {
            let mut e = e.clone();
            e.push(("TBOOST_TEST_RANK", r.to_string()));
            let rank = &rank;
            s.spawn(move || isolated_case(name, &format!("rank{r}"), &e, || rank(r)));
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}

fn root_file() -> std::path::PathBuf {
    std::path::PathBuf::from(std::env::var("TBOOST_TEST_ROOT_FILE").expect("set by in_processes"))
}

#[test]
fn root_info_ranks_in_separate_processes_meet_and_large_collectives_go_in_rounds() {
    // 300,000 f32 per rank: 1.2 MB, more than the SIMULATOR's 1 MiB slot, so two rounds
    let len = 300_000;
    in_processes("root_info_ranks_in_separate_processes_meet_and_large_collectives_go_in_rounds", &[], |r| {
        let (sum, all, bc) = process_rank(&root_file(), r, 2, |dev, stream, comm| {
            let buf = ok(dev.upload(&rand_vec(len, r as u64 + 1)), "upload");
            let out = ok(dev.alloc(len * 4), "alloc");
            ok(comm.all_reduce_sum((&buf, 0), (&out, 0), len, HcclDType::F32, stream), "HcclAllReduce");
            let gathered = ok(dev.alloc(2 * len * 4), "alloc");
            ok(comm.all_gather((&buf, 0), (&gathered, 0), len, HcclDType::F32, stream), "HcclAllGather");
            let bc = ok(dev.upload(&[r as f32 + 5.0; 8]), "upload");
            ok(comm.broadcast((&bc, 0), 8, HcclDType::F32, 1, stream), "HcclBroadcast");
            ok(comm.barrier(stream), "HcclBarrier");
            ok(stream.synchronize(), "synchronize");
            let sum: Vec<f32> = ok(out.to_vec(0, len), "read");
            let all: Vec<f32> = ok(gathered.to_vec(0, 2 * len), "read");
            let bc: Vec<f32> = ok(bc.to_vec(0, 8), "read");
            (sum, all, bc)
        });
        let inputs: Vec<Vec<f32>> = (0..2).map(|q| rand_vec(len, q as u64 + 1)).collect();
        for i in (0..len).step_by(997).chain([len - 1]) {
            assert_eq!(sum[i], inputs[0][i] + inputs[1][i], "rank {r}: sum at {i}");
        }
        assert_eq!(all, inputs.concat(), "rank {r}: the all-gather is both inputs in rank order");
        assert_eq!(bc, vec![6.0f32; 8], "rank {r}: broadcast from rank 1");
    });
}

#[test]
fn a_rank_process_that_leaves_fails_the_others_collective_within_the_timeout_naming_it() {
    let name = "a_rank_process_that_leaves_fails_the_others_collective_within_the_timeout_naming_it";
    in_processes(name, &[("HCCL_EXEC_TIMEOUT", "1")], |r| {
        process_rank(&root_file(), r, 2, |dev, stream, comm| {
            let b = ok(dev.upload(&[1f32; 4]), "upload");
            ok(comm.all_reduce_sum((&b, 0), (&b, 0), 4, HcclDType::F32, stream), "queue 1");
            ok(stream.synchronize(), "collective #1 completes");
            if r == 1 {
                return; // this process goes away without its second collective
            }
            ok(comm.all_reduce_sum((&b, 0), (&b, 0), 4, HcclDType::F32, stream), "queue 2");
            let t = Instant::now();
            let e = stream.synchronize().unwrap_err().to_string();
            assert!(e.contains("HcclAllReduce #2 on rank 0") && e.contains("rank 1 did not arrive"), "{e}");
            assert!(t.elapsed() < Duration::from_secs(3), "failed after {:?}", t.elapsed());
        });
    });
}

#[test]
fn buffers_must_be_device_memory_of_the_rank_and_streams_of_its_device() {
    isolated("buffers_must_be_device_memory_of_the_rank_and_streams_of_its_device", &env(&[]), || {
        let (cann, h) = hccl();
        let mut comms = ok(h.init_all(&[0, 1]), "HcclCommInitAll");
        let c1 = comms.pop().unwrap();
        let c0 = comms.pop().unwrap();
        let d1 = ok(cann.device(1), "device 1");
        let s1 = ok(d1.create_stream(), "stream on device 1");
        let b1 = ok(d1.alloc(64), "alloc on device 1");
        let d0 = ok(cann.device(0), "device 0"); // this thread's current device is now 0
        let s0 = ok(d0.create_stream(), "stream on device 0");
        let b0 = ok(d0.alloc(64), "alloc on device 0");
        let host = ok(d0.alloc_host(64), "host buffer");
        let before = stats(&cann).rule_violations;

        let e = c0.all_reduce_sum((&b1, 0), (&b0, 0), 16, HcclDType::F32, &s0).unwrap_err();
        assert_eq!(hccl_code(&e), 1, "{e}");
        assert!(e.to_string().contains("memory of device 1, but the rank's device is 0"), "{e}");

        // SAFETY: the simulator checks the pointer before touching it.
        let e = unsafe { c0.all_reduce_raw(host.as_ptr(), b0.as_ptr(), 16, HcclDType::F32, s0.as_raw()) }.unwrap_err();
        assert!(e.to_string().contains("is host memory"), "{e}");
        assert!(e.to_string().contains("HCCL_E_PARA"), "the code's name is in the message: {e}");

        let e = c0.all_reduce_sum((&b0, 0), (&b0, 0), 16, HcclDType::F32, &s1).unwrap_err();
        assert!(e.to_string().contains("the stream belongs to device 1"), "{e}");

        let e = c1.all_reduce_sum((&b1, 0), (&b1, 0), 16, HcclDType::F32, &s1).unwrap_err();
        assert!(e.to_string().contains("current device is 0, the rank's is 1"), "{e}");

        // bounds are checked before HCCL sees the pointers
        let e = c0.all_reduce_sum((&b0, 0), (&b0, 0), 17, HcclDType::F32, &s0).unwrap_err();
        assert!(matches!(e, AclError::Invalid(_)), "{e}");

        assert!(stats(&cann).rule_violations >= before + 4, "each refused call is counted as a rule violation");

        // destroyed once: the second HcclCommDestroy is refused
        ok(c0.destroy_raw(), "HcclCommDestroy");
        let e = c0.destroy_raw().unwrap_err();
        assert!(e.to_string().contains("already destroyed"), "{e}");
        std::mem::forget(c0); // its drop would destroy a third time
        let e = h.init_all(&[2, 2]).map(|_| ()).expect_err("HcclCommInitAll with a device twice");
        assert!(e.to_string().contains("listed twice"), "{e}");
        drop((b0, b1, host, s0, s1, c1));
    });
}

#[test]
fn ranks_that_disagree_on_count_fail_on_every_rank_and_break_the_communicator() {
    isolated("ranks_that_disagree_on_count_fail_on_every_rank_and_break_the_communicator", &env(&[]), || {
        let (cann, h) = hccl();
        let comms = ok(h.init_all(&[0, 1]), "HcclCommInitAll");
        let res = on_ranks(&cann, comms, |r, dev, stream, comm| {
            let b = ok(dev.upload(&[1f32; 16]), "upload");
            let count = if r == 0 { 8 } else { 16 };
            ok(comm.all_reduce_sum((&b, 0), (&b, 0), count, HcclDType::F32, stream), "queue");
            let first = stream.synchronize().unwrap_err().to_string();
            ok(comm.all_reduce_sum((&b, 0), (&b, 0), 8, HcclDType::F32, stream), "queue");
            let second = stream.synchronize().unwrap_err().to_string();
            (first, second)
        });
        for (r, (first, second)) in res.iter().enumerate() {
            assert!(first.contains("the ranks must have the same count, dataType and op"), "rank {r}: {first}");
            assert!(first.contains("count 8") && first.contains("count 16"), "rank {r} names both: {first}");
            assert!(second.contains("the communicator is broken"), "rank {r}: {second}");
        }
    });
}

#[test]
fn an_injected_timeout_fails_the_waiting_rank_within_hccl_exec_timeout_naming_the_missing_rank() {
    let e = env(&[("HCCL_EXEC_TIMEOUT", "1"), ("TBOOST_SIM_HCCL_FAULT", "timeout@2:1")]);
    isolated("an_injected_timeout_fails_the_waiting_rank_within_hccl_exec_timeout_naming_the_missing_rank", &e, || {
        let (cann, h) = hccl();
        let comms = ok(h.init_all(&[0, 1]), "HcclCommInitAll");
        let res = on_ranks(&cann, comms, |_, dev, stream, comm| {
            let b = ok(dev.upload(&[1f32; 4]), "upload");
            ok(comm.all_reduce_sum((&b, 0), (&b, 0), 4, HcclDType::F32, stream), "queue 1");
            ok(stream.synchronize(), "collective #1 completes");
            ok(comm.all_reduce_sum((&b, 0), (&b, 0), 4, HcclDType::F32, stream), "queue 2");
            let t = Instant::now();
            let second = stream.synchronize().unwrap_err().to_string();
            let took = t.elapsed();
            ok(comm.all_reduce_sum((&b, 0), (&b, 0), 4, HcclDType::F32, stream), "queue 3");
            let t3 = Instant::now();
            let third = stream.synchronize().unwrap_err().to_string();
            (second, took, third, t3.elapsed())
        });
        let (second, took, third, t3) = &res[0];
        assert!(second.contains("HcclAllReduce #2 on rank 0"), "{second}");
        assert!(second.contains("rank 1 did not arrive within HCCL_EXEC_TIMEOUT=1s"), "{second}");
        assert!(*took >= Duration::from_millis(900) && *took < Duration::from_secs(3), "timed out after {took:?}");
        assert!(third.contains("broken"), "{third}");
        assert!(*t3 < Duration::from_millis(500), "a broken communicator fails at once ({t3:?})");
        assert!(res[1].0.contains("fault injection") && res[1].0.contains("rank 1"), "{}", res[1].0);
    });
}

#[test]
fn an_injected_failure_fails_its_rank_at_once_and_the_others_at_the_timeout() {
    let e = env(&[("HCCL_EXEC_TIMEOUT", "1"), ("TBOOST_SIM_HCCL_FAULT", "fail@1:0")]);
    isolated("an_injected_failure_fails_its_rank_at_once_and_the_others_at_the_timeout", &e, || {
        let (cann, h) = hccl();
        let comms = ok(h.init_all(&[0, 1, 2]), "HcclCommInitAll");
        let res = on_ranks(&cann, comms, |_, dev, stream, comm| {
            let b = ok(dev.upload(&[1f32; 4]), "upload");
            ok(comm.all_gather((&b, 0), (&ok(dev.alloc(48), "alloc"), 0), 4, HcclDType::F32, stream), "queue");
            let t = Instant::now();
            let err = stream.synchronize().unwrap_err().to_string();
            (err, t.elapsed())
        });
        assert!(res[0].0.contains("HcclAllGather #1 on rank 0: fault injection"), "{}", res[0].0);
        assert!(res[0].1 < Duration::from_millis(500), "the failing rank fails at once");
        for (err, took) in &res[1..] {
            assert!(err.contains("rank 0 did not arrive"), "{err}");
            assert!(*took < Duration::from_secs(3), "{took:?}");
        }
    });
}

#[test]
fn a_missing_libhccl_is_an_absent_capability_naming_what_was_searched() {
    isolated("a_missing_libhccl_is_an_absent_capability_naming_what_was_searched", &env(&[]), || {
        // a copy of the simulator without libhccl.so
        let src = sim_home(&[]).join("lib64");
        let dir = std::env::temp_dir().join(format!("ascend-sys-nohccl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for lib in ["libascendcl.so", "libnnopbase.so", "libopapi.so"] {
            std::fs::copy(src.join(lib), dir.join(lib)).unwrap();
        }
        let cann = ok(Cann::load_from(&SearchOrder::dirs_only([dir.clone()])), "the CANN copy loads without HCCL");
        let e = Hccl::load_from(&cann, &SearchOrder::dirs_only([dir.clone()])).unwrap_err();
        assert_eq!(e.to_string(), format!("HCCL (libhccl.so) not found; searched: {}/libhccl.so", dir.display()));
        let _ = std::fs::remove_dir_all(&dir);
    });
}
