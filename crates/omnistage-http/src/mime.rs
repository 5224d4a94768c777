//! Content types: the `Content-Type` value for a file, chosen by its extension alone
//! (case-insensitive). Text types carry `; charset=utf-8`; unknown extensions, and files without
//! one, are `application/octet-stream`.

use std::path::Path;

/// The type sent when the extension is unknown.
pub const DEFAULT_TYPE: &str = "application/octet-stream";

/// Longest extension looked up; longer ones are unknown.
const EXTENSION_BYTES_MAX: usize = 8;

/// The `Content-Type` value for `path`.
pub fn content_type(path: &Path) -> &'static str {
    let Some(ext) = path.extension().and_then(|e| e.to_str()) else {
        return DEFAULT_TYPE;
    };
    if ext.len() > EXTENSION_BYTES_MAX {
        return DEFAULT_TYPE;
    }
    let mut lower = [0u8; EXTENSION_BYTES_MAX];
    let lower = &mut lower[..ext.len()];
    lower.copy_from_slice(ext.as_bytes());
    lower.make_ascii_lowercase();
    match &*lower {
        b"html" | b"htm" => "text/html; charset=utf-8",
        b"css" => "text/css; charset=utf-8",
        b"js" | b"mjs" => "text/javascript; charset=utf-8",
        b"json" => "application/json",
        b"txt" => "text/plain; charset=utf-8",
        b"xml" => "application/xml; charset=utf-8",
        b"svg" => "image/svg+xml",
        b"png" => "image/png",
        b"jpg" | b"jpeg" => "image/jpeg",
        b"gif" => "image/gif",
        b"webp" => "image/webp",
        b"ico" => "image/x-icon",
        b"wasm" => "application/wasm",
        b"pdf" => "application/pdf",
        b"woff" => "font/woff",
        b"woff2" => "font/woff2",
        b"mp4" => "video/mp4",
        b"webm" => "video/webm",
        b"gz" => "application/gzip",
        b"zip" => "application/zip",
        _ => DEFAULT_TYPE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_types() {
        let cases = [
            ("index.html", "text/html; charset=utf-8"),
            ("a.HTM", "text/html; charset=utf-8"),
            ("s.css", "text/css; charset=utf-8"),
            ("app.js", "text/javascript; charset=utf-8"),
            ("m.mjs", "text/javascript; charset=utf-8"),
            ("d.json", "application/json"),
            ("r.txt", "text/plain; charset=utf-8"),
            ("f.xml", "application/xml; charset=utf-8"),
            ("i.svg", "image/svg+xml"),
            ("i.png", "image/png"),
            ("i.jpg", "image/jpeg"),
            ("i.JPEG", "image/jpeg"),
            ("i.gif", "image/gif"),
            ("i.webp", "image/webp"),
            ("favicon.ico", "image/x-icon"),
            ("m.wasm", "application/wasm"),
            ("doc.pdf", "application/pdf"),
            ("f.woff", "font/woff"),
            ("f.woff2", "font/woff2"),
            ("v.mp4", "video/mp4"),
            ("v.webm", "video/webm"),
            ("a.tar.gz", "application/gzip"),
            ("a.zip", "application/zip"),
        ];
        for (name, ty) in cases {
            assert_eq!(content_type(Path::new(name)), ty, "{name}");
        }
    }

    #[test]
    fn unknown_types() {
        for name in [
            "Makefile",
            "a.exe",
            "a.",
            ".bashrc",
            "x.verylongextension",
            "dir/x.HtMlX",
        ] {
            assert_eq!(content_type(Path::new(name)), DEFAULT_TYPE, "{name}");
        }
        assert_eq!(
            content_type(Path::new("/srv/www/Index.Html")),
            "text/html; charset=utf-8"
        );
    }
}
