//! The process group across real processes: this test binary starts itself as each rank (a
//! test that finds `RANK_VARIABLE` set plays that rank and exits), on CPU with Gloo.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tch::nn::{self, Module, OptimizerConfig, VarStore};
use tch::{Device, Kind, Tensor};
use tchmem::dist::{self, Setup};

/// Set in a rank's process: its rank.
const RANK_VARIABLE: &str = "TCHMEM_DIST_TEST_RANK";
/// Set in a rank's process: the folder it meets the others in and writes its results to.
const DIR_VARIABLE: &str = "TCHMEM_DIST_TEST_DIR";
const WORLD: usize = 2;
const BATCH: i64 = 8;
const STEPS: usize = 3;

/// Starts `test` of this binary as each of `world` ranks; their exit statuses, in rank order.
fn run_ranks(test: &str, world: usize, dir: &Path) -> Vec<std::process::ExitStatus> {
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(RANK_VARIABLE, rank.to_string())
                .env(DIR_VARIABLE, dir)
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|mut child| child.wait().unwrap())
        .collect()
}

/// This process's rank and folder when it plays a rank.
fn as_rank() -> Option<(usize, PathBuf)> {
    let rank = std::env::var(RANK_VARIABLE).ok()?.parse().ok()?;
    Some((rank, PathBuf::from(std::env::var_os(DIR_VARIABLE)?)))
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tchmem-dist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn join(rank: usize, dir: &Path, timeout: Duration) {
    dist::init(&Setup {
        rank,
        world_size: WORLD,
        store: dir.join("store"),
        timeout,
    })
    .unwrap();
}

/// The whole batch, the same in every process.
fn batch() -> (Tensor, Tensor) {
    tch::manual_seed(7);
    let x = Tensor::randn([BATCH, 6], (Kind::Double, Device::Cpu));
    let y = Tensor::randn([BATCH, 1], (Kind::Double, Device::Cpu));
    (x, y)
}

/// A small net in f64 drawn from `seed`.
fn small_net(seed: i64) -> (VarStore, impl Module) {
    tch::manual_seed(seed);
    let mut vs = VarStore::new(Device::Cpu);
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "l1", 6, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "l2", 16, 1, Default::default()));
    vs.double();
    (vs, net)
}

/// tch's SGD with momentum (libtorch's C++ optimizer).
fn sgd(vs: &VarStore) -> nn::Optimizer {
    nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(vs, 0.05)
    .unwrap()
}

/// tchmem's AdamW (its state's bytes are known).
fn adamw(vs: &VarStore) -> tchmem::optim::Optimizer {
    tchmem::optim::AdamW::default().build(vs, 0.01).unwrap()
}

/// The net drawn from `seed`, and SGD with momentum over it.
fn model(seed: i64) -> (VarStore, impl Module, nn::Optimizer) {
    let (vs, net) = small_net(seed);
    let opt = sgd(&vs);
    (vs, net, opt)
}

