//! Panic reporting: quiet and visible. The process-wide panic hook [`install`] puts in place
//! prints one line per panic, `omnistage: panic in STAGE at FILE:LINE: MESSAGE`, the backtrace
//! at most once per location per minute (a client that can trigger a panic cannot fill the
//! operator's logs with backtraces), and counts the panic for its stage ([`panic_counts`], shown
//! in `/metrics`).
//!
//! The stage is the one whose handler the thread is running: the worker marks each batch with
//! [`StageGuard`] (one thread-local store before and after, not per message); other threads
//! name themselves with [`set_thread_stage`] (the admin API's handlers), else the thread's name.
//! Containment is elsewhere (the worker's `catch_unwind`, and the glue's own): this only reports.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::panic::PanicHookInfo;
use std::sync::{Mutex, MutexGuard, Once, PoisonError};
use std::time::{Duration, Instant};

/// A location's backtrace is printed at most once per this long.
pub const BACKTRACE_INTERVAL: Duration = Duration::from_secs(60);
/// Most locations whose last backtrace time is remembered; past it, entries older than the
/// interval are dropped, and while it stays full, new locations get no backtrace.
const BACKTRACE_LOCATIONS_MAX: usize = 1024;
/// Most distinct stage names counted; more (never seen: a runtime has at most 64 stages, and a
/// process a few runtimes) are counted under [`OTHER_STAGE`].
const STAGE_NAMES_MAX: usize = 256;
/// Where panics of stages past [`STAGE_NAMES_MAX`] are counted.
const OTHER_STAGE: &str = "other";
/// Longest panic message printed, in bytes (cut on a character boundary).
const MESSAGE_BYTES_MAX: usize = 512;

thread_local! {
    static CURRENT_STAGE: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// Marks the running thread as handling `stage` until dropped (then the previous mark is back).
pub struct StageGuard {
    previous: Option<&'static str>,
}

impl StageGuard {
    /// Marks the thread; `stage` comes from [`intern`].
    pub fn enter(stage: &'static str) -> StageGuard {
        StageGuard {
            previous: CURRENT_STAGE.with(|c| c.replace(Some(stage))),
        }
    }
}

impl Drop for StageGuard {
    fn drop(&mut self) {
        CURRENT_STAGE.with(|c| c.set(self.previous));
    }
}

/// Names the stage of a thread that is not a worker (e.g. `"admin"`) for its whole life.
pub fn set_thread_stage(stage: &str) {
    let stage = intern(stage);
    CURRENT_STAGE.with(|c| c.set(Some(stage)));
}

struct State {
    /// Interned stage names and their panic counts, in first-seen order.
    stages: Vec<(&'static str, u64)>,
    /// When each location's backtrace was last printed.
    backtraces: BTreeMap<String, Instant>,
}

static STATE: Mutex<State> = Mutex::new(State {
    stages: Vec::new(),
    backtraces: BTreeMap::new(),
});

fn state() -> MutexGuard<'static, State> {
    // A panic while the lock is held (never inside this module) must not silence the hook.
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A `'static` copy of `name`, shared by every caller with the same name: each distinct name is
/// leaked once (stage names are few and fixed); past [`STAGE_NAMES_MAX`], [`OTHER_STAGE`].
pub fn intern(name: &str) -> &'static str {
    intern_locked(&mut state(), name)
}

/// Panics counted so far per stage (every stage ever interned, zero or not), in first-seen order.
pub fn panic_counts() -> Vec<(&'static str, u64)> {
    state().stages.clone()
}

/// Installs the reporting hook (once per process; later calls do nothing). It replaces the
/// default hook: a test or program that wants its own sets it after this.
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::panic::set_hook(Box::new(report)));
}

fn report(info: &PanicHookInfo<'_>) {
    let stage = CURRENT_STAGE.with(Cell::get);
    let thread = std::thread::current();
    let stage_name = stage.unwrap_or_else(|| thread.name().unwrap_or("unnamed thread"));
    let (file, line) = info.location().map_or(("?", 0), |l| (l.file(), l.line()));
    let payload = info.payload();
    let message = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(a non-string payload)");
    let show_backtrace = {
        let mut st = state();
        let counted = stage.unwrap_or_else(|| intern_locked(&mut st, stage_name));
        if let Some(entry) = st.stages.iter_mut().find(|(s, _)| *s == counted) {
            entry.1 += 1;
        }
        let location = format!("{file}:{line}");
        backtrace_due(&mut st.backtraces, location, Instant::now())
    };
    let mut out = one_line(stage_name, file, line, message);
    if show_backtrace {
        out.push_str(&format!(
            "omnistage: backtrace (printed once per {} s for {file}:{line}):\n{}\n",
            BACKTRACE_INTERVAL.as_secs(),
            std::backtrace::Backtrace::force_capture()
        ));
    }
    // One write, so lines of panics on several threads do not interleave.
    use std::io::Write;
    let _ = std::io::stderr().lock().write_all(out.as_bytes());
}

