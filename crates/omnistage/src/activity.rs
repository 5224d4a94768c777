//! `activity`: the activity tree — the principals that consumption is charged to and shares
//! are given to.
//!
//! An activity has a path (`/tenants/a`), a weight among its siblings (1..=10000, default 100),
//! an optional cap (a [`ShaperSpec`]) and the policy it runs over its own children. The root
//! `/` and `/infra` (work whose owner is not known yet) exist from the start and cannot be
//! removed. Every change is validated here, before any worker sees it; a refused change leaves
//! the table as it was. Each activity carries the [`SharedTag`] that all cores' trees use to
//! keep its share machine-wide.
//!
//! Pure: no clock, no threads. `exec` wraps the table in a lock and tells workers what changed.

use crate::account::{ActivityId, RETIRED};
use crate::sched::{PolicyKind, ShaperSpec, SharedTag, WEIGHT_DEFAULT, WEIGHT_MAX, WEIGHT_MIN};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Id of the root activity `/`.
pub const ROOT: ActivityId = 0;
/// Id of `/infra`.
pub const INFRA: ActivityId = 1;
/// Most activities alive at once.
pub const ACTIVITIES_MAX: usize = 65_536;
/// Deepest path (segments below the root).
pub const DEPTH_MAX: usize = 16;
/// Longest path, bytes.
pub const PATH_LEN_MAX: usize = 256;

/// What can be set on an activity.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ActivitySpec {
    pub weight: u32,
    /// Cap on the CPU this activity (with its sub-tree) may use, per worker: each worker's
    /// tree holds its own bucket (ns of CPU per second), so the machine-wide total is up to
    /// the number of workers it runs on times this.
    pub cap: Option<ShaperSpec>,
    /// Policy over this activity's children (child activities and its stage queues).
    pub policy: PolicyKind,
    /// Level under a strict-priority parent (0 first); ignored by other policies.
    pub priority: u8,
}

impl Default for ActivitySpec {
    fn default() -> Self {
        ActivitySpec {
            weight: WEIGHT_DEFAULT,
            cap: None,
            policy: PolicyKind::Sfq,
            priority: 0,
        }
    }
}

impl ActivitySpec {
    pub fn weight(weight: u32) -> Self {
        ActivitySpec {
            weight,
            ..Default::default()
        }
    }
    pub fn validate(&self) -> Result<(), ActivityError> {
        if !(WEIGHT_MIN..=WEIGHT_MAX).contains(&self.weight) {
            return Err(ActivityError::InvalidWeight(self.weight));
        }
        if let Some(cap) = &self.cap {
            cap.validate().map_err(ActivityError::InvalidCap)?;
        }
        Ok(())
    }
}

/// One activity.
#[derive(Clone, Debug)]
pub struct Activity {
    pub id: ActivityId,
    pub path: String,
    pub parent: Option<ActivityId>,
    pub spec: ActivitySpec,
    pub children: Vec<ActivityId>,
    /// Normalized service shared by every core's tree (see [`SharedTag`]).
    pub tag: Arc<SharedTag>,
}

/// Why a change was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ActivityError {
    BadPath(String),
    NotFound(String),
    Exists(String),
    NoParent(String),
    HasChildren(String),
    Protected(String),
    Cycle(String),
    InvalidWeight(u32),
    InvalidCap(String),
    TooMany,
}

impl std::fmt::Display for ActivityError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ActivityError::BadPath(p) => write!(
                f,
                "bad activity path {p:?}: want /seg[/seg...], segments of [A-Za-z0-9_.-], at most {DEPTH_MAX} deep and {PATH_LEN_MAX} bytes"
            ),
            ActivityError::NotFound(p) => write!(f, "no activity {p}"),
            ActivityError::Exists(p) => write!(f, "activity {p} exists"),
            ActivityError::NoParent(p) => write!(f, "the parent of {p} does not exist"),
            ActivityError::HasChildren(p) => write!(f, "activity {p} has children"),
            ActivityError::Protected(p) => write!(f, "activity {p} cannot be removed or moved"),
            ActivityError::Cycle(p) => write!(f, "moving {p} there would put it under itself"),
            ActivityError::InvalidWeight(w) => {
                write!(f, "weight {w} is outside {WEIGHT_MIN}..={WEIGHT_MAX}")
            }
            ActivityError::InvalidCap(s) => write!(f, "invalid cap: {s}"),
            ActivityError::TooMany => write!(f, "too many activities (limit {ACTIVITIES_MAX})"),
        }
    }
}

