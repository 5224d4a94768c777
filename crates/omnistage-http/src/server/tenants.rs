//! The tenants as the running server knows them: the live configuration swapped by a reload
//! ([`Live`]), each tenant's runtime record ([`TenantRuntime`]), their activities and admission
//! predicates on `http.work` (p90 targets, class groups), and the reload and per-tenant update
//! of a running server.

use super::tls::TlsConfigs;
use super::{FleetHooks, FleetStatus, Server};
use crate::config::{CapKind, Config};
use omnistage::account::{ActivityId, StageId};
use omnistage::activity::{ActivitySpec, ACTIVITIES_MAX};
use omnistage::admit::P90Params;
use omnistage::exec::{ClassGroup, Predicate, Runtime};
use omnistage::sched::{ShaperKind, ShaperSpec};
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Highest admission rate of a tenant with a p90 target, requests/s (all cores).
const P90_RATE_MAX_PER_S: f64 = 100_000.0;
/// Little's-law queue bound of a p90-controlled tenant, as a fraction of its target: the queue
/// holds at most this × target × its measured completion rate, so the mean queueing delay is
/// about 0.4 × target; the margin is for the 90th percentile, which sits above the mean (on a
/// busy machine we measured p90 of 15–20 ms at 0.5 × a 20 ms target).
const P90_QUEUE_BOUND_FRACTION: f64 = 0.4;
/// Requests a p90-controlled tenant may send back to back.
const P90_BURST: u32 = 256;

/// One tenant as the running server knows it. The same `Arc` lives across reloads for as long
/// as the tenant keeps its name, so connection counts stay with the tenant.
pub(super) struct TenantRuntime {
    pub(super) name: String,
    pub(super) activity: ActivityId,
    pub(super) path: String,
    pub(super) open: AtomicUsize,
    /// Bytes of this tenant's files in the cache, over all cores.
    pub(super) cache_bytes: AtomicU64,
    /// Bytes the disk stage read for this tenant.
    pub(super) disk_bytes: AtomicU64,
    /// Bytes of its `net_cap` its send buckets discarded (all cores): while it was backlogged
    /// (wake-ups later than the bucket's allowance) and while it was idle.
    pub(super) net_cap_lost_backlogged_bytes: AtomicU64,
    pub(super) net_cap_lost_idle_bytes: AtomicU64,
    /// The fleet layer's hooks (lease pools, link backlog, link weight).
    pub(super) fleet: Arc<FleetHooks>,
}

/// A tenant as the fleet layer sees it ([`Server::fleet_tenants`]).
#[derive(Clone, Debug)]
pub struct FleetTenant {
    pub name: String,
    /// `/tenants/<name>`.
    pub path: String,
    pub activity: ActivityId,
    /// The weight in the running configuration.
    pub weight: u32,
    /// Its fleet caps.
    pub caps: crate::config::TenantFleet,
    pub hooks: Arc<FleetHooks>,
}

/// The configuration and its tenants, swapped as one by a reload (so an index into one always
/// means the same tenant in the other).
pub(super) struct Live {
    pub(super) config: Config,
    pub(super) tenants: Vec<Arc<TenantRuntime>>,
    /// Per tenant, the activity of each of its classes in config order
    /// (`/tenants/<tenant>/<class>`).
    pub(super) classes: Vec<Vec<ActivityId>>,
    /// The certificates, when the server has TLS listeners (`tls.rs`).
    pub(super) tls: Option<Arc<TlsConfigs>>,
}

/// Why [`Server::update_tenant`] refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpdateError {
    NoTenant(String),
    Refused(String),
}

/// The scheduler's shaper kind of a configured cap kind.
pub(super) fn cap_kind(k: CapKind) -> ShaperKind {
    match k {
        CapKind::Token => ShaperKind::Token,
        CapKind::Leaky => ShaperKind::Leaky,
    }
}

fn shaper_of(rate_per_s: Option<f64>, kind: ShaperKind) -> Option<ShaperSpec> {
    rate_per_s.map(|r| ShaperSpec {
        kind,
        rate_per_s: r.max(1.0) as u64,
        // A token bucket may burst 10 ms of its rate.
        burst: (r / 100.0).max(1.0) as u64,
        grain: 0,
    })
}

