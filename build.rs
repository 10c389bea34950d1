//! Exports the child's slot symbol from the `tchmem` binary so that code in cells (loaded as
//! shared libraries) can find it with dlsym (see src/child/runtime_slot.rs).

fn main() {
    println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=tchmem_child_slot");
}
