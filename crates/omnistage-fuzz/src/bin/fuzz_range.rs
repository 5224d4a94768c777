//! AFL++ target `range` (see the crate doc); run it with `crates/omnistage-fuzz/run --seconds N range`.
fn main() {
    afl::fuzz!(|data: &[u8]| omnistage_fuzz::range(data));
}
