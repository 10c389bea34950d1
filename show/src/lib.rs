//! What every notebook cell imports: the value a cell ends in, shown with `Debug` as evcxr shows
//! it, in one compile.
//!
//! evcxr compiles a cell that ends in a value with `(value).evcxr_display();` first and, when
//! that does not compile (the type has no `evcxr_display` method, as for numbers, strings and
//! tensors), compiles the whole cell again with `Debug` formatting: every such cell cost two
//! compiles. The kernel imports [`ShowDebugValue`] into every cell (`use … as _`), so that the
//! first compile already succeeds for `Debug` values. A type's own inherent `evcxr_display`
//! still wins (Rust prefers inherent methods), so rich displays keep working.
//!
//! The crate has no dependencies: rustc loads, and links into the cell's library, every crate a
//! cell imports, so an import of the runtime (tch, libtorch's bindings, NVML, serde) cost each
//! cell that names nothing of them ~0.1 s (`scripts/bench/vs-evcxr`'s `use` line).

use std::io::Write;

/// The marker evcxr's rich output starts with: a line `EVCXR_BEGIN_CONTENT <mime>`, the
/// content, and a line [`EVCXR_END_CONTENT`].
pub const EVCXR_BEGIN_CONTENT: &str = "EVCXR_BEGIN_CONTENT";

/// The marker evcxr's rich output ends with.
pub const EVCXR_END_CONTENT: &str = "EVCXR_END_CONTENT";

/// Prints `content` as a block of evcxr's rich output, which the kernel shows as the cell's
/// result (the last block of a MIME type in a cell wins).
pub fn result_block(mime: &str, content: &str) {
    let mut out = std::io::stdout().lock();
    let _ = write!(
        out,
        "{EVCXR_BEGIN_CONTENT} {mime}\n{content}\n{EVCXR_END_CONTENT}\n"
    );
    let _ = out.flush();
}

/// The value a cell ends in, shown with `Debug` (see the crate's documentation).
pub trait ShowDebugValue {
    /// Sends the value as the cell's `text/plain` result, formatted with `{:?}`.
    fn evcxr_display(&self);
}

impl<T: std::fmt::Debug + ?Sized> ShowDebugValue for T {
    fn evcxr_display(&self) {
        // The block evcxr's own Debug fallback prints; the kernel turns it into the result.
        result_block("text/plain", &format!("{self:?}"));
    }
}
