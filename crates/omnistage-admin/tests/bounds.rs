//! Listings are bounded: past `LIST_ENTRIES_MAX` entries the tree and the stages leave the rest
//! out and say so (`"truncated": true, "omitted": N`), with the totals still counting them.

use omnistage::activity::ActivitySpec;
use omnistage::exec::{Affinity, Ctx, Runtime, StageConfig};
use omnistage_admin::{InProcess, TenantChange, TenantError, Tenants, LIST_ENTRIES_MAX};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Bare(Runtime);

impl Tenants for Bare {
    fn set_tenant(&self, path: &str, _: &TenantChange) -> Result<(), TenantError> {
        Err(TenantError::NotATenant(path.into()))
    }
}

fn get(ip: &InProcess, path: &str) -> serde_json::Value {
    let raw = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    let a = ip.answer(raw.as_bytes()).unwrap();
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    serde_json::from_slice(&a.body).unwrap()
}

fn nodes(n: &serde_json::Value) -> usize {
    1 + n["children"]
        .as_array()
        .map(|c| c.iter().map(nodes).sum())
        .unwrap_or(0)
}

#[test]
fn the_tree_and_the_stages_past_their_bound_are_cut_and_say_so() {
    let mut b = Runtime::builder().workers(1);
    let stage = b
        .stage("s", StageConfig::default(), |_| {
            |_: &mut Ctx<'_>, _: u32| {}
        })
        .unwrap();
    let rt = b.start().unwrap();
    // `/`, `/infra`, `/t` and LIST_ENTRIES_MAX more under `/t`: past the bound by 3 nodes.
    rt.create_activity("/t", ActivitySpec::weight(10)).unwrap();
    let mut ids = Vec::new();
    for i in 0..LIST_ENTRIES_MAX {
        ids.push(
            rt.create_activity(&format!("/t/{i:05}"), ActivitySpec::weight(1))
                .unwrap(),
        );
    }
    // One message in each: LIST_ENTRIES_MAX rows of (s, activity), and one more below.
    for &id in &ids {
        rt.send(&stage, id, Affinity::Any, 0).unwrap();
    }
    rt.send(&stage, 0, Affinity::Any, 0).unwrap();
    let end = Instant::now() + Duration::from_secs(60);
    while rt.pending() > 0 {
        assert!(Instant::now() < end, "the runtime did not drain");
        std::thread::sleep(Duration::from_millis(5));
    }
    let ip = InProcess::with_tenants(Arc::new(Bare(rt)), |b: &Bare| &b.0, None);

    let t = get(&ip, "/api/v1/tree");
    assert_eq!(t["truncated"], true);
    assert_eq!(t["omitted"], 3);
    assert_eq!(nodes(&t["root"]), LIST_ENTRIES_MAX);
    // The totals count what was left out: every message of the stage is the root's.
    assert_eq!(
        t["root"]["total"]["messages"].as_u64(),
        Some(LIST_ENTRIES_MAX as u64 + 1),
        "{}",
        t["root"]["total"]
    );

    let st = get(&ip, "/api/v1/stages");
    assert_eq!(st["truncated"], true, "{}", st["omitted"]);
    let rows: usize = st["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["activities"].as_array().unwrap().len())
        .sum();
    assert_eq!(rows, LIST_ENTRIES_MAX);
    assert!(st["omitted"].as_u64().unwrap() >= 1, "{}", st["omitted"]);

    // One activity's sub-tree is not cut by the whole tree's bound.
    let one = get(&ip, "/api/v1/activities/t/09999");
    assert_eq!(one["path"], "/t/09999");
}
