//! AFL++ target `chunked` (see the crate doc); run it with `crates/omnistage-fuzz/run --seconds N chunked`.
fn main() {
    afl::fuzz!(|data: &[u8]| omnistage_fuzz::chunked(data));
}
