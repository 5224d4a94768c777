//! The command's side of `omnistage shape`: turns the options into a group configuration, opens
//! (or creates) the group's shared segment and joins it, finds the preload library, warns about
//! programs a preload cannot reach, and runs the program with `LD_PRELOAD` and the group in its
//! environment, staying as its parent to leave the group when it ends.

use crate::link::{BucketTemplate, Link, Reporter, REPORT_EVERY_NS};
use crate::meter::{BucketCfg, GroupCfg, GroupState, BUCKET_NAMES, WEIGHT_MAX};
use crate::sys::{self, SegmentMap};
use crate::units::{parse_rate, parse_size};
use clap::{Args, ValueEnum};
use omnistage::sched::ShaperSpec;
use std::path::{Path, PathBuf};

/// The preload library's file name, looked for next to the `omnistage` binary.
pub const PRELOAD_FILE: &str = "libomnistage_shape_preload.so";
/// Overrides where the preload library is looked for.
pub const ENV_PRELOAD_PATH: &str = "OMNISTAGE_SHAPE_PRELOAD";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BucketKind {
    Token,
    Leaky,
}

/// `omnistage shape`'s options.
#[derive(Args, Clone, Debug)]
#[command(after_help = LIMITS_HELP)]
pub struct ShapeArgs {
    /// One bucket for network and disk together, both directions (e.g. 1MiB/s, 10MB/s, 1Gbit/s).
    #[arg(long)]
    pub rate: Option<String>,
    /// Network (IPv4/IPv6 sockets), reads and writes together.
    #[arg(long)]
    pub net_rate: Option<String>,
    /// Disk (regular files, block devices), reads and writes together.
    #[arg(long)]
    pub disk_rate: Option<String>,
    /// Reads (network and disk).
    #[arg(long)]
    pub read_rate: Option<String>,
    /// Writes (network and disk).
    #[arg(long)]
    pub write_rate: Option<String>,
    /// Bucket depth of every token bucket (e.g. 64KiB); default the bytes of 10 ms at its rate.
    #[arg(long)]
    pub burst: Option<String>,
    /// Token bucket (bursts up to --burst) or leaky bucket (smooth at the rate, no burst).
    #[arg(long, value_enum, default_value = "token")]
    pub bucket: BucketKind,
    /// Share the rates with other `omnistage shape` commands of this group (by --weight); the
    /// first member's rates are the group's.
    #[arg(long)]
    pub group: Option<String>,
    /// This member's weight in its group (1..=10000).
    #[arg(long, default_value_t = 1)]
    pub weight: u32,
    /// A running omnistage's admin API (e.g. http://127.0.0.1:9090): the group's bytes are
    /// reported to --activity there, and `omnistage set` changes its network and disk rates
    /// (cap_net, cap_disk) live.
    #[arg(long, requires = "activity")]
    pub admin: Option<String>,
    /// The activity the group's bytes go to (created if missing; its parent must exist), e.g.
    /// /tenants/a/backup.
    #[arg(long, requires = "admin")]
    pub activity: Option<String>,
    /// The admin API's bearer token (default: the OMNISTAGE_ADMIN_TOKEN environment variable).
    #[arg(long, requires = "admin")]
    pub token: Option<String>,
    /// The program and its arguments.
    #[arg(last = true, required = true, num_args = 1..)]
    pub program: Vec<String>,
}

pub const LIMITS_HELP: &str = "\
What is shaped: IPv4/IPv6 sockets are network; regular files and block devices are disk. Pipes,
terminals, character devices (/dev/null) and Unix sockets are never shaped. Child processes
(fork, exec) are shaped with their parent, within the same rates.

