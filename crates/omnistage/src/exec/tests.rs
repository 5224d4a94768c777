//! Unit tests of `exec` that need its private parts (hooks between two locks, the affinity
//! table).

use super::*;
use crate::activity::ActivitySpec;
use std::sync::mpsc::channel;
use std::time::Duration;

thread_local! {
    /// Run once by the next [`Shared::gate`] on this thread that makes a gate, right after it
    /// takes the gates' write lock: lets a test put another thread's work in that window.
    static GATE_HOOK: std::cell::Cell<Option<Box<dyn FnOnce()>>> =
        const { std::cell::Cell::new(None) };
}

pub(super) fn gate_hook() {
    if let Some(f) = GATE_HOOK.take() {
        f();
    }
}

/// How long a test waits for something that should happen at once before it calls it a
/// deadlock (a watchdog, not a measurement).
const WATCHDOG: Duration = Duration::from_secs(20);

/// `remove_activity` once took the gates' and predicates' locks inside the activities' write
/// lock, while the first send to a (stage, activity) (`Shared::gate`) takes the activities'
/// lock inside the gates' one: a removal that came while a send made its gate deadlocked both
/// (and with them every later send and admin call). Here the removal starts while the send
/// holds the gates' lock.
#[test]
fn removing_an_activity_while_a_send_makes_its_gate_does_not_deadlock() {
    let mut b = Runtime::builder().workers(1);
    let s = b
        .stage::<u32, _, _>("s", StageConfig::default(), |_| {
            |_: &mut Ctx<'_>, _: u32| {}
        })
        .expect("stage");
    let (b, victim) = b
        .activity("/victim", ActivitySpec::default())
        .expect("activity");
    let (b, other) = b
        .activity("/other", ActivitySpec::default())
        .expect("activity");
    let rt = Arc::new(b.start().expect("start"));
    let (done_tx, done_rx) = channel::<&'static str>();
    let sender = {
        let (rt, done_tx) = (rt.clone(), done_tx.clone());
        std::thread::spawn(move || {
            let hook = {
                let (rt, done_tx) = (rt.clone(), done_tx.clone());
                move || {
                    std::thread::spawn(move || {
                        let r = rt.remove_activity("/victim");
                        assert!(r.is_ok(), "{r:?}");
                        let _ = done_tx.send("remove");
                    });
                    // Long enough for the removal to take the activities' lock (no result is
                    // read from this wait: it only makes the bad interleaving happen).
                    std::thread::sleep(Duration::from_millis(100));
                }
            };
            GATE_HOOK.set(Some(Box::new(hook)));
            // The first send to (s, /other) makes its gate, with the hook in the window.
            let r = rt.send(&s, other, Affinity::Core(0), 1);
            assert!(GATE_HOOK.take().is_none(), "the hook ran");
            assert_eq!(r, Ok(()));
            let _ = done_tx.send("send");
        })
    };
    let mut done = Vec::new();
    for _ in 0..2 {
        match done_rx.recv_timeout(WATCHDOG) {
            Ok(what) => done.push(what),
            Err(_) => panic!("deadlock: only {done:?} finished"),
        }
    }
    sender.join().expect("sender");
    assert_eq!(rt.activity_id("/victim"), None);
    // The victim's gates went with it; a send to it is refused.
    assert_eq!(
        rt.send(&s, victim, Affinity::Core(0), 2),
        Err(SendError::NoSuchActivity(victim))
    );
}

/// A shard full of live keys once swept itself for every new key and then left the key out,
/// so every message of that key was placed on the least-loaded core again (its affinity lost):
/// here the least-loaded core alternates, and the new key must keep the core it got first.
#[test]
fn a_new_key_in_a_full_affinity_shard_keeps_its_core() {
    const TTL: u64 = 1_000_000_000;
    let table = AffinityTable::new(1, TTL);
    for k in 0..AFFINITY_PER_SHARD_MAX as u64 {
        assert_eq!(table.place(k, 0, || 0), 0);
    }
    let flip = std::cell::Cell::new(0u16);
    let alternate = || {
        flip.set(flip.get() + 1);
        flip.get() % 2
    };
    let new_key = u64::MAX;
    let first = table.place(new_key, 1, alternate);
    let again = table.place(new_key, 2, alternate);
    assert_eq!(first, again, "the new key moved between cores");
    assert_eq!(flip.get(), 1, "least_loaded asked once");
    let len = table.shards[0].lock().expect("lock").map.len();
    assert!(len <= AFFINITY_PER_SHARD_MAX, "{len}");
    // Once they expire, the old keys make room (one sweep per TTL), and the live ones stay.
    let later = TTL + 1;
    assert_eq!(table.place(new_key - 1, later, || 1), 1);
    assert_eq!(table.place(new_key, later, || 0), first);
    let len = table.shards[0].lock().expect("lock").map.len();
    assert_eq!(len, 2);
}
