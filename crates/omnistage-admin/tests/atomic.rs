//! A `PUT` is one change: a reload of the config file (SIGHUP) does not run in the middle of
//! it, and a step that fails after earlier ones were applied puts them back.

use omnistage_admin::{InProcess, Served, TenantChange, TenantError, Tenants};
use omnistage_http::config::TenantConfig;
use omnistage_http::persist::{ConfigFile, Edit};
use omnistage_http::server::{Server, ServerOptions};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(20);

fn served(dir: &Path) -> (Arc<Served>, PathBuf) {
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n\n\
         [[tenant]]\nname = \"a\"\nhosts = [\"a\"]\ndocroot = '{d}'\nweight = 50\n",
        d = dir.display()
    );
    let path = dir.join("omnistage.toml");
    std::fs::write(&path, toml).unwrap();
    let (config, file) = ConfigFile::load(&path).unwrap();
    let server = Server::start(
        config,
        ServerOptions {
            workers: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    (Arc::new(Served::new(server, Some(file))), path)
}

/// What a `PUT` does to the file: `gate` stops it in its file write (after the server's
/// tenant and the activity were changed) until the test lets it go; `fail_write` makes the
/// write fail. Everything else is the served server's.
struct Wrapped {
    served: Arc<Served>,
    gate: Mutex<Option<(Sender<()>, Receiver<()>)>>,
    fail_write: bool,
}

impl Tenants for Wrapped {
    fn set_tenant(&self, path: &str, change: &TenantChange) -> Result<(), TenantError> {
        self.served.set_tenant(path, change)
    }
    fn check_tenant(&self, path: &str, change: &TenantChange) -> Result<(), TenantError> {
        self.served.check_tenant(path, change)
    }
    fn configured_activities(&self) -> Vec<String> {
        self.served.configured_activities()
    }
    fn check_persist(&self, edits: &[Edit]) -> Result<(), TenantError> {
        self.served.check_persist(edits)
    }
    fn persist(&self, edits: &[Edit]) -> Result<(), TenantError> {
        let gate = self.gate.lock().unwrap().take();
        if let Some((entered, release)) = gate {
            entered.send(()).unwrap();
            release
                .recv_timeout(DEADLINE)
                .expect("released by the test");
        }
        if self.fail_write {
            return Err(TenantError::Refused("the disk is full".into()));
        }
        self.served.persist(edits)
    }
    fn changes(&self) -> Option<&Mutex<()>> {
        self.served.changes()
    }
    fn saved_tenant(&self, path: &str) -> Option<TenantConfig> {
        self.served.saved_tenant(path)
    }
    fn restore_tenant(&self, path: &str, saved: &TenantConfig) -> Result<(), TenantError> {
        self.served.restore_tenant(path, saved)
    }
}

fn put(ip: &InProcess, path: &str, body: &str) -> (u16, String) {
    let raw = format!(
        "PUT /api/v1/activities{path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let a = ip.answer(raw.as_bytes()).unwrap();
    (a.status, String::from_utf8_lossy(&a.body).into_owned())
}

/// (running config's weight and net cap of tenant a, the runtime's weight of /tenants/a)
fn tenant_a(s: &Served) -> (u32, Option<u64>, u32) {
    let c = s.server().config();
    let t = c.tenants.iter().find(|t| t.name == "a").unwrap();
    let w = s.runtime().with_activities(|tb| {
        let id = tb.lookup("/tenants/a").unwrap();
        tb.get(id).unwrap().spec.weight
    });
    (t.weight, t.net_cap_bytes_per_s, w)
}

/// A SIGHUP that comes while a persisted `PUT` is between applying its change and writing the
/// file waits for the `PUT`: it then reads the file with the change in it, and the server runs
/// what the file says. (It ran in between: it reloaded the file without the change, undoing
/// it in the server, and the `PUT` then wrote it to the file; the API had answered 200 and
/// the server ran without the change until the next reload.)
#[test]
fn a_reload_does_not_run_in_the_middle_of_a_persisted_change() {
    let dir = tempfile::tempdir().unwrap();
    let (s, path) = served(dir.path());
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    let w = Arc::new(Wrapped {
        served: s.clone(),
        gate: Mutex::new(Some((entered_tx, release_rx))),
        fail_write: false,
    });
    let ip = Arc::new(InProcess::with_tenants(
        w,
        |w: &Wrapped| w.served.runtime(),
        None,
    ));
    let a = {
        let ip = ip.clone();
        std::thread::spawn(move || {
            put(
                &ip,
                "/tenants/a?persist=true",
                r#"{"weight": 70, "cap_net": "10MB/s"}"#,
            )
        })
    };
    entered_rx
        .recv_timeout(DEADLINE)
        .expect("the PUT reached its file write");
    // The change is applied in the server, not yet in the file.
    assert_eq!(tenant_a(&s), (70, Some(10_000_000), 70));
    let (reloaded_tx, reloaded_rx) = mpsc::channel();
    let reload = {
        let s = s.clone();
        std::thread::spawn(move || {
            let r = s.reload_file();
            let _ = reloaded_tx.send(());
            r
        })
    };
    // Unserialised, the reload finishes now; serialised, it waits for the PUT. Either way the
    // PUT goes on after this bounded wait (it only orders the unserialised case).
    let reload_first = reloaded_rx.recv_timeout(Duration::from_secs(1)).is_ok();
    release_tx.send(()).unwrap();
    let (status, body) = a.join().unwrap();
    assert_eq!(status, 200, "{body}");
    reload.join().unwrap().expect("the reload applies");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("weight = 70"), "{text}");
    assert!(text.contains("net_cap = \"10000000B/s\""), "{text}");
    assert_eq!(
        tenant_a(&s),
        (70, Some(10_000_000), 70),
        "the file has the change, the server does not (the reload ran in the middle of the \
         PUT: {reload_first})"
    );
}

/// A persisted `PUT` whose file write fails after the server's tenant and the activity were
/// changed puts both back: the answer says nothing changed, and nothing did. (The change kept
/// running, answered 500 "runs, but the config file was not written".)
#[test]
fn a_change_whose_file_write_fails_is_undone() {
    let dir = tempfile::tempdir().unwrap();
    let (s, path) = served(dir.path());
    let before_file = std::fs::read_to_string(&path).unwrap();
    let w = Arc::new(Wrapped {
        served: s.clone(),
        gate: Mutex::new(None),
        fail_write: true,
    });
    let ip = InProcess::with_tenants(w, |w: &Wrapped| w.served.runtime(), None);
    let before = tenant_a(&s);
    assert_eq!(before, (50, None, 50));
    let (status, body) = put(
        &ip,
        "/tenants/a?persist=true",
        r#"{"weight": 70, "cap_net": "10MB/s"}"#,
    );
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("not changed"), "{body}");
    assert!(body.contains("the disk is full"), "{body}");
    assert_eq!(tenant_a(&s), before, "the change was left applied: {body}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), before_file);
}
