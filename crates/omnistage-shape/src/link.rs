//! A shaping group's link to a running omnistage (`omnistage shape --admin URL --activity
//! PATH`): the group's bytes show in that server's activity tree, `omnistage top` and
//! `/metrics`, and `omnistage set PATH cap_net=R cap_disk=R` changes the group's rates live.
//!
//! - One launcher of the group reports: the first with `--admin` claims it (its pid and the
//!   activity go into the group's segment); another launcher of the group takes over when that
//!   one is gone. A launcher naming another activity than the group's is refused.
//! - Every [`REPORT_EVERY_NS`] the reporter sends the bytes the group moved since its last
//!   report (network in and out, disk read and written, counted by the hooks of every member
//!   once the group is claimed, with or without a bucket) and runs the group at the network and
//!   disk rates the answer carries. Bytes a failed report could not send are sent by the next.
//! - A rate change keeps a bucket's balance (clamped to its new depth), a new bucket starts
//!   full, a removed one stops limiting. The hooks notice a change through the segment's epoch
//!   (`sys`) on their next call.
//!
//! The admin API is reached through [`Link`], which the command implements with its admin
//! client. This module is clock-free (callers pass `now_ns`) and tested with a fake link.

use crate::meter::{BucketCfg, GroupState, ACTIVITY_BYTES_MAX, B_DISK, B_NET, IO_KINDS};
use omnistage::sched::{Shaper, ShaperSpec};

/// How often the reporter reports (and so how soon a `set` reaches the group's buckets).
pub const REPORT_EVERY_NS: u64 = 250_000_000;

/// A group's network and disk rates, bytes/s (`None`: no such bucket).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rates {
    pub net: Option<u64>,
    pub disk: Option<u64>,
}

/// Why the admin API did not take a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkError {
    /// The group is not attached there (the server restarted, or the activity was removed):
    /// attach again.
    Detached(String),
    /// Anything else (unreachable, refused); the reporter tries again next time.
    Failed(String),
}

/// The admin API as the reporter sees it.
pub trait Link: Send {
    /// Attaches the group to its activity with `rates`; answers the rates to run at (an
    /// activity attached before keeps the rates it has).
    fn attach(&mut self, rates: Rates) -> Result<Rates, LinkError>;
    /// Sends `bytes` (by `IO_NAMES`) moved since the last report; answers the rates to run at.
    fn report(&mut self, bytes: [u64; IO_KINDS]) -> Result<Rates, LinkError>;
}

impl Link for Box<dyn Link> {
    fn attach(&mut self, rates: Rates) -> Result<Rates, LinkError> {
        (**self).attach(rates)
    }
    fn report(&mut self, bytes: [u64; IO_KINDS]) -> Result<Rates, LinkError> {
        (**self).report(bytes)
    }
}

/// What the reporter needs of the group's segment (`sys::SegmentMap` in the command, a plain
/// state in tests).
pub trait Group {
    fn with<R>(&self, f: impl FnOnce(&mut GroupState) -> R) -> R;
}

/// How a bucket made by a rate change is built: the group's `--bucket` and `--burst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketTemplate {
    pub leaky: bool,
    /// A token bucket's depth; `None`: the bytes of 10 ms at the rate.
    pub burst: Option<u64>,
}

impl BucketTemplate {
    pub fn bucket(&self, rate_per_s: u64) -> BucketCfg {
        BucketCfg::from_spec(if self.leaky {
            ShaperSpec::leaky(rate_per_s)
        } else {
            ShaperSpec::token(rate_per_s, self.burst.unwrap_or((rate_per_s / 100).max(1)))
        })
    }
}

impl GroupState {
    /// The rates of the group's network and disk buckets.
    pub fn net_disk_rates(&self) -> Rates {
        let rate = |b: usize| {
            let c = &self.cfg.buckets[b];
            (c.present != 0).then_some(c.rate_per_s)
        };
        Rates {
            net: rate(B_NET),
            disk: rate(B_DISK),
        }
    }