impl std::error::Error for ActivityError {}

/// Splits and checks a path; returns its segments.
pub fn parse_path(path: &str) -> Result<Vec<&str>, ActivityError> {
    let bad = || ActivityError::BadPath(path.chars().take(PATH_LEN_MAX + 8).collect());
    if path == "/" {
        return Ok(Vec::new());
    }
    if path.len() > PATH_LEN_MAX || !path.starts_with('/') {
        return Err(bad());
    }
    let segs: Vec<&str> = path[1..].split('/').collect();
    if segs.len() > DEPTH_MAX {
        return Err(bad());
    }
    for s in &segs {
        let ok = !s.is_empty()
            && *s != "."
            && *s != ".."
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
        if !ok {
            return Err(bad());
        }
    }
    Ok(segs)
}

fn parent_path(path: &str) -> &str {
    match path.rfind('/') {
        Some(0) => "/",
        Some(i) => &path[..i],
        None => "/",
    }
}

/// The activity tree.
///
/// Ids are never reused (a message tagged with a removed activity can never be charged to a
/// new one that took its place), so the live activities are kept in a map by id: a removed
/// activity leaves nothing behind here, and the table's memory follows the live count
/// ([`ACTIVITIES_MAX`] at most), not the number of ids ever given out.
#[derive(Debug)]
pub struct ActivityTable {
    entries: BTreeMap<ActivityId, Activity>,
    /// The next id to give out; ids run up to [`RETIRED`] (excluded), then creation is refused.
    next_id: ActivityId,
    by_path: HashMap<String, ActivityId>,
    /// Bumped on every accepted change.
    version: u64,
}

impl Default for ActivityTable {
    fn default() -> Self {
        Self::new()
    }
}

impl ActivityTable {
    /// A table holding `/` and `/infra`.
    pub fn new() -> Self {
        let mut t = ActivityTable {
            entries: BTreeMap::new(),
            next_id: ROOT + 1,
            by_path: HashMap::new(),
            version: 0,
        };
        t.entries.insert(
            ROOT,
            Activity {
                id: ROOT,
                path: "/".into(),
                parent: None,
                spec: ActivitySpec::default(),
                children: Vec::new(),
                tag: Arc::new(SharedTag::default()),
            },
        );
        t.by_path.insert("/".into(), ROOT);
        let infra = t
            .create("/infra", ActivitySpec::default())
            .expect("infra is valid");
        assert_eq!(infra, INFRA);
        t.version = 0;
        t
    }

