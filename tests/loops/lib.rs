//! Every reference loop (`*.rs` here) and every golden rewrite of it (`rewritten/*.rs`) as a
//! test function compiled against tch and the runtime: a rewrite that does not compile fails
//! CI. Running them trains each model for several epochs on the CPU (more than 15 minutes in
//! all on 2 cores), so they are ignored by default;
//! `cargo test --release -p tchmem-loops -- --ignored` runs them. build.rs wraps each cell in a
//! function.

#[cfg(test)]
mod loops {
    include!(concat!(env!("OUT_DIR"), "/loops.rs"));
}