    /// Runs the group's network and disk buckets at `rates` from `now_ns`. A bucket that stays
    /// keeps its balance, clamped to its new depth; a new one starts full (as a new group's
    /// buckets do); a removed one stops limiting. A bucket whose rate is unchanged is left as
    /// it is. Returns whether anything changed; a rate no bucket can run at is refused and
    /// changes nothing.
    pub fn set_net_disk_rates(
        &mut self,
        rates: Rates,
        t: BucketTemplate,
        now_ns: u64,
    ) -> Result<bool, String> {
        let wanted = [(B_NET, rates.net), (B_DISK, rates.disk)];
        for (_, r) in wanted {
            if let Some(r) = r {
                t.bucket(r).spec().validate()?;
            }
        }
        let mut changed = false;
        for (b, r) in wanted {
            let old = self.cfg.buckets[b];
            match r {
                None if old.present != 0 => {
                    self.cfg.buckets[b] = BucketCfg::default();
                    changed = true;
                }
                None => {}
                Some(r) if old.present != 0 && old.rate_per_s == r => {}
                Some(r) => {
                    // A bucket that stays keeps its kind; a new one takes the template's.
                    let kind = BucketTemplate {
                        leaky: if old.present != 0 {
                            old.kind == 1
                        } else {
                            t.leaky
                        },
                        ..t
                    };
                    let new = kind.bucket(r);
                    let s = if old.present != 0 {
                        let mut s = self.shaper(b);
                        s.set_spec(new.spec(), now_ns);
                        s
                    } else {
                        Shaper::new(new.spec(), now_ns)
                    };
                    self.cfg.buckets[b] = new;
                    self.run[b].store(&s);
                    changed = true;
                }
            }
        }
        if changed {
            self.cfg_changed = 1;
        }
        debug_assert!(self.cfg.validate().is_ok());
        Ok(changed)
    }

    /// The activity the group reports to, if a reporter claimed it.
    pub fn activity(&self) -> Option<&str> {
        let n = (self.activity_len as usize).min(ACTIVITY_BYTES_MAX);
        (n > 0)
            .then(|| std::str::from_utf8(&self.activity[..n]).ok())
            .flatten()
    }

    /// Whether `pid` is (now) the group's reporter to `activity`: it is when nobody reports, or
    /// the reporter is gone (not `alive`), or it already was. Refused when the group reports to
    /// another activity. The first claim makes the hooks count bytes.
    pub fn claim_reporter(
        &mut self,
        pid: i32,
        activity: &str,
        alive: impl Fn(i32) -> bool,
    ) -> Result<bool, String> {
        if activity.is_empty() || activity.len() > ACTIVITY_BYTES_MAX {
            return Err(format!(
                "activity path must be 1..={ACTIVITY_BYTES_MAX} bytes"
            ));
        }
        match self.activity() {
            Some(a) if a != activity => {
                return Err(format!(
                    "this group reports to {a}: give the same --activity, or use another --group"
                ))
            }
            Some(_) => {}
            None => {
                self.activity[..activity.len()].copy_from_slice(activity.as_bytes());
                self.activity_len = activity.len() as u32;
            }
        }
        if self.counted == 0 {
            self.counted = 1;
            self.cfg_changed = 1;
        }
        if self.reporter_pid == 0 || self.reporter_pid == pid || !alive(self.reporter_pid) {
            self.reporter_pid = pid;
            return Ok(true);
        }
        Ok(false)
    }

    /// Bytes counted and not yet sent on, by `IO_NAMES`, at most [`REPORT_BYTES_MAX`] of each
    /// kind (the rest goes in the next reports).
    pub fn unreported(&self) -> [u64; IO_KINDS] {
        let mut d = [0; IO_KINDS];
        for (k, v) in d.iter_mut().enumerate() {
            *v = self.io[k]
                .saturating_sub(self.io_reported[k])
                .min(REPORT_BYTES_MAX);
        }
        d
    }