/// SEDA's p90 controller parameters for a target, scaled for a server that answers up to
/// ~100,000 requests/s: SEDA's rate range (0.05–5,000/s) and additive step (2/s) suit tens of
/// requests per second and would cap a fast tenant or leave it cut for minutes, so the ceiling
/// is 100,000/s, the step 100/s and the floor 10/s (a cut class still sends the controller a
/// sample every 100 ms, so it can recover); the other parameters are SEDA's defaults. The
/// queue is also bounded by Little's law to [`P90_QUEUE_BOUND_FRACTION`] × target × the
/// measured completion rate, so a backlog admitted before the controller reacts cannot hold
/// the response time over the target (docs/design.md, "Overload").
fn p90_params(target: Duration) -> P90Params {
    P90Params {
        target_ns: (target.as_nanos() as u64).max(1),
        rate_max_per_s: P90_RATE_MAX_PER_S,
        rate_min_per_s: P90_RATE_MAX_PER_S / 10_000.0,
        adj_i: P90_RATE_MAX_PER_S / 1000.0,
        queue_bound_fraction: P90_QUEUE_BOUND_FRACTION,
        ..P90Params::default()
    }
}

fn p90_predicate(target: Duration) -> Predicate {
    Predicate::P90 {
        params: p90_params(target),
        initial_rate_per_s: P90_RATE_MAX_PER_S,
        burst: P90_BURST,
    }
}

/// The admission predicate of each of a tenant's activities on the work stage: the tenant's
/// own (requests in no class) first, then one per class in config order. With no class
/// priority, each gets its own p90 controller (the class's target, else the tenant's, else
/// none). When some class has a `priority`, they share one class-based controller
/// ([`ClassGroup`]): one level per distinct priority (0 first), and a bottom level for classes
/// without one and requests in no class (when the tenant has a target).
fn tenant_predicates(t: &crate::config::TenantConfig) -> Result<Vec<Option<Predicate>>, String> {
    let own = t.p90_target;
    if t.classes.iter().all(|c| c.priority.is_none()) {
        return Ok(std::iter::once(own.map(p90_predicate))
            .chain(
                t.classes
                    .iter()
                    .map(|c| c.p90_target.or(own).map(p90_predicate)),
            )
            .collect());
    }
    let mut priorities: Vec<u32> = t.classes.iter().filter_map(|c| c.priority).collect();
    priorities.sort_unstable();
    priorities.dedup();
    let bottom = priorities.len();
    let level_of = |c: &crate::config::ClassConfig| {
        c.priority
            .map(|p| priorities.iter().position(|&x| x == p).expect("listed"))
    };
    let mut targets: Vec<Option<Duration>> = vec![None; bottom + 1];
    for c in &t.classes {
        let (l, target) = match level_of(c) {
            Some(l) => (l, c.p90_target.or(own)),
            None => (bottom, own),
        };
        if let Some(x) = target {
            targets[l] = Some(targets[l].map_or(x, |y| y.min(x)));
        }
    }
    if own.is_some() {
        targets[bottom] = own;
    }
    let levels = if targets[bottom].is_some() {
        bottom + 1
    } else {
        bottom
    };
    let targets_ns: Vec<u64> = targets[..levels]
        .iter()
        .map(|x| {
            (x.expect("config checks every prioritized class has a target")
                .as_nanos() as u64)
                .max(1)
        })
        .collect();
    let params = p90_params(Duration::from_nanos(targets_ns[0]));
    let group = ClassGroup::new(&targets_ns, params, P90_RATE_MAX_PER_S)?;
    let pred = |level: usize| {
        (level < levels).then(|| Predicate::ClassedP90 {
            group: group.clone(),
            level,
            burst: P90_BURST,
        })
    };
    Ok(std::iter::once(pred(bottom))
        .chain(
            t.classes
                .iter()
                .map(|c| pred(level_of(c).unwrap_or(bottom))),
        )
        .collect())
}

