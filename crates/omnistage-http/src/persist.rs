//! Writing live changes back to the config file (`?persist=true`, `omnistage set --persist`):
//! a [`ConfigFile`] remembers the bytes it was loaded from, and [`ConfigFile::apply`] edits the
//! tenants' and classes' keys with `toml_edit` (the operator's comments, order and layout
//! survive), checks that the result is still a valid config, and replaces the file atomically
//! (written beside it, fsynced, renamed over it, the directory fsynced).
//!
//! Refused, with nothing written: a file that changed on disk since it was loaded (someone
//! edited it: reload first, so no edit is lost), a tenant or class the file does not have, and
//! an edit that would make the file invalid. A server on the embedded default has no
//! `ConfigFile` at all; the caller refuses that case.

use std::io::Write;
use std::path::{Path, PathBuf};

use toml_edit::{DocumentMut, Item, Table, Value};

use crate::config::{parse_config_of_file, Config, ConfigError};

/// A config file as loaded: where it is and the bytes the running config came from.
#[derive(Debug, Clone)]
pub struct ConfigFile {
    path: PathBuf,
    loaded: Vec<u8>,
}

/// A value for a key of the file.
#[derive(Debug, Clone, PartialEq)]
pub enum Setting {
    Int(i64),
    Float(f64),
    Str(String),
    /// Remove the key (back to its default).
    Remove,
}

/// One key of one `[[tenant]]` (or one of its `[[tenant.class]]` tables) to set or remove.
#[derive(Debug, Clone, PartialEq)]
pub struct Edit {
    /// The tenant's `name`.
    pub tenant: String,
    /// The class's `name` within the tenant, for a class key.
    pub class: Option<String>,
    /// The key, e.g. `weight`, `cpu_cap`, `net_cap`.
    pub key: String,
    /// What to put there.
    pub value: Setting,
}

impl ConfigFile {
    /// Reads and parses `path`; the config and the file that remembers these bytes.
    pub fn load(path: &Path) -> Result<(Config, ConfigFile), ConfigError> {
        // A regular file of bounded size only: this runs at start and on SIGHUP, in the
        // thread that also handles SIGTERM (`read_config_bytes`).
        let loaded = crate::config::read_config_bytes(path).map_err(|message| ConfigError {
            path: Some(path.to_path_buf()),
            line: None,
            column: None,
            message,
        })?;
        let text = std::str::from_utf8(&loaded).map_err(|_| ConfigError {
            path: Some(path.to_path_buf()),
            line: None,
            column: None,
            message: "not UTF-8".into(),
        })?;
        // Relative paths in the file resolve against its directory, as documented (they once
        // resolved against the working directory here: `serve --config
        // examples/three-tenants.toml` answered 404 for every file).
        let config = parse_config_of_file(text, path).map_err(|mut e| {
            e.path = Some(path.to_path_buf());
            e
        })?;
        Ok((
            config,
            ConfigFile {
                path: path.to_path_buf(),
                loaded,
            },
        ))
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Applies `edits` to the file (all or none); see the module doc.
    pub fn apply(&mut self, edits: &[Edit]) -> Result<(), String> {
        let new_text = self.edited(edits)?;
        replace_atomically(&self.path, new_text.as_bytes())
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))?;
        self.loaded = new_text.into_bytes();
        Ok(())
    }

    /// Whether [`ConfigFile::apply`] would take `edits` now, without writing anything: every
    /// refusal but a failing write (the admin API checks before it changes the server, and
    /// writes the file after).
    pub fn check(&self, edits: &[Edit]) -> Result<(), String> {
        self.edited(edits).map(|_| ())
    }

    /// The file's text with `edits` applied, checked: refused when the file changed on disk
    /// since it was loaded, or when the result is not a valid config.
    fn edited(&self, edits: &[Edit]) -> Result<String, String> {
        let now = crate::config::read_config_bytes(&self.path)
            .map_err(|e| format!("{}: {e}", self.path.display()))?;
        if now != self.loaded {
            return Err(format!(
                "{} changed on disk since it was loaded: reload it (SIGHUP) first, then repeat \
                 the change, so that neither edit is lost",
                self.path.display()
            ));
        }
        let text = std::str::from_utf8(&now).map_err(|_| "the config file is not UTF-8")?;
        let new_text = edit_text(text, edits)?;
        parse_config_of_file(&new_text, &self.path)
            .map_err(|e| format!("the change would make the config file invalid: {e}"))?;
        Ok(new_text)
    }
}

