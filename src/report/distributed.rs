//! A `%%distributed` cell's memory: every rank's record side by side (a column per rank in one
//! chart, a table) and how far apart the ranks are.

use serde_json::{Map, Value};
use tchmem_wire::memory::{Category, MemoryRecord};
use tchmem_wire::mime::RANKS_MIME;
use tchmem_wire::Display;

use super::embed;
use super::format::human_bytes;
use super::{chart, records_table};

/// The bytes a record is compared by: allocated on CUDA, the watched tensors' on CPU.
fn held(record: &MemoryRecord) -> u64 {
    match &record.cuda {
        Some(cuda) => cuda.after.allocated,
        None => record.categories.iter().map(|c| c.bytes).sum(),
    }
}

/// How far apart the ranks' bytes are: the largest less the smallest, and which ranks.
pub fn spread(records: &[(usize, MemoryRecord)]) -> Option<String> {
    let most = records.iter().max_by_key(|(_, record)| held(record))?;
    let least = records.iter().min_by_key(|(_, record)| held(record))?;
    let (high, low) = (held(&most.1), held(&least.1));
    if high == low {
        return Some(format!(
            "no spread between ranks: each holds {}",
            human_bytes(high)
        ));
    }
    let share = 100.0 * (high - low) as f64 / high as f64;
    Some(format!(
        "spread between ranks: {} ({share:.1}% of rank {}'s {}; rank {} holds the least, {})",
        human_bytes(high - low),
        most.0,
        human_bytes(high),
        least.0,
        human_bytes(low)
    ))
}

/// The display of the ranks' records after a `%%distributed` cell (`None` for a rank that sent
/// none); `None` when no rank sent one.
pub fn ranks_display(records: &[Option<MemoryRecord>]) -> Option<Display> {
    let numbered: Vec<(usize, MemoryRecord)> = records
        .iter()
        .enumerate()
        .filter_map(|(rank, record)| Some((rank, record.clone()?)))
        .collect();
    if numbered.is_empty() {
        return None;
    }
    let (mut text, rows) = records_table("rank", &numbered);
    let spread = spread(&numbered).unwrap_or_default();
    text.push_str(&spread);
    let columns: Vec<(usize, &[Category])> = numbered
        .iter()
        .map(|(rank, record)| (*rank, record.categories.as_slice()))
        .collect();
    let chart = embed::chart_html(chart::rank_columns(&columns), "memory by rank");
    let mut data = Map::new();
    data.insert("text/plain".into(), Value::String(text));
    data.insert(
        "text/html".into(),
        Value::String(format!(
            "<div class='tchmem-memory'>{chart}<table>{rows}</table><div>{spread}</div></div>"
        )),
    );
    data.insert(
        RANKS_MIME.into(),
        serde_json::to_value(records).unwrap_or(Value::Null),
    );
    Some(Display {
        data,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tchmem_wire::memory::CategoryName;

    fn on_cpu(parameters: u64) -> MemoryRecord {
        MemoryRecord {
            device: "cpu".into(),
            categories: vec![Category {
                name: CategoryName::Parameters,
                bytes: parameters,
                exact: true,
                how: String::new(),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn each_rank_has_a_row_a_column_and_the_spread_is_told() {
        let display = ranks_display(&[Some(on_cpu(4096)), None, Some(on_cpu(3072))]).unwrap();
        let text = display.data["text/plain"].as_str().unwrap();
        assert!(text.starts_with("rank"), "{text}");
        assert!(
            text.contains("\n0    cpu") && text.contains("\n2    cpu"),
            "{text}"
        );
        assert!(!text.contains("\n1 "), "{text}");
        assert!(
            text.contains("spread between ranks: 1.0 KiB (25.0% of rank 0's 4.0 KiB; rank 2"),
            "{text}"
        );
        let html = display.data["text/html"].as_str().unwrap();
        let charts = embed::svgs_in(html);
        assert!(charts.len() == 1 && charts[0].contains("rank"), "{html}");
        assert_eq!(display.data[RANKS_MIME].as_array().unwrap().len(), 3);
        assert!(ranks_display(&[None, None]).is_none());
        let even = ranks_display(&[Some(on_cpu(2048)), Some(on_cpu(2048))]).unwrap();
        let text = even.data["text/plain"].as_str().unwrap();
        assert!(
            text.ends_with("no spread between ranks: each holds 2.0 KiB"),
            "{text}"
        );
    }
}
