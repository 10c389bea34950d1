//! Two trials of one loop, lined up item by item: a minimal edit script (Myers) over what each
//! step did, in order. The allocator's requests line up by their lifetimes ([`super::reserved`]),
//! the recorded operators by their names ([`super::op_peak`]).

use std::hash::Hash;
use std::time::{Duration, Instant};

use similar::{capture_diff_slices_deadline, Algorithm, DiffOp};

/// The diff gives up after this.
const DEADLINE: Duration = Duration::from_secs(2);

/// Which runs of the edit script pair their items.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runs {
    /// Equal runs only.
    Equal,
    /// Equal runs, and replaced runs of equal length one for one (the same requests with other
    /// lifetimes).
    EqualAndSameLength,
}

/// For each of `large`'s items, the index of its twin in `small`, and whether the diff finished
/// before its deadline (past it, the rest of the two is left unpaired).
pub fn pairs<T: Hash + Eq + Ord>(
    small: &[T],
    large: &[T],
    runs: Runs,
) -> (Vec<Option<usize>>, bool) {
    if small == large {
        return ((0..large.len()).map(Some).collect(), true);
    }
    let deadline = Instant::now() + DEADLINE;
    let ops = capture_diff_slices_deadline(Algorithm::Myers, small, large, Some(deadline));
    let finished = Instant::now() <= deadline;
    let mut pairs = vec![None; large.len()];
    for op in ops {
        let (old_index, new_index, len) = match op {
            DiffOp::Equal {
                old_index,
                new_index,
                len,
            } => (old_index, new_index, len),
            DiffOp::Replace {
                old_index,
                old_len,
                new_index,
                new_len,
            } if runs == Runs::EqualAndSameLength && old_len == new_len => {
                (old_index, new_index, new_len)
            }
            _ => continue,
        };
        for k in 0..len {
            pairs[new_index + k] = Some(old_index + k);
        }
    }
    (pairs, finished)
}

#[cfg(test)]
mod tests {
    use super::{pairs, Runs};

    #[test]
    fn equal_runs_pair_around_what_one_side_alone_has() {
        let small = ["n", "a", "b"];
        let large = ["n", "n", "a", "b"];
        let (paired, finished) = pairs(&small, &large, Runs::Equal);
        assert!(finished);
        assert_eq!(paired, [Some(0), None, Some(1), Some(2)]);
    }

    #[test]
    fn replaced_runs_of_one_length_pair_only_where_asked() {
        let (small, large) = ([1, 2, 3], [1, 9, 3]);
        assert_eq!(
            pairs(&small, &large, Runs::Equal).0,
            [Some(0), None, Some(2)]
        );
        assert_eq!(
            pairs(&small, &large, Runs::EqualAndSameLength).0,
            [Some(0), Some(1), Some(2)]
        );
    }
}
