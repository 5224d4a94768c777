//! Changes of one activity at the same time: the changing routes are serialised, so two `PUT`s
//! on one activity both take effect (each copies the activity's whole spec, changes its fields
//! and writes the copy back: unserialised, the second copy undid the first's change).

use omnistage::activity::ActivitySpec;
use omnistage::exec::Runtime;
use omnistage::sched::PolicyKind;
use omnistage_admin::{InProcess, TenantChange, TenantError, Tenants};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(20);

/// Tenants whose first `set_tenant` (the weight a `PUT` folds into the running configuration,
/// between reading the activity's spec and writing it back) waits until the test releases it.
struct Gated {
    rt: Runtime,
    entered: Mutex<Option<Sender<()>>>,
    release: Mutex<Option<Receiver<()>>>,
}

impl Tenants for Gated {
    fn set_tenant(&self, _path: &str, _change: &TenantChange) -> Result<(), TenantError> {
        let entered = self.entered.lock().unwrap().take();
        if let Some(tx) = entered {
            let rx = self.release.lock().unwrap().take().unwrap();
            tx.send(()).unwrap();
            rx.recv_timeout(DEADLINE).expect("released by the test");
        }
        Ok(())
    }
}

fn put(ip: &InProcess, path: &str, body: &str) -> u16 {
    let raw = format!(
        "PUT /api/v1/activities{path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    ip.answer(raw.as_bytes()).unwrap().status
}

#[test]
fn two_puts_on_one_activity_both_take_effect() {
    let rt = Runtime::builder().workers(1).start().unwrap();
    rt.create_activity("/x", ActivitySpec::weight(10)).unwrap();
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    let gated = Arc::new(Gated {
        rt,
        entered: Mutex::new(Some(entered_tx)),
        release: Mutex::new(Some(release_rx)),
    });
    let ip = Arc::new(InProcess::with_tenants(
        gated.clone(),
        |g: &Gated| &g.rt,
        None,
    ));
    // A changes the weight and stops between reading the spec and writing it back.
    let a = {
        let ip = ip.clone();
        std::thread::spawn(move || put(&ip, "/x", r#"{"weight": 70}"#))
    };
    entered_rx
        .recv_timeout(DEADLINE)
        .expect("A reached the running configuration");
    // B changes the policy meanwhile.
    let (b_done_tx, b_done_rx) = mpsc::channel();
    let b = {
        let ip = ip.clone();
        std::thread::spawn(move || {
            let s = put(&ip, "/x", r#"{"policy": "drr"}"#);
            let _ = b_done_tx.send(());
            s
        })
    };
    // Unserialised, B finishes now, on the spec A read; serialised, it waits for A. Either way
    // A goes on after this bounded wait (it only orders the unserialised case).
    let b_first = b_done_rx.recv_timeout(Duration::from_secs(1)).is_ok();
    release_tx.send(()).unwrap();
    assert_eq!(a.join().unwrap(), 200);
    assert_eq!(b.join().unwrap(), 200);
    let spec = gated.rt.with_activities(|t| {
        let id = t.lookup("/x").unwrap();
        t.get(id).unwrap().spec.clone()
    });
    assert_eq!(
        (spec.weight, spec.policy),
        (70, PolicyKind::Drr),
        "one change was lost (B finished before A: {b_first})"
    );
}

/// Tenants whose change passes every check but fails when applied, and which count the file
/// writes asked of them.
struct FailsToApply {
    rt: Runtime,
    writes: Mutex<usize>,
}

impl Tenants for FailsToApply {
    fn set_tenant(&self, _path: &str, _change: &TenantChange) -> Result<(), TenantError> {
        Err(TenantError::Refused("the server could not apply it".into()))
    }
    fn check_persist(&self, _edits: &[omnistage_http::persist::Edit]) -> Result<(), TenantError> {
        Ok(())
    }
    fn persist(&self, _edits: &[omnistage_http::persist::Edit]) -> Result<(), TenantError> {
        *self.writes.lock().unwrap() += 1;
        Ok(())
    }
}

/// A persisted change that passes its checks but that the server then fails to apply is
/// refused and never written: the file is written only once the change runs. (It was written
/// first, and the answer said "not changed" while the file kept the edit.)
#[test]
fn a_persisted_change_the_server_cannot_apply_is_not_written() {
    let rt = Runtime::builder().workers(1).start().unwrap();
    rt.create_activity("/tenants", ActivitySpec::weight(100))
        .unwrap();
    rt.create_activity("/tenants/a", ActivitySpec::weight(10))
        .unwrap();
    let t = Arc::new(FailsToApply {
        rt,
        writes: Mutex::new(0),
    });
    let ip = InProcess::with_tenants(t.clone(), |t: &FailsToApply| &t.rt, None);
    for body in [r#"{"weight": 70}"#, r#"{"cap_net": "10MB/s"}"#] {
        assert_eq!(put(&ip, "/tenants/a?persist=true", body), 409, "{body}");
    }
    assert_eq!(
        *t.writes.lock().unwrap(),
        0,
        "refused, yet written to the file"
    );
    let weight = t.rt.with_activities(|tb| {
        let id = tb.lookup("/tenants/a").unwrap();
        tb.get(id).unwrap().spec.weight
    });
    assert_eq!(weight, 10);
}