    /// `sent` (an earlier [`GroupState::unreported`]) was taken by the admin API.
    pub fn mark_reported(&mut self, sent: [u64; IO_KINDS]) {
        for (r, s) in self.io_reported.iter_mut().zip(sent) {
            *r = r.saturating_add(s);
        }
    }
}

/// Most bytes of each kind one report carries: what the admin API accepts
/// (`omnistage_admin::model::SHAPED_REPORT_BYTES_MAX`; a test in the command's crate holds the
/// two equal). A larger backlog (the admin API away for a while under a fast group, or a
/// member that wrote the shared counters) goes out over several reports; sent whole, it was
/// refused with 400 and never marked reported, so every later report was refused too.
pub const REPORT_BYTES_MAX: u64 = 1 << 40;

/// The group's reporter (see the module's doc): made by [`Reporter::start`], then
/// [`Reporter::tick`] every [`REPORT_EVERY_NS`] and [`Reporter::finish`] at the end.
pub struct Reporter<L: Link> {
    link: L,
    activity: String,
    pid: i32,
    template: BucketTemplate,
    attached: bool,
    /// The last problem said, so a lasting one is said once.
    said: Option<String>,
}

impl<L: Link> Reporter<L> {
    /// Claims the group for `pid` (refused when it reports to another activity) and attaches it
    /// with its rates, then runs it at the rates the answer gives. A failed attach is an error:
    /// the user asked for the link.
    pub fn start(
        mut link: L,
        activity: &str,
        pid: i32,
        template: BucketTemplate,
        group: &impl Group,
        now_ns: u64,
        alive: impl Fn(i32) -> bool,
    ) -> Result<Reporter<L>, String> {
        let rates = group.with(|g| {
            g.claim_reporter(pid, activity, &alive)?;
            Ok::<_, String>(g.net_disk_rates())
        })?;
        let given = link.attach(rates).map_err(|e| match e {
            LinkError::Detached(m) | LinkError::Failed(m) => m,
        })?;
        group.with(|g| g.set_net_disk_rates(given, template, now_ns))?;
        Ok(Reporter {
            link,
            activity: activity.to_string(),
            pid,
            template,
            attached: true,
            said: None,
        })
    }

    /// One report, when this launcher is the group's reporter. Returns a message to show when
    /// the link's state changes (a failure, or its recovery).
    pub fn tick(
        &mut self,
        group: &impl Group,
        now_ns: u64,
        alive: impl Fn(i32) -> bool,
    ) -> Option<String> {
        let claim = group.with(|g| {
            let mine = g.claim_reporter(self.pid, &self.activity, &alive)?;
            Ok::<_, String>((mine, g.unreported(), g.net_disk_rates()))
        });
        let (mine, bytes, rates) = match claim {
            Ok(c) => c,
            Err(e) => return self.say(Some(e)),
        };
        if !mine {
            return None;
        }
        if !self.attached {
            match self.link.attach(rates) {
                Ok(r) => {
                    self.attached = true;
                    if let Err(e) = group.with(|g| g.set_net_disk_rates(r, self.template, now_ns)) {
                        return self.say(Some(format!("the admin API's rates: {e}")));
                    }
                }
                Err(LinkError::Detached(m) | LinkError::Failed(m)) => return self.say(Some(m)),
            }
        }
        match self.link.report(bytes) {
            Ok(r) => {
                let set = group.with(|g| {
                    g.mark_reported(bytes);
                    g.set_net_disk_rates(r, self.template, now_ns)
                });
                match set {
                    Ok(_) => self.say(None),
                    Err(e) => self.say(Some(format!("the admin API's rates: {e}"))),
                }
            }
            Err(LinkError::Detached(m)) => {
                self.attached = false;
                self.say(Some(m))
            }
            Err(LinkError::Failed(m)) => self.say(Some(m)),
        }
    }

    /// The last report, when the program has ended.
    pub fn finish(&mut self, group: &impl Group, now_ns: u64, alive: impl Fn(i32) -> bool) {
        let _ = self.tick(group, now_ns, alive);
    }

