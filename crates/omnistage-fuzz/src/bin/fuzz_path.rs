//! AFL++ target `path` (see the crate doc); run it with `crates/omnistage-fuzz/run --seconds N path`.
fn main() {
    afl::fuzz!(|data: &[u8]| omnistage_fuzz::path(data));
}