/// `text` with `edits` applied by `toml_edit` (everything else byte for byte as it was).
pub fn edit_text(text: &str, edits: &[Edit]) -> Result<String, String> {
    let mut doc: DocumentMut = text
        .parse()
        .map_err(|e| format!("the config file does not parse: {e}"))?;
    for e in edits {
        let tenant = named(
            doc.get_mut("tenant").and_then(Item::as_array_of_tables_mut),
            &e.tenant,
        )
        .ok_or_else(|| format!("the config file has no [[tenant]] named {:?}", e.tenant))?;
        let table = match &e.class {
            None => tenant,
            Some(c) => named(
                tenant
                    .get_mut("class")
                    .and_then(Item::as_array_of_tables_mut),
                c,
            )
            .ok_or_else(|| format!("tenant {:?} has no [[tenant.class]] named {c:?}", e.tenant))?,
        };
        match &e.value {
            Setting::Remove => {
                table.remove(&e.key);
            }
            v => {
                let value = match v {
                    Setting::Int(i) => Value::from(*i),
                    Setting::Float(f) => Value::from(*f),
                    Setting::Str(s) => Value::from(s.as_str()),
                    Setting::Remove => unreachable!("handled above"),
                };
                match table.get_mut(&e.key).and_then(Item::as_value_mut) {
                    // Keep the key's place and its comments; only the value changes.
                    Some(old) => {
                        let decor = old.decor().clone();
                        *old = value;
                        *old.decor_mut() = decor;
                    }
                    None => {
                        table.insert(&e.key, Item::Value(value));
                    }
                }
            }
        }
    }
    Ok(doc.to_string())
}

fn named<'a>(
    tables: Option<&'a mut toml_edit::ArrayOfTables>,
    name: &str,
) -> Option<&'a mut Table> {
    tables?
        .iter_mut()
        .find(|t| t.get("name").and_then(Item::as_str) == Some(name))
}