/// Creates or updates the activities of `config`'s tenants (and their classes), and their
/// admission targets on the work stage; returns the live state, reusing the runtime record of
/// every tenant that keeps its name, and the activities of the classes `config` dropped, for
/// the caller to remove once the new state is live ([`remove_dropped`]).
///
/// Nothing is removed here, and what can refuse the configuration is checked before anything
/// changes: the certificates load ([`TlsConfigs::load`]) and the runtime has room for every
/// activity the configuration adds ([`check_room`]). A refusal half-way once left the tenants
/// before it applied and the classes they dropped removed, under the old live state.
///
/// A tenant's admission predicates (and with them its p90 controllers' state) are set again
/// only when its admission settings changed, one of its activities is new, or (a reload of
/// the file) the admin API replaced them: every SIGHUP once reset every tenant's controllers
/// to their initial rate.
///
/// `only_changed` (an admin change of one tenant): an activity whose settings in `config` are
/// those of `old`'s config is left as it runs, and the certificates are kept when no path to
/// them changed (an admin change once read every certificate from disk again, and failed when
/// one had gone). What the admin API set on them through the runtime (a class's weight, a
/// policy) and what a fleet node's thread set (weights) then stay. Otherwise (a reload of the
/// file) every activity's spec is applied again.
pub(super) fn apply_tenants(
    rt: &Runtime,
    config: Config,
    old: Option<&Live>,
    work: StageId,
    only_changed: bool,
) -> Result<(Live, Vec<ActivityId>), String> {
    // First, before anything changes: a certificate that does not load refuses the whole
    // configuration, and the old one keeps serving.
    let tls = match old {
        Some(o) if only_changed && same_certificates(&o.config, &config) => o.tls.clone(),
        _ => TlsConfigs::load(&config, old.and_then(|o| o.tls.as_deref()))?,
    };
    check_room(rt, &config)?;
    if rt.activity_id("/tenants").is_none() {
        rt.create_activity("/tenants", ActivitySpec::default())
            .map_err(|e| e.to_string())?;
    }
    let upsert = |path: &str, spec: ActivitySpec| -> Result<ActivityId, String> {
        match rt.activity_id(path) {
            Some(id) => {
                rt.set_activity(path, spec).map_err(|e| e.to_string())?;
                Ok(id)
            }
            None => rt.create_activity(path, spec).map_err(|e| e.to_string()),
        }
    };
    let mut out = Vec::with_capacity(config.tenants.len());
    let mut all_classes = Vec::with_capacity(config.tenants.len());
    let mut dropped = Vec::new();
    for t in &config.tenants {
        let path = format!("/tenants/{}", t.name);
        // The tenant as the running config has it.
        let running = old.and_then(|o| o.config.tenants.iter().find(|x| x.name == t.name));
        // ... when what did not change is left alone.
        let before = running.filter(|_| only_changed);
        // Every activity of the tenant was there already (one made now needs its admission).
        let mut all_existed = true;
        let mut upsert_if = |path: &str, same: bool, spec: ActivitySpec| match rt.activity_id(path)
        {
            Some(id) if same => Ok(id),
            id => {
                all_existed &= id.is_some();
                upsert(path, spec)
            }
        };
        let spec = ActivitySpec {
            weight: t.weight,
            // A shaper sits in each worker's tree, so the machine-wide cap is split evenly
            // between the workers (an activity confined to one worker then gets only its part:
            // a machine-wide bucket shared by the workers is future work).
            cap: shaper_of(
                t.cpu_cap.map(|f| f * 1e9 / rt.workers() as f64),
                cap_kind(t.cap_kind),
            ),
            ..Default::default()
        };
        let same = before.is_some_and(|b| {
            b.weight == t.weight && b.cpu_cap == t.cpu_cap && b.cap_kind == t.cap_kind
        });
        let activity = upsert_if(&path, same, spec)?;
        let mut classes = Vec::with_capacity(t.classes.len());
        for c in &t.classes {
            let same = before.is_some_and(|b| {
                b.classes
                    .iter()
                    .any(|x| x.name == c.name && x.weight == c.weight)
            });
            classes.push(upsert_if(
                &format!("{path}/{}", c.name),
                same,
                ActivitySpec::weight(c.weight),
            )?);
        }
        let prev = old.and_then(|o| {
            let i = o.tenants.iter().position(|x| x.name == t.name)?;
            Some((o.tenants[i].clone(), o.classes[i].clone()))
        });
        if let Some((_, prev_classes)) = &prev {
            dropped.extend(prev_classes.iter().filter(|id| !classes.contains(id)));
        }
        // The predicates hang on the tenant's target and its classes' names, targets and
        // priorities (a class-priority controller is shared by all of them): all or none.
        let same_admission = all_existed
            && running.is_some_and(|b| {
                b.p90_target == t.p90_target
                    && b.classes.len() == t.classes.len()
                    && b.classes.iter().zip(&t.classes).all(|(x, y)| {
                        x.name == y.name && x.p90_target == y.p90_target && x.priority == y.priority
                    })
            });
        // A reload of the file also puts back what the admin API set in place of the
        // configured predicates (the file's values win), but leaves a configured p90
        // controller with what it learnt.
        let keep_admission = same_admission
            && (only_changed
                || admission_as_configured(
                    rt,
                    work,
                    t,
                    std::iter::once(&activity).chain(&classes),
                ));
        if !keep_admission {
            let predicates = tenant_predicates(t)?;
            for (&id, predicate) in std::iter::once(&activity).chain(&classes).zip(predicates) {
                rt.set_admission(work, id, predicate)
                    .map_err(|e| e.to_string())?;
            }
        }
        match prev {
            Some((o, _)) => out.push(o),
            None => out.push(Arc::new(TenantRuntime {
                name: t.name.clone(),
                activity,
                path,
                open: AtomicUsize::new(0),
                cache_bytes: AtomicU64::new(0),
                disk_bytes: AtomicU64::new(0),
                net_cap_lost_backlogged_bytes: AtomicU64::new(0),
                net_cap_lost_idle_bytes: AtomicU64::new(0),
                fleet: Arc::new(FleetHooks::default()),
            })),
        }
        all_classes.push(classes);
    }
    let live = Live {
        config,
        tenants: out,
        classes: all_classes,
        tls,
    };
    Ok((live, dropped))
}

