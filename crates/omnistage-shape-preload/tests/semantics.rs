//! Each interposed call's semantics on real descriptors: a probe program runs under the preload
//! library in a group made here, and the test checks what each call returned (bytes, -1 and
//! errno) and the bytes the group's buckets were charged. Rates are chosen so that every
//! expectation is exact: buckets small or slow enough that a second call can only find them
//! empty, or fast enough that nothing waits long. Nothing here asserts a speed.

use omnistage_shape::launch::Membership;
use omnistage_shape::meter::{BucketCfg, GroupCfg};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

const ALL: usize = 0;
const DISK: usize = 2;
const READ: usize = 3;
const WRITE: usize = 4;

fn cfg(bucket: usize, rate: u64, burst: u64) -> GroupCfg {
    let mut c = GroupCfg::default();
    c.buckets[bucket] = BucketCfg {
        present: 1,
        kind: 0,
        rate_per_s: rate,
        burst,
    };
    c
}

fn probe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_omnistage-shape-probe"))
}

/// The library under test: beside the probe after `cargo build`, or in `deps/` where `cargo test`
/// leaves it (the crate is also an rlib so that `cargo test` builds the cdylib on a fresh clone).
/// The newer of the two when both exist: `cargo test` rebuilds only the one in `deps/`, so an
/// uplifted copy from an earlier `cargo build` may be stale (a test once passed against it with
/// the hook under test removed).
fn preload() -> PathBuf {
    let dir = probe().parent().unwrap().to_path_buf();
    let candidates = [
        dir.join("libomnistage_shape_preload.so"),
        dir.join("deps").join("libomnistage_shape_preload.so"),
    ];
    candidates
        .iter()
        .filter_map(|p| Some((std::fs::metadata(p).ok()?.modified().ok()?, p)))
        .max_by_key(|(t, _)| *t)
        .map_or_else(|| candidates[1].clone(), |(_, p)| p.clone())
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 % 251) as u8).collect()
}

