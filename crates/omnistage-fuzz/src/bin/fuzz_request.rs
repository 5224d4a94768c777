//! AFL++ target `request` (see the crate doc); run it with `crates/omnistage-fuzz/run --seconds N request`.
fn main() {
    afl::fuzz!(|data: &[u8]| omnistage_fuzz::request(data));
}
