//! The memory record of one cell: what the allocator counters said before, after and at the
//! peak, and where the memory sits by category.

use serde::{Deserialize, Serialize};

/// The CUDA caching allocator's main counters at one moment (bytes).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Counters {
    /// Bytes in live tensors (rounded up to the allocator's block sizes).
    pub allocated: u64,
    /// Bytes the allocator holds from the driver (allocated + cached).
    pub reserved: u64,
    /// Bytes in blocks in use, including those freed but not yet reusable (stream use).
    pub active: u64,
    /// Bytes callers asked for, before rounding.
    pub requested: u64,
}

/// What the CUDA side measured around one cell.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct CudaMemory {
    /// Device index.
    pub device: i64,
    /// Counters before the cell.
    pub before: Counters,
    /// Counters after the cell.
    pub after: Counters,
    /// Highest value of each counter while the cell ran (peaks are reset before every cell).
    pub peak: Counters,
    /// Allocations made by the cell.
    pub allocations: i64,
    /// Times the allocator freed its cache and retried because memory ran out.
    pub alloc_retries: i64,
    /// Out-of-memory errors raised while the cell ran.
    pub ooms: i64,
    /// Device memory in total and free after the cell (cudaMemGetInfo).
    pub device_total: u64,
    /// Free device memory after the cell.
    pub device_free: u64,
    /// This process's device memory as NVML sees it (context + reserved + other libraries).
    pub nvml_process: Option<u64>,
    /// NVML process usage measured when the session started, right after CUDA was initialised
    /// and before anything was allocated: the CUDA context on its own.
    #[serde(default)]
    pub context_at_start: Option<u64>,
    /// Allocator bytes still allocated right after that measurement: the workspace cuBLAS
    /// keeps per handle and stream (allocated through the caching allocator, never freed by
    /// emptying the cache). Counted as "CUDA context + workspace", not as a cell's tensors.
    #[serde(default)]
    pub workspace_at_start: Option<u64>,
    /// What libtorch's OOM observer saw each time the allocator gave up on a request during the
    /// cell (empty without the observer).
    #[serde(default)]
    pub oom_events: Vec<OomEvent>,
}

/// The device's state when the caching allocator gave up on a request (libtorch's OOM
/// observer).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct OomEvent {
    /// The CUDA device.
    pub device: i64,
    /// The size of the request that failed (rounded up by the allocator).
    pub requested: u64,
    /// The allocator's limit: the device's memory, or its memory fraction of it when one is set
    /// (libtorch passes the allowed maximum then).
    pub device_total: u64,
    /// Free device memory at that moment.
    pub device_free: u64,
    /// The allocator's allocated bytes at that moment.
    #[serde(default)]
    pub allocated: Option<u64>,
    /// The allocator's reserved bytes at that moment (allocated + cached).
    #[serde(default)]
    pub reserved: Option<u64>,
    /// Bytes of the watched stores' variables on the device; `None` when the watched tensors
    /// were busy (the observer never waits for a lock).
    #[serde(default)]
    pub parameters: Option<u64>,
    /// Bytes of their defined gradients (as `parameters`).
    #[serde(default)]
    pub gradients: Option<u64>,
    /// Bytes of the watched input batch (as `parameters`).
    #[serde(default)]
    pub input_batch: Option<u64>,
}

impl CudaMemory {
    /// NVML process usage not explained by the context measured at start plus the allocator's
    /// reserved bytes (kernels loaded lazily since, library workspaces, other allocators), as
    /// (bytes, fraction of NVML usage). Negative bytes mean NVML saw less than expected.
    pub fn unexplained(&self) -> Option<(i64, f64)> {
        let nvml = self.nvml_process?;
        let context = self.context_at_start?;
        let gap = nvml as i64 - (context + self.after.reserved) as i64;
        Some((
            gap,
            if nvml == 0 {
                0.0
            } else {
                gap as f64 / nvml as f64
            },
        ))
    }
}

/// The places training memory goes.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum CategoryName {
    /// Tensors of watched variable stores.
    Parameters,
    /// Their gradients.
    Gradients,
    /// Optimizer state (moments, momentum buffers).
    OptimizerState,
    /// Tensors saved by the forward pass for backward.
    Activations,
    /// The watched input batch.
    InputBatch,
    /// CUDA context and libraries' workspaces: NVML's process usage minus reserved bytes.
    CudaContext,
    /// Reserved by the allocator but not allocated (cache and fragmentation).
    Fragmentation,
    /// Allocated bytes no other category accounts for.
    Other,
}

impl CategoryName {
    /// All, in the order charts stack them.
    pub const ALL: [CategoryName; 8] = [
        CategoryName::Parameters,
        CategoryName::Gradients,
        CategoryName::OptimizerState,
        CategoryName::Activations,
        CategoryName::InputBatch,
        CategoryName::Other,
        CategoryName::Fragmentation,
        CategoryName::CudaContext,
    ];

    /// Human label.
    pub fn label(self) -> &'static str {
        match self {
            CategoryName::Parameters => "parameters",
            CategoryName::Gradients => "gradients",
            CategoryName::OptimizerState => "optimizer state",
            CategoryName::Activations => "activations",
            CategoryName::InputBatch => "input batch",
            CategoryName::CudaContext => "CUDA context + workspace",
            CategoryName::Fragmentation => "fragmentation + cache",
            CategoryName::Other => "other tensors",
        }
    }
}

/// Bytes in one category, and how they were found.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Category {
    /// Which category.
    pub name: CategoryName,
    /// Bytes after the cell.
    pub bytes: u64,
    /// Counted from known tensors or counters (true), or inferred from differences (false).
    pub exact: bool,
    /// How the number was obtained.
    pub how: String,
}

/// Everything the runtime measured about one cell's memory.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct MemoryRecord {
    /// The device the categories describe ("cuda:0" or "cpu").
    pub device: String,
    /// Allocator counters; `None` without CUDA.
    pub cuda: Option<CudaMemory>,
    /// Categories after the cell.
    pub categories: Vec<Category>,
    /// Categories at the start of the cell's last backward pass (`tchmem::phase::backward`),
    /// where activations are alive: usually the training step's peak.
    #[serde(default)]
    pub at_backward: Option<Vec<Category>>,
    /// What could not be measured, and why.
    pub notes: Vec<String>,
    /// Time the kernel's child spent recording this cell (both hooks), in seconds.
    #[serde(default)]
    pub recording_seconds: Option<f64>,
    /// Time the cell's code ran, without compilation, in seconds.
    #[serde(default)]
    pub wall_seconds: Option<f64>,
}

impl MemoryRecord {
    /// Bytes of `name`, 0 if absent.
    pub fn bytes(&self, name: CategoryName) -> u64 {
        category_bytes(&self.categories, name)
    }
}

/// Bytes of `name` in `categories`, 0 if absent.
pub fn category_bytes(categories: &[Category], name: CategoryName) -> u64 {
    categories
        .iter()
        .filter(|c| c.name == name)
        .map(|c| c.bytes)
        .sum()
}
