//! Downsampling: a timeline of any length as a fixed number of columns, each holding the state
//! at its highest instant, so that the chart stays small and every peak stays visible. Columns
//! split the trace by allocation events, not by time, as PyTorch's memory_viz does: the first
//! step of a training run takes far longer than later ones (libraries load, kernels compile),
//! and over time the later steps would be a sliver at the end.

use super::model::{State, Timeline};

/// One column of the chart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Column {
    /// The changes it covers (indices into the timeline's changes, end exclusive).
    pub changes: (usize, usize),
    /// The time of its first and last change (µs since the epoch).
    pub start_us: i64,
    /// The last change's time.
    pub end_us: i64,
    /// The instant of most allocated memory within it.
    pub at_us: i64,
    /// The memory then.
    pub state: State,
}

/// The column holding change `index` among `count` changes drawn as `width` columns.
pub fn column_of(index: usize, count: usize, width: usize) -> usize {
    if count == 0 {
        return 0;
    }
    (index * width / count).min(width - 1)
}

/// At most `width` columns over the timeline's changes (one pass over them); a timeline with
/// fewer changes gets one column per change. The first column also holds the starting state.
pub fn columns(timeline: &Timeline, width: usize) -> Vec<Column> {
    let count = timeline.changes.len();
    let width = width.max(1).min(count.max(1));
    let mut columns: Vec<Column> = Vec::with_capacity(width);
    let mut current = timeline.start;
    for (index, (time, state)) in timeline.states().enumerate() {
        let c = column_of(index, count, width);
        if columns.len() <= c {
            columns.push(Column {
                changes: (index, index + 1),
                start_us: time,
                end_us: time,
                at_us: time,
                state: current,
            });
        }
        let column = columns.last_mut().expect("pushed above");
        column.changes.1 = index + 1;
        column.end_us = time;
        if state.allocated() >= column.state.allocated() {
            let reserved = column.state.reserved.max(state.reserved);
            column.state = state;
            column.state.reserved = reserved;
            column.at_us = time;
        } else {
            // The cache can grow while allocated memory falls: keep the column's highest
            // reserved bytes too.
            column.state.reserved = column.state.reserved.max(state.reserved);
        }
        current = state;
    }
    if columns.is_empty() {
        columns.push(Column {
            changes: (0, 0),
            start_us: timeline.start_us,
            end_us: timeline.end_us,
            at_us: timeline.start_us,
            state: timeline.start,
        });
    }
    columns
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_split_the_changes_evenly() {
        assert_eq!(column_of(0, 1000, 10), 0);
        assert_eq!(column_of(999, 1000, 10), 9);
        assert_eq!(column_of(100, 1000, 10), 1);
        assert_eq!(column_of(5, 3, 10), 9);
    }
}