/// Whether the admission predicates in force on `ids` (the tenant's activity, then its
/// classes') are those `t` builds ([`tenant_predicates`]), their controllers' state aside: not
/// something the admin API set since. A class-priority tenant's levels must share one group.
fn admission_as_configured<'a>(
    rt: &Runtime,
    work: StageId,
    t: &crate::config::TenantConfig,
    ids: impl Iterator<Item = &'a ActivityId>,
) -> bool {
    let Ok(want) = tenant_predicates(t) else {
        return false;
    };
    // What an activity without a predicate of its own gets: the work stage's, which
    // `Server::start` leaves at the default.
    let stage_default = omnistage::exec::StageConfig::default().predicate;
    let mut shared: Option<Arc<ClassGroup>> = None;
    let mut n = 0;
    for (want, &id) in want.iter().zip(ids) {
        n += 1;
        let have = rt.admission(work, id);
        let same = match (want, &have) {
            (None, Some(h)) => *h == stage_default,
            (
                Some(Predicate::ClassedP90 { level, burst, .. }),
                Some(Predicate::ClassedP90 {
                    group,
                    level: l,
                    burst: b,
                }),
            ) => {
                level == l
                    && burst == b
                    && Arc::ptr_eq(shared.get_or_insert_with(|| group.clone()), group)
            }
            (Some(w), Some(h)) => w == h,
            _ => false,
        };
        if !same {
            return false;
        }
    }
    n == want.len()
}

/// Removes the activities of classes a reload dropped, once the configuration without them is
/// live: each if nothing is queued for it (else it drains and stays, unused, as before).
pub(super) fn remove_dropped(rt: &Runtime, dropped: &[ActivityId]) {
    for &id in dropped {
        if let Some(p) = rt.with_activities(|tab| tab.get(id).map(|a| a.path.clone())) {
            let _ = rt.remove_activity(&p);
        }
    }
}

