//! The exact terms of a memory estimate ("will it fit?"): the bytes of a model's trainable
//! parameters and of the state its optimizer keeps, computed from their shapes alone, so that
//! the kernel can add them to what short trial runs measured.

use serde::{Deserialize, Serialize};

/// The shape and element size of one trainable parameter: all an estimate needs of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamShape {
    /// Its dimensions (empty for a scalar).
    pub dims: Vec<i64>,
    /// Bytes per element of its kind (4 for f32, 2 for bf16).
    pub element_size: u64,
}

impl ParamShape {
    /// Number of elements (1 for a scalar; negative dimensions count as 0).
    pub fn numel(&self) -> u64 {
        self.dims.iter().map(|&d| d.max(0) as u64).product()
    }

    /// Bytes of its data: `numel × element size`.
    pub fn bytes(&self) -> u64 {
        self.numel() * self.element_size
    }
}

/// Bytes of all `shapes` (parameters, or as many gradients).
pub fn tensor_bytes(shapes: &[ParamShape]) -> u64 {
    shapes.iter().map(ParamShape::bytes).sum()
}

/// How ZeRO (the runtime's `dist::ZeroOptimizer`) shares tensors out among `ranks`: each, the
/// largest first, to the rank with the fewest bytes so far (the lower rank on a tie; among
/// tensors of equal size, the lower index first). `bytes[i]` is tensor i's size; the result is
/// each tensor's rank. The ranks' loads do not depend on the order of the tensors.
pub fn zero_owners(bytes: &[u64], ranks: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..bytes.len()).collect();
    order.sort_by(|&a, &b| bytes[b].cmp(&bytes[a]).then(a.cmp(&b)));
    let mut load = vec![0u64; ranks.max(1)];
    let mut owner = vec![0; bytes.len()];
    for index in order {
        let rank = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        owner[index] = rank;
        load[rank] += bytes[index];
    }
    owner
}

/// Bytes per element of an f32 tensor, the kind most optimizer state is kept in.
const F32: u64 = 4;

/// `tchmem::optim::AdamW8bit`'s defaults (`block_size`, `min_8bit_size`), and the bytes of its
/// lookup tables: two maps of 256 f32 codes and their 255 midpoints each.
const BLOCK_SIZE: u64 = 256;
const MIN_8BIT_SIZE: u64 = 4096;
const MAPS_8BIT: u64 = 2 * (256 + 255) * F32;

/// How an optimizer's state grows with the parameters it trains: what an estimate adds for the
/// optimizer of a loop before running it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerRule {
    /// Adam, as `tchmem::optim::Adam` keeps it: two moments in the parameter's kind (8 bytes per
    /// f32 element) and a 4-byte f32 step count per parameter. tch's `nn::Adam` (libtorch's C++
    /// optimizer, whose state Rust cannot see) keeps the same two moments and its step count as
    /// a host integer, so this is 4 bytes per parameter above it. With `amsgrad` both keep a
    /// third moment (`max_exp_avg_sq`), which this rule does not count.
    Adam,
    /// AdamW: the same state as [`OptimizerRule::Adam`].
    AdamW,
    /// SGD: with momentum one f32 buffer per parameter (`tchmem::optim::Sgd`, momentum 0.9 by
    /// default; tch's `nn::Sgd` keeps it in the parameter's kind, the same for f32), without
    /// none (tch's `nn::Sgd` default, momentum 0).
    Sgd {
        /// Whether momentum is non-zero.
        momentum: bool,
    },
    /// tch's `nn::RmsProp`: the squared-gradient average, plus a momentum buffer and a gradient
    /// average when enabled, each in the parameter's kind.
    RmsProp {
        /// Whether momentum is non-zero.
        momentum: bool,
        /// Whether the centered variant keeps a gradient average.
        centered: bool,
    },
    /// `tchmem::optim::Lion`: one momentum buffer in the parameter's kind.
    Lion,
    /// `tchmem::optim::AdamW8bit` with its default block size (256) and small-parameter bound
    /// (4096 elements): per parameter of `n ≥ 4096` elements `2n` bytes of codes and
    /// `8 × ceil(n / 256)` of scales, per smaller one `8n` (f32 moments), plus 4088 bytes of
    /// lookup tables when any parameter is quantized (one device).
    AdamW8bit,
    /// `tchmem::optim::Adafactor` with its defaults (no first moment): f32 row and column
    /// accumulators over the last two dims of a parameter of two dims or more, a full f32 one
    /// for 1-D and 0-D parameters.
    Adafactor,
}

