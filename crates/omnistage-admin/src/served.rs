//! An HTTP server together with the config file it runs from ([`Served`]): what `omnistage
//! serve` hands the admin API, so that `?persist=true` can write a change back to the file and a
//! SIGHUP reloads the file the changes were written to.

use crate::{TenantChange, TenantError, Tenants};
use omnistage::exec::Runtime;
use omnistage_http::config::Config;
use omnistage_http::persist::{ConfigFile, Edit};
use omnistage_http::server::{Reloaded, Server};
use std::sync::{Arc, Mutex, PoisonError};

/// How a refused reload begins (`serve` prints it after "omnistage: reload: ").
pub const RELOAD_REFUSED: &str = "refused, the old config keeps serving";

/// A running server and its config file (`None`: the embedded default, nothing to write).
pub struct Served {
    /// Shared with the fleet thread, when the server is a node of a fleet.
    server: Arc<Server>,
    file: Mutex<Option<ConfigFile>>,
    /// One change at a time: a reload of the file here, or a change through the admin API
    /// (see [`Tenants::changes`]).
    changes: Mutex<()>,
}

impl Served {
    /// `file` is what the server's config was loaded from ([`ConfigFile::load`]).
    pub fn new(server: Server, file: Option<ConfigFile>) -> Served {
        Served {
            server: Arc::new(server),
            file: Mutex::new(file),
            changes: Mutex::new(()),
        }
    }

    /// The server.
    pub fn server(&self) -> &Server {
        &self.server
    }

    /// The server's runtime (for [`crate::start_admin_with_tenants`]).
    pub fn runtime(&self) -> &Runtime {
        self.server.runtime()
    }

    /// The server, for those that run beside the admin API (the fleet thread).
    pub fn shared_server(&self) -> Arc<Server> {
        self.server.clone()
    }

    /// The server, for its graceful drain; `None` while another holder of
    /// [`Served::shared_server`] still runs.
    pub fn into_server(self) -> Option<Server> {
        Arc::try_unwrap(self.server).ok()
    }

    /// SIGHUP: reads the file again and reloads the server from it; the file's bytes become the
    /// ones later persisted changes are checked against. Ok: the file's path and the config
    /// now running (for the layers beside the server that keep their own copy, the fleet's),
    /// and what of it waits for a restart.
    pub fn reload_file(&self) -> Result<(String, Config, Reloaded), String> {
        // Not in the middle of an admin API change (between applying it and writing it to the
        // file): this reload would undo it, or read the file before the change was in it.
        let _changes = self.changes.lock().unwrap_or_else(PoisonError::into_inner);
        let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(f) = file.as_ref() else {
            return Err("no config file to reload (embedded default)".into());
        };
        let path = f.path().to_path_buf();
        let (config, fresh) =
            ConfigFile::load(&path).map_err(|e| format!("{RELOAD_REFUSED}: {e}"))?;
        // Nothing was applied on an error (a certificate that does not load, say): the same
        // words as a file that does not parse, so an operator reads one message for both. The
        // old bytes stay remembered then, so a `?persist=true` edit meanwhile is refused as
        // "changed on disk" instead of being written onto a file that is not what runs.
        let reloaded = self
            .server
            .reload(config.clone())
            .map_err(|e| format!("{RELOAD_REFUSED}: {e}"))?;
        // Remember the new bytes even if the reload is only partly applied (listeners): they
        // are what the running config now comes from.
        *file = Some(fresh);
        Ok((path.display().to_string(), config, reloaded))
    }
}

impl Tenants for Served {
    fn set_tenant(&self, path: &str, change: &TenantChange) -> Result<(), TenantError> {
        self.server.set_tenant(path, change)
    }

    fn check_tenant(&self, path: &str, change: &TenantChange) -> Result<(), TenantError> {
        Tenants::check_tenant(&*self.server, path, change)
    }

    fn changes(&self) -> Option<&Mutex<()>> {
        Some(&self.changes)
    }

    fn saved_tenant(&self, path: &str) -> Option<omnistage_http::config::TenantConfig> {
        Tenants::saved_tenant(&*self.server, path)
    }

    fn restore_tenant(
        &self,
        path: &str,
        saved: &omnistage_http::config::TenantConfig,
    ) -> Result<(), TenantError> {
        Tenants::restore_tenant(&*self.server, path, saved)
    }

    fn cache_bytes(&self) -> Vec<(String, u64)> {
        Tenants::cache_bytes(&*self.server)
    }

    fn configured_activities(&self) -> Vec<String> {
        self.server.configured_activities()
    }

    fn server_counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        Tenants::server_counters(&*self.server)
    }

    fn fleet(&self) -> Option<crate::model::Fleet> {
        Tenants::fleet(&*self.server)
    }

    fn upstreams(&self) -> Vec<omnistage_http::server::UpstreamTenantStats> {
        Tenants::upstreams(&*self.server)
    }

    fn persist(&self, edits: &[Edit]) -> Result<(), TenantError> {
        let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        match file.as_mut() {
            None => Err(no_file()),
            Some(f) => f.apply(edits).map_err(TenantError::Refused),
        }
    }

    fn check_persist(&self, edits: &[Edit]) -> Result<(), TenantError> {
        let file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        match file.as_ref() {
            None => Err(no_file()),
            Some(f) => f.check(edits).map_err(TenantError::Refused),
        }
    }
}

fn no_file() -> TenantError {
    TenantError::Refused(
        "this server runs on the embedded default config: there is no file to write the change \
         to; start it with --config FILE to persist changes"
            .into(),
    )
}
