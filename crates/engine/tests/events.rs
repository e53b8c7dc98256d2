//! `EventEngine`: one thread steps, others read and wait for the events.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tboost_engine::engine::{Engine, EngineConfig, EventEngine, KvSize};
use tboost_engine::sample::FinishReason;
use tboost_engine::sched::Request;
use tboost_engine::Error;

fn event_engine() -> EventEngine {
    let e = Engine::new(EngineConfig { threads: 1, kv_size: KvSize::Blocks(16), ..Default::default() }).unwrap();
    let model = tboost_testkit::synthetic::build("small", tboost_engine::backend::DType::F32, 7).unwrap();
    e.load_model(&model).unwrap();
    EventEngine::new(e)
}

fn request(n: usize) -> Request {
    Request { ignore_eos: true, ..Request::new(vec![3, 4, 5], n) }
}

#[test]
fn a_waiting_thread_wakes_when_a_step_produces_its_event() {
    let ev = Arc::new(event_engine());
    let id = ev.engine().enqueue(request(2)).unwrap();
    let waiter = {
        let ev = ev.clone();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let n = ev.wait(Some(id), Duration::from_secs(30)).unwrap();
            (n, t0.elapsed())
        })
    };
    // Let the waiter block first: nothing is queued before the step.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(ev.ready(Some(id)).unwrap(), 0);
    let queued = ev.step().unwrap();
    assert!(queued >= 1, "the first step samples the first token");
    let (n, waited) = waiter.join().unwrap();
    assert!(n >= 1, "woken with {n} events ready");
    assert!(waited < Duration::from_secs(30), "woken by the step, not by the timeout ({waited:?})");
    let got = ev.read(Some(id), 16).unwrap();
    assert_eq!(got.len(), n);
    assert_eq!(got[0].event.id, id);
    assert_eq!(got[0].index, 0);
    assert!(got[0].event.token.is_some());
}

#[test]
fn wait_returns_zero_at_its_timeout_when_nothing_comes() {
    let ev = event_engine();
    let id = ev.engine().enqueue(request(2)).unwrap();
    let t0 = Instant::now();
    assert_eq!(ev.wait(Some(id), Duration::from_millis(80)).unwrap(), 0);
    assert_eq!(ev.wait(None, Duration::from_millis(20)).unwrap(), 0);
    assert!(t0.elapsed() >= Duration::from_millis(100), "returned before its timeout: {:?}", t0.elapsed());
}

#[test]
fn wait_on_an_ended_request_whose_events_were_read_returns_at_once() {
    let ev = event_engine();
    let id = ev.engine().enqueue(request(3)).unwrap();
    while ev.engine().has_work().unwrap() {
        ev.step().unwrap();
    }
    // Its events are still queued: wait answers at once with their number.
    let t0 = Instant::now();
    assert_eq!(ev.wait(Some(id), Duration::from_secs(30)).unwrap(), 3);
    let events = ev.read(Some(id), 16).unwrap();
    assert_eq!(events.iter().map(|e| e.index).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(events.last().unwrap().event.finish, Some(FinishReason::Length));
    // All read: nothing more will come, so NotFound at once rather than at the timeout.
    match ev.wait(Some(id), Duration::from_secs(30)) {
        Err(Error::NotFound(msg)) => assert!(msg.contains("has ended"), "{msg}"),
        other => panic!("wait on an ended, fully read request: {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "waited {:?}", t0.elapsed());
    assert_eq!(ev.pending(), 0);
}

#[test]
fn unknown_ids_are_not_found_and_close_wakes_waiters() {
    let ev = Arc::new(event_engine());
    assert!(matches!(ev.wait(Some(99), Duration::from_secs(30)), Err(Error::NotFound(_))));
    assert!(matches!(ev.read(Some(99), 1), Err(Error::NotFound(_))));
    let waiter = {
        let ev = ev.clone();
        std::thread::spawn(move || ev.wait(None, Duration::from_secs(30)))
    };
    std::thread::sleep(Duration::from_millis(50));
    ev.close();
    assert!(matches!(waiter.join().unwrap(), Err(Error::Interrupted)));
    assert!(ev.is_closed());
}

#[test]
fn read_of_any_request_takes_events_oldest_first_up_to_the_limit() {
    let ev = event_engine();
    let a = ev.engine().enqueue(request(2)).unwrap();
    let b = ev.engine().enqueue(request(2)).unwrap();
    while ev.engine().has_work().unwrap() {
        ev.step().unwrap();
    }
    assert_eq!(ev.ready(None).unwrap(), 4);
    let first = ev.read(None, 3).unwrap();
    assert_eq!(first.len(), 3);
    let rest = ev.read(None, 16).unwrap();
    assert_eq!(rest.len(), 1);
    let ids: Vec<u64> = first.iter().chain(&rest).map(|e| e.event.id).collect();
    assert_eq!(ids.iter().filter(|&&i| i == a).count(), 2);
    assert_eq!(ids.iter().filter(|&&i| i == b).count(), 2);
}
