//! `%%distributed`: the cell magic that runs its cell in several processes at once, each a rank
//! of one process group (data parallel training from a notebook).

use clap::Parser;

use super::MagicReply;

use tchmem_wire::MAX_RANKS;

/// Run this cell in N processes at once, each a rank of one process group (libtorch's Gloo, on
/// this host), with tchmem::dist::rank(), world_size(), barrier(), broadcast_parameters(&vs) and
/// all_reduce_gradients(&vs) ready to use.
///
/// The ranks keep their own variables from one %%distributed cell to the next (the notebook's
/// other cells do not see them, nor they the notebook's); each rank's output is shown with its
/// rank. A panic on one rank is reported with its rank; ranks left waiting for it in a
/// collective are stopped after a few seconds, and the next %%distributed cell starts a new
/// world. A different N starts a new world too.
#[derive(Parser, Debug, Clone, PartialEq, Eq)]
#[command(
    name = "%%distributed",
    no_binary_name = true,
    disable_version_flag = true,
    after_help = "Example:\n  %%distributed --procs 2\n  \
                  println!(\"rank {} of {}\", tchmem::dist::rank(), tchmem::dist::world_size());"
)]
pub struct DistributedRequest {
    /// How many processes (ranks) run the cell: CPU tensors, through Gloo.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=MAX_RANKS as i64))]
    pub procs: Option<u16>,
    /// One process per GPU through NCCL (not built yet: see the message).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    pub gpus: Option<u16>,
}

impl DistributedRequest {
    /// How many ranks the world has.
    pub fn ranks(&self) -> usize {
        usize::from(self.procs.unwrap_or(1))
    }
}

/// Parses `%%distributed`'s arguments: `--procs N` is required; `--gpus` is explained.
pub fn parse_args(args: &[&str]) -> Result<DistributedRequest, MagicReply> {
    let request = DistributedRequest::try_parse_from(args).map_err(super::reply)?;
    if let Some(gpus) = request.gpus {
        return Err(MagicReply::Error(format!(
            "%%distributed --gpus {gpus}: a group of one process per GPU (NCCL) is not built yet; \
             `--procs {gpus}` runs {gpus} ranks on Gloo, whose collectives take CPU tensors \
             (move gradients to the CPU, or keep the model there)."
        )));
    }
    if request.procs.is_none() {
        return Err(MagicReply::Error(
            "%%distributed needs the number of ranks: `%%distributed --procs 2` runs the cell \
             in 2 processes (see %%distributed --help)."
                .to_string(),
        ));
    }
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn procs_is_required_bounded_and_gpus_is_explained() {
        assert_eq!(parse_args(&["--procs", "2"]).unwrap().ranks(), 2);
        let error = |args: &[&str]| match parse_args(args) {
            Err(MagicReply::Error(message)) => message,
            other => panic!("{args:?}: {other:?}"),
        };
        assert!(error(&[]).contains("--procs 2"));
        assert!(error(&["--procs", "0"]).contains("0"));
        assert!(error(&["--procs", "65"]).contains("65"));
        assert!(error(&["--procs", "two"]).contains("two"));
        assert!(error(&["--gpus", "2"]).contains("--procs 2"));
        assert!(error(&["--nodes", "2"]).contains("--nodes"));
        assert!(matches!(parse_args(&["--help"]), Err(MagicReply::Help(h)) if h.contains("rank")));
    }
}
