//! From a request target to a file: decoding and normalizing the target ([`decode_target`]),
//! then finding the file inside a tenant's docroot ([`resolve`]) so that no request can reach
//! anything outside it.
//!
//! Decoding rules ([`decode_target`]):
//!
//! - Forms: origin-form (`/path?query`) and `http://` absolute-form (`http://host/path`, whose
//!   path is taken; the host is [`crate::request::Request::host`]'s business). Anything else
//!   (`*`, authority-form, `https://`, relative paths) → 400. A fragment (`#`) → 400.
//! - The query is split off at the first `?` and returned raw (still percent-encoded).
//! - The path is percent-decoded once: `%252e` becomes the literal name `%2e`, never `.`.
//!   A malformed escape, an encoded or raw NUL, a control character, and bytes that are not
//!   valid UTF-8 (which includes overlong encodings such as `%c0%ae`) → 400.
//! - An encoded slash (`%2F`) → 404: a file name cannot contain `/`, so such a path names
//!   nothing, and refusing it keeps `..%2f` from ever becoming a separator.
//! - A backslash, raw or encoded (`%5C`) → 404: we never serve names containing `\`, so no
//!   platform can read it as a separator.
//! - Empty segments collapse (`//` → `/`), `.` segments vanish, `..` removes the previous
//!   segment; a `..` that would climb above the root → 404 (refused, not clamped, so every
//!   traversal attempt looks alike). A trailing `/`, `/.` or `/..` keeps a trailing slash.
//!
//! Resolving rules ([`resolve`]):
//!
//! - The decoded path is joined to the docroot and canonicalized (symlinks followed); the result
//!   must lie inside the canonicalized docroot, else 404. A symlink pointing out of the docroot is
//!   therefore 404 while one pointing inside is served (as its target: `Resolved::path` is the
//!   canonical path, so its content type follows the target's name).
//! - Only regular files are served; sockets, FIFOs and devices → 404.
//! - A directory serves its first index file that exists (each index also checked to stay
//!   inside); no index → 404 (no listings). A directory named without its trailing slash, that
//!   has an index, → 301 to the path plus `/` (percent-encoded, query dropped), so relative links
//!   in the index page work.
//! - The file can still change between `resolve` and `open` (a tenant that controls its own
//!   docroot could swap a directory for a symlink); the glue opens `Resolved::path` at once.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::ascii::strip_prefix_ignore_ascii_case;
use crate::error::HttpError;

/// Longest request target accepted by [`decode_target`] (the parser's `uri_bytes_max` is
/// normally smaller).
pub const TARGET_BYTES_MAX: usize = 64 * 1024;
/// Most segments in a decoded path → 400 beyond.
pub const PATH_SEGMENTS_MAX: usize = 256;

/// A file found inside a docroot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The canonical docroot.
    pub root: PathBuf,
    /// The canonical path of the file (inside the canonical docroot).
    pub path: PathBuf,
    /// Its length in bytes.
    pub len: u64,
    /// Its modification time.
    pub modified: SystemTime,
}

/// Decodes and normalizes a request target into `(path, query)`; see the module doc for rules.
/// The path always starts with `/`.
pub fn decode_target(target: &str) -> Result<(String, Option<String>), HttpError> {
    let mut path = String::new();
    let mut scratch = Vec::new();
    let query = decode_target_into(target, &mut path, &mut scratch)?;
    Ok((path, query.map(str::to_string)))
}