Limits: the library is loaded with LD_PRELOAD, so it does not reach statically linked programs,
programs that make system calls directly (Go), io_uring, stdio's buffered I/O inside glibc
(fread/fwrite reach the kernel through glibc's internal calls), nor setuid/setgid programs (the
loader ignores LD_PRELOAD for them). A program that clears its environment loses the shaping in
the programs it starts. `poll`, `ppoll`, `select`, `pselect`, `epoll_wait`, `epoll_pwait` and
`epoll_pwait2` are interposed and sleep until the buckets allow the descriptor (edge-triggered
epoll gets its edge back when the tokens are there); epoll tracks at most 1,024 registrations
per process (beyond them a waiter on a throttled non-blocking socket spins).";

/// The group configuration the options ask for; `None` when they give no rate (join a group at
/// its rates, or run unlimited).
pub fn group_cfg(a: &ShapeArgs) -> Result<Option<GroupCfg>, String> {
    let rates = [
        &a.rate,
        &a.net_rate,
        &a.disk_rate,
        &a.read_rate,
        &a.write_rate,
    ];
    let flags = [
        "--rate",
        "--net-rate",
        "--disk-rate",
        "--read-rate",
        "--write-rate",
    ];
    let burst = a
        .burst
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(|e| format!("--burst: {e}"))?;
    if burst.is_some() && a.bucket == BucketKind::Leaky {
        return Err("--burst is for token buckets: a leaky bucket's depth is one quantum (10 ms at its rate)".into());
    }
    if burst == Some(0) && a.bucket == BucketKind::Token {
        return Err("--burst: a token bucket needs at least 1 byte".into());
    }
    let mut cfg = GroupCfg::default();
    let mut any = false;
    for (i, r) in rates.iter().enumerate() {
        let Some(text) = r else { continue };
        let rate = parse_rate(text).map_err(|e| format!("{}: {e}", flags[i]))?;
        let spec = match a.bucket {
            BucketKind::Token => ShaperSpec::token(rate, burst.unwrap_or((rate / 100).max(1))),
            BucketKind::Leaky => ShaperSpec::leaky(rate),
        };
        spec.validate().map_err(|e| format!("{}: {e}", flags[i]))?;
        cfg.buckets[i] = BucketCfg::from_spec(spec);
        any = true;
    }
    if !any && a.burst.is_some() {
        return Err(
            "--burst needs a rate (--rate, --net-rate, --disk-rate, --read-rate or --write-rate)"
                .into(),
        );
    }
    debug_assert_eq!(BUCKET_NAMES.len(), rates.len());
    Ok(any.then_some(cfg))
}

/// A group name: 1..=64 of `[A-Za-z0-9_.-]`.
pub fn check_group_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "group name {name:?} must be 1 to 64 of A-Z a-z 0-9 _ . -"
        ))
    }
}

/// Where the preload library is: `$OMNISTAGE_SHAPE_PRELOAD`, else next to the running binary
/// (`target/release/` after `cargo build --release`), else `../lib/omnistage/` from it.
pub fn find_preload() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(ENV_PRELOAD_PATH) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("{ENV_PRELOAD_PATH}={} is not a file", p.display()))
        };
    }
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the omnistage binary: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let candidates = [
        dir.join(PRELOAD_FILE),
        // Where `cargo test` leaves it (the crate is also an rlib, see its Cargo.toml).
        dir.join("deps").join(PRELOAD_FILE),
        dir.join("..").join(PRELOAD_FILE),
        dir.join("../lib/omnistage").join(PRELOAD_FILE),
    ];
    candidates.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
        format!(
            "{PRELOAD_FILE} not found next to {} (build it with `cargo build --release`, which builds the \
             whole workspace, or `cargo build --release -p omnistage-shape-preload`; or set {ENV_PRELOAD_PATH})",
            exe.display()
        )
    })
}

/// The program's path, looked up in PATH like the shell does.
pub fn resolve_program(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(program))
                .find(|p| p.is_file())
        })
        .unwrap_or(None)
}

