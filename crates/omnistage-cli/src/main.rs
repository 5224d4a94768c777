//! The `omnistage` command: experiments now; the server and the load generator come next.

mod exp;

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
    /// Run an experiment (a benchmark, not a test) and print its results.
    Exp(exp::ExpArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Exp(args) => exp::run(args),
    };
    if let Err(e) = result {
        eprintln!("omnistage: {e}");
        std::process::exit(2);
    }
}
