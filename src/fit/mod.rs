//! "Will it fit?": the arithmetic behind `%memestimate`, `%memfit`, `%%optimize --fit` and the
//! OOM diagnosis, kept apart from the kernel so that it is tested without one.
//!
//! A training cell is run as short *trials* (the `--compare` instrumentation: a few optimizer
//! steps at a chosen batch size, under chosen rewrites). [`trial`] holds what one trial
//! measured; [`estimate`] predicts a configuration's peak from exact fixed terms (parameters,
//! gradients, the optimizer's state by its rule) and a slope calibrated on two small trials,
//! refined per operator by [`op_peak`] where the trials recorded their operators, and the
//! reserved bytes by [`reserved`] (both line the trials up by [`edit_script`]): the trials' allocator events on their lines, through a
//! model of the allocator ([`allocator`]), and what micro-batches add by [`accumulated`];
//! [`search`] finds the largest batch that fits by trials; [`candidates`] ranks the rewrites'
//! combinations for `--fit`; [`diagnosis`] explains an OOM with ranked fixes.

pub mod accumulated;
pub mod allocator;
pub mod candidates;
pub mod diagnosis;
pub mod edit_script;
pub mod estimate;
pub mod op_peak;
pub mod request_pairs;
pub mod reserved;
pub mod search;
pub mod trial;

/// Parses a size: `16GiB`, `16 GB`, `512MiB`, `1.5g`, or plain bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size: write it as 16GiB, 512MiB or 8GB"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1024.0 * 1024.0,
        "mb" => 1e6,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "gb" => 1e9,
        "t" | "tib" => 1024f64.powi(4),
        "tb" => 1e12,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{text}`: use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)"
            ))
        }
    };
    Ok((number * scale) as u64)
}

/// Parses a percentage (`10%`, `10`, `0.1` is 0.1 %): the fraction, in [0, 1).
pub fn parse_percent(text: &str) -> Result<f64, String> {
    let number: f64 = text
        .trim()
        .trim_end_matches('%')
        .parse()
        .map_err(|_| format!("`{text}` is not a percentage: write it as 10%"))?;
    if !(0.0..100.0).contains(&number) {
        return Err(format!(
            "{text}: the margin must be at least 0% and below 100%"
        ));
    }
    Ok(number / 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_percentages_parse_as_people_write_them() {
        assert_eq!(parse_size("16GiB"), Ok(16 << 30));
        assert_eq!(parse_size("8 GB"), Ok(8_000_000_000));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("lots").unwrap_err().contains("16GiB"));
        assert!(parse_size("3 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
        assert_eq!(parse_percent("10%"), Ok(0.1));
        assert_eq!(parse_percent("5"), Ok(0.05));
        assert!(parse_percent("100%").is_err());
        assert!(parse_percent("ten").is_err());
    }
}