impl OptimizerRule {
    /// The bytes the optimizer's state tensors hold after its first step over trainable
    /// parameters of `shapes` (each of which has a gradient by then).
    pub fn state_bytes(&self, shapes: &[ParamShape]) -> u64 {
        match *self {
            OptimizerRule::Adam | OptimizerRule::AdamW => {
                2 * tensor_bytes(shapes) + F32 * shapes.len() as u64
            }
            OptimizerRule::Sgd { momentum } => {
                let elements: u64 = shapes.iter().map(ParamShape::numel).sum();
                if momentum {
                    F32 * elements
                } else {
                    0
                }
            }
            OptimizerRule::RmsProp { momentum, centered } => {
                (1 + momentum as u64 + centered as u64) * tensor_bytes(shapes)
            }
            OptimizerRule::Lion => tensor_bytes(shapes),
            OptimizerRule::AdamW8bit => adamw8bit_bytes(shapes),
            OptimizerRule::Adafactor => shapes.iter().map(adafactor_bytes).sum(),
        }
    }

    /// A short name for reports.
    pub fn label(&self) -> &'static str {
        match self {
            OptimizerRule::Adam => "Adam",
            OptimizerRule::AdamW => "AdamW",
            OptimizerRule::Sgd { momentum: true } => "SGD (momentum)",
            OptimizerRule::Sgd { momentum: false } => "SGD",
            OptimizerRule::RmsProp { .. } => "RMSprop",
            OptimizerRule::Lion => "Lion",
            OptimizerRule::AdamW8bit => "AdamW 8-bit",
            OptimizerRule::Adafactor => "Adafactor",
        }
    }
}

/// `tchmem::optim::AdamW8bit`'s state for its default configuration.
fn adamw8bit_bytes(shapes: &[ParamShape]) -> u64 {
    let mut quantized = false;
    let moments: u64 = shapes
        .iter()
        .map(|shape| {
            let n = shape.numel();
            if n >= MIN_8BIT_SIZE {
                quantized = true;
                2 * n + 2 * F32 * n.div_ceil(BLOCK_SIZE)
            } else {
                2 * F32 * n
            }
        })
        .sum();
    moments + if quantized { MAPS_8BIT } else { 0 }
}

/// `tchmem::optim::Adafactor`'s second moment for one parameter (the default keeps no first
/// moment).
fn adafactor_bytes(shape: &ParamShape) -> u64 {
    let size = |d: &i64| (*d).max(0) as u64;
    let [outer @ .., rows, cols] = shape.dims.as_slice() else {
        return F32 * shape.numel();
    };
    F32 * outer.iter().map(size).product::<u64>() * (size(rows) + size(cols))
}

/// The MIME type of a [`DeviceRoom`] in a cell's outputs (`tchmem::estimate::room()`).
pub const DEVICE_ROOM_MIME: &str = "application/vnd.tchmem.device-room+json";

/// How much device memory there is to fit into, as the allocator sees it now.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DeviceRoom {
    /// The device's memory.
    pub total: u64,
    /// Free on the device (cudaMemGetInfo): what neither this process nor others use.
    pub free: u64,
    /// Bytes this process's allocator holds.
    pub reserved: u64,
    /// Of those, bytes in live tensors.
    pub allocated: u64,
    /// The allocator's memory fraction (1 unless set).
    pub fraction: f64,
    /// This process's memory beyond the allocator's (CUDA context, library workspaces), from
    /// NVML; `None` without NVML.
    pub context: Option<u64>,
}

