//! Cost of a token-tree forward of the fast Q8 target (`FastTarget` as a
//! `speculative::TreeTarget`) against a chain forward of the same number of rows and against a
//! one-token forward.
//!
//! After a prefix of `--prefix` tokens, for each node count `n` of `--nodes`: a chain forward of
//! `n + 1` tokens (the root and a chain of `n` drafts, what a chain verify step runs), and tree
//! forwards of the root and `n` nodes in four shapes: `chain` (a tree whose every node is the
//! child of the one before: the same rows as the chain, through the tree code), `binary` (a
//! binary tree in breadth-first order, depth about `log2 n`), `wide` (every node a child of the
//! root, depth 1) and `mixed` (each node's parent drawn uniformly from the earlier rows, fixed
//! seed). The measurements are interleaved round-robin (one run of every configuration, then
//! the next round), each followed by a truncation back to the prefix, so that load from other
//! processes spreads over all of them; the table gives the median of `--runs` rounds (after one
//! warm-up round; `--stat min` gives the fastest round instead). `commit` is the time of `commit_tree` of the deepest path of the `mixed`
//! tree that is not the one the forward leaves in the cache (a worst case: every kept entry is
//! copied).
//!
//! ```text
//! scripts/fetch-model.sh
//! RAYON_NUM_THREADS=1 cargo run --release -p speculative-candle --example fast_tree_cost
//! ```

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use speculative::{DraftBlock, TargetModel, TreeTarget};
use speculative_candle::{FastFormat, FastTarget, GgufTokenizer, KernelPath, default_model_path};

#[derive(Parser, Debug)]
#[command(about = "Cost of a tree forward of the fast Q8 target against a chain of as many rows")]
struct Args {
    /// GGUF model file (default: models/SmolLM2-135M-Instruct.Q4_1.gguf or $SPECULATIVE_MODEL).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prefix length in tokens before the measured forwards.
    #[arg(long, default_value_t = 100)]
    prefix: usize,
    /// Timed rounds (median reported).
    #[arg(long, default_value_t = 15)]
    runs: usize,
    /// Node counts `n` (the tree has `n + 1` rows with its root), comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [8, 16, 32])]
    nodes: Vec<usize>,
    /// Threads of the fast forward.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Statistic over the rounds: `median` (default) or `min` (less sensitive to other load).
    #[arg(long, default_value = "median")]
    stat: String,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn minimum(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

/// What one configuration runs after the prefix.
enum Job {
    /// A forward of these tokens.
    Chain(Vec<u32>),
    /// A tree forward: root, node tokens, parent rows.
    Tree(u32, Vec<u32>, Vec<u32>),
    /// A tree forward (not timed), then the timed commit of a path.
    Commit(u32, Vec<u32>, Vec<u32>, Vec<u32>),
}

/// Parent rows of `n` nodes in a shape (module docs).
fn parents(shape: &str, n: usize, seed: &mut u64) -> Vec<u32> {
    (0..n)
        .map(|i| match shape {
            "chain" => i as u32,
            "binary" => (i / 2) as u32,
            "wide" => 0,
            _ => {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 33) % (i as u64 + 1)) as u32
            }
        })
        .collect()
}

/// The deepest path of `parents` that does not end at the last row of the preorder (the path
/// the forward leaves in the cache), so that every kept entry is copied.
fn deep_path(tokens: &[u32], parents: &[u32]) -> Vec<u32> {
    let block = DraftBlock::tree(tokens, parents);
    let mut depths = Vec::new();
    block.depths(&mut depths);
    // The last row of the preorder: descend through the last child.
    let mut last = None;
    let mut row = 0;
    while let Some(j) = block.children(row).last() {
        last = Some(j);
        row = j + 1;
    }
    let node = (0..tokens.len())
        .filter(|&i| Some(i) != last)
        .max_by_key(|&i| (depths[i], std::cmp::Reverse(i)))
        .unwrap_or(0);
    let mut path = Vec::new();
    block.path_to(node, &mut path);
    path
}

