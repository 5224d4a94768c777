//! `http.work`: a request in its tenant's (or class's) activity, behind the tenant's admission
//! gate (overload becomes 503): static files (conditional and range requests, the file cache,
//! `sendfile`, the disk stage for large ones), synthetic endpoints, errors; a handler panic
//! becomes a 500 for that response only.

use super::conn::{answer_error, answer_status, close, drive, finish, recycle, Body, Source, Step};
use super::core_server::{with_core, CoreServer};
use super::file_cache::{open_beneath, CachedFile, CACHE_FILE_BYTES_MAX, FILE_CACHE_TTL_NS};
use crate::cond::RangeOutcome;
use crate::request::{Method, Request};
use crate::synthetic::Synthetic;
use crate::{cond, path, response, synthetic, HttpError};
use bytes::Bytes;
use omnistage::account::ActivityId;
use omnistage::exec::Ctx;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Files up to this size are read whole into the response; larger ones are streamed.
const INLINE_FILE_BYTES_MAX: u64 = 256 * 1024;

/// Body of a `/_burn` answer.
const BURN_BODY: &[u8] = b"burned\n";

/// A request handed to the work stage in its tenant's activity. The request travels by value;
/// its head buffer comes from, and goes back to, the worker's pool (no allocation per request).
pub(super) struct Work {
    pub(super) key: u64,
    pub(super) request: Request,
}

/// The buffers a request is served with, kept by the core and reused (no allocation per
/// request): the file-cache key (tenant activity, decoded path) and the percent-decoded bytes.
#[derive(Default)]
pub(super) struct ServeScratch {
    pub(super) key: (ActivityId, String),
    pub(super) decoded: Vec<u8>,
}

/// Spins the CPU for about `iters` rounds (fixed work for `/_burn`).
#[inline(never)]
pub fn burn(iters: u64) -> u64 {
    let mut x = std::hint::black_box(0x2545_F491_4F6C_DD1Du64);
    for _ in 0..iters {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    std::hint::black_box(x)
}

pub(super) fn calibrate_burn() -> f64 {
    let mut v: Vec<f64> = (0..5)
        .map(|_| {
            let n = 1_000_000;
            let t = std::time::Instant::now();
            burn(n);
            n as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e6
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[2]
}

pub(super) fn on_work(ctx: &mut Ctx<'_>, w: Work) {
    with_core(|cs| {
        cs.refresh(ctx);
        let Work { key, request } = w;
        let Some(c) = cs.conn(key) else { return };
        // Where this response starts: a panic unwinds to here and only this
        // response's bytes are taken back.
        let mark = c.out.mark();
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            serve(ctx, cs, key, &request)
        }));
        let step = match served {
            Ok(step) => step,
            Err(_) => {
                cs.shared.stats.panics.fetch_add(1, Ordering::Relaxed);
                let date = cs.date();
                match cs.conn(key) {
                    Some(c) => {
                        c.out.rollback(mark);
                        c.body = None;
                        c.closing = true;
                        c.out
                            .with_head(|b| response::error_response(b, 500, false, &date, &[]));
                        finish(ctx, cs, key, &request, 500, 0)
                    }
                    None => Step::Closed,
                }
            }
        };
        recycle(request);
        if let Step::Answered = step {
            drive(ctx, cs, key);
        }
    });
}

/// Answers one request in its tenant's activity, with the core's reused buffers.
pub(super) fn serve(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, req: &Request) -> Step {
    let mut scratch = std::mem::take(&mut cs.serve_scratch);
    let step = serve_with(ctx, cs, key, req, &mut scratch);
    cs.serve_scratch = scratch;
    step
}

