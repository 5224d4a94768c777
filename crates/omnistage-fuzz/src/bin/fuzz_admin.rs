//! AFL++ target `admin` (see the crate doc); run it with `crates/omnistage-fuzz/run --seconds N admin`.
fn main() {
    afl::fuzz!(|data: &[u8]| omnistage_fuzz::admin(data));
}