impl DeviceRoom {
    /// The most the allocator may reserve: its memory fraction of the device, and no more than
    /// what it holds plus what is free.
    pub fn allocator_limit(&self) -> u64 {
        let by_fraction = (self.total as f64 * self.fraction) as u64;
        by_fraction.min(self.free + self.reserved)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_trainable_shapes_split_store_by_store() {
        let shape = |n: i64| ParamShape {
            dims: vec![n],
            element_size: 4,
        };
        let mut shapes = ModelShapes {
            trainable: vec![shape(1), shape(2), shape(3)],
            per_store: vec![2, 0, 1],
            ..ModelShapes::default()
        };
        let dims: Vec<Vec<i64>> = shapes
            .trainable_by_store()
            .iter()
            .map(|store| store.iter().map(|s| s.dims[0]).collect())
            .collect();
        assert_eq!(dims, [vec![1, 2], vec![], vec![3]]);
        // Counts that do not add up (an older runtime's answer): all in one.
        shapes.per_store.clear();
        assert_eq!(shapes.trainable_by_store(), [shapes.trainable.as_slice()]);
    }

    #[test]
    fn zero_shares_tensors_out_largest_first_to_the_least_loaded_rank() {
        // 100 → 0; 60 → 1; 50 → 1 (60 < 100); 40 → 0 (100 < 110); 10 → 1 (110 < 140).
        assert_eq!(
            super::zero_owners(&[10, 100, 50, 60, 40], 2),
            [1, 0, 1, 1, 0]
        );
        assert_eq!(super::zero_owners(&[5, 5, 5], 1), [0, 0, 0]);
        // More ranks than tensors: some own nothing.
        assert_eq!(super::zero_owners(&[8, 4], 4), [0, 1]);
        assert!(super::zero_owners(&[], 2).is_empty());
    }

    use super::*;

    fn f32(dims: &[i64]) -> ParamShape {
        ParamShape {
            dims: dims.to_vec(),
            element_size: 4,
        }
    }

    #[test]
    fn shapes_count_elements_and_bytes() {
        assert_eq!(f32(&[3, 5]).numel(), 15);
        assert_eq!(f32(&[]).numel(), 1, "a scalar has one element");
        let bf16 = ParamShape {
            dims: vec![8],
            element_size: 2,
        };
        assert_eq!(bf16.bytes(), 16);
        assert_eq!(tensor_bytes(&[f32(&[3, 5]), bf16]), 60 + 16);
    }

    #[test]
    fn adam_keeps_two_moments_and_a_step_count_per_parameter() {
        let shapes = [f32(&[10, 10]), f32(&[10])];
        assert_eq!(OptimizerRule::Adam.state_bytes(&shapes), 8 * 110 + 2 * 4);
        assert_eq!(OptimizerRule::AdamW.state_bytes(&shapes), 8 * 110 + 2 * 4);
    }

    #[test]
    fn sgd_keeps_state_only_with_momentum() {
        let shapes = [f32(&[10, 10])];
        assert_eq!(
            OptimizerRule::Sgd { momentum: true }.state_bytes(&shapes),
            400
        );
        assert_eq!(
            OptimizerRule::Sgd { momentum: false }.state_bytes(&shapes),
            0
        );
        let rms = |momentum, centered| OptimizerRule::RmsProp { momentum, centered };
        assert_eq!(rms(false, false).state_bytes(&shapes), 400);
        assert_eq!(rms(true, true).state_bytes(&shapes), 1200);
        assert_eq!(OptimizerRule::Lion.state_bytes(&shapes), 400);
    }

    #[test]
    fn adamw8bit_quantizes_only_large_parameters_and_adds_its_tables_once() {
        let small = [f32(&[100])];
        assert_eq!(OptimizerRule::AdamW8bit.state_bytes(&small), 800);
        let large = [f32(&[64, 65]), f32(&[4096])];
        // 4160 elements: 2 × 4160 codes, 2 × 17 f32 scales; 4096: 2 × 4096, 2 × 16 scales.
        let expected = (2 * 4160 + 8 * 17) + (2 * 4096 + 8 * 16) + 4088;
        assert_eq!(OptimizerRule::AdamW8bit.state_bytes(&large), expected);
    }

    #[test]
    fn adafactor_factors_matrices_over_their_last_two_dims() {
        assert_eq!(
            OptimizerRule::Adafactor.state_bytes(&[f32(&[30, 20])]),
            4 * 50
        );
        assert_eq!(
            OptimizerRule::Adafactor.state_bytes(&[f32(&[2, 30, 20])]),
            4 * 100
        );
        assert_eq!(OptimizerRule::Adafactor.state_bytes(&[f32(&[7])]), 28);
        assert_eq!(OptimizerRule::Adafactor.state_bytes(&[f32(&[])]), 4);
    }

    #[test]
    fn rules_have_labels_and_a_snake_case_wire_form() {
        let rule = OptimizerRule::Sgd { momentum: true };
        assert_eq!(rule.label(), "SGD (momentum)");
        let json = serde_json::to_string(&rule).unwrap();
        assert_eq!(json, r#"{"sgd":{"momentum":true}}"#);
        assert_eq!(serde_json::from_str::<OptimizerRule>(&json).unwrap(), rule);
        assert_eq!(
            serde_json::to_string(&OptimizerRule::AdamW8bit).unwrap(),
            r#""adam_w8bit""#
        );
    }

    #[test]
    fn the_allocator_limit_is_the_fraction_or_what_is_left() {
        let room = DeviceRoom {
            total: 100,
            free: 60,
            reserved: 20,
            allocated: 10,
            fraction: 1.0,
            context: Some(5),
        };
        assert_eq!(room.allocator_limit(), 80);
        assert_eq!(
            DeviceRoom {
                fraction: 0.5,
                ..room
            }
            .allocator_limit(),
            50
        );
    }
}

/// The MIME type of a [`ModelShapes`] in a cell's outputs (`tchmem::estimate::model(..)`).
pub const MODEL_SHAPES_MIME: &str = "application/vnd.tchmem.model-shapes+json";

/// The variables of a model's stores: what `%memestimate` counts before any training loop.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelShapes {
    /// The variables that train (each gets a gradient and optimizer state): of a store's
    /// trainable list, those that take a gradient or hold one.
    pub trainable: Vec<ParamShape>,
    /// Bytes of the other variables, held but with no gradient and no state: buffers such as
    /// BatchNorm's running statistics, and the variables of a frozen store (`vs.freeze()`).
    pub frozen_bytes: u64,
    /// Whether the stores are on a CUDA device.
    pub cuda: bool,
    /// How many of `trainable` each store holds, in the order the stores were given (each may
    /// have an optimizer of its own).
    #[serde(default)]
    pub per_store: Vec<usize>,
    /// Bytes of the gradients the stores' variables hold now (from a step before the estimate):
    /// already allocated, and counted as gradients, not as what else the notebook holds.
    #[serde(default)]
    pub gradient_bytes: u64,
}

impl ModelShapes {
    /// `trainable` store by store (all in one when the stores' counts do not add up to it).
    pub fn trainable_by_store(&self) -> Vec<&[ParamShape]> {
        if self.per_store.iter().sum::<usize>() != self.trainable.len() {
            return vec![&self.trainable];
        }
        let mut rest = self.trainable.as_slice();
        self.per_store
            .iter()
            .map(|&count| {
                let (store, after) = rest.split_at(count);
                rest = after;
                store
            })
            .collect()
    }
}