    fn say(&mut self, problem: Option<String>) -> Option<String> {
        if problem == self.said {
            return None;
        }
        let was = std::mem::replace(&mut self.said, problem.clone());
        match problem {
            Some(p) => Some(format!("reporting to {}: {p}", self.activity)),
            None => was.map(|_| format!("reporting to {} again", self.activity)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meter::{Class, Dir, GroupCfg, Mode, Need, Verdict};
    use std::cell::RefCell;
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    struct Plain(RefCell<GroupState>);

    impl Group for Plain {
        fn with<R>(&self, f: impl FnOnce(&mut GroupState) -> R) -> R {
            f(&mut self.0.borrow_mut())
        }
    }

    /// What the fake was sent: the verb, the bytes reported, the rates attached with.
    type Sent = (&'static str, [u64; IO_KINDS], Rates);

    /// A fake admin API: answers from a script, records what it was sent.
    #[derive(Clone, Default)]
    struct Fake {
        answers: Arc<Mutex<VecDeque<Result<Rates, LinkError>>>>,
        sent: Arc<Mutex<Vec<Sent>>>,
    }

    impl Fake {
        fn answer(&self, a: Result<Rates, LinkError>) {
            self.answers.lock().unwrap().push_back(a);
        }
        fn next(&self) -> Result<Rates, LinkError> {
            self.answers
                .lock()
                .unwrap()
                .pop_front()
                .expect("an answer scripted")
        }
    }

    impl Link for Fake {
        fn attach(&mut self, rates: Rates) -> Result<Rates, LinkError> {
            self.sent.lock().unwrap().push(("attach", [0; 4], rates));
            self.next()
        }
        fn report(&mut self, bytes: [u64; IO_KINDS]) -> Result<Rates, LinkError> {
            self.sent
                .lock()
                .unwrap()
                .push(("report", bytes, Rates::default()));
            self.next()
        }
    }

    const TOKEN: BucketTemplate = BucketTemplate {
        leaky: false,
        burst: None,
    };
    const MIB: u64 = 1 << 20;

    fn group(net: Option<u64>) -> Plain {
        let mut cfg = GroupCfg::default();
        if let Some(r) = net {
            cfg.buckets[B_NET] = TOKEN.bucket(r);
        }
        Plain(RefCell::new(GroupState::new(cfg, 0).unwrap()))
    }

    /// Moves `bytes` through the group as one stream transfer at `now`, as the hooks do.
    fn transfer(g: &Plain, class: Class, dir: Dir, bytes: u64, now: u64) -> u64 {
        g.with(|s| {
            let slot = crate::meter::Slot {
                index: 0,
                generation: s.members[0].generation,
            };
            let need = Need::of(class, dir);
            match s.request(slot, &need, bytes, Mode::Stream, now) {
                Verdict::Go(n) => {
                    s.settle(slot, &need, Mode::Stream, n, n, now);
                    n
                }
                Verdict::Wait(_) => 0,
            }
        })
    }

    /// A backlog above what one report may carry goes out over several reports.
    #[test]
    fn a_large_backlog_is_reported_in_parts() {
        let g = group(None);
        g.0.borrow_mut().io[0] = 3 * REPORT_BYTES_MAX + 5;
        let mut parts = Vec::new();
        for _ in 0..5 {
            let sent = g.0.borrow().unreported();
            assert!(sent.iter().all(|&b| b <= REPORT_BYTES_MAX));
            parts.push(sent[0]);
            g.0.borrow_mut().mark_reported(sent);
        }
        let m = REPORT_BYTES_MAX;
        assert_eq!(parts, [m, m, m, 5, 0]);
    }

    #[test]
    fn bytes_are_counted_once_claimed_and_sent_once() {
        let g = group(None);
        g.with(|s| s.join(1, 1, 0).unwrap());
        // Before a reporter claims the group nothing is counted.
        assert_eq!(transfer(&g, Class::Net, Dir::Read, 100, 1), 100);
        assert_eq!(g.0.borrow().unreported(), [0; 4]);
        let fake = Fake::default();
        fake.answer(Ok(Rates::default()));
        let mut r = Reporter::start(fake.clone(), "/shape/x", 7, TOKEN, &g, 2, |_| true).unwrap();
        assert_eq!(transfer(&g, Class::Net, Dir::Read, 1000, 3), 1000);
        assert_eq!(transfer(&g, Class::Net, Dir::Write, 20, 3), 20);
        assert_eq!(transfer(&g, Class::Disk, Dir::Read, 300, 3), 300);
        assert_eq!(transfer(&g, Class::Disk, Dir::Write, 4000, 3), 4000);
        fake.answer(Ok(Rates::default()));
        assert_eq!(r.tick(&g, 4, |_| true), None);
        // A failed report loses nothing: the next one carries its bytes too.
        assert_eq!(transfer(&g, Class::Net, Dir::Read, 5, 5), 5);
        fake.answer(Err(LinkError::Failed("connection refused".into())));
        let said = r.tick(&g, 6, |_| true).expect("a failure is said");
        assert!(
            said.contains("/shape/x") && said.contains("refused"),
            "{said}"
        );
        fake.answer(Err(LinkError::Failed("connection refused".into())));
        assert_eq!(r.tick(&g, 7, |_| true), None, "said once while it lasts");
        fake.answer(Ok(Rates::default()));
        assert!(r.tick(&g, 8, |_| true).unwrap().contains("again"));
        let sent = fake.sent.lock().unwrap().clone();
        let reports: Vec<[u64; 4]> = sent
            .iter()
            .filter(|s| s.0 == "report")
            .map(|s| s.1)
            .collect();
        assert_eq!(
            reports,
            [
                [1000, 20, 300, 4000],
                [5, 0, 0, 0],
                [5, 0, 0, 0],
                [5, 0, 0, 0]
            ]
        );
        assert_eq!(g.0.borrow().unreported(), [0; 4]);
    }

    #[test]
    fn the_answers_rates_run_the_buckets() {
        let g = group(Some(MIB));
        g.with(|s| s.join(1, 1, 0).unwrap());
        let fake = Fake::default();
        // The attach sends the group's own rates; an activity attached earlier answers with its.
        fake.answer(Ok(Rates {
            net: Some(2 * MIB),
            disk: None,
        }));
        let mut r = Reporter::start(fake.clone(), "/shape/x", 7, TOKEN, &g, 0, |_| true).unwrap();
        assert_eq!(
            fake.sent.lock().unwrap()[0].2,
            Rates {
                net: Some(MIB),
                disk: None
            }
        );
        let s = g.0.borrow().cfg.buckets[B_NET];
        assert_eq!((s.rate_per_s, s.burst), (2 * MIB, 2 * MIB / 100));
        assert!(g.0.borrow().cfg_changed != 0, "the hooks are told");
        // A disk rate appears: a full new bucket; the network bucket goes: no limit.
        fake.answer(Ok(Rates {
            net: None,
            disk: Some(100_000),
        }));
        r.tick(&g, 1_000_000_000, |_| true);
        assert_eq!(g.0.borrow().cfg.buckets[B_NET].present, 0);
        let t0 = 1_000_000_000;
        assert_eq!(
            transfer(&g, Class::Disk, Dir::Write, 1 << 20, t0),
            1000,
            "a new token bucket starts full (10 ms of 100 kB/s)"
        );
        assert_eq!(transfer(&g, Class::Disk, Dir::Write, 1 << 20, t0), 0);
        assert_eq!(transfer(&g, Class::Net, Dir::Write, 1 << 20, t0), 1 << 20);
        // Over a simulated second at 100 kB/s the disk bucket passes 100 kB (+ its depth).
        let moved: u64 = (1..=100)
            .map(|i| transfer(&g, Class::Disk, Dir::Write, 1 << 20, t0 + i * 10_000_000))
            .sum();
        assert_eq!(moved, 100_000);
        // A lower rate clamps the balance to the new depth at once.
        fake.answer(Ok(Rates {
            net: None,
            disk: Some(10_000),
        }));
        r.tick(&g, t0 + 2_000_000_000, |_| true);
        assert_eq!(
            transfer(&g, Class::Disk, Dir::Write, 1 << 20, t0 + 2_000_000_000),
            100
        );
        // A rate no bucket can run at is said and changes nothing.
        fake.answer(Ok(Rates {
            net: Some(0),
            disk: Some(10_000),
        }));
        assert!(r.tick(&g, t0 + 3_000_000_000, |_| true).is_some());
        assert_eq!(g.0.borrow().cfg.buckets[B_NET].present, 0);
    }

    #[test]
    fn one_launcher_reports_and_another_takes_over_when_it_is_gone() {
        let g = group(None);
        let (a, b) = (Fake::default(), Fake::default());
        a.answer(Ok(Rates::default()));
        let mut ra = Reporter::start(a.clone(), "/shape/x", 10, TOKEN, &g, 0, |_| true).unwrap();
        b.answer(Ok(Rates::default()));
        let mut rb = Reporter::start(b.clone(), "/shape/x", 11, TOKEN, &g, 0, |_| true).unwrap();
        // Another activity is refused.
        let c = Fake::default();
        let e = Reporter::start(c, "/shape/y", 12, TOKEN, &g, 0, |_| true)
            .err()
            .unwrap();
        assert!(e.contains("reports to /shape/x"), "{e}");
        a.answer(Ok(Rates::default()));
        ra.tick(&g, 1, |_| true);
        assert_eq!(rb.tick(&g, 1, |_| true), None);
        assert_eq!(b.sent.lock().unwrap().len(), 1, "b only attached");
        // a is gone: b reports from now on.
        b.answer(Ok(Rates::default()));
        rb.tick(&g, 2, |pid| pid != 10);
        assert_eq!(g.0.borrow().reporter_pid, 11);
        assert_eq!(b.sent.lock().unwrap().len(), 2);
    }

    #[test]
    fn a_detached_group_attaches_again_and_a_failed_start_is_an_error() {
        let g = group(None);
        let fake = Fake::default();
        fake.answer(Err(LinkError::Failed(
            "cannot reach the admin API at http://127.0.0.1:1".into(),
        )));
        let e = Reporter::start(fake.clone(), "/shape/x", 7, TOKEN, &g, 0, |_| true)
            .err()
            .unwrap();
        assert!(e.contains("cannot reach"), "{e}");
        fake.answer(Ok(Rates::default()));
        let mut r = Reporter::start(fake.clone(), "/shape/x", 7, TOKEN, &g, 0, |_| true).unwrap();
        fake.answer(Err(LinkError::Detached("no activity /shape/x".into())));
        assert!(r.tick(&g, 1, |_| true).is_some());
        fake.answer(Ok(Rates::default()));
        fake.answer(Ok(Rates::default()));
        r.tick(&g, 2, |_| true);
        let kinds: Vec<&str> = fake.sent.lock().unwrap().iter().map(|s| s.0).collect();
        assert_eq!(kinds, ["attach", "attach", "report", "attach", "report"]);
    }

    #[test]
    fn long_or_empty_activity_paths_are_refused() {
        let g = group(None);
        let long = format!("/{}", "a".repeat(ACTIVITY_BYTES_MAX));
        assert!(g.with(|s| s.claim_reporter(1, &long, |_| true)).is_err());
        assert!(g.with(|s| s.claim_reporter(1, "", |_| true)).is_err());
        let max = format!("/{}", "a".repeat(ACTIVITY_BYTES_MAX - 1));
        assert!(g.with(|s| s.claim_reporter(1, &max, |_| true)).unwrap());
        assert_eq!(g.0.borrow().activity(), Some(max.as_str()));
    }
}
