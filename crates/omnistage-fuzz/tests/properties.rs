//! proptest properties for every parser, in the ordinary test suite: any bytes, and the seed
//! corpus's inputs mutated (bytes flipped, inserted and deleted), never panic a target, and each
//! target's own assertions (a refused input gets a defined answer) hold.
use std::path::PathBuf;

use proptest::prelude::*;

/// The seed corpus of `target` (`corpus/TARGET/*`), sorted by name.
fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| std::fs::read(p).expect("read seed"))
        .collect()
}

#[derive(Debug, Clone)]
enum Edit {
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Edit::Flip(at, b)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(at, b)| Edit::Insert(at, b)),
        (any::<usize>(), 1usize..16).prop_map(|(at, n)| Edit::Delete(at, n)),
    ]
}

/// A seed of `target` with up to 8 edits applied.
fn mutated(target: &'static str) -> impl Strategy<Value = Vec<u8>> {
    let seeds = seeds(target);
    assert!(!seeds.is_empty(), "{target} has no seeds");
    (0..seeds.len(), prop::collection::vec(edit(), 0..8)).prop_map(move |(i, edits)| {
        let mut v = seeds[i].clone();
        for e in edits {
            let at = |x: usize, len: usize| if len == 0 { 0 } else { x % (len + 1) };
            match e {
                Edit::Flip(x, b) if !v.is_empty() => {
                    let i = x % v.len();
                    v[i] ^= b;
                }
                Edit::Flip(..) => {}
                Edit::Insert(x, b) => {
                    let i = at(x, v.len());
                    v.splice(i..i, b);
                }
                Edit::Delete(x, n) => {
                    let i = at(x, v.len());
                    let end = (i + n).min(v.len());
                    v.drain(i..end);
                }
            }
        }
        v
    })
}

fn any_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..1024)
}

macro_rules! properties {
    ($($name:ident => $target:literal, $f:path;)*) => {
        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
            $(
                #[test]
                fn $name(random in any_bytes(), seeded in mutated($target)) {
                    $f(&random);
                    $f(&seeded);
                }
            )*
        }
    };
}

properties! {
    request_heads => "request", omnistage_fuzz::request;
    range_headers => "range", omnistage_fuzz::range;
    conditional_headers => "cond", omnistage_fuzz::conditional;
    path_decoding => "path", omnistage_fuzz::path;
    chunked_bodies => "chunked", omnistage_fuzz::chunked;
    config_files => "config", omnistage_fuzz::config;
    upstream_responses => "upstream", omnistage_fuzz::upstream;
    admin_requests => "admin", omnistage_fuzz::admin;
}

/// Every seed passes its own target unchanged (the corpus holds no known crash).
#[test]
fn seeds_pass_their_targets() {
    for (name, f) in omnistage_fuzz::TARGETS {
        for seed in seeds(name) {
            f(&seed);
        }
    }
}