/// Whether `new` names the same certificate files as `old`: the same TLS listeners, default
/// certificate and, tenant by tenant in the same order, the same own certificates.
fn same_certificates(old: &Config, new: &Config) -> bool {
    let (o, n) = (&old.server, &new.server);
    o.listen_tls == n.listen_tls
        && o.tls_cert == n.tls_cert
        && o.tls_key == n.tls_key
        && old.tenants.len() == new.tenants.len()
        && old
            .tenants
            .iter()
            .zip(&new.tenants)
            .all(|(a, b)| a.name == b.name && a.tls_cert == b.tls_cert && a.tls_key == b.tls_key)
}

/// Refuses `config`, before anything changes, when the runtime has no room for the activities
/// it adds: those live now (the old configuration's, tenants earlier reloads dropped, classes
/// still draining, what the admin API made) all stay while it is applied (dropped classes are
/// removed only after), so they and the new ones must fit the runtime's [`ACTIVITIES_MAX`].
fn check_room(rt: &Runtime, config: &Config) -> Result<(), String> {
    let (live, new) = rt.with_activities(|tab| {
        let mut new = usize::from(tab.lookup("/tenants").is_none());
        let mut path = String::new();
        for t in &config.tenants {
            path.clear();
            path.push_str("/tenants/");
            path.push_str(&t.name);
            new += usize::from(tab.lookup(&path).is_none());
            let tenant_len = path.len();
            for c in &t.classes {
                path.truncate(tenant_len);
                path.push('/');
                path.push_str(&c.name);
                new += usize::from(tab.lookup(&path).is_none());
            }
        }
        (tab.len(), new)
    });
    if live + new > ACTIVITIES_MAX {
        return Err(format!(
            "the configuration adds {new} activities (tenants and classes) to the {live} the \
             runtime holds, beyond its limit of {ACTIVITIES_MAX}; nothing was applied (tenants \
             a reload dropped keep their activities until a restart)"
        ));
    }
    Ok(())
}

/// What [`Server::reload`] did: everything it was given, except what `not_applied` lists.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reloaded {
    /// Settings that change only on restart and differ from the running ones, one sentence
    /// each (the running values stay).
    pub not_applied: Vec<String>,
}

/// The settings a reload cannot change, as the server started with them.
pub(super) struct RestartOnly {
    listen: Vec<SocketAddr>,
    listen_tls: Vec<SocketAddr>,
    /// The workers running, and `--workers` when it chose them.
    workers: usize,
    workers_option: Option<usize>,
    wake_credit_us: u64,
    /// The disk stage's reader threads and its server-wide cap (the pool is built at start).
    disk_threads: usize,
    disk_cap_bytes_per_s: Option<u64>,
    /// `connections_max` as the work stage's queue limit took it at start (the connection
    /// limit itself follows a reload).
    connections_max: usize,
}

impl RestartOnly {
    /// `workers`: the count the server runs; `workers_option`: `--workers`, if given.
    pub(super) fn of(
        s: &crate::config::ServerConfig,
        workers: usize,
        workers_option: Option<usize>,
    ) -> RestartOnly {
        RestartOnly {
            listen: s.listen.clone(),
            listen_tls: s.listen_tls.clone(),
            workers,
            workers_option,
            wake_credit_us: s.wake_credit_us,
            disk_threads: s.disk_threads,
            disk_cap_bytes_per_s: s.disk_cap_bytes_per_s,
            connections_max: s.connections_max,
        }
    }