/// [`decode_target`] without allocating once the buffers have grown: the decoded path is
/// written into `path` (cleared first), `scratch` holds the percent-decoded bytes, and the
/// query is returned as a slice of `target` (still percent-encoded).
pub fn decode_target_into<'t>(
    target: &'t str,
    path: &mut String,
    scratch: &mut Vec<u8>,
) -> Result<Option<&'t str>, HttpError> {
    path.clear();
    if target.len() > TARGET_BYTES_MAX {
        return Err(HttpError::UriTooLong);
    }
    let rest = if target.starts_with('/') {
        target
    } else {
        let Some(after) = strip_prefix_ignore_ascii_case(target, "http://") else {
            return Err(HttpError::BadTarget("unsupported request-target form"));
        };
        let authority_end = after.find(['/', '?', '#']).unwrap_or(after.len());
        if authority_end == 0 {
            return Err(HttpError::BadTarget("absolute-form target without host"));
        }
        &after[authority_end..]
    };
    if rest.contains('#') {
        return Err(HttpError::BadTarget("fragment in target"));
    }
    let (raw_path, query) = match rest.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (rest, None),
    };

    percent_decode(raw_path.as_bytes(), scratch)?;
    let decoded =
        std::str::from_utf8(scratch).map_err(|_| HttpError::BadTarget("invalid UTF-8"))?;

    // Segments are written to `path` as they come; `..` takes the last one off again.
    let mut depth = 0usize;
    let mut trailing_slash = false;
    for seg in decoded.split('/') {
        trailing_slash = true;
        match seg {
            "" | "." => {}
            ".." => {
                if depth == 0 {
                    path.clear();
                    return Err(HttpError::NotFound);
                }
                depth -= 1;
                let last = path.rfind('/').unwrap_or(0);
                path.truncate(last);
            }
            name => {
                trailing_slash = false;
                if depth == PATH_SEGMENTS_MAX {
                    path.clear();
                    return Err(HttpError::BadTarget("too many path segments"));
                }
                depth += 1;
                path.push('/');
                path.push_str(name);
            }
        }
    }
    if depth == 0 || trailing_slash {
        path.push('/');
    }
    Ok(query)
}

/// Percent-decodes `raw` into `out` (cleared first).
fn percent_decode(raw: &[u8], out: &mut Vec<u8>) -> Result<(), HttpError> {
    out.clear();
    let mut i = 0;
    while i < raw.len() {
        let b = raw[i];
        let byte = if b == b'%' {
            let hi = raw.get(i + 1).copied().and_then(hex_value);
            let lo = raw.get(i + 2).copied().and_then(hex_value);
            let (Some(hi), Some(lo)) = (hi, lo) else {
                return Err(HttpError::BadTarget("malformed percent escape"));
            };
            i += 3;
            let v = hi << 4 | lo;
            if v == b'/' {
                return Err(HttpError::NotFound);
            }
            v
        } else {
            i += 1;
            b
        };
        match byte {
            0 => return Err(HttpError::BadTarget("NUL in path")),
            b'\\' => return Err(HttpError::NotFound),
            b if b < 0x20 || b == 0x7f => {
                return Err(HttpError::BadTarget("control character in path"))
            }
            b => out.push(b),
        }
    }
    Ok(())
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Finds the file for `decoded` (from [`decode_target`]) inside `docroot`; see the module doc.
pub fn resolve(
    docroot: &Path,
    decoded: &str,
    index_files: &[String],
) -> Result<Resolved, HttpError> {
    // Defense in depth: the path must look like decode_target's output.
    if !decoded.starts_with('/')
        || decoded
            .split('/')
            .any(|s| s == "." || s == ".." || s.contains(['\0', '\\']))
    {
        return Err(HttpError::NotFound);
    }
    let root = docroot.canonicalize().map_err(|_| HttpError::NotFound)?;
    let relative = decoded.trim_start_matches('/');
    let trailing_slash = decoded.ends_with('/');
    let joined = if relative.is_empty() {
        root.clone()
    } else {
        root.join(relative)
    };
    let canonical = joined.canonicalize().map_err(|_| HttpError::NotFound)?;
    if !canonical.starts_with(&root) {
        return Err(HttpError::NotFound);
    }
    let meta = fs::metadata(&canonical).map_err(|_| HttpError::NotFound)?;
    if meta.is_file() {
        if trailing_slash {
            return Err(HttpError::NotFound);
        }
        return Ok(resolved(root, canonical, &meta));
    }
    if !meta.is_dir() {
        return Err(HttpError::NotFound);
    }
    for name in index_files {
        if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\\', '\0']) {
            continue;
        }
        let Ok(index) = canonical.join(name).canonicalize() else {
            continue;
        };
        if !index.starts_with(&root) {
            continue;
        }
        let Ok(index_meta) = fs::metadata(&index) else {
            continue;
        };
        if !index_meta.is_file() {
            continue;
        }
        if !trailing_slash {
            let mut location = percent_encode_path(decoded);
            location.push('/');
            return Err(HttpError::MovedPermanently { location });
        }
        return Ok(resolved(root, index, &index_meta));
    }
    Err(HttpError::NotFound)
}

