//! Reports panics to the kernel as structured messages instead of stderr text, so that a panic
//! in a cell shows as one clean error with its message and location.

use tchmem_wire::CellMessage;

/// Installs the hook (idempotent). Cells link Rust's standard library dynamically, so the hook
/// set here holds for every later cell of the session.
pub fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            if crate::checkpoint::is_rerun_stop(info.payload()) {
                return;
            }
            let message = if let Some(text) = info.payload().downcast_ref::<&str>() {
                (*text).to_string()
            } else if let Some(text) = info.payload().downcast_ref::<String>() {
                text.clone()
            } else {
                "(a panic with a non-text payload)".to_string()
            };
            let thread = std::thread::current()
                .name()
                .unwrap_or("<unnamed>")
                .to_string();
            crate::display::send(&CellMessage::Panic {
                thread,
                message,
                location: info.location().map(|l| l.to_string()),
            });
        }));
    });
}
