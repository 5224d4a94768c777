//! A fixed number of dispatches on one worker, for counting the runtime's instructions per
//! dispatch under callgrind in each scheduling mode (docs/design.md, "The bypass").
//!
//! Three activities (weights 50/33/17) each keep four messages in flight on one stage whose
//! handler does nothing but re-send its message; the run ends after `N` dispatches. Run it at
//! two sizes and divide the difference of the instruction counts by the difference of `N`, so
//! start-up and shutdown cancel:
//!
//! ```text
//! cargo build --release -p omnistage --example dispatch_cost
//! valgrind --tool=callgrind target/release/examples/dispatch_cost scheduled 200000
//! valgrind --tool=callgrind target/release/examples/dispatch_cost scheduled 400000
//! ```
//!
//! Modes: `scheduled` (the tree and the ledger), `bypass` (FIFO, no accounting, no clock read
//! per dispatch).

use omnistage::activity::ActivitySpec;
use omnistage::exec::{Affinity, Runtime, StageConfig, StageRef};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: dispatch_cost scheduled|bypass N";
    let bypass = match args.next().as_deref() {
        Some("scheduled") => false,
        Some("bypass") => true,
        _ => return Err(usage.into()),
    };
    let n: u64 = args
        .next()
        .and_then(|s| s.parse().ok())
        .filter(|&n| (1..=1_000_000_000).contains(&n))
        .ok_or(usage)?;
    let mut b = Runtime::builder().workers(1).bypass(bypass);
    let me: Arc<OnceLock<StageRef<()>>> = Arc::new(OnceLock::new());
    let handled = Arc::new(AtomicU64::new(0));
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_tx = Arc::new(Mutex::new(Some(done_tx)));
    let (me2, handled2) = (me.clone(), handled.clone());
    let stage = b
        .stage::<(), _, _>(
            "work",
            StageConfig {
                batch_max: 1,
                ..Default::default()
            },
            move |_| {
                let (me, handled, done) = (me2.clone(), handled2.clone(), done_tx.clone());
                move |ctx, ()| {
                    // One worker: a relaxed counter, the same cost in every mode.
                    let h = handled.fetch_add(1, Ordering::Relaxed) + 1;
                    if h < n {
                        let _ = ctx.send(me.get().expect("set"), ());
                    } else if let Some(tx) = done.lock().expect("done lock").take() {
                        let _ = tx.send(());
                    }
                }
            },
        )
        .map_err(|e| e.to_string())?;
    me.set(stage).map_err(|_| "set twice")?;
    let rt = b.start().map_err(|e| e.to_string())?;
    rt.create_activity("/tenants", ActivitySpec::default())
        .map_err(|e| e.to_string())?;
    for (name, w) in [("a", 50), ("b", 33), ("c", 17)] {
        let id = rt
            .create_activity(&format!("/tenants/{name}"), ActivitySpec::weight(w))
            .map_err(|e| e.to_string())?;
        for _ in 0..4 {
            rt.send(&stage, id, Affinity::Core(0), ())
                .map_err(|e| e.to_string())?;
        }
    }
    done_rx.recv().map_err(|e| e.to_string())?;
    rt.shutdown();
    println!(
        "{} dispatches, bypass {bypass}",
        handled.load(Ordering::Relaxed)
    );
    Ok(())
}