    /// What `new` asks for that a reload leaves as it is.
    fn differences(&self, new: &crate::config::ServerConfig) -> Vec<String> {
        let mut out = Vec::new();
        let list = |v: &[SocketAddr]| {
            let s: Vec<String> = v.iter().map(|a| a.to_string()).collect();
            format!("[{}]", s.join(", "))
        };
        for (key, running, asked) in [
            ("listen", &self.listen, &new.listen),
            ("listen_tls", &self.listen_tls, &new.listen_tls),
        ] {
            if running != asked {
                out.push(format!(
                    "[server] {key} changes only on restart: still {} (the file says {})",
                    list(running),
                    list(asked)
                ));
            }
        }
        // Against the count running (which `--workers` may have chosen), not the file's
        // value at start.
        let asked = match new.workers {
            Some(w) => Some((w, w.to_string())),
            // Unset: one per CPU, unless `--workers` decides.
            None if self.workers_option.is_none() => super::worker_count(None, None)
                .ok()
                .map(|w| (w, format!("unset, one per CPU: {w}"))),
            None => None,
        };
        if let Some((_, said)) = asked.filter(|(w, _)| *w != self.workers) {
            let by_option = if self.workers_option.is_some() {
                ", and --workers sets it"
            } else {
                ""
            };
            out.push(format!(
                "[server] workers changes only on restart: still {} (the file says {said}{by_option})",
                self.workers
            ));
        }
        if self.wake_credit_us != new.wake_credit_us {
            out.push(format!(
                "[server] wake_credit_us changes only on restart: still {} (the file says {})",
                self.wake_credit_us, new.wake_credit_us
            ));
        }
        if self.disk_threads != new.disk_threads {
            out.push(format!(
                "[server] disk_threads changes only on restart: still {} (the file says {})",
                self.disk_threads, new.disk_threads
            ));
        }
        if self.disk_cap_bytes_per_s != new.disk_cap_bytes_per_s {
            let show = |c: Option<u64>| c.map_or("none".to_string(), |b| format!("{b} bytes/s"));
            out.push(format!(
                "[server] disk_cap changes only on restart: still {} (the file says {})",
                show(self.disk_cap_bytes_per_s),
                show(new.disk_cap_bytes_per_s)
            ));
        }
        if self.connections_max != new.connections_max {
            out.push(format!(
                "[server] connections_max {} applies to connections, but the work stage's \
                 queue limit per tenant stays {} until restart",
                new.connections_max, self.connections_max
            ));
        }
        out
    }
}

/// Opens where access-log lines go: a file is opened (created, appended to) at start and again
/// at every reload of the file, so that a log rotated by renaming is followed to the new file
/// (`logrotate` without `copytruncate`), and a changed path takes effect.
pub(super) fn open_access_log(
    log: &crate::config::AccessLog,
) -> Result<Option<Box<dyn std::io::Write + Send>>, String> {
    use crate::config::AccessLog;
    Ok(match log {
        AccessLog::Off => None,
        AccessLog::Stdout => Some(Box::new(std::io::stdout())),
        AccessLog::File(p) => Some(Box::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| format!("cannot open access log {}: {e}", p.display()))?,
        )),
    })
}

impl Server {
    /// The running configuration (as last loaded or changed through [`Server::update_tenant`]).
    pub fn config(&self) -> Config {
        self.shared.live.read().expect("live lock").config.clone()
    }

    /// Every tenant of the running configuration with its fleet hooks, in config order.
    pub fn fleet_tenants(&self) -> Vec<FleetTenant> {
        let live = self.shared.live.read().expect("live lock").clone();
        live.config
            .tenants
            .iter()
            .zip(&live.tenants)
            .map(|(t, tr)| FleetTenant {
                name: tr.name.clone(),
                path: tr.path.clone(),
                activity: tr.activity,
                weight: t.weight,
                caps: t.fleet,
                hooks: tr.fleet.clone(),
            })
            .collect()
    }

    /// Sets the weights of tenants' nodes in the send scheduler (`None`: back to the
    /// configured weight), by tenant name; unknown names are skipped. The cores re-weight at
    /// their next dispatch; nothing else changes (no reload, the cache stays).
    pub fn set_send_weights(&self, weights: &[(&str, Option<u32>)]) {
        let live = self.shared.live.read().expect("live lock").clone();
        let mut changed = false;
        for &(name, w) in weights {
            if let Some(tr) = live.tenants.iter().find(|t| t.name == name) {
                changed |= tr.fleet.set_send_weight(w.map(|w| w.clamp(1, 10_000)));
            }
        }
        if changed {
            self.shared.send_version.fetch_add(1, Ordering::Release);
        }
    }

