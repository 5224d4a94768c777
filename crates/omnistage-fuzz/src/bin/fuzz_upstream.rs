//! AFL++ target `upstream` (see the crate doc); run it with `crates/omnistage-fuzz/run --seconds N upstream`.
fn main() {
    afl::fuzz!(|data: &[u8]| omnistage_fuzz::upstream(data));
}