fn serve_with(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    req: &Request,
    scratch: &mut ServeScratch,
) -> Step {
    let live = cs.live.clone();
    let tr = cs.conn(key).and_then(|c| c.tenant.clone());
    let upstream = tr
        .and_then(|tr| live.config.tenants.iter().find(|t| t.name == tr.name))
        .and_then(|t| t.upstream_for(req.target()));
    if let Some(u) = upstream {
        return super::proxy::start(ctx, cs, key, req, u);
    }
    if let Some(e) = req.body_refusal() {
        // Routed to a proxy when it was parsed, not now (a reload): the body cannot be read.
        return answer_error(ctx, cs, key, req, &e, false);
    }
    let keep = req.keep_alive && !cs.shared.draining.load(Ordering::Relaxed);
    if req.method == Method::Other {
        // A body-less unknown method: the stream is still in step, so the connection may stay.
        return answer_status(ctx, cs, key, req, 501, keep);
    }
    let ServeScratch {
        key: cache_key,
        decoded,
    } = scratch;
    let query = match path::decode_target_into(req.target(), &mut cache_key.1, decoded) {
        Ok(q) => q,
        Err(e) => return answer_error(ctx, cs, key, req, &e, keep),
    };
    let Some(tr) = cs.conn(key).and_then(|c| c.tenant.clone()) else {
        return Step::Closed;
    };
    let live = cs.live.clone();
    let Some(tenant) = live.config.tenants.iter().find(|t| t.name == tr.name) else {
        // The tenant was removed by a reload while this request waited.
        return answer_status(ctx, cs, key, req, 421, false);
    };
    if tenant.synthetic {
        if cache_key.1 == "/_panic" {
            // A synthetic fault, to exercise (and test) the panic-to-500 path.
            panic!("synthetic panic requested by /_panic");
        }
        if let Some(s) = synthetic::parse_synthetic(&cache_key.1, query) {
            let date = cs.date();
            let (body_len, source) = match s {
                Err(e) => return answer_error(ctx, cs, key, req, &e, keep),
                Ok(Synthetic::Burn { us }) => {
                    burn((cs.shared.burn_iters_per_us * us as f64) as u64);
                    (BURN_BODY.len() as u64, None)
                }
                Ok(Synthetic::Bytes { n }) => (n, Some(Source::Pattern)),
            };
            let c = cs.conn(key).expect("live");
            let ctype = if source.is_some() {
                "application/octet-stream"
            } else {
                "text/plain; charset=utf-8"
            };
            c.out.with_head(|b| {
                response::write_head(
                    b,
                    200,
                    "OK",
                    &[("Content-Type", ctype)],
                    Some(body_len),
                    keep,
                    &date,
                )
            });
            if req.method != Method::Head {
                match source {
                    None => c.out.with_head(|b| b.extend_from_slice(BURN_BODY)),
                    Some(source) => {
                        // Generated bytes go out through the same credit window as files.
                        c.body = Some(Box::new(Body {
                            source,
                            direct: false,
                            offset: 0,
                            remaining: body_len,
                            in_flight: false,
                        }));
                    }
                }
            }
            c.closing |= !keep;
            return finish(ctx, cs, key, req, 200, body_len);
        }
    }
    let now_ns = ctx.now_ns();
    cache_key.0 = tr.activity;
    let fresh = cs
        .files
        .get(cache_key)
        .is_some_and(|f| f.expires_ns > now_ns);
    if !fresh {
        let resolved = match path::resolve(&tenant.docroot, &cache_key.1, &tenant.index) {
            Ok(r) => r,
            Err(e) => {
                cs.cache_drop(cache_key);
                cs.files.remove(cache_key);
                return answer_error(ctx, cs, key, req, &e, keep);
            }
        };
        let direct = cs.live.config.server.disk_direct && cs.shared.disk.get().is_some();
        // The length and mtime are the descriptor's, not those `resolve` read from the path.
        let opened = match open_beneath(&resolved.root, &resolved.path, direct) {
            Ok(o) => o,
            Err(_) => return answer_error(ctx, cs, key, req, &HttpError::NotFound, keep),
        };
        if !cs.files.contains_key(cache_key) {
            cs.cache_make_entry_room();
        }
        // The cached bytes stay valid while the file's length and mtime do.
        let content = match cs.files.get(cache_key) {
            Some(old) if old.len == opened.len && old.modified == opened.modified => {
                old.content.clone()
            }
            _ => {
                cs.cache_drop(cache_key);
                None
            }
        };
        let entry = CachedFile {
            file: Arc::new(opened.file),
            len: opened.len,
            modified: opened.modified,
            etag: cond::etag(opened.len, opened.modified).into(),
            last_modified: cond::last_modified(opened.modified).into(),
            content_type: crate::mime::content_type(&resolved.path),
            expires_ns: now_ns + FILE_CACHE_TTL_NS,
            content,
            direct,
        };
        cs.files.insert(cache_key.clone(), entry);
    }
    let f = &cs.files[cache_key];
    let (file, flen, modified, direct) = (f.file.clone(), f.len, f.modified, f.direct);
    let mut content = f.content.clone();
    let (etag, last_modified, ctype) = (f.etag.clone(), f.last_modified.clone(), f.content_type);
    let date = cs.date();
    if cond::not_modified(req, &etag, modified) {
        let c = cs.conn(key).expect("live");
        let headers = [("ETag", &*etag), ("Last-Modified", &*last_modified)];
        c.out.with_head(|b| {
            response::write_head(b, 304, "Not Modified", &headers, None, keep, &date)
        });
        c.closing |= !keep;
        return finish(ctx, cs, key, req, 304, 0);
    }
    let range = cond::range_for(req, &etag, modified, flen);
    let (status, start, len) = match range {
        RangeOutcome::Full => (200, 0, flen),
        RangeOutcome::Partial {
            start,
            end_inclusive,
        } => (206, start, end_inclusive - start + 1),
        RangeOutcome::Unsatisfiable => {
            let cr = cond::content_range(&range, flen).unwrap_or_default();
            let c = cs.conn(key).expect("live");
            let head_only = req.method == Method::Head;
            c.out.with_head(|b| {
                let body_start =
                    response::error_response(b, 416, keep, &date, &[("Content-Range", &cr)]);
                if head_only {
                    b.truncate(body_start);
                }
            });
            c.closing |= !keep;
            return finish(ctx, cs, key, req, 416, 0);
        }
    };
    let content_range = cond::content_range(&range, flen);
    let mut headers: [(&str, &str); 5] = [
        ("Content-Type", ctype),
        ("ETag", &etag),
        ("Last-Modified", &last_modified),
        ("Accept-Ranges", "bytes"),
        ("", ""),
    ];
    let mut headers_len = 4;
    if let Some(cr) = &content_range {
        headers[4] = ("Content-Range", cr);
        headers_len = 5;
    }
    let headers = &headers[..headers_len];
    let c = cs.conn(key).expect("live");
    c.out.with_head(|b| {
        response::write_head(
            b,
            status,
            response::status_reason(status),
            headers,
            Some(len),
            keep,
            &date,
        )
    });
    c.closing |= !keep;
    let disk_stage = cs.shared.disk.get().is_some();
    let server = &cs.live.config.server;
    // Large files go from the page cache to the socket with sendfile, and are not kept in
    // memory: the files the worker would read itself (no disk stage, or a file the cache
    // would take). The disk stage keeps the ones it schedules (larger than the cache takes,
    // cache off, or O_DIRECT): their reads are charged to their tenant's disk share there.
    let by_sendfile = server.sendfile
        && !direct
        && flen >= server.sendfile_min_bytes
        && (!disk_stage || (server.cache_bytes_max > 0 && flen <= CACHE_FILE_BYTES_MAX));
    if req.method != Method::Head && len > 0 {
        let cacheable = content.is_none()
            && !by_sendfile
            && server.cache_bytes_max > 0
            && !server.disk_direct
            && flen <= CACHE_FILE_BYTES_MAX;
        // A miss the cache takes: read the whole file once and keep it. One it refuses is
        // served like an uncached file below, reading only the range asked for (reading the
        // whole file for it would cost a client asking for one byte the whole file's read,
        // every time).
        if cacheable && cs.cache_make_room(flen as usize, cache_key.0) {
            let mut all = vec![0; flen as usize];
            match read_resident(&file, &mut all, disk_stage) {
                Ok(true) => {
                    let bytes = Bytes::from(all);
                    if let Some(f) = cs.files.get_mut(cache_key) {
                        f.content = Some(bytes.clone());
                        cs.cache_account(cache_key.0, bytes.len() as isize);
                    }
                    content = Some(bytes);
                }
                // Not all in the page cache: served uncached below, through the disk stage
                // (charged to the tenant's disk share there); cached once it is resident.
                Ok(false) => {}
                Err(_) => {
                    close(ctx, cs, key);
                    return Step::Closed;
                }
            }
        }
    }
    let c = cs.conn(key).expect("live");
    if req.method != Method::Head && len > 0 {
        if let Some(content) = content {
            let body = content.slice(start as usize..(start + len) as usize);
            if 2 * body.len() >= content.len() {
                // A hit: the body is a slice of the cached bytes, queued without a copy.
                c.out.push_shared(body);
            } else {
                // A small part of the file (a range): copied after the head. A shared slice
                // would keep the whole buffer alive while the output queue counts only the
                // slice, so a client asking for one byte of many files (and not reading)
                // could pin a whole file per response; copied, the queue's bound is the
                // memory's bound, and a shared slice is never more than twice what it counts.
                c.out.with_head(|b| b.extend_from_slice(&body));
            }
        } else if by_sendfile {
            // The open file goes with the segment (an `Arc`), so the descriptor outlives any
            // change to the file cache; a file that shrank closes the connection when sent.
            c.out.push_file(file, start, len as usize);
        } else if len <= INLINE_FILE_BYTES_MAX && !disk_stage {
            let mut body = vec![0; len as usize];
            if file.read_exact_at(&mut body, start).is_err() {
                close(ctx, cs, key);
                return Step::Closed;
            }
            c.out.push_owned(body);
        } else {
            c.body = Some(Box::new(Body {
                source: Source::File(file),
                direct,
                offset: start,
                remaining: len,
                in_flight: false,
            }));
        }
    }
    finish(ctx, cs, key, req, status, len)
}