    /// Records what the fleet layer computed (`None`: not in a fleet).
    pub fn set_fleet_status(&self, status: Option<Arc<FleetStatus>>) {
        *self.shared.fleet_status.write().expect("fleet status lock") = status;
    }

    /// What the fleet layer last computed, if this server is a node of a fleet.
    pub fn fleet_status(&self) -> Option<Arc<FleetStatus>> {
        self.shared
            .fleet_status
            .read()
            .expect("fleet status lock")
            .clone()
    }

    /// Bytes of file bodies read through the disk stage for each tenant, in config order:
    /// the pool's reads and the chunks a worker copied from the page cache alike.
    pub fn disk_bytes(&self) -> Vec<(String, u64)> {
        let live = self.shared.live.read().expect("live lock").clone();
        live.tenants
            .iter()
            .map(|t| (t.name.clone(), t.disk_bytes.load(Ordering::Relaxed)))
            .collect()
    }

    /// Bytes the disk stage's reader threads read, all tenants: the reads that had to wait for
    /// the device (not in the page cache) and every `disk_direct` read. 0 without a disk stage.
    pub fn disk_pool_bytes(&self) -> u64 {
        self.shared
            .disk
            .get()
            .map_or(0, |p| p.bytes_read.load(Ordering::Relaxed))
    }

