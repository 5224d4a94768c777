//! The `omnistage` command: the server, the load generator, and experiments.

mod exp;
mod serve;

use clap::{Parser, Subcommand};

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
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Exp(args) => exp::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Load(args) => omnistage_load::run(&args).map(|r| {
            if args.json {
                println!("{}", serde_json::to_string(&r).expect("report serializes"));
            } else {
                omnistage_load::print_table(&r);
            }
        }),
    };
    if let Err(e) = result {
        eprintln!("omnistage: {e}");
        std::process::exit(2);
    }
}
