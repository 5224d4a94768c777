//! AFL++ target `cond` (see the crate doc); run it with `crates/omnistage-fuzz/run --seconds N cond`.
fn main() {
    afl::fuzz!(|data: &[u8]| omnistage_fuzz::conditional(data));
}
