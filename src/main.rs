//! `tchmem`: a Jupyter kernel for Rust notebooks on tch/libtorch that measures GPU memory.
//!
//! One binary plays four roles: the kernel (`tchmem kernel`), the installer (`tchmem install`),
//! the headless notebook runner (`tchmem execute`) and, re-executed by the engine, the child
//! process that loads and runs compiled cells (selected by an environment variable, see
//! [`child`]).

mod cell_edition;
mod cell_error;
mod cell_syntax;
mod cells;
mod child;
mod cli;
mod engine;
mod fit;
mod html;
mod install;
mod kernel;
mod libtorch;
mod magics;
mod notebook;
mod parse_thread;
mod report;
mod rewrite;
mod session;
mod svg_image;
mod timeline;

use clap::Parser;

fn main() {
    // The child that runs cells must be recognised before anything else happens: it is this same
    // binary, started by the engine, and must not parse our command line.
    if child::is_child_process() {
        child::run();
    }
    // evcxr re-executes this binary as a rustc wrapper for its compilation cache.
    evcxr::runtime_hook();

    let cli = cli::Cli::parse();
    init_logging(cli.verbose);
    if let Err(error) = cli::run(cli) {
        eprintln!("tchmem: error: {error:#}");
        std::process::exit(1);
    }
}

/// Logs go to stderr, which Jupyter shows in the server's terminal; `RUST_LOG` overrides `-v`.
fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "tchmem=info",
        1 => "tchmem=debug",
        _ => "tchmem=trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}
