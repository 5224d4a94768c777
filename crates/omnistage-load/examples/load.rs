//! Runs the load generator on its own, as `omnistage load` will:
//! `cargo run --release -p omnistage-load --example load -- --tenant a:a.test:8:path=/ --seconds 5`.

use clap::Parser;

#[derive(Parser)]
#[command(name = "load", about = "omnistage load generator (standalone example)")]
struct Cli {
    #[command(flatten)]
    load: omnistage_load::LoadArgs,
}

fn main() {
    let cli = Cli::parse();
    match omnistage_load::run(&cli.load) {
        Ok(report) if cli.load.json => println!(
            "{}",
            serde_json::to_string(&report).expect("the report serializes")
        ),
        Ok(report) => omnistage_load::print_table(&report),
        Err(e) => {
            eprintln!("load: {e}");
            std::process::exit(2);
        }
    }
}