fn run_once(m: &mut FastTarget, job: &Job, p: usize, logits: &mut Vec<f32>) -> f64 {
    let t = match job {
        Job::Chain(tokens) => {
            let s = Instant::now();
            m.forward(tokens, logits).expect("chain forward");
            s.elapsed()
        }
        Job::Tree(root, tokens, parents) => {
            let block = DraftBlock::tree(tokens, parents);
            let s = Instant::now();
            m.forward_tree(*root, &block, logits).expect("tree forward");
            s.elapsed()
        }
        Job::Commit(root, tokens, parents, path) => {
            let block = DraftBlock::tree(tokens, parents);
            m.forward_tree(*root, &block, logits).expect("tree forward");
            let s = Instant::now();
            m.commit_tree(path).expect("commit");
            s.elapsed()
        }
    };
    m.truncate(p).expect("truncate");
    t.as_secs_f64() * 1e3
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let path = args.model.clone().unwrap_or_else(default_model_path);
    let tok = GgufTokenizer::load(&path)?;
    let text = "The history of lighthouses is long. Keepers lived on remote rocks, trimmed the \
                wicks, wound the clockwork and logged the weather every four hours. In 1850 a \
                keeper earned about 50 pounds a year; storms cut them off for weeks at a time. ";
    let max_n = args.nodes.iter().copied().max().unwrap_or(1);
    let mut tokens = Vec::new();
    while tokens.len() < args.prefix + max_n + 1 {
        tokens.extend(tok.encode(text)?);
    }
    let (prefix, new) = tokens.split_at(args.prefix);
    let mut m = FastTarget::load(&path, FastFormat::Q8)?.with_threads(args.threads);
    m.forward(prefix, &mut Vec::new())?;
    let p = m.seq_len();

    let shapes = ["chain", "binary", "wide", "mixed"];
    let mut seed = 42u64;
    let mut jobs = vec![("1 token".to_string(), Job::Chain(vec![new[0]]))];
    for &n in &args.nodes {
        let (root, nodes) = (new[0], new[1..=n].to_vec());
        jobs.push((
            format!("{n}: chain forward"),
            Job::Chain(new[..=n].to_vec()),
        ));
        for shape in shapes {
            let par = parents(shape, n, &mut seed);
            jobs.push((
                format!("{n}: tree {shape}"),
                Job::Tree(root, nodes.clone(), par.clone()),
            ));
            if shape == "mixed" {
                let path = deep_path(&nodes, &par);
                jobs.push((
                    format!("{n}: commit (mixed, depth {})", path.len()),
                    Job::Commit(root, nodes.clone(), par, path),
                ));
            }
        }
    }
    let mut times = vec![Vec::with_capacity(args.runs); jobs.len()];
    let mut logits = Vec::new();
    for round in 0..=args.runs {
        for (i, (_, job)) in jobs.iter().enumerate() {
            let ms = run_once(&mut m, job, p, &mut logits);
            if round > 0 {
                times[i].push(ms);
            }
        }
    }
    let stat: fn(Vec<f64>) -> f64 = if args.stat == "min" { minimum } else { median };
    let med: Vec<f64> = times.into_iter().map(stat).collect();
    println!(
        "model {}; prefix {} tokens; {} of {} rounds; fast Q8 ({:?}), {} thread(s)",
        path.display(),
        args.prefix,
        if args.stat == "min" { "min" } else { "median" },
        args.runs,
        KernelPath::detect(),
        args.threads
    );
    println!("| forward | ms | / 1 token | / chain of n + 1 |");
    println!("|---|---|---|---|");
    let one = med[0];
    let mut chain = one;
    for ((name, job), &ms) in jobs.iter().zip(&med) {
        if matches!(job, Job::Chain(_)) {
            chain = ms;
        }
        if matches!(job, Job::Commit(..)) {
            println!("| {name} | {ms:.3} | {:.3} | {:.3} |", ms / one, ms / chain);
        } else {
            println!("| {name} | {ms:.2} | {:.2} | {:.2} |", ms / one, ms / chain);
        }
    }
    Ok(())
}
