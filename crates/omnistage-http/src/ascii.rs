//! Byte-safe helpers for `str`s that come from outside (clients, backends, config, admin):
//! never index a `str` by a byte offset found in client input, since a multi-byte character
//! across that offset panics. These compare bytes and only cut where the cut is proven to fall
//! on a character boundary.

/// `s` without `prefix` when `s` starts with it, ASCII case ignored. `prefix` must be ASCII, so
/// when its bytes match, the byte after them starts a character and the cut is safe.
pub fn strip_prefix_ignore_ascii_case<'s>(s: &'s str, prefix: &str) -> Option<&'s str> {
    debug_assert!(prefix.is_ascii(), "prefix must be ASCII");
    let head = s.as_bytes().get(..prefix.len())?;
    if head.eq_ignore_ascii_case(prefix.as_bytes()) {
        // The matched bytes are ASCII, so `prefix.len()` is a char boundary of `s`.
        s.get(prefix.len()..)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_ascii_prefix_in_any_case() {
        assert_eq!(
            strip_prefix_ignore_ascii_case("BYTES=0-1", "bytes="),
            Some("0-1")
        );
        assert_eq!(strip_prefix_ignore_ascii_case("bytes=", "bytes="), Some(""));
        assert_eq!(strip_prefix_ignore_ascii_case("byte", "bytes="), None);
        assert_eq!(strip_prefix_ignore_ascii_case("bytez=1", "bytes="), None);
    }

    #[test]
    fn a_multibyte_char_across_the_cut_is_no_match_not_a_panic() {
        // 'ÿ' is two bytes (C3 BF): byte 6 falls inside it.
        assert_eq!(
            strip_prefix_ignore_ascii_case("bytes\u{ff}0-2", "bytes="),
            None
        );
        assert_eq!(
            strip_prefix_ignore_ascii_case("http:/\u{e9}x", "http://"),
            None
        );
        assert_eq!(strip_prefix_ignore_ascii_case("\u{1f600}", "ab"), None);
    }
}