/// The store's variables by name.
fn named(vs: &VarStore) -> Vec<(String, Tensor)> {
    let mut named: Vec<_> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// The largest difference of each variable from the reference's, by name.
fn assert_close(saved: &[(String, Tensor)], reference: &[(String, Tensor)], what: &str) {
    assert_eq!(saved.len(), reference.len(), "{what}");
    for ((name, ours), (ref_name, theirs)) in saved.iter().zip(reference) {
        assert_eq!(name, ref_name, "{what}");
        let gap = (ours - theirs).abs().max().double_value(&[]);
        assert!(gap <= 1e-10, "{what}, {name}: {gap:e} from one process");
    }
}

/// `STEPS` steps on `rows` of the batch; the variables after them, by name.
fn train(
    vs: &VarStore,
    net: &impl Module,
    opt: &mut nn::Optimizer,
    rows: (i64, i64),
) -> Vec<(String, Tensor)> {
    let (x, y) = batch();
    let (x, y) = (x.narrow(0, rows.0, rows.1), y.narrow(0, rows.0, rows.1));
    for _ in 0..STEPS {
        opt.zero_grad();
        net.forward(&x)
            .mse_loss(&y, tch::Reduction::Mean)
            .backward();
        dist::all_reduce_gradients(vs).unwrap();
        opt.step();
    }
    named(vs)
}

/// [`train`] with an optimizer of any kind, its step given.
fn train_with<O>(
    vs: &VarStore,
    net: &impl Module,
    opt: &mut O,
    rows: (i64, i64),
    step: impl Fn(&mut O, &Tensor),
) -> Vec<(String, Tensor)> {
    let (x, y) = batch();
    let (x, y) = (x.narrow(0, rows.0, rows.1), y.narrow(0, rows.0, rows.1));
    for _ in 0..STEPS {
        step(opt, &net.forward(&x).mse_loss(&y, tch::Reduction::Mean));
    }
    named(vs)
}

/// Saves variables by name to `path`.
fn save(variables: &[(String, Tensor)], path: &Path) {
    let refs: Vec<(&str, &Tensor)> = variables.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Tensor::save_multi(&refs, path).unwrap();
}

/// As rank 0: an all-reduce that must fail; how long it took and its error, written to `dir`.
fn report_failed_all_reduce(dir: &Path) {
    let started = Instant::now();
    let mut tensor = Tensor::ones([4], (Kind::Float, Device::Cpu));
    let error = dist::all_reduce(&mut tensor, dist::ReduceOp::Sum).unwrap_err();
    let report = format!("{:.1}\n{error}", started.elapsed().as_secs_f64());
    std::fs::write(dir.join("rank0.txt"), report).unwrap();
    dist::shutdown();
}

/// What [`report_failed_all_reduce`] wrote: seconds and the error, which names rank 0.
fn failed_all_reduce(dir: &Path) -> (f64, String) {
    let report = std::fs::read_to_string(dir.join("rank0.txt")).unwrap();
    let (seconds, text) = report.split_once('\n').unwrap();
    assert!(text.starts_with("rank 0: an all-reduce failed"), "{text}");
    (seconds.parse().unwrap(), text.to_string())
}

#[test]
fn two_gloo_ranks_on_half_batches_step_like_one_process_on_the_whole_batch() {
    const TEST: &str = "two_gloo_ranks_on_half_batches_step_like_one_process_on_the_whole_batch";
    if let Some((rank, dir)) = as_rank() {
        join(rank, &dir, Duration::from_secs(60));
        assert_eq!((dist::rank(), dist::world_size()), (rank, WORLD));
        // Each rank draws its own model: the broadcast must give them rank 0's.
        let (vs, net, mut opt) = model(100 + rank as i64);
        dist::broadcast_parameters(&vs).unwrap();
        let share = BATCH / WORLD as i64;
        let trained = train(&vs, &net, &mut opt, (rank as i64 * share, share));
        let (names, tensors): (Vec<_>, Vec<_>) = trained.into_iter().unzip();
        Tensor::save_multi(
            &names
                .iter()
                .zip(&tensors)
                .map(|(n, t)| (n.as_str(), t))
                .collect::<Vec<_>>(),
            dir.join(format!("rank{rank}.ot")),
        )
        .unwrap();
        dist::shutdown();
        return;
    }
    let dir = fresh_dir("step");
    let statuses = run_ranks(TEST, WORLD, &dir);
    assert!(statuses.iter().all(|s| s.success()), "{statuses:?}");
    let reference = {
        let _turn = common::rng_turn();
        // No group here: a world of 1, where the collectives do nothing.
        assert_eq!((dist::rank(), dist::world_size()), (0, 1));
        let (vs, net, mut opt) = model(100);
        train(&vs, &net, &mut opt, (0, BATCH))
    };
    for rank in 0..WORLD {
        let saved = Tensor::load_multi(dir.join(format!("rank{rank}.ot"))).unwrap();
        assert_close(&saved, &reference, &format!("rank {rank}"));
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn zero_stages_step_like_one_process_and_keep_a_share_of_the_optimizer_state() {
    const TEST: &str = "zero_stages_step_like_one_process_and_keep_a_share_of_the_optimizer_state";
    let share = BATCH / WORLD as i64;
    if let Some((rank, dir)) = as_rank() {
        join(rank, &dir, Duration::from_secs(60));
        let rows = (rank as i64 * share, share);
        let mut bytes = Vec::new();
        for stage in [1, 2] {
            let stage_of = dist::ZeroStage::from_number(stage).unwrap();
            // tch's SGD with momentum (C++), then tchmem's AdamW.
            let (vs, net) = small_net(100 + rank as i64);
            dist::broadcast_parameters(&vs).unwrap();
            let mut opt = dist::ZeroOptimizer::new(&vs, sgd(&vs), stage_of);
            let trained = train_with(&vs, &net, &mut opt, rows, |opt, loss| {
                opt.backward_step(loss).unwrap()
            });
            save(&trained, &dir.join(format!("sgd-{stage}-rank{rank}.ot")));
            let (vs, net) = small_net(100 + rank as i64);
            dist::broadcast_parameters(&vs).unwrap();
            let mut opt = dist::ZeroOptimizer::new(&vs, adamw(&vs), stage_of);
            let trained = train_with(&vs, &net, &mut opt, rows, |opt, loss| {
                opt.backward_step(loss).unwrap()
            });
            save(&trained, &dir.join(format!("adamw-{stage}-rank{rank}.ot")));
            bytes.push(format!(
                "{} {}",
                opt.inner().state_bytes(),
                opt.share_bytes()
            ));
        }
        std::fs::write(dir.join(format!("rank{rank}.txt")), bytes.join("\n")).unwrap();
        dist::shutdown();
        return;
    }
    let dir = fresh_dir("zero");
    let statuses = run_ranks(TEST, WORLD, &dir);
    assert!(statuses.iter().all(|s| s.success()), "{statuses:?}");
    // One process on the whole batch, without ZeRO.
    let _turn = common::rng_turn();
    let (vs, net) = small_net(100);
    let mut opt = sgd(&vs);
    let reference_sgd = train_with(&vs, &net, &mut opt, (0, BATCH), |opt, loss| {
        opt.backward_step(loss)
    });
    let (vs, net) = small_net(100);
    let mut opt = adamw(&vs);
    let reference_adamw = train_with(&vs, &net, &mut opt, (0, BATCH), |opt, loss| {
        opt.backward_step(loss)
    });
    let whole_state = opt.state_bytes();
    let parameters: u64 = reference_adamw
        .iter()
        .map(|(_, t)| t.numel() as u64 * 8)
        .sum();
    for stage in [1, 2] {
        for rank in 0..WORLD {
            let load = |name: &str| {
                Tensor::load_multi(dir.join(format!("{name}-{stage}-rank{rank}.ot"))).unwrap()
            };
            let what = |name: &str| format!("ZeRO {stage}, {name}, rank {rank}");
            assert_close(&load("sgd"), &reference_sgd, &what("tch's SGD"));
            assert_close(&load("adamw"), &reference_adamw, &what("tchmem's AdamW"));
        }
    }
    // Each rank keeps the state of the parameters it updates only: together, the whole state.
    let mut state_sum = [0u64; 2];
    let mut share_sum = [0u64; 2];
    for rank in 0..WORLD {
        let report = std::fs::read_to_string(dir.join(format!("rank{rank}.txt"))).unwrap();
        for (stage, line) in report.lines().enumerate() {
            let (state, share) = line.split_once(' ').unwrap();
            let (state, share): (u64, u64) = (state.parse().unwrap(), share.parse().unwrap());
            assert!(
                state < whole_state,
                "rank {rank} keeps {state} of {whole_state} bytes"
            );
            // AdamW's two moments per parameter, in f32 for these f64 parameters (and a step
            // count per parameter).
            assert!(
                state >= share,
                "{state} bytes of state for {share} of parameters"
            );
            state_sum[stage] += state;
            share_sum[stage] += share;
        }
    }
    assert_eq!(state_sum, [whole_state; 2]);
    assert_eq!(share_sum, [parameters; 2]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn all_gather_and_reduce_scatter_split_and_join_flat_shards_in_rank_order() {
    const TEST: &str = "all_gather_and_reduce_scatter_split_and_join_flat_shards_in_rank_order";
    if let Some((rank, dir)) = as_rank() {
        join(rank, &dir, Duration::from_secs(60));
        let r = rank as f64;
        // Rank r holds [r+1, r+1, r+1] as a 1×3 tensor.
        let shard = Tensor::full([1, 3], r + 1.0, (Kind::Double, Device::Cpu));
        let gathered = dist::all_gather(&shard).unwrap();
        // Rank r holds [10r, 10r+1, 10r+2, 10r+3]; rank 0 keeps the first half of the sum.
        let full = Tensor::arange(4, (Kind::Double, Device::Cpu)) + 10.0 * r;
        let summed = dist::reduce_scatter(&full, dist::ReduceOp::Sum).unwrap();
        // Rank r holds [4 - 4r, 1, 2, 3 + 10r]: the largest of each is rank 0's first, then 1,
        // 2 and rank 1's last (Gloo's own reduce-scatter would sum).
        let mixed = Tensor::from_slice(&[4.0 - 4.0 * r, 1.0, 2.0, 3.0 + 10.0 * r]);
        let largest = dist::reduce_scatter(&mixed, dist::ReduceOp::Max).unwrap();
        let odd = Tensor::zeros([3], (Kind::Double, Device::Cpu));
        let refused = dist::reduce_scatter(&odd, dist::ReduceOp::Sum).unwrap_err();
        let line = |t: &Tensor| Vec::<f64>::try_from(t).unwrap();
        let report = format!(
            "{:?}\n{:?}\n{refused}\n{:?}",
            line(&gathered),
            line(&summed),
            line(&largest)
        );
        std::fs::write(dir.join(format!("rank{rank}.txt")), report).unwrap();
        dist::shutdown();
        return;
    }
    let dir = fresh_dir("shards");
    let statuses = run_ranks(TEST, WORLD, &dir);
    assert!(statuses.iter().all(|s| s.success()), "{statuses:?}");
    let read = |rank: usize| std::fs::read_to_string(dir.join(format!("rank{rank}.txt"))).unwrap();
    let (zero, one) = (read(0), read(1));
    let zero: Vec<&str> = zero.lines().collect();
    let one: Vec<&str> = one.lines().collect();
    assert_eq!(zero[0], "[1.0, 1.0, 1.0, 2.0, 2.0, 2.0]");
    assert_eq!(one[0], zero[0]);
    // The sum is [10, 12, 14, 16]: rank 0 keeps [10, 12], rank 1 [14, 16].
    assert_eq!(zero[1], "[10.0, 12.0]");
    assert_eq!(one[1], "[14.0, 16.0]");
    assert!(zero[2].contains("pad it to a multiple"), "{}", zero[2]);
    assert_eq!(zero[3], "[4.0, 1.0]");
    assert_eq!(one[3], "[2.0, 13.0]");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn strided_tensors_and_gradients_only_some_ranks_have_are_reduced_right() {
    const TEST: &str = "strided_tensors_and_gradients_only_some_ranks_have_are_reduced_right";
    if let Some((rank, dir)) = as_rank() {
        join(rank, &dir, Duration::from_secs(60));
        let r = rank as f64;
        // A transposed (strided) tensor, reduced by its largest elements.
        let mut strided = (Tensor::arange(6, (Kind::Double, Device::Cpu)) * (r + 1.0))
            .reshape([2, 3])
            .tr();
        dist::all_reduce(&mut strided, dist::ReduceOp::Max).unwrap();
        // `a` is used on every rank, `b` only on rank 0, `c` on none.
        let vs = VarStore::new(Device::Cpu);
        let root = vs.root();
        let a = root.var("a", &[2], nn::Init::Const(1.0));
        let b = root.var("b", &[2], nn::Init::Const(1.0));
        let c = root.var("c", &[2], nn::Init::Const(1.0));
        let mut loss = (&a * (r + 1.0)).sum(Kind::Double);
        if rank == 0 {
            loss += (&b * 4.0).sum(Kind::Double);
        }
        loss.backward();
        dist::all_reduce_gradients(&vs).unwrap();
        let line = |t: &Tensor| Vec::<f64>::try_from(t.reshape([-1])).unwrap();
        let report = format!(
            "{:?}\n{:?}\n{:?}\n{}",
            line(&strided.contiguous()),
            line(&a.grad()),
            line(&b.grad()),
            c.grad().defined()
        );
        std::fs::write(dir.join(format!("rank{rank}.txt")), report).unwrap();
        dist::shutdown();
        return;
    }
    let dir = fresh_dir("strided");
    let statuses = run_ranks(TEST, WORLD, &dir);
    assert!(statuses.iter().all(|s| s.success()), "{statuses:?}");
    for rank in 0..WORLD {
        let report = std::fs::read_to_string(dir.join(format!("rank{rank}.txt"))).unwrap();
        let lines: Vec<&str> = report.lines().collect();
        // Rank 1's values (twice rank 0's) win the max, read in the transposed order.
        assert_eq!(lines[0], "[0.0, 6.0, 2.0, 8.0, 4.0, 10.0]", "rank {rank}");
        // a: the mean of 1 and 2; b: the mean of 4 and rank 1's zeros; c: still none.
        assert_eq!(lines[1], "[1.5, 1.5]", "rank {rank}");
        assert_eq!(lines[2], "[2.0, 2.0]", "rank {rank}");
        assert_eq!(lines[3], "false", "rank {rank}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_rank_that_stops_is_reported_by_the_others_instead_of_waited_for() {
    const TEST: &str = "a_rank_that_stops_is_reported_by_the_others_instead_of_waited_for";
    if let Some((rank, dir)) = as_rank() {
        // A timeout long enough that a loaded machine (a CI build beside it once took rank 0
        // over 4.5 s to see the exit) cannot pass the test by timing out instead.
        join(rank, &dir, Duration::from_secs(30));
        if rank == 1 {
            // A crash between joining and the first collective.
            std::process::exit(3);
        }
        report_failed_all_reduce(&dir);
        return;
    }
    let dir = fresh_dir("stop");
    let statuses = run_ranks(TEST, WORLD, &dir);
    assert_eq!(statuses[1].code(), Some(3));
    assert!(statuses[0].success(), "{statuses:?}");
    let (seconds, text) = failed_all_reduce(&dir);
    assert!(text.contains("Another rank may have stopped"), "{text}");
    // Well before the group's timeout (30 s): the closed connection says so.
    assert!(seconds < 20.0, "{seconds} s: {text}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_rank_that_never_arrives_times_the_collective_out() {
    const TEST: &str = "a_rank_that_never_arrives_times_the_collective_out";
    if let Some((rank, dir)) = as_rank() {
        join(rank, &dir, Duration::from_secs(3));
        if rank == 1 {
            // Alive, connected, and busy elsewhere for longer than the timeout.
            std::thread::sleep(Duration::from_secs(8));
            dist::shutdown();
            return;
        }
        report_failed_all_reduce(&dir);
        return;
    }
    let dir = fresh_dir("late");
    let statuses = run_ranks(TEST, WORLD, &dir);
    assert!(statuses[0].success(), "{statuses:?}");
    let (seconds, text) = failed_all_reduce(&dir);
    assert!(text.to_lowercase().contains("timed out"), "{text}");
    // The timeout (3 s), not the other rank's 8 s.
    assert!((2.5..7.5).contains(&seconds), "{seconds} s: {text}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_setups_are_explained() {
    if as_rank().is_some() {
        return;
    }
    let setup = Setup {
        rank: 2,
        world_size: 2,
        store: std::env::temp_dir().join("tchmem-dist-never"),
        timeout: Duration::from_secs(1),
    };
    let error = dist::init(&setup).unwrap_err().to_string();
    assert!(error.contains("rank 2 of 2"), "{error}");
    // Without a group, collectives have nothing to wait for.
    let mut tensor = Tensor::ones([3], (Kind::Float, Device::Cpu));
    dist::all_reduce(&mut tensor, dist::ReduceOp::Sum).unwrap();
    assert_eq!(tensor.sum(Kind::Float).double_value(&[]), 3.0);
    assert!(dist::barrier().is_ok());
}
