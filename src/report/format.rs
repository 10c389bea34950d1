//! Numbers for people.

/// `1536` → `1.5 KiB`; bytes below 1 KiB stay exact.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A signed change, `+1.5 MiB` or `-200 B`.
pub fn signed_bytes(delta: i128) -> String {
    let sign = if delta < 0 { "-" } else { "+" };
    format!("{sign}{}", human_bytes(delta.unsigned_abs() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(human_bytes(880), "880 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(384 * 1024 * 1024), "384.0 MiB");
        assert_eq!(signed_bytes(-200), "-200 B");
        assert_eq!(signed_bytes(2048), "+2.0 KiB");
    }
}