/// Writes `bytes` to a new file beside `path`, fsyncs it, renames it over `path` and fsyncs
/// the directory: a crash leaves the old file or the new one, never a mix.
fn replace_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map_or("config".into(), |n| n.to_string_lossy());
    let tmp = dir.join(format!(".{name}.omnistage-{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        if let Ok(meta) = std::fs::metadata(path) {
            f.set_permissions(meta.permissions())?;
        }
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "# the operator's notes\n[server]\nlisten = [\"127.0.0.1:0\"]\n\n\
        [[tenant]]\nname = \"a\"   # the big one\nhosts = [\"a\"]\ndocroot = \".\"\nweight = 50 # half\n\n\
        [[tenant.class]]\nname = \"gold\"\nheader = \"X-Class: gold\"\nweight = 10\n\n\
        [[tenant]]\nname = \"b\"\ndocroot = \".\"\n";

    fn edit(tenant: &str, class: Option<&str>, key: &str, value: Setting) -> Edit {
        Edit {
            tenant: tenant.into(),
            class: class.map(str::to_string),
            key: key.into(),
            value,
        }
    }

    fn file(dir: &Path, text: &str) -> (Config, ConfigFile) {
        let p = dir.join("omnistage.toml");
        std::fs::write(&p, text).unwrap();
        ConfigFile::load(&p).unwrap()
    }

    #[test]
    fn edits_keep_comments_and_layout() {
        let out = edit_text(
            FILE,
            &[
                edit("a", None, "weight", Setting::Int(70)),
                edit("b", None, "net_cap", Setting::Str("10MB/s".into())),
                edit("a", Some("gold"), "weight", Setting::Int(20)),
            ],
        )
        .unwrap();
        let want = FILE
            .replace("weight = 50 # half", "weight = 70 # half")
            .replace("weight = 10\n", "weight = 20\n")
            .replace(
                "name = \"b\"\ndocroot = \".\"\n",
                "name = \"b\"\ndocroot = \".\"\nnet_cap = \"10MB/s\"\n",
            );
        assert_eq!(out, want);
        let c = crate::config::parse_config(&out).unwrap();
        assert_eq!(c.tenants[0].weight, 70);
        assert_eq!(c.tenants[0].classes[0].weight, 20);
        assert_eq!(c.tenants[1].net_cap_bytes_per_s, Some(10_000_000));
        let removed = edit_text(&out, &[edit("b", None, "net_cap", Setting::Remove)]).unwrap();
        assert_eq!(
            removed,
            FILE.replace("weight = 50 # half", "weight = 70 # half")
                .replace("weight = 10\n", "weight = 20\n")
        );
    }

    #[test]
    fn unknown_tenants_and_classes_are_refused() {
        let e = edit_text(FILE, &[edit("zz", None, "weight", Setting::Int(1))]).unwrap_err();
        assert!(e.contains("no [[tenant]] named \"zz\""), "{e}");
        let e = edit_text(FILE, &[edit("b", Some("gold"), "weight", Setting::Int(1))]).unwrap_err();
        assert!(e.contains("no [[tenant.class]] named \"gold\""), "{e}");
    }

    #[test]
    fn relative_docroots_resolve_against_the_files_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("www")).unwrap();
        let text = FILE.replace("docroot = \".\"\nweight", "docroot = \"./www\"\nweight");
        let (config, _) = file(dir.path(), &text);
        let www = dir.path().join("www").canonicalize().unwrap();
        assert_eq!(config.tenants[0].docroot, www);
        assert_eq!(
            config.tenants[1].docroot,
            dir.path().canonicalize().unwrap()
        );
        // A docroot that is not there is refused when the file is loaded, not served as 404s.
        let missing = FILE.replace("docroot = \".\"\nweight", "docroot = \"./nowhere\"\nweight");
        std::fs::write(dir.path().join("bad.toml"), &missing).unwrap();
        let e = ConfigFile::load(&dir.path().join("bad.toml")).unwrap_err();
        assert!(e.to_string().contains("is not a directory"), "{e}");
    }

    #[test]
    fn apply_writes_atomically_and_remembers() {
        let dir = tempfile::tempdir().unwrap();
        let (_, mut f) = file(dir.path(), FILE);
        f.apply(&[edit("a", None, "weight", Setting::Int(60))])
            .unwrap();
        let text = std::fs::read_to_string(f.path()).unwrap();
        assert!(text.contains("weight = 60 # half") && text.starts_with("# the operator's notes"));
        // A second change builds on the first (the file is what the change left).
        f.apply(&[edit("a", None, "weight", Setting::Int(61))])
            .unwrap();
        assert_eq!(ConfigFile::load(f.path()).unwrap().0.tenants[0].weight, 61);
        // Nothing left beside it.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn a_file_changed_on_disk_is_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let (_, mut f) = file(dir.path(), FILE);
        let by_hand = FILE.replace("weight = 50", "weight = 55");
        std::fs::write(f.path(), &by_hand).unwrap();
        let e = f
            .apply(&[edit("a", None, "weight", Setting::Int(60))])
            .unwrap_err();
        assert!(
            e.contains("changed on disk since it was loaded") && e.contains("SIGHUP"),
            "{e}"
        );
        assert_eq!(std::fs::read_to_string(f.path()).unwrap(), by_hand);
    }

    #[test]
    fn an_edit_that_makes_the_file_invalid_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (_, mut f) = file(dir.path(), FILE);
        let e = f
            .apply(&[edit("a", None, "weight", Setting::Int(0))])
            .unwrap_err();
        assert!(e.contains("would make the config file invalid"), "{e}");
        assert_eq!(std::fs::read_to_string(f.path()).unwrap(), FILE);
    }
}