/// Reads all of `file` into `buf` (its length) on the worker: only from the page cache when
/// a disk stage can take the read instead (`preadv2(RWF_NOWAIT)`: false, nothing promised in
/// `buf`, as soon as a page would wait for the device), else as it comes. Why: a cold file
/// read here would hold the worker, and every tenant on its core, for the device's latency,
/// and its bytes would escape the tenant's `disk_cap`. A file system that cannot say (no
/// RWF_NOWAIT for buffered reads) is read as it comes.
fn read_resident(file: &std::fs::File, buf: &mut [u8], may_defer: bool) -> std::io::Result<bool> {
    use rustix::io::{preadv2, Errno, ReadWriteFlags};
    if !may_defer {
        file.read_exact_at(buf, 0)?;
        return Ok(true);
    }
    let mut done = 0;
    // Each round reads at least one byte or ends: bounded by the buffer's length.
    while done < buf.len() {
        let slice = &mut [std::io::IoSliceMut::new(&mut buf[done..])];
        match preadv2(file, slice, done as u64, ReadWriteFlags::NOWAIT) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(Errno::AGAIN) => return Ok(false),
            Err(Errno::INTR) => {}
            Err(Errno::OPNOTSUPP | Errno::INVAL | Errno::NOSYS) => {
                file.read_exact_at(&mut buf[done..], done as u64)?;
                return Ok(true);
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}