    /// What each tenant's `net_cap` buckets discarded of their rate (all cores), in config
    /// order: `(name, bytes lost while backlogged, bytes lost while idle)`. The first is what
    /// wake-ups later than a leaky bucket's catch-up allowance cost the tenant; the second is
    /// the rate it had no output to use.
    pub fn net_cap_lost_bytes(&self) -> Vec<(String, u64, u64)> {
        let live = self.shared.live.read().expect("live lock").clone();
        live.tenants
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.net_cap_lost_backlogged_bytes.load(Ordering::Relaxed),
                    t.net_cap_lost_idle_bytes.load(Ordering::Relaxed),
                )
            })
            .collect()
    }

    /// Bytes of each tenant's files in the cache (all cores), in config order.
    pub fn cache_bytes(&self) -> Vec<(String, u64)> {
        let live = self.shared.live.read().expect("live lock").clone();
        live.tenants
            .iter()
            .map(|t| (t.name.clone(), t.cache_bytes.load(Ordering::Relaxed)))
            .collect()
    }

    /// The activity paths the running configuration owns: each tenant's and its classes'. The
    /// config file says which of them exist, so the admin API refuses to remove or move them
    /// (the server would hold an activity that is gone; only a reload may take them away).
    pub fn configured_activities(&self) -> Vec<String> {
        let live = self.shared.live.read().expect("live lock").clone();
        let mut out = Vec::new();
        for t in &live.config.tenants {
            let path = t.activity();
            out.extend(t.classes.iter().map(|c| format!("{path}/{}", c.name)));
            out.push(path);
        }
        out
    }

    /// Applies a new configuration: tenants' weights and caps, docroots, limits, upstreams,
    /// certificates. Settings that only a restart changes (listen addresses, worker count) keep
    /// their running values: the reload still applies, and [`Reloaded::not_applied`] says what
    /// it left. An error means nothing was applied and the old configuration keeps serving.
    pub fn reload(&self, config: Config) -> Result<Reloaded, String> {
        // One reload at a time: each builds on the state the previous one left.
        let restart_only = self.reloading.lock().expect("reload lock");
        self.reload_locked(&restart_only, config, false)
    }

    /// [`Server::reload`] for a caller that holds the reload lock (`restart_only` is what it
    /// guards); `only_changed` as [`apply_tenants`] takes it.
    fn reload_locked(
        &self,
        restart_only: &RestartOnly,
        config: Config,
        only_changed: bool,
    ) -> Result<Reloaded, String> {
        let not_applied = restart_only.differences(&config.server);
        let mut config = config;
        // The listeners keep running as they are (they change only on restart), and the live
        // config says so: tenants are bound to listeners by the configured address, and TLS
        // listeners need their certificates (a file without them is refused, not applied
        // with every handshake then closed for want of a certificate).
        config.server.listen = restart_only.listen.clone();
        config.server.listen_tls = restart_only.listen_tls.clone();
        for t in &config.tenants {
            if let Some(a) = t
                .listen
                .iter()
                .find(|a| !restart_only.listen.contains(a) && !restart_only.listen_tls.contains(a))
            {
                return Err(format!(
                    "tenant {:?} is bound to listener {a}, which is not running (listeners \
                     change only on restart; running: {})",
                    t.name,
                    restart_only
                        .listen
                        .iter()
                        .chain(&restart_only.listen_tls)
                        .map(|a| a.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        // A file reload opens the access log again (before anything changes: a log that
        // cannot be opened refuses the reload); an admin change leaves it.
        let log = if only_changed {
            None
        } else {
            Some(open_access_log(&config.server.access_log)?)
        };
        let old = self.shared.live.read().expect("live lock").clone();
        let (live, dropped) = apply_tenants(&self.rt, config, Some(&old), self.work, only_changed)?;
        *self.shared.live.write().expect("live lock") = Arc::new(live);
        self.shared.live_version.fetch_add(1, Ordering::Release);
        remove_dropped(&self.rt, &dropped);
        if let Some(log) = log {
            // Lines the cores still buffer go to the new log at their next flush.
            let mut w = self.shared.log.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(w) = w.as_mut() {
                let _ = w.flush();
            }
            *w = log;
        }
        Ok(Reloaded { not_applied })
    }

    /// Whether [`Server::update_tenant`] would take the change, without applying it (the admin
    /// API checks every part of a request before it changes anything or writes the file).
    pub fn check_tenant_update(
        &self,
        name: &str,
        f: impl FnOnce(&mut crate::config::TenantConfig),
    ) -> Result<(), UpdateError> {
        self.updated_config(name, f).map(|_| ())
    }

    /// Changes one tenant's settings in the running configuration (a reload with that change).
    pub fn update_tenant(
        &self,
        name: &str,
        f: impl FnOnce(&mut crate::config::TenantConfig),
    ) -> Result<(), UpdateError> {
        // The reload lock is held from reading the running config to applying the changed
        // one: another update or a reload between the two would be undone by this one (it
        // would apply a config read before theirs). `f` runs under it, so it must not update
        // or reload the server itself.
        let restart_only = self.reloading.lock().expect("reload lock");
        let config = self.updated_config(name, f)?;
        // The running config with one tenant changed: nothing in it waits for a restart.
        // Only what changed is applied again: the other tenants, and what of this one the change
        // left, keep what the API or a fleet node set on them through the runtime.
        self.reload_locked(&restart_only, config, true)
            .map(|_| ())
            .map_err(UpdateError::Refused)
    }

    /// The running config with `f` applied to tenant `name`, checked.
    fn updated_config(
        &self,
        name: &str,
        f: impl FnOnce(&mut crate::config::TenantConfig),
    ) -> Result<Config, UpdateError> {
        // The running config as it is, not the runtime's weights and CPU caps: on a fleet node
        // the fleet thread sets the tenants' weights through the runtime for a while, and they
        // must not become configured ones. A weight or CPU cap the admin API sets comes in
        // through `f` like any other change.
        let mut config = self.shared.live.read().expect("live lock").config.clone();
        let t = config
            .tenants
            .iter_mut()
            .find(|t| t.name == name)
            .ok_or_else(|| UpdateError::NoTenant(format!("no tenant {name}")))?;
        f(t);
        if t.net_cap_bytes_per_s == Some(0) || t.disk_cap_bytes_per_s == Some(0) {
            return Err(UpdateError::Refused(
                "a cap of 0 bytes/s would stop the tenant; remove the cap instead".into(),
            ));
        }
        if t.cache_bytes
            .is_some_and(|b| b > config.server.cache_bytes_max)
        {
            return Err(UpdateError::Refused(format!(
                "cache budget above the server's cache_bytes_max ({})",
                config.server.cache_bytes_max
            )));
        }
        Ok(config)
    }
}