/// [`intern`] with the lock already held (the hook's path).
fn intern_locked(st: &mut State, name: &str) -> &'static str {
    if let Some(&(s, _)) = st.stages.iter().find(|(s, _)| *s == name) {
        return s;
    }
    if st.stages.len() >= STAGE_NAMES_MAX {
        if !st.stages.iter().any(|(s, _)| *s == OTHER_STAGE) {
            st.stages.push((OTHER_STAGE, 0));
        }
        return OTHER_STAGE;
    }
    let s: &'static str = Box::leak(name.to_owned().into_boxed_str());
    st.stages.push((s, 0));
    s
}

/// `omnistage: panic in STAGE at FILE:LINE: MESSAGE` and a newline; the message on one line
/// (line breaks escaped) and at most [`MESSAGE_BYTES_MAX`] bytes.
pub fn one_line(stage: &str, file: &str, line: u32, message: &str) -> String {
    let mut cut = message.len().min(MESSAGE_BYTES_MAX);
    while !message.is_char_boundary(cut) {
        cut -= 1;
    }
    let tail = if cut < message.len() { "..." } else { "" };
    let message = message[..cut].replace('\r', "\\r").replace('\n', "\\n");
    format!("omnistage: panic in {stage} at {file}:{line}: {message}{tail}\n")
}

/// True when `location`'s backtrace is due at `now` (none printed within
/// [`BACKTRACE_INTERVAL`]); records it. Bounded by [`BACKTRACE_LOCATIONS_MAX`].
fn backtrace_due(last: &mut BTreeMap<String, Instant>, location: String, now: Instant) -> bool {
    if let Some(t) = last.get_mut(&location) {
        if now.saturating_duration_since(*t) < BACKTRACE_INTERVAL {
            return false;
        }
        *t = now;
        return true;
    }
    if last.len() >= BACKTRACE_LOCATIONS_MAX {
        last.retain(|_, t| now.saturating_duration_since(*t) < BACKTRACE_INTERVAL);
        if last.len() >= BACKTRACE_LOCATIONS_MAX {
            return false;
        }
    }
    last.insert(location, now);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_panic_escaped_and_bounded() {
        assert_eq!(
            one_line("work", "src/a.rs", 7, "boom"),
            "omnistage: panic in work at src/a.rs:7: boom\n"
        );
        assert_eq!(
            one_line("work", "a.rs", 1, "two\nlines\r"),
            "omnistage: panic in work at a.rs:1: two\\nlines\\r\n"
        );
        // A long message is cut on a character boundary, never inside 'é'.
        let long = "é".repeat(MESSAGE_BYTES_MAX);
        let l = one_line("s", "f", 1, &long);
        assert!(
            l.ends_with("...\n") && l.len() < MESSAGE_BYTES_MAX + 64,
            "{}",
            l.len()
        );
    }

    #[test]
    fn a_backtrace_once_per_location_per_interval() {
        let mut last = BTreeMap::new();
        let t0 = Instant::now();
        assert!(backtrace_due(&mut last, "a:1".into(), t0));
        assert!(!backtrace_due(
            &mut last,
            "a:1".into(),
            t0 + Duration::from_secs(59)
        ));
        assert!(backtrace_due(
            &mut last,
            "b:2".into(),
            t0 + Duration::from_secs(1)
        ));
        assert!(backtrace_due(
            &mut last,
            "a:1".into(),
            t0 + BACKTRACE_INTERVAL
        ));
        assert!(!backtrace_due(
            &mut last,
            "a:1".into(),
            t0 + BACKTRACE_INTERVAL
        ));
    }

    #[test]
    fn the_backtrace_memory_is_bounded() {
        let mut last = BTreeMap::new();
        let t0 = Instant::now();
        for i in 0..BACKTRACE_LOCATIONS_MAX {
            assert!(backtrace_due(&mut last, format!("f:{i}"), t0));
        }
        // Full and all recent: a new location gets no backtrace (but still its line).
        assert!(!backtrace_due(&mut last, "new:1".into(), t0));
        assert_eq!(last.len(), BACKTRACE_LOCATIONS_MAX);
        // A minute on, the old entries make room.
        assert!(backtrace_due(
            &mut last,
            "new:1".into(),
            t0 + BACKTRACE_INTERVAL
        ));
        assert_eq!(last.len(), 1);
    }

    #[test]
    fn stage_names_are_interned_once() {
        let a = intern("panic-test-stage");
        let b = intern(&String::from("panic-test-stage"));
        assert!(std::ptr::eq(a, b));
        assert!(panic_counts().iter().any(|(s, _)| *s == "panic-test-stage"));
    }
}