fn temp_file(tag: &str, bytes: &[u8]) -> PathBuf {
    let p = std::env::temp_dir().join(format!("omnistage-shape-{tag}-{}", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    p
}

struct Run {
    lines: BTreeMap<String, (i64, i32)>,
    bucket_bytes: [u64; 5],
}

impl Run {
    fn get(&self, label: &str) -> (i64, i32) {
        *self
            .lines
            .get(label)
            .unwrap_or_else(|| panic!("no line {label} in {:?}", self.lines))
    }
}

/// The probe running `args` under the library as member `m` of its group.
fn probe_command(args: &[&str], m: &Membership) -> Command {
    let so = preload();
    assert!(so.is_file(), "{} not built", so.display());
    let mut c = Command::new(probe());
    c.args(args)
        .env("LD_PRELOAD", &so)
        .env("OMNISTAGE_SHAPE_GROUP", &m.group)
        .env(
            "OMNISTAGE_SHAPE_MEMBER",
            format!("{}:{}", m.slot.index, m.slot.generation),
        );
    c
}

fn run(scenario: &str, c: GroupCfg, path: &str) -> Run {
    run_with(scenario, c, path, &[])
}

/// [`run`] with more arguments for the probe after the path.
fn run_with(scenario: &str, c: GroupCfg, path: &str, more: &[&str]) -> Run {
    let group = format!("test.{scenario}{}.{}", more.join("-"), std::process::id());
    let m = Membership::join(&group, Some(c), 1).unwrap();
    let mut args = vec![scenario, path];
    args.extend_from_slice(more);
    let out = probe_command(&args, &m).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{scenario} ({}): {text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = BTreeMap::new();
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        let r: i64 = f[1].parse().unwrap();
        let e: i32 = f.get(2).map_or(0, |e| e.parse().unwrap());
        lines.insert(f[0].to_string(), (r, e));
    }
    let bucket_bytes = m.map.with(|g| g.run.map(|r| r.bytes));
    Run {
        lines,
        bucket_bytes,
    }
}

#[test]
fn blocking_file_reads_return_everything_and_errors_pass_through() {
    let f = temp_file("read", &pattern(3000));
    // 100 KB/s with a 1000-byte burst: each 3000-byte read waits for tokens twice.
    let r = run("file-read", cfg(DISK, 100_000, 1000), f.to_str().unwrap());
    for (label, n) in [
        ("read", 3000),
        ("read-eof", 0),
        ("pread", 1500),
        ("preadv", 3000),
        ("readv", 3000),
    ] {
        assert_eq!(r.get(label), (n, 0), "{label}");
    }
    for ok in ["read-ok", "pread-ok", "preadv-ok", "readv-ok"] {
        assert_eq!(r.get(ok).0, 1, "{ok}");
    }
    assert_eq!(r.get("read-efault"), (-1, libc::EFAULT));
    assert_eq!(r.get("read-ebadf"), (-1, libc::EBADF));
    assert_eq!(r.get("recv-enotsock"), (-1, libc::ENOTSOCK));
    assert_eq!(r.bucket_bytes[DISK], 3000 + 1500 + 3000 + 3000);
    std::fs::remove_file(f).ok();
}

#[test]
fn blocking_file_writes_move_everything_and_pipes_and_dev_null_are_not_shaped() {
    let f = temp_file("write", b"");
    let r = run("file-write", cfg(WRITE, 100_000, 1000), f.to_str().unwrap());
    for label in ["write", "pwrite", "writev", "pwritev"] {
        assert_eq!(r.get(label), (3000, 0), "{label}");
    }
    assert_eq!(r.get("devnull"), (1 << 20, 0));
    assert_eq!(r.get("pipe"), (4096, 0));
    assert_eq!(
        r.bucket_bytes[WRITE], 12_000,
        "only the file's bytes are charged"
    );
    let p = pattern(3000);
    assert_eq!(
        std::fs::read(&f).unwrap(),
        [&p[..], &p[..], &p[..], &p[..]].concat()
    );
    std::fs::remove_file(f).ok();
}

#[test]
fn non_blocking_reads_take_what_the_bucket_holds_then_fail_with_eagain() {
    // 10 B/s, burst 100: the full bucket gives 100 bytes, then nothing for seconds.
    let r = run("tcp-nonblocking", cfg(READ, 10, 100), "");
    assert_eq!(
        r.get("peer-write"),
        (5000, 0),
        "writes are not limited by a read rate"
    );
    assert_eq!(
        r.get("peek"),
        (4096, 0),
        "MSG_PEEK moves nothing and is not held"
    );
    assert_eq!(r.get("recv"), (100, 0));
    assert_eq!(r.get("recv-ok").0, 1);
    for label in [
        "recv-again",
        "read-again",
        "recvfrom-again",
        "recvmsg-again",
    ] {
        assert_eq!(r.get(label), (-1, libc::EAGAIN), "{label}");
    }
    // poll does not report the socket readable while the bucket is empty (no spinning), and
    // gives the caller's events back unchanged.
    assert_eq!(r.get("poll-held"), (0, 0));
    assert_eq!(r.get("poll-events-restored").0, 1);
    // So do select and pselect, and what is not throttled (writing) is reported at once.
    assert_eq!(r.get("select-held"), (0, 0));
    assert_eq!(r.get("select-set-cleared").0, 1);
    assert_eq!(r.get("select-timeval-spent").0, 1);
    assert_eq!(r.get("select-write"), (1, 0));
    assert_eq!(r.get("select-write-only").0, 1);
    assert_eq!(r.get("pselect-held"), (0, 0));
    // Sets wider than FD_SETSIZE are the real call's, unshaped (the held path's copies hold
    // one fd_set each).
    assert_eq!(r.get("select-wide"), (1, 0));
    // So do epoll_wait, epoll_pwait and epoll_pwait2 (level-triggered), and put the caller's
    // interest back.
    assert_eq!(r.get("epoll-held"), (0, 0));
    assert_eq!(r.get("epoll-pwait-held"), (0, 0));
    assert_eq!(r.get("epoll-pwait2-held"), (0, 0));
    assert_eq!(r.get("epoll-write"), (1, 0));
    assert_eq!(r.get("epoll-write-events").0, libc::EPOLLOUT as i64);
    // A one-shot registration that fired during a held wait stays disabled.
    assert_eq!(r.get("epoll-oneshot-first"), (1, 0));
    assert_eq!(r.get("epoll-oneshot-again"), (0, 0));
    assert_eq!(r.get("epoll-del-any-event"), (0, 0));
    assert_eq!(r.get("epoll-pipe"), (1, 0));
    assert_eq!(r.get("epoll-pipe-events").0, libc::EPOLLIN as i64);
    assert_eq!(r.bucket_bytes[READ], 100);
}

#[test]
fn select_touches_only_the_longs_that_cover_nfds() {
    // 10 B/s, burst 100: after the first recv the read is held for seconds, so select takes
    // the held path (copies of the sets) on sets of one long that end at a PROT_NONE page.
    let r = run("select-page-end", cfg(READ, 10, 100), "");
    assert_eq!(r.get("recv"), (100, 0));
    assert_eq!(r.get("select-held"), (0, 0));
    assert_eq!(r.get("select-held-cleared").0, 1);
    assert_eq!(r.get("select-write"), (1, 0));
    assert_eq!(r.get("select-write-only").0, 1);
    assert_eq!(r.get("pselect-held"), (0, 0));
}

#[test]
fn edge_triggered_epoll_gets_an_edge_back_when_the_tokens_are_there() {
    // 2,000 B/s, burst 200: the first reads take what the bucket holds and fail with EAGAIN;
    // the data that stays in the socket raises no new edge, so only the shaper can give one.
    let r = run("tcp-epoll-edge", cfg(READ, 2_000, 200), "");
    assert_eq!(r.get("edge-first"), (1, 0));
    assert_eq!(r.get("edge-drained").0, 1);
    assert_eq!(r.get("edge-again"), (-1, libc::EAGAIN));
    assert_eq!(r.get("edge-rearmed"), (1, 0));
    assert_eq!(r.get("edge-rearmed-events").0, libc::EPOLLIN as i64);
    assert!(r.get("edge-more").0 > 0, "the re-armed socket is readable");
}

#[test]
fn blocking_socket_calls_keep_their_semantics() {
    let r = run("tcp-blocking", cfg(READ, 1_000_000, 1000), "");
    // recv returns what the bucket allowed (a stream socket may return less); MSG_WAITALL waits
    // for all of it; blocking sends move everything.
    assert_eq!(r.get("recv"), (1000, 0));
    assert_eq!(r.get("recv-waitall"), (4096, 0));
    assert_eq!(r.get("recv-ok").0, 1);
    assert_eq!(r.get("send"), (3000, 0));
    assert_eq!(r.get("sendmsg"), (3000, 0));
    assert_eq!(r.get("peer-read"), (6000, 0));
    assert_eq!(r.get("sent-ok").0, 1);
    let (res, errno) = r.get("send-epipe");
    assert!(
        res == -1 && (errno == libc::EPIPE || errno == libc::ECONNRESET),
        "{res} {errno}"
    );
    assert_eq!(r.bucket_bytes[READ], 1000 + 4096 + 6000);
}

#[test]
fn non_blocking_sends_take_what_the_bucket_holds_then_fail_with_eagain() {
    let r = run("tcp-send-nonblocking", cfg(WRITE, 10, 100), "");
    assert_eq!(r.get("send"), (100, 0));
    assert_eq!(r.get("send-again"), (-1, libc::EAGAIN));
    assert_eq!(r.get("sendto-again"), (-1, libc::EAGAIN));
    assert_eq!(r.bucket_bytes[WRITE], 100);
}

#[test]
fn datagrams_move_whole_and_leave_a_debt() {
    let r = run("udp", cfg(WRITE, 1000, 100), "");
    assert_eq!(r.get("send-whole"), (1500, 0), "a datagram is never cut");
    assert_eq!(
        r.get("send-debt"),
        (-1, libc::EAGAIN),
        "its debt holds the next one back"
    );
    assert_eq!(r.get("peer-recv"), (1500, 0));
    assert_eq!(r.bucket_bytes[WRITE], 1500);
}

#[test]
fn sendfile_copy_file_range_and_splice_are_charged_per_side() {
    let f = temp_file("transfers", &pattern(3000));
    let r = run(
        "transfers",
        cfg(ALL, 100_000_000, 1_000_000),
        f.to_str().unwrap(),
    );
    assert_eq!(r.get("sendfile"), (3000, 0));
    assert_eq!(r.get("sendfile-ok").0, 1);
    assert_eq!(r.get("copy_file_range"), (3000, 0));
    assert_eq!(r.get("splice"), (3000, 0));
    // sendfile: disk read + network write; the peer's recv: network read; copy_file_range: disk
    // read + disk write; splice: disk read (the pipe is not shaped).
    assert_eq!(r.bucket_bytes[ALL], 6000 + 3000 + 6000 + 3000);
    std::fs::remove_file(&f).ok();
    std::fs::remove_file(format!("{}.copy", f.display())).ok();
}

#[test]
fn forked_children_and_exec_ed_programs_are_shaped_in_the_same_group() {
    let f = temp_file("fork", &pattern(3000));
    let r = run(
        "fork-exec",
        cfg(DISK, 10_000_000, 1_000_000),
        f.to_str().unwrap(),
    );
    assert_eq!(r.get("child-exit").0, 0);
    // The forked child's read and /bin/cat's read (exec'd by it) both count.
    assert_eq!(r.bucket_bytes[DISK], 6000);
    std::fs::remove_file(f).ok();
}

#[test]
fn a_splice_from_a_pipe_returns_what_the_pipe_had() {
    // 100 KB/s with a 1,000-byte burst: the first piece is all the pipe holds; the real call
    // would return it, and so must the shaped one (not wait for the bytes written later).
    let r = run("splice-pipe", cfg(WRITE, 100_000, 1000), "");
    assert_eq!(r.get("splice-from-pipe"), (1000, 0));
    assert_eq!(r.bucket_bytes[WRITE], 1000);
}

#[test]
fn a_sendmsg_sent_in_pieces_does_not_write_to_its_const_header() {
    // 1 MB/s with a 1,000-byte burst: 3,000 bytes go in pieces, through a copy of the header;
    // the caller's (in a read-only page) is not written.
    let r = run("sendmsg-readonly", cfg(WRITE, 1_000_000, 1000), "");
    assert_eq!(r.get("sendmsg-readonly"), (3000, 0));
    assert_eq!(r.get("peer-read"), (3000, 0));
    assert_eq!(r.bucket_bytes[WRITE], 3000);
}

#[test]
fn writes_to_a_file_are_not_cut_between_writers_and_keep_the_rate() {
    // Two members of one group each append 100 records of 2,000 bytes to one O_APPEND file
    // at 100,000 B/s with a 1,000-byte burst: a record is longer than the bucket is deep, and
    // the kernel makes each write atomic, so no record may hold the other writer's bytes.
    let f = temp_file("append", b"");
    let group = format!("test.append.{}", std::process::id());
    let (rate, burst, line, lines) = (100_000u64, 1_000u64, 2_000usize, 100usize);
    let members: Vec<Membership> = (0..2)
        .map(|_| Membership::join(&group, Some(cfg(DISK, rate, burst)), 1).unwrap())
        .collect();
    let started = std::time::Instant::now();
    let children: Vec<_> = members
        .iter()
        .zip(["A", "B"])
        .map(|(m, letter)| {
            probe_command(&["append", f.to_str().unwrap(), letter], m)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}: {text}", out.status);
        assert_eq!(text.trim(), format!("appended {} 0", line * lines));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let bytes = std::fs::read(&f).unwrap();
    std::fs::remove_file(&f).ok();
    assert_eq!(bytes.len(), 2 * line * lines);
    let mut count = [0usize; 2];
    for (i, rec) in bytes.split_inclusive(|&b| b == b'\n').enumerate() {
        let first = rec[0];
        assert!(
            rec.len() == line && rec[..line - 1].iter().all(|&b| b == first),
            "record {i} is cut: {} bytes, {} of {:?} then {:?}",
            rec.len(),
            rec.iter().take_while(|&&b| b == first).count(),
            first as char,
            rec.iter().find(|&&b| b != first).map(|&b| b as char)
        );
        count[usize::from(first == b'B')] += 1;
    }
    assert_eq!(count, [lines, lines]);
    // Shaping still holds the rate: what the bucket held at the start and one record's debt
    // aside, every byte waited for its tokens.
    let least = (2 * line * lines) as f64 - burst as f64 - line as f64;
    assert!(
        elapsed >= least / rate as f64,
        "{elapsed:.3} s for {} bytes at {rate} B/s",
        2 * line * lines
    );
    let charged = members[0].map.with(|g| g.run[DISK].bytes);
    assert_eq!(charged, (2 * line * lines) as u64);
}

#[test]
fn a_read_blocked_waiting_for_data_holds_no_tokens() {
    // 1 MB/s, burst 10,000, for 2 s: thread A's blocking recv waits for a byte every 2 ms,
    // thread B's socket is always full. A moves next to nothing, so B must get nearly the whole
    // rate (if A's waiting recv held the bucket, B would get half of it or less).
    let r = run("read-two-threads", cfg(READ, 1_000_000, 10_000), "");
    let (a, b) = (r.get("a-got").0, r.get("b-got").0);
    assert!(a > 0, "A got {a}");
    assert!(b >= 1_500_000, "B got {b} (A {a})");
    // And the rate holds: 2 s at 1 MB/s, the burst, and a piece in flight.
    assert!(a + b <= 2_000_000 + 10_000 + 65_536, "A {a} B {b}");
}

#[test]
fn a_blocking_writev_of_many_iovecs_moves_everything() {
    // 100 KB/s with a 1,000-byte burst: to a socket, the first piece spans 100 of the 300
    // iovecs, more than the library's window of 64; a blocking write still moves all 3,000
    // bytes. To a file it is one call.
    let f = temp_file("writev-many", b"");
    let r = run(
        "file-writev-many",
        cfg(WRITE, 100_000, 1000),
        f.to_str().unwrap(),
    );
    assert_eq!(r.get("writev-many"), (3000, 0));
    assert_eq!(std::fs::read(&f).unwrap(), pattern(3000));
    assert_eq!(r.get("writev-many-socket"), (3000, 0));
    assert_eq!(r.get("peer-read"), (3000, 0));
    assert_eq!(r.get("peer-read-ok").0, 1);
    assert_eq!(r.bucket_bytes[WRITE], 6000);
    std::fs::remove_file(f).ok();
}

#[test]
fn fortified_preads_are_shaped() {
    // 100 KB/s with a 1,000-byte burst: each read waits for tokens; all are charged.
    let f = temp_file("fortified", &pattern(3000));
    let r = run("fortified", cfg(DISK, 100_000, 1000), f.to_str().unwrap());
    assert_eq!(r.get("pread-chk"), (1500, 0));
    assert_eq!(r.get("pread64-chk"), (1500, 0));
    assert_eq!(r.get("read-chk"), (3000, 0));
    for ok in ["pread-chk-ok", "pread64-chk-ok", "read-chk-ok"] {
        assert_eq!(r.get(ok).0, 1, "{ok}");
    }
    assert_eq!(r.bucket_bytes[DISK], 1500 + 1500 + 3000);
    std::fs::remove_file(f).ok();
}

#[test]
fn a_fortified_ppoll_is_held_like_ppoll() {
    // 10 B/s, burst 100: after the first recv the socket is held for seconds.
    let r = run("fortified-poll", cfg(READ, 10, 100), "");
    assert_eq!(r.get("recv"), (100, 0));
    assert_eq!(r.get("ppoll-chk-held"), (0, 0));
    assert_eq!(r.get("poll-chk-held"), (0, 0));
}

#[test]
fn fortified_calls_with_a_length_past_the_buffer_abort_as_glibc_does() {
    use std::os::unix::process::ExitStatusExt;
    for call in [
        "read", "pread", "pread64", "recv", "recvfrom", "poll", "ppoll",
    ] {
        let group = format!("test.chk-fail-{call}.{}", std::process::id());
        let m = Membership::join(&group, Some(cfg(ALL, 100_000_000, 1_000_000)), 1).unwrap();
        let out = probe_command(&["chk-fail", "", call], &m).output().unwrap();
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGABRT),
            "{call}: {} {}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("buffer overflow detected"),
            "{call}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn preadv2_and_pwritev2_are_shaped() {
    let f = temp_file("v2", b"");
    let r = run("v2", cfg(DISK, 100_000, 1000), f.to_str().unwrap());
    assert_eq!(r.get("pwritev2"), (3000, 0));
    assert_eq!(r.get("preadv2"), (3000, 0));
    assert_eq!(r.get("preadv2-ok").0, 1);
    // Offset -1: the file position, which the read advances.
    assert_eq!(r.get("preadv2-position"), (3000, 0));
    assert_eq!(r.get("preadv2-position-ok").0, 1);
    assert_eq!(r.get("position").0, 3000);
    assert_eq!(r.bucket_bytes[DISK], 9000);
    std::fs::remove_file(f).ok();
}

#[test]
fn sendmmsg_and_recvmmsg_move_whole_messages_and_leave_a_debt() {
    // 1,000 B/s with a 100-byte burst: two messages (1,500 bytes) go whole and leave a debt
    // that holds the next call back.
    let r = run_with("mmsg", cfg(WRITE, 1000, 100), "", &["send"]);
    assert_eq!(r.get("sendmmsg"), (2, 0));
    assert_eq!(r.get("sendmmsg-lens").0, 1500);
    assert_eq!(r.get("sendmmsg-debt"), (-1, libc::EAGAIN));
    assert_eq!(r.bucket_bytes[WRITE], 1500);
    let r = run_with("mmsg", cfg(READ, 1000, 100), "", &["recv"]);
    assert_eq!(r.get("recvmmsg"), (2, 0));
    assert_eq!(r.get("recvmmsg-lens").0, 1500);
    assert_eq!(r.get("recvmmsg-debt"), (-1, libc::EAGAIN));
    assert_eq!(r.bucket_bytes[READ], 1500);
}

#[test]
fn closing_a_registered_descriptor_frees_its_epoll_registrations() {
    // 10 B/s, burst 100: the socket is held for seconds after the first recv. 1,056
    // registrations of closed sockets (no EPOLL_CTL_DEL) must not fill the 1,024-entry table
    // and leave the throttled socket's registration untracked (then reported readable).
    let r = run("epoll-closed", cfg(READ, 10, 100), "");
    assert_eq!(r.get("recv"), (100, 0));
    assert_eq!(r.get("epoll-after-closes"), (0, 0));
    assert_eq!(r.get("epoll-new-set"), (0, 0));
}

#[test]
fn a_signal_handler_waiting_on_epoll_inside_epoll_ctl_does_not_deadlock() {
    let r = run("signal-in-epoll", cfg(READ, 1_000_000, 100_000), "");
    assert_eq!(r.get("handler-returned").0, 1);
}

#[test]
fn a_child_forked_while_the_epoll_table_is_locked_can_close_its_descriptors() {
    let r = run("fork-in-epoll", cfg(READ, 1_000_000, 100_000), "");
    assert_eq!(r.get("child-closed").0, 1);
}

#[test]
fn a_blocking_socket_call_waiting_for_tokens_ends_for_a_signal_as_the_real_call_would() {
    // 300 B/s each way, bursts of 100: after the first 100 bytes a call waits for a third of a
    // second or more; SIGUSR1 comes every 10 ms.
    let mut c = cfg(WRITE, 300, 100);
    c.buckets[READ] = c.buckets[WRITE];
    let r = run("eintr", c, "");
    // Without SA_RESTART: the partial count, or EINTR with nothing moved. On a quiet machine
    // the counts are the burst (100) and the calls after it fail with EINTR; a thread stalled
    // past a third of a second before its signal sees tokens refilled meanwhile, so a count
    // can be larger, or a piece can move before the signal: never the whole 1,000, which is
    // what a call that ignores signals moves.
    let partial = |label: &str| {
        let (n, e) = r.get(label);
        assert!((100..1000).contains(&n) && e == 0, "{label} {n} {e}");
    };
    let eintr_or_partial = |label: &str| {
        let (n, e) = r.get(label);
        assert!(
            (n, e) == (-1, libc::EINTR) || ((1..1000).contains(&n) && e == 0),
            "{label} {n} {e}"
        );
    };
    partial("send-partial");
    eintr_or_partial("send-eintr");
    partial("recv-first");
    eintr_or_partial("recv-eintr");
    // With SA_RESTART a call that moved nothing waits on: it moves bytes, never EINTR.
    let (n, e) = r.get("recv-restarted");
    assert!(n > 0 && e == 0, "recv-restarted {n} {e}");
    let (n, e) = r.get("send-restarted");
    assert!(n > 0 && n <= 200 && e == 0, "send-restarted {n} {e}");
    assert_eq!(r.get("signals").0, 1);
}

#[test]
fn bad_pointers_get_efault_not_a_crash() {
    // Shaped (a rate on everything), so each call takes the library's path.
    let r = run("efault", cfg(ALL, 100_000_000, 1_000_000), "");
    for label in [
        "poll",
        "epoll-pwait2-timeout",
        "readv",
        "writev",
        "sendmsg",
        "recvmsg",
        "sendmsg-iov",
        "sendmmsg",
    ] {
        assert_eq!(r.get(label), (-1, libc::EFAULT), "{label}");
    }
}
