//! Cost of one scheduling decision: `Tree::pick` + `Tree::charge` through a three-level tree
//! (root -> groups -> leaves, `ceil(sqrt(leaves))` groups), every node running the same policy,
//! for each policy at 1 to 10,000 active leaves. Every charge says the leaf is still backlogged,
//! so all leaves stay active and the measured state is the steady, fully loaded one.
//!
//! Kept short (about a minute for the whole file): `cargo bench -p omnistage --bench sched`,
//! or add `-- --quick`, or filter, e.g. `-- sfq/10000`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use omnistage::sched::{ClientParams, NodeId, PolicyKind, Tree};
use std::hint::black_box;
use std::time::Duration;

const LEAVES: [usize; 5] = [1, 10, 100, 1_000, 10_000];
/// Cost charged per dispatch (ns): above the tree's minimum cost.
const COST: u64 = 1_000;

fn ceil_sqrt(n: usize) -> usize {
    let mut g = 1;
    while g * g < n {
        g += 1;
    }
    g
}

/// Varied weights and priorities so that fair-queue heaps and DRR rounds are not degenerate.
fn params(i: usize) -> ClientParams {
    ClientParams {
        weight: 1 + (i * 37 % 1000) as u32,
        priority: (i % 4) as u8,
        shared: None,
    }
}

fn build(kind: PolicyKind, leaves: usize) -> Tree {
    let mut tree = Tree::new(kind);
    let root = tree.root();
    let groups: Vec<NodeId> = (0..ceil_sqrt(leaves))
        .map(|g| tree.add_interior(root, params(g), kind).unwrap())
        .collect();
    for i in 0..leaves {
        let leaf = tree.add_leaf(groups[i % groups.len()], params(i)).unwrap();
        tree.leaf_ready(leaf, 0);
    }
    tree
}

fn pick_charge(c: &mut Criterion) {
    let mut group = c.benchmark_group("sched_pick_charge");
    group
        .measurement_time(Duration::from_secs(1))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(20)
        .throughput(Throughput::Elements(1));
    for kind in PolicyKind::ALL {
        for leaves in LEAVES {
            let mut tree = build(kind, leaves);
            let mut now = 0u64;
            group.bench_function(BenchmarkId::new(kind.name(), leaves), |b| {
                b.iter(|| {
                    let leaf = tree.pick(now).expect("every leaf is backlogged");
                    now += COST;
                    tree.charge(leaf, COST, true, now);
                    black_box(leaf)
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, pick_charge);
criterion_main!(benches);
