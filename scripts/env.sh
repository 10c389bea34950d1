# Sourced by the scripts: where tchmem keeps its venv and build outputs. Both live outside the
# checkout (under ~/.cache/tchmem by default) so that clones share them; override with
# TCHMEM_VENV and CARGO_TARGET_DIR.
TCHMEM_CACHE=${TCHMEM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tchmem}
export TCHMEM_VENV=${TCHMEM_VENV:-$TCHMEM_CACHE/venv}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$TCHMEM_CACHE/target}
export TCHMEM_BIN=$CARGO_TARGET_DIR/release/tchmem
# torch-sys (cells and the runtime crate) builds against the venv's torch.
libtorch_dir() { "$TCHMEM_VENV/bin/python" -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])'; }
