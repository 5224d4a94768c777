//! Shared pieces of the admin API tests: a small runtime with a pipeline and a load stage,
//! an admin server on a free port, and waiting for conditions (never sleeping as an
//! assertion).

#![allow(dead_code)]

use omnistage::activity::ActivitySpec;
use omnistage::exec::{Affinity, Ctx, Runtime, StageConfig, StageRef};
use omnistage_admin::client::{Client, Reply};
use omnistage_admin::{start_admin_rt, AdminConfig, AdminHandle};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

pub const DEADLINE: Duration = Duration::from_secs(20);

pub fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A runtime with `front` (each message sends two to `back`), `back`, and `spin` (a message
/// re-sends itself while `running`, so the workers stay loaded), and activities `/t/a` (weight
/// 60) and `/t/b` (weight 30).
pub struct Rig {
    pub rt: Arc<Runtime>,
    pub front: StageRef<u32>,
    pub back: StageRef<u32>,
    pub spin: StageRef<u32>,
    pub running: Arc<AtomicBool>,
    pub a: u32,
    pub b: u32,
}

pub fn rig(workers: usize) -> Rig {
    let back_cell: Arc<OnceLock<StageRef<u32>>> = Arc::new(OnceLock::new());
    let spin_cell: Arc<OnceLock<StageRef<u32>>> = Arc::new(OnceLock::new());
    let running = Arc::new(AtomicBool::new(true));
    let mut b = Runtime::builder().workers(workers);
    let front: StageRef<u32> = {
        let cell = back_cell.clone();
        b.stage("front", StageConfig::default(), move |_| {
            let cell = cell.clone();
            move |ctx: &mut Ctx<'_>, m: u32| {
                let back = *cell.get().expect("set before start");
                let _ = ctx.send(&back, m);
                let _ = ctx.send(&back, m);
            }
        })
        .unwrap()
    };
    let back: StageRef<u32> = b
        .stage("back", StageConfig::default(), |_| {
            |_: &mut Ctx<'_>, _m: u32| {}
        })
        .unwrap();
    let spin: StageRef<u32> = {
        let (cell, running) = (spin_cell.clone(), running.clone());
        b.stage("spin", StageConfig::default(), move |_| {
            let (cell, running) = (cell.clone(), running.clone());
            move |ctx: &mut Ctx<'_>, m: u32| {
                let t = Instant::now();
                while t.elapsed() < Duration::from_micros(5) {
                    std::hint::spin_loop();
                }
                if running.load(Ordering::Relaxed) {
                    let me = *cell.get().expect("set before start");
                    let _ = ctx.send(&me, m);
                }
            }
        })
        .unwrap()
    };
    back_cell.set(back).ok().unwrap();
    spin_cell.set(spin).ok().unwrap();
    let (b, a) = b.activity("/t/a", ActivitySpec::weight(60)).unwrap();
    let (b, bb) = b.activity("/t/b", ActivitySpec::weight(30)).unwrap();
    let rt = Arc::new(b.start().unwrap());
    Rig {
        rt,
        front,
        back,
        spin,
        running,
        a,
        b: bb,
    }
}

impl Rig {
    /// Sends `n` messages to `front` in `activity` and waits until all are handled.
    pub fn pipeline(&self, activity: u32, n: u32) {
        for i in 0..n {
            let end = Instant::now() + DEADLINE;
            while self
                .rt
                .send(&self.front, activity, Affinity::Any, i)
                .is_err()
            {
                assert!(Instant::now() < end, "front kept refusing");
                std::thread::yield_now();
            }
        }
        self.drain();
    }

    pub fn drain(&self) {
        wait_for("the runtime to drain", || self.rt.pending() == 0);
    }

    /// Starts `per_activity` circulating messages in each of /t/a and /t/b on `spin`.
    pub fn load(&self, per_activity: u32) {
        for act in [self.a, self.b] {
            for i in 0..per_activity {
                self.rt.send(&self.spin, act, Affinity::Any, i).unwrap();
            }
        }
    }

    pub fn stop_load(&self) {
        self.running.store(false, Ordering::Relaxed);
        self.drain();
    }
}

pub fn admin(rt: &Arc<Runtime>, token: Option<&str>) -> (AdminHandle, Client) {
    let cfg = AdminConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: token.map(str::to_string),
        sample_interval: Duration::from_millis(50),
        threads: 2,
    };
    let h = start_admin_rt(rt.clone(), cfg).unwrap();
    let c = Client::new(
        &format!("http://{}", h.local_addr()),
        token.map(str::to_string),
    )
    .unwrap();
    (h, c)
}

pub fn req(c: &Client, method: &str, path: &str, body: Option<&str>) -> Reply {
    c.request(method, path, body.map(str::as_bytes)).unwrap()
}

pub fn json(r: &Reply) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.text()))
}

/// Finds a node by path (the crate's own `find` is private).
pub fn find_node<'a>(
    t: &'a omnistage_admin::model::Tree,
    path: &str,
) -> &'a omnistage_admin::model::Node {
    fn walk<'a>(
        n: &'a omnistage_admin::model::Node,
        p: &str,
    ) -> Option<&'a omnistage_admin::model::Node> {
        if n.path == p {
            return Some(n);
        }
        n.children.iter().find_map(|c| walk(c, p))
    }
    walk(&t.root, path).unwrap_or_else(|| panic!("no node {path}"))
}
