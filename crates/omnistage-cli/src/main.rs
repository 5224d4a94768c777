//! The `omnistage` command: the server, the load generator, experiments, and the admin
//! commands (`top`, `tree`, `set`, `graph`) that watch and steer a running server, and `shape`,
//! which runs an unmodified program with its I/O shaped.

mod admin_cli;
mod serve;
mod shape_link;
mod top;

use clap::{Parser, Subcommand};
use omnistage_exp as exp;

#[derive(Parser)]
#[command(
    name = "omnistage",
    version,
    about = "A staged runtime that shares a machine fairly among tenants"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve tenants over HTTP (embedded default config: the current directory on 127.0.0.1:8080).
    Serve(serve::ServeArgs),
    /// Generate HTTP load against a server (several tenants, closed or open loop).
    Load(omnistage_load::LoadArgs),
    /// Run an experiment (a benchmark, not a test) and print its results.
    Exp(exp::ExpArgs),
    /// Watch a running server live (over its admin API), like `top`.
    Top(top::TopArgs),
    /// Print a running server's activity tree (over its admin API).
    Tree(admin_cli::TreeArgs),
    /// Create or change an activity of a running server: `set /tenants/a weight=70`.
    Set(admin_cli::SetArgs),
    /// Print a running server's stage graph as measured (Graphviz dot, or --json).
    Graph(admin_cli::GraphArgs),
    /// Run an unmodified program with its network and disk I/O shaped (a preload library, TAP).
    Shape(omnistage_shape::launch::ShapeArgs),
}

/// Writes `text` to stdout. A reader that went away (`omnistage tree | head -1`) ends the
/// command quietly with status 0, as other Unix tools do, instead of the panic `print!` raises
/// (Rust ignores SIGPIPE, so the write fails with `BrokenPipe`); any other write error is one
/// line and status 2.
fn print_stdout(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        let _ = writeln!(std::io::stderr(), "omnistage: cannot write to stdout: {e}");
        std::process::exit(2);
    }
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Exp(args) => exp::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Top(args) => top::run(args),
        Command::Tree(args) => admin_cli::tree(args),
        Command::Set(args) => admin_cli::set(args),
        Command::Graph(args) => admin_cli::graph(args),
        Command::Shape(args) => {
            match shape_link::AdminLink::of(&args)
                .and_then(|link| omnistage_shape::launch::run(&args, link))
            {
                Ok(code) => std::process::exit(code),
                Err(e) => Err(format!("shape: {e}")),
            }
        }
        Command::Load(args) => omnistage_load::run(&args).map(|r| {
            if args.json {
                print_stdout(&format!(
                    "{}\n",
                    serde_json::to_string(&r).expect("report serializes")
                ));
            } else {
                print_stdout(&omnistage_load::format_table(&r));
            }
        }),
    };
    if let Err(e) = result {
        // Not `eprintln!`, which panics when stderr is gone (the status still says it failed).
        use std::io::Write;
        // An error may quote what a server sent: its control characters are escaped.
        let _ = writeln!(
            std::io::stderr(),
            "omnistage: {}",
            admin_cli::escape_controls(&e, true)
        );
        std::process::exit(2);
    }
}