    fn live_mut(&mut self, id: ActivityId) -> &mut Activity {
        self.entries.get_mut(&id).expect("live activity")
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn get(&self, id: ActivityId) -> Option<&Activity> {
        self.entries.get(&id)
    }

    pub fn lookup(&self, path: &str) -> Option<ActivityId> {
        self.by_path.get(path).copied()
    }

    pub fn parent_of(&self, id: ActivityId) -> Option<ActivityId> {
        self.get(id).and_then(|a| a.parent)
    }

    /// Live activities in id order.
    pub fn iter(&self) -> impl Iterator<Item = &Activity> {
        self.entries.values()
    }

    pub fn len(&self) -> usize {
        self.by_path.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_path.is_empty()
    }

    /// Ids from the root down to `id` (inclusive).
    pub fn ancestry(&self, id: ActivityId) -> Vec<ActivityId> {
        let mut v = Vec::new();
        let mut cur = Some(id);
        while let Some(x) = cur {
            v.push(x);
            assert!(
                v.len() <= DEPTH_MAX + 1,
                "activity chain deeper than the limit"
            );
            cur = self.parent_of(x);
        }
        v.reverse();
        v
    }

    /// Creates an activity; its parent must exist.
    pub fn create(&mut self, path: &str, spec: ActivitySpec) -> Result<ActivityId, ActivityError> {
        parse_path(path)?;
        spec.validate()?;
        if path == "/" || self.by_path.contains_key(path) {
            return Err(ActivityError::Exists(path.into()));
        }
        let parent = self
            .lookup(parent_path(path))
            .ok_or_else(|| ActivityError::NoParent(path.into()))?;
        if self.by_path.len() >= ACTIVITIES_MAX || self.next_id == RETIRED {
            return Err(ActivityError::TooMany);
        }
        // Ids are never reused: a message tagged with a removed activity can never be charged
        // to a new one that took its place.
        let id = self.next_id;
        self.next_id += 1;
        self.entries.insert(
            id,
            Activity {
                id,
                path: path.into(),
                parent: Some(parent),
                spec,
                children: Vec::new(),
                tag: Arc::new(SharedTag::default()),
            },
        );
        self.by_path.insert(path.into(), id);
        self.live_mut(parent).children.push(id);
        self.version += 1;
        Ok(id)
    }

    /// Creates the activity and any missing ancestors (with default specs).
    pub fn ensure(&mut self, path: &str, spec: ActivitySpec) -> Result<ActivityId, ActivityError> {
        let segs = parse_path(path)?;
        spec.validate()?;
        let mut prefix = String::new();
        for (i, s) in segs.iter().enumerate() {
            prefix.push('/');
            prefix.push_str(s);
            if self.lookup(&prefix).is_none() {
                let sp = if i + 1 == segs.len() {
                    spec.clone()
                } else {
                    ActivitySpec::default()
                };
                self.create(&prefix, sp)?;
            }
        }
        self.lookup(path)
            .ok_or_else(|| ActivityError::NotFound(path.into()))
    }

    /// Changes an activity's spec.
    pub fn set(&mut self, id: ActivityId, spec: ActivitySpec) -> Result<(), ActivityError> {
        spec.validate()?;
        let a = self.entries.get_mut(&id);
        let a = a.ok_or_else(|| ActivityError::NotFound(format!("#{id}")))?;
        if id == ROOT && spec.cap.is_some() {
            return Err(ActivityError::Protected("/".into()));
        }
        a.spec = spec;
        self.version += 1;
        Ok(())
    }

    /// Removes an activity with no children. `/` and `/infra` are protected.
    pub fn remove(&mut self, id: ActivityId) -> Result<Activity, ActivityError> {
        let a = self
            .get(id)
            .ok_or_else(|| ActivityError::NotFound(format!("#{id}")))?;
        if id == ROOT || id == INFRA {
            return Err(ActivityError::Protected(a.path.clone()));
        }
        if !a.children.is_empty() {
            return Err(ActivityError::HasChildren(a.path.clone()));
        }
        let a = self.entries.remove(&id).expect("checked");
        self.by_path.remove(&a.path);
        let parent = a.parent.expect("non-root has parent");
        self.live_mut(parent).children.retain(|&c| c != id);
        self.version += 1;
        Ok(a)
    }

    /// Moves an activity (and its sub-tree) under `new_parent`; paths below it change. The
    /// moved activity gets a fresh shared tag: its old normalized service was measured against
    /// other siblings, and on its first wake under the new parent it is clamped to that
    /// parent's virtual time.
    pub fn move_to(&mut self, id: ActivityId, new_parent: ActivityId) -> Result<(), ActivityError> {
        let a = self
            .get(id)
            .ok_or_else(|| ActivityError::NotFound(format!("#{id}")))?;
        if id == ROOT || id == INFRA {
            return Err(ActivityError::Protected(a.path.clone()));
        }
        let old_path = a.path.clone();
        let np = self
            .get(new_parent)
            .ok_or_else(|| ActivityError::NotFound(format!("#{new_parent}")))?;
        if self.ancestry(new_parent).contains(&id) {
            return Err(ActivityError::Cycle(old_path));
        }
        let name = &old_path[old_path.rfind('/').expect("absolute") + 1..];
        let new_path = if np.path == "/" {
            format!("/{name}")
        } else {
            format!("{}/{name}", np.path)
        };
        if self.by_path.contains_key(&new_path) {
            return Err(ActivityError::Exists(new_path));
        }
        // Check depth and length of every path in the sub-tree before changing anything.
        let mut subtree = vec![id];
        let mut i = 0;
        while i < subtree.len() {
            subtree.extend(self.get(subtree[i]).expect("live").children.iter().copied());
            i += 1;
        }
        let mut renames = Vec::with_capacity(subtree.len());
        for &x in &subtree {
            let p = &self.get(x).expect("live").path;
            let np = format!("{new_path}{}", &p[old_path.len()..]);
            parse_path(&np)?;
            renames.push((x, p.clone(), np));
        }
        let old_parent = self.get(id).expect("live").parent.expect("non-root");
        self.live_mut(old_parent).children.retain(|&c| c != id);
        self.live_mut(new_parent).children.push(id);
        for (x, old, new) in renames {
            self.by_path.remove(&old);
            self.by_path.insert(new.clone(), x);
            self.live_mut(x).path = new;
        }
        let a = self.live_mut(id);
        a.parent = Some(new_parent);
        a.tag = Arc::new(SharedTag::default());
        self.version += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_with_root_and_infra() {
        let t = ActivityTable::new();
        assert_eq!(t.lookup("/"), Some(ROOT));
        assert_eq!(t.lookup("/infra"), Some(INFRA));
        assert_eq!(t.get(INFRA).unwrap().parent, Some(ROOT));
    }

    #[test]
    fn create_change_move_remove() {
        let mut t = ActivityTable::new();
        let a = t.ensure("/tenants/a", ActivitySpec::weight(50)).unwrap();
        let tenants = t.lookup("/tenants").unwrap();
        assert_eq!(t.get(a).unwrap().parent, Some(tenants));
        assert_eq!(t.ancestry(a), vec![ROOT, tenants, a]);
        t.set(a, ActivitySpec::weight(70)).unwrap();
        assert_eq!(t.get(a).unwrap().spec.weight, 70);
        let g = t.create("/gold", ActivitySpec::default()).unwrap();
        t.move_to(tenants, g).unwrap();
        assert_eq!(t.get(a).unwrap().path, "/gold/tenants/a");
        assert_eq!(t.lookup("/gold/tenants/a"), Some(a));
        assert_eq!(t.lookup("/tenants/a"), None);
        assert_eq!(
            t.remove(tenants).unwrap_err(),
            ActivityError::HasChildren("/gold/tenants".into())
        );
        t.remove(a).unwrap();
        t.remove(tenants).unwrap();
        assert_eq!(t.lookup("/gold/tenants"), None);
    }

    #[test]
    fn refused_changes_change_nothing() {
        let mut t = ActivityTable::new();
        let a = t.ensure("/t/a", ActivitySpec::default()).unwrap();
        let tt = t.lookup("/t").unwrap();
        let v = t.version();
        assert!(matches!(
            t.create("/t/a", ActivitySpec::default()),
            Err(ActivityError::Exists(_))
        ));
        assert!(matches!(
            t.create("/x/y", ActivitySpec::default()),
            Err(ActivityError::NoParent(_))
        ));
        assert!(matches!(
            t.create("t", ActivitySpec::default()),
            Err(ActivityError::BadPath(_))
        ));
        assert!(matches!(
            t.create("/t/../x", ActivitySpec::default()),
            Err(ActivityError::BadPath(_))
        ));
        assert!(matches!(
            t.create("/t/a b", ActivitySpec::default()),
            Err(ActivityError::BadPath(_))
        ));
        assert_eq!(
            t.create("/w", ActivitySpec::weight(0)),
            Err(ActivityError::InvalidWeight(0))
        );
        assert_eq!(
            t.create("/w", ActivitySpec::weight(10_001)),
            Err(ActivityError::InvalidWeight(10_001))
        );
        assert!(matches!(t.remove(INFRA), Err(ActivityError::Protected(_))));
        assert!(matches!(t.remove(ROOT), Err(ActivityError::Protected(_))));
        assert!(matches!(t.move_to(tt, a), Err(ActivityError::Cycle(_))));
        assert!(matches!(
            t.move_to(INFRA, a),
            Err(ActivityError::Protected(_))
        ));
        assert_eq!(t.version(), v);
        assert_eq!(t.get(a).unwrap().path, "/t/a");
    }

    #[test]
    fn path_limits_are_enforced() {
        let deep = "/a".repeat(DEPTH_MAX + 1);
        assert!(parse_path(&deep).is_err());
        assert!(parse_path(&"/a".repeat(DEPTH_MAX)).is_ok());
        let long = format!("/{}", "x".repeat(PATH_LEN_MAX));
        assert!(parse_path(&long).is_err());
        let mut t = ActivityTable::new();
        // Moving a deep sub-tree under another deep one must not create an over-deep path.
        let d = "/a".repeat(DEPTH_MAX - 1);
        t.ensure(&d, ActivitySpec::default()).unwrap();
        t.ensure("/b/c", ActivitySpec::default()).unwrap();
        let b = t.lookup("/b").unwrap();
        let deep_leaf = t.lookup(&d).unwrap();
        // /b/c under a depth-15 node would be 17 deep.
        assert!(matches!(
            t.move_to(b, deep_leaf),
            Err(ActivityError::BadPath(_))
        ));
    }

    #[test]
    fn activity_count_is_bounded() {
        let mut t = ActivityTable::new();
        for i in 0..(ACTIVITIES_MAX - 2) {
            t.create(&format!("/a{i}"), ActivitySpec::default())
                .unwrap();
        }
        assert_eq!(
            t.create("/one-more", ActivitySpec::default()),
            Err(ActivityError::TooMany)
        );
    }
}