fn resolved(root: PathBuf, path: PathBuf, meta: &fs::Metadata) -> Resolved {
    Resolved {
        root,
        path,
        len: meta.len(),
        modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
    }
}

/// Percent-encodes a decoded path for a `Location` header: keeps unreserved characters,
/// sub-delims, `:`, `@` and `/`; encodes everything else (including `%`, `?`, `#`, spaces and
/// non-ASCII bytes).
pub fn percent_encode_path(path: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(path.len());
    for &b in path.as_bytes() {
        let keep = b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/".contains(&b);
        if keep {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 0xf)] as char);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn dec(t: &str) -> Result<(String, Option<String>), HttpError> {
        decode_target(t)
    }

    fn path_of(t: &str) -> String {
        dec(t).unwrap_or_else(|e| panic!("{t}: {e}")).0
    }

    /// An absolute-form check once sliced the target at byte 7 whatever it held.
    #[test]
    fn a_multibyte_char_across_the_scheme_is_refused_not_a_panic() {
        for t in ["http:/\u{e9}x", "abcdef\u{e9}", "\u{1f600}\u{1f600}"] {
            assert!(
                matches!(dec(t), Err(HttpError::BadTarget(_))),
                "{t:?}: {:?}",
                dec(t)
            );
        }
    }

    #[test]
    fn decodes_and_splits_query() {
        assert_eq!(
            dec("/a/b.html?x=1&y=%20"),
            Ok(("/a/b.html".into(), Some("x=1&y=%20".into())))
        );
        assert_eq!(dec("/?"), Ok(("/".into(), Some(String::new()))));
        assert_eq!(path_of("/"), "/");
        assert_eq!(path_of("/hello%20world.txt"), "/hello world.txt");
        assert_eq!(path_of("/caf%C3%A9"), "/café");
        assert_eq!(path_of("/a?b?c"), "/a");
        assert_eq!(dec("/a?b?c").unwrap().1.as_deref(), Some("b?c"));
        // Double encoding decodes once, to a literal name.
        assert_eq!(path_of("/%252e%252e/x"), "/%2e%2e/x");
        // A '+' is not a space in paths.
        assert_eq!(path_of("/a+b"), "/a+b");
    }

    #[test]
    fn normalizes_segments() {
        assert_eq!(path_of("//a///b"), "/a/b");
        assert_eq!(path_of("/a/./b"), "/a/b");
        assert_eq!(path_of("/a/../b"), "/b");
        assert_eq!(path_of("/a/%2e%2E/b"), "/b");
        assert_eq!(path_of("/a/b/"), "/a/b/");
        assert_eq!(path_of("/a/b/."), "/a/b/");
        assert_eq!(path_of("/a/b/.."), "/a/");
        assert_eq!(path_of("/a/.."), "/");
        assert_eq!(path_of("/."), "/");
        assert_eq!(path_of("/..."), "/...");
        assert_eq!(path_of("/.hidden"), "/.hidden");
    }

    #[test]
    fn absolute_form_takes_the_path() {
        assert_eq!(
            dec("http://a.test/x/y?q"),
            Ok(("/x/y".into(), Some("q".into())))
        );
        assert_eq!(dec("HTTP://a.test"), Ok(("/".into(), None)));
        assert_eq!(
            dec("http://a.test?q=1"),
            Ok(("/".into(), Some("q=1".into())))
        );
        assert_eq!(dec("http://a.test/../etc/passwd"), Err(HttpError::NotFound));
        for bad in [
            "https://a.test/x",
            "ftp://a/x",
            "*",
            "a.test:80",
            "x/y",
            "",
            "http:///x",
            "http://",
        ] {
            assert!(
                matches!(dec(bad), Err(HttpError::BadTarget(_))),
                "{bad:?}: {:?}",
                dec(bad)
            );
        }
    }

    #[test]
    fn refuses_bad_encodings() {
        for bad in [
            "/a%",
            "/a%2",
            "/a%zz",
            "/a%%41",
            "/%00",
            "/a%00.html",
            "/a%0d%0a",
            "/%7f",
            "/%c0%ae%c0%ae/x",
            "/%e0%80%ae",
            "/%ff",
            "/a#frag",
        ] {
            let e = dec(bad).expect_err(bad);
            assert_eq!(e.status(), 400, "{bad}: {e:?}");
            assert!(!e.closes_connection());
        }
        assert_eq!(
            dec(&format!("/{}", "a".repeat(TARGET_BYTES_MAX))),
            Err(HttpError::UriTooLong)
        );
        let deep = "/a".repeat(PATH_SEGMENTS_MAX + 1);
        assert!(matches!(dec(&deep), Err(HttpError::BadTarget(_))));
        assert!(dec(&"/a".repeat(PATH_SEGMENTS_MAX)).is_ok());
    }

    #[test]
    fn traversal_is_404_when_decoding() {
        for t in [
            "/..",
            "/../",
            "/../x",
            "/%2e%2e/x",
            "/%2E%2e/",
            "/.%2e/x",
            "/%2e./x",
            "/..%2fx",
            "/..%2Fx",
            "/a%2f..%2f..%2fx",
            "/%2e%2e%5cx",
            "/..\\x",
            "/a/%5c",
            "/./../",
            "/a/../../x",
            "/a/b/../../../x",
            "http://h/../x",
        ] {
            assert_eq!(dec(t), Err(HttpError::NotFound), "{t}");
        }
    }

    struct Tree {
        _tmp: tempfile::TempDir,
        base: PathBuf,
        www: PathBuf,
    }

    /// base/secret.txt (outside), base/www/{index.html, a.txt, sub/index.html, sub/page.css,
    /// empty/, %2e%2e/x.txt, in.txt -> a.txt, out.txt -> ../secret.txt, outdir -> .., linkidx/}.
    fn tree() -> Tree {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().canonicalize().unwrap();
        let www = base.join("www");
        fs::create_dir_all(www.join("sub")).unwrap();
        fs::create_dir_all(www.join("empty")).unwrap();
        fs::create_dir_all(www.join("%2e%2e")).unwrap();
        fs::create_dir_all(www.join("linkidx")).unwrap();
        fs::create_dir_all(www.join("dir with space")).unwrap();
        fs::write(base.join("secret.txt"), "secret").unwrap();
        fs::write(www.join("index.html"), "root index").unwrap();
        fs::write(www.join("a.txt"), "aaa").unwrap();
        fs::write(www.join("sub/index.html"), "sub index").unwrap();
        fs::write(www.join("sub/page.css"), "css").unwrap();
        fs::write(www.join("%2e%2e/x.txt"), "literal").unwrap();
        fs::write(www.join("dir with space/index.htm"), "spaced").unwrap();
        symlink("a.txt", www.join("in.txt")).unwrap();
        symlink("../secret.txt", www.join("out.txt")).unwrap();
        symlink("..", www.join("outdir")).unwrap();
        symlink("../../secret.txt", www.join("linkidx/index.html")).unwrap();
        Tree {
            _tmp: tmp,
            base,
            www,
        }
    }

    fn index() -> Vec<String> {
        vec!["index.html".into(), "index.htm".into()]
    }

    /// The whole pipeline the glue runs: decode, then resolve.
    fn serve(t: &Tree, target: &str) -> Result<Resolved, HttpError> {
        let (p, _) = decode_target(target)?;
        resolve(&t.www, &p, &index())
    }

    #[test]
    fn serves_files_and_indexes() {
        let t = tree();
        let r = serve(&t, "/a.txt").unwrap();
        assert_eq!(r.path, t.www.join("a.txt"));
        assert_eq!(r.len, 3);
        assert!(r.modified > SystemTime::UNIX_EPOCH);
        assert_eq!(serve(&t, "/").unwrap().path, t.www.join("index.html"));
        assert_eq!(
            serve(&t, "/sub/").unwrap().path,
            t.www.join("sub/index.html")
        );
        assert_eq!(serve(&t, "/sub/page.css").unwrap().len, 3);
        assert_eq!(
            serve(&t, "/sub/../a.txt").unwrap().path,
            t.www.join("a.txt")
        );
        assert_eq!(
            serve(&t, "/dir%20with%20space/").unwrap().path,
            t.www.join("dir with space/index.htm")
        );
        // The literal directory named "%2e%2e" is reachable through double encoding only.
        assert_eq!(
            serve(&t, "/%252e%252e/x.txt").unwrap().path,
            t.www.join("%2e%2e/x.txt")
        );
        // Symlink inside the docroot: served as its target.
        let r = serve(&t, "/in.txt").unwrap();
        assert_eq!(r.path, t.www.join("a.txt"));
    }

    #[test]
    fn directories_without_slash_redirect() {
        let t = tree();
        assert_eq!(
            serve(&t, "/sub"),
            Err(HttpError::MovedPermanently {
                location: "/sub/".into()
            })
        );
        assert_eq!(
            serve(&t, "/dir%20with%20space?x=1"),
            Err(HttpError::MovedPermanently {
                location: "/dir%20with%20space/".into()
            })
        );
        // No index: 404, with or without slash; no listing.
        assert_eq!(serve(&t, "/empty"), Err(HttpError::NotFound));
        assert_eq!(serve(&t, "/empty/"), Err(HttpError::NotFound));
        // Index lists are taken in order and skip unsafe names.
        let weird = vec![
            "../secret.txt".to_string(),
            "".into(),
            "..".into(),
            "index.htm".into(),
        ];
        assert_eq!(resolve(&t.www, "/", &weird), Err(HttpError::NotFound));
        assert_eq!(
            resolve(&t.www, "/dir with space/", &weird).unwrap().path,
            t.www.join("dir with space/index.htm")
        );
    }

    #[test]
    fn missing_and_odd_paths_are_404() {
        let t = tree();
        for target in [
            "/nope",
            "/nope/",
            "/a.txt/",
            "/a.txt/x",
            "/sub/nope.html",
            "/in.txt/",
        ] {
            assert_eq!(serve(&t, target), Err(HttpError::NotFound), "{target}");
        }
        // A docroot that does not exist.
        assert_eq!(
            resolve(&t.base.join("missing"), "/", &index()),
            Err(HttpError::NotFound)
        );
    }

    #[test]
    fn traversal_is_404_end_to_end() {
        let t = tree();
        for target in [
            "/../secret.txt",
            "/%2e%2e/secret.txt",
            "/%2E%2e/secret.txt",
            "/%2E%2e/",
            "/..%2fsecret.txt",
            "/%2e%2e%5csecret.txt",
            "/..\\secret.txt",
            "/./../secret.txt",
            "/./../",
            "/sub/../../secret.txt",
            "/%252e%252e/secret.txt",
            "http://a.test/../secret.txt",
            "http://a.test/%2e%2e/secret.txt",
            "/out.txt",
            "/outdir/secret.txt",
            "/outdir/",
            "/linkidx/",
        ] {
            assert_eq!(serve(&t, target), Err(HttpError::NotFound), "{target}");
        }
        // Overlong UTF-8 for '.' is not a dot: refused by UTF-8 validation.
        assert_eq!(
            serve(&t, "/%c0%ae%c0%ae/secret.txt").unwrap_err().status(),
            400
        );
        // resolve alone refuses un-normalized input.
        for raw in [
            "/../secret.txt",
            "../secret.txt",
            "secret.txt",
            "/a/./b",
            "/a\\b",
        ] {
            assert_eq!(
                resolve(&t.www, raw, &index()),
                Err(HttpError::NotFound),
                "{raw}"
            );
        }
    }

    #[test]
    fn location_encoding() {
        assert_eq!(percent_encode_path("/a b/é?#%"), "/a%20b/%C3%A9%3F%23%25");
        assert_eq!(percent_encode_path("/a-b_c.d~e/(x):@"), "/a-b_c.d~e/(x):@");
    }
}