/// Why a preload cannot reach `path`, if it can tell: a static ELF (no program interpreter) or a
/// setuid/setgid file. Scripts and unreadable files get no warning.
pub fn preload_blind_spot(path: &Path) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).ok()?;
    if meta.permissions().mode() & 0o6000 != 0 {
        return Some(format!(
            "{} is setuid/setgid: the loader ignores LD_PRELOAD for it, so it will not be shaped",
            path.display()
        ));
    }
    let bytes = std::fs::read(path).ok()?;
    match elf_has_interpreter(&bytes) {
        Some(false) => Some(format!(
            "{} is statically linked: LD_PRELOAD cannot reach it, so it will not be shaped",
            path.display()
        )),
        _ => None,
    }
}

/// For a 64-bit little-endian ELF: whether it has a PT_INTERP program header (is dynamically
/// linked). `None` for anything else.
pub fn elf_has_interpreter(b: &[u8]) -> Option<bool> {
    if b.len() < 64 || &b[..4] != b"\x7fELF" || b[4] != 2 || b[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    if phentsize < 4 || phnum > 4096 {
        return None;
    }
    const PT_INTERP: u32 = 3;
    for i in 0..phnum {
        if u32_at(phoff.checked_add(i.checked_mul(phentsize)?)?)? == PT_INTERP {
            return Some(true);
        }
    }
    Some(false)
}

/// A joined group: leaves it (and removes the segment when it was the last member) on drop.
pub struct Membership {
    pub group: String,
    pub map: SegmentMap,
    pub slot: crate::meter::Slot,
    pub cfg: GroupCfg,
    pub created: bool,
}

impl Membership {
    /// Opens or creates `group` and joins it. A `cfg` differing from an existing group's is
    /// refused with both configurations named.
    pub fn join(group: &str, cfg: Option<GroupCfg>, weight: u32) -> Result<Membership, String> {
        if weight == 0 || weight > WEIGHT_MAX {
            return Err(format!(
                "--weight must be in 1..={WEIGHT_MAX}, got {weight}"
            ));
        }
        let create_cfg = cfg.unwrap_or_default();
        let (map, created) = SegmentMap::open(group, Some(create_cfg))?;
        let now = sys::now_ns();
        let joined = map.with(|g: &mut GroupState| {
            if let Some(asked) = cfg {
                if !created && g.cfg != asked {
                    return Err(format!(
                        "group {group} runs at {}; this member asked for {}: leave the rates out to join at the group's, or use another --group",
                        g.cfg.describe(),
                        asked.describe()
                    ));
                }
            }
            g.reap(u64::MAX, sys::alive);
            g.join(sys::getpid(), weight, now).map(|s| (s, g.cfg))
        });
        match joined {
            Ok((slot, cfg)) => Ok(Membership {
                group: group.to_string(),
                map,
                slot,
                cfg,
                created,
            }),
            Err(e) => {
                if created {
                    sys::unlink(group);
                }
                Err(e)
            }
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        let last = self.map.with(|g| {
            g.leave(self.slot);
            if g.member_count() == 0 {
                // Joiners that still open this segment see it closed and start a new one.
                g.closed = 1;
                true
            } else {
                false
            }
        });
        if last {
            sys::unlink(&self.group);
        }
    }
}

/// How buckets made by a live rate change are built: this command's `--bucket` and `--burst`.
pub fn bucket_template(a: &ShapeArgs) -> Result<BucketTemplate, String> {
    Ok(BucketTemplate {
        leaky: a.bucket == BucketKind::Leaky,
        burst: a
            .burst
            .as_deref()
            .map(parse_size)
            .transpose()
            .map_err(|e| format!("--burst: {e}"))?,
    })
}

/// Runs `omnistage shape`: returns the exit code to leave with. `link` reaches the admin API
/// named by `--admin` (the command builds it with its admin client).
pub fn run(a: &ShapeArgs, link: Option<Box<dyn Link>>) -> Result<i32, String> {
    if a.admin.is_some() != link.is_some() {
        return Err("--admin needs a link to the admin API (and a link needs --admin)".into());
    }
    let cfg = group_cfg(a)?;
    let group = match &a.group {
        Some(g) => {
            check_group_name(g)?;
            format!("g.{g}")
        }
        None => {
            if a.weight != 1 {
                return Err("--weight needs --group".into());
            }
            format!("p.{}.{}", sys::getpid(), sys::now_ns())
        }
    };
    let preload = find_preload()?;
    let program = &a.program[0];
    if let Some(path) = resolve_program(program) {
        if let Some(w) = preload_blind_spot(&path) {
            eprintln!("omnistage shape: warning: {w}");
        }
    }
    let m = Membership::join(&group, cfg, a.weight)?;
    let mut reporter = match (link, &a.activity) {
        (Some(link), Some(activity)) => Some(
            Reporter::start(
                link,
                activity,
                sys::getpid(),
                bucket_template(a)?,
                &m.map,
                sys::now_ns(),
                sys::alive,
            )
            .map_err(|e| format!("--admin {}: {e}", a.admin.as_deref().unwrap_or("")))?,
        ),
        _ => None,
    };
    if m.map.with(|g| g.cfg.is_unlimited()) && reporter.is_none() {
        eprintln!("omnistage shape: no rate given: the program runs with the library loaded but unlimited");
    }
    let mut ld_preload = preload.display().to_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD") {
        if !old.is_empty() {
            ld_preload = format!("{ld_preload}:{}", old.to_string_lossy());
        }
    }
    // The program's terminal signals reach it directly (same process group); we stay to leave
    // the group, so SIGINT/SIGQUIT only interrupt the program, and SIGTERM/SIGHUP are passed on.
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGQUIT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ])
    .map_err(|e| format!("signals: {e}"))?;
    let mut child = std::process::Command::new(program)
        .args(&a.program[1..])
        .env("LD_PRELOAD", ld_preload)
        .env(sys::ENV_GROUP, &group)
        .env(
            sys::ENV_MEMBER,
            format!("{}:{}", m.slot.index, m.slot.generation),
        )
        .env(sys::ENV_WEIGHT, a.weight.to_string())
        .spawn()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    let pid = child.id() as i32;
    let handle = signals.handle();
    let forwarder = std::thread::spawn(move || {
        for s in signals.forever() {
            if s == signal_hook::consts::SIGTERM || s == signal_hook::consts::SIGHUP {
                sys::signal(pid, s);
            }
        }
    });
    // The reporter runs beside the wait, every REPORT_EVERY_NS, and once more at the end.
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let status = std::thread::scope(|scope| {
        if let Some(r) = reporter.as_mut() {
            let map = &m.map;
            scope.spawn(move || {
                let every = std::time::Duration::from_nanos(REPORT_EVERY_NS);
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stop_rx.recv_timeout(every)
                {
                    if let Some(msg) = r.tick(map, sys::now_ns(), sys::alive) {
                        eprintln!("omnistage shape: {msg}");
                    }
                }
                r.finish(map, sys::now_ns(), sys::alive);
            });
        }
        let status = child
            .wait()
            .map_err(|e| format!("waiting for {program}: {e}"));
        drop(stop_tx);
        status
    });
    handle.close();
    let _ = forwarder.join();
    drop(m);
    let status = status?;
    use std::os::unix::process::ExitStatusExt;
    Ok(status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: ShapeArgs,
    }

    fn parse(args: &[&str]) -> Result<ShapeArgs, String> {
        let mut v = vec!["shape"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v)
            .map(|c| c.a)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn rates_become_buckets_with_a_ten_ms_burst_by_default() {
        let a = parse(&["--rate", "1MiB/s", "--", "true"]).unwrap();
        let cfg = group_cfg(&a).unwrap().unwrap();
        assert_eq!(cfg.buckets[0].rate_per_s, 1 << 20);
        assert_eq!(cfg.buckets[0].burst, (1 << 20) / 100);
        assert!(cfg.buckets[1..].iter().all(|b| b.present == 0));
        let a = parse(&[
            "--net-rate",
            "10MB/s",
            "--write-rate",
            "1Gbit/s",
            "--burst",
            "64KiB",
            "--",
            "true",
        ])
        .unwrap();
        let cfg = group_cfg(&a).unwrap().unwrap();
        assert_eq!(
            (cfg.buckets[1].rate_per_s, cfg.buckets[1].burst),
            (10_000_000, 65_536)
        );
        assert_eq!(
            (cfg.buckets[4].rate_per_s, cfg.buckets[4].burst),
            (125_000_000, 65_536)
        );
        let a = parse(&["--disk-rate", "1MB/s", "--bucket", "leaky", "--", "true"]).unwrap();
        let cfg = group_cfg(&a).unwrap().unwrap();
        assert_eq!((cfg.buckets[2].kind, cfg.buckets[2].burst), (1, 0));
        assert!(group_cfg(&parse(&["--", "true"]).unwrap())
            .unwrap()
            .is_none());
    }

    #[test]
    fn bad_options_are_refused_clearly() {
        let e = group_cfg(&parse(&["--rate", "fast", "--", "true"]).unwrap()).unwrap_err();
        assert!(e.starts_with("--rate:"), "{e}");
        let e = group_cfg(&parse(&["--rate", "2TiB/s", "--", "true"]).unwrap()).unwrap_err();
        assert!(e.contains("rate must be"), "{e}");
        assert!(group_cfg(&parse(&["--burst", "1KiB", "--", "true"]).unwrap()).is_err());
        assert!(group_cfg(
            &parse(&["--rate", "1MB/s", "--bucket", "leaky", "--burst", "1KiB", "--", "true"])
                .unwrap()
        )
        .is_err());
        assert!(
            group_cfg(&parse(&["--rate", "1MB/s", "--burst", "0", "--", "true"]).unwrap()).is_err()
        );
        assert!(
            parse(&["--rate", "1MB/s"]).is_err(),
            "a program is required"
        );
        assert!(check_group_name("backup-1.a_b").is_ok());
        for bad in ["", "a/b", "x y", &"n".repeat(65)] {
            assert!(check_group_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn static_and_dynamic_elves_are_told_apart() {
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert_eq!(elf_has_interpreter(&me), Some(true));
        // The same header with every program header's type cleared: no PT_INTERP.
        let mut stat = me.clone();
        let phoff = u64::from_le_bytes(stat[0x20..0x28].try_into().unwrap()) as usize;
        let (sz, n) = (
            u16::from_le_bytes([stat[0x36], stat[0x37]]) as usize,
            u16::from_le_bytes([stat[0x38], stat[0x39]]) as usize,
        );
        for i in 0..n {
            stat[phoff + i * sz..phoff + i * sz + 4].copy_from_slice(&1u32.to_le_bytes());
        }
        assert_eq!(elf_has_interpreter(&stat), Some(false));
        assert_eq!(elf_has_interpreter(b"#!/bin/sh\n"), None);
        assert_eq!(elf_has_interpreter(&me[..40]), None);
    }

    #[test]
    fn a_group_refuses_a_member_with_other_rates_and_closes_with_its_last_member() {
        let name = format!("test.{}.{}", sys::getpid(), sys::now_ns());
        let cfg = group_cfg(&parse(&["--rate", "1MB/s", "--", "true"]).unwrap()).unwrap();
        let first = Membership::join(&name, cfg, 2).unwrap();
        assert!(first.created);
        let other = group_cfg(&parse(&["--rate", "2MB/s", "--", "true"]).unwrap()).unwrap();
        let e = Membership::join(&name, other, 1).err().unwrap();
        assert!(
            e.contains("runs at all=") && e.contains("asked for all="),
            "{e}"
        );
        // Same rates, or none, join the group.
        let second = Membership::join(&name, cfg, 1).unwrap();
        let third = Membership::join(&name, None, 1).unwrap();
        assert!(!second.created && !third.created);
        assert_eq!(first.map.with(|g| g.member_count()), 3);
        drop((second, third));
        drop(first);
        // The last member removed the segment: the next joiner creates a new one.
        let again = Membership::join(&name, other, 1).unwrap();
        assert!(again.created);
    }
}
