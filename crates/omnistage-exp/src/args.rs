//! The options every experiment takes, in one struct flattened into each experiment's own
//! arguments: `--json`, `--out`, `--seconds`, `--repeats` and `--nginx` (the peer's binary).
//! An experiment sets its own defaults for `--seconds` and `--repeats` with
//! `#[command(mut_arg("seconds", |a| a.default_value("30")))]` on its struct, so `--help`
//! shows the default that applies; the values here are the fallbacks.

use super::nginx;
use clap::Args;
use std::path::{Path, PathBuf};

/// Most repeats of one configuration (every repeat is a full run).
pub const REPEATS_MAX: usize = 50;
/// Longest run an experiment accepts, seconds.
pub const SECONDS_MAX: f64 = 3600.0;

#[derive(Args, Clone, Debug)]
pub struct Common {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Write NAME.json, the page NAME.md and the chart NAME.svg into this directory.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Measured seconds of each run.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Runs of each configuration (peers alternate with omnistage round by round); pages show
    /// the median and the min-max.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// The peer's binary (nginx, Debian's package), for experiments that compare with a peer.
    #[arg(long, default_value = nginx::DEFAULT_BIN)]
    pub nginx: PathBuf,
}

impl Common {
    /// Checks `--seconds` against `lo..=SECONDS_MAX` and `--repeats` against `1..=REPEATS_MAX`.
    pub fn check(&self, seconds_min: f64) -> Result<(), String> {
        if !(seconds_min..=SECONDS_MAX).contains(&self.seconds) {
            return Err(format!("--seconds {seconds_min}..={SECONDS_MAX}"));
        }
        if !(1..=REPEATS_MAX).contains(&self.repeats) {
            return Err(format!("--repeats 1..={REPEATS_MAX}"));
        }
        Ok(())
    }

    /// Options for a unit test: JSON, no files, one run of `seconds`, no peer installed.
    #[cfg(test)]
    pub fn for_test(seconds: f64) -> Common {
        Common {
            json: true,
            out: None,
            seconds,
            repeats: 1,
            nginx: PathBuf::from("/nonexistent/nginx"),
        }
    }

    pub fn out(&self) -> Option<&Path> {
        self.out.as_deref()
    }

    /// The command-line words that reproduce these options (for a page's command line), without
    /// `--json`/`--out`, and `--nginx` only when it is not the default.
    pub fn words(&self) -> String {
        let mut s = format!("--seconds {} --repeats {}", self.seconds, self.repeats);
        if self.nginx != Path::new(nginx::DEFAULT_BIN) {
            s.push_str(&format!(" --nginx {}", self.nginx.display()));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    #[command(mut_arg("seconds", |a| a.default_value("30")))]
    struct Cli {
        #[command(flatten)]
        common: Common,
    }

    /// As experiments use it: an `Args` struct behind a subcommand.
    #[derive(Parser)]
    struct Top {
        #[command(subcommand)]
        which: Which,
    }
    #[derive(clap::Subcommand)]
    enum Which {
        Exp(ExpArgs),
    }
    #[derive(Args)]
    #[command(mut_arg("seconds", |a| a.default_value("7")))]
    #[command(mut_arg("repeats", |a| a.default_value("1")))]
    struct ExpArgs {
        #[command(flatten)]
        common: Common,
    }

    #[test]
    fn a_subcommands_own_defaults() {
        let Which::Exp(e) = Top::try_parse_from(["x", "exp"]).unwrap().which;
        assert_eq!((e.common.seconds, e.common.repeats), (7.0, 1));
    }

    #[test]
    fn defaults_and_an_experiments_own_default() {
        let c = Cli::try_parse_from(["x"]).unwrap().common;
        assert_eq!(c.seconds, 30.0);
        assert_eq!(c.repeats, 3);
        assert!(!c.json && c.out.is_none());
        assert_eq!(c.nginx, Path::new(nginx::DEFAULT_BIN));
        let c = Cli::try_parse_from(["x", "--seconds", "2", "--repeats", "5", "--json"])
            .unwrap()
            .common;
        assert_eq!((c.seconds, c.repeats, c.json), (2.0, 5, true));
        assert!(c.check(0.5).is_ok());
    }

    #[test]
    fn limits_are_checked() {
        let mut c = Cli::try_parse_from(["x"]).unwrap().common;
        c.repeats = 0;
        assert!(c.check(0.5).is_err());
        c.repeats = REPEATS_MAX + 1;
        assert!(c.check(0.5).is_err());
        c.repeats = 1;
        c.seconds = 0.1;
        assert!(c.check(0.5).is_err());
        c.seconds = SECONDS_MAX + 1.0;
        assert!(c.check(0.5).is_err());
    }
}
