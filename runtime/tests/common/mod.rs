//! What the runtime's test binaries share.

use std::sync::{Mutex, MutexGuard};

/// libtorch has one global random generator and a test binary runs its tests on parallel
/// threads. A test that seeds and then draws (or compares two seeded draws) must not see another
/// test's draws in between, so every test of a binary that draws takes its turn.
static RNG: Mutex<()> = Mutex::new(());

/// The turn at libtorch's random generator, held until the guard drops.
pub fn rng_turn() -> MutexGuard<'static, ()> {
    RNG.lock().unwrap_or_else(|e| e.into_inner())
}
