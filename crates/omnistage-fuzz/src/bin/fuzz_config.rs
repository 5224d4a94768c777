//! AFL++ target `config` (see the crate doc); run it with `crates/omnistage-fuzz/run --seconds N config`.
fn main() {
    afl::fuzz!(|data: &[u8]| omnistage_fuzz::config(data));
}
