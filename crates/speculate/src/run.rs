//! One run of `speculate`: the prompt, the speculative generation (streamed), the plain one of
//! `--compare`, and the figures.

use std::io::{Read, Write};
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use spec_bench::draft_model::TargetText;
use speculative::decode::{
    Detokenizer, DraftLength, Generation, GenerationParams, Generator, SeedSource, StopConditions,
    TreeDrafts,
};
use speculative::{NoProposer, Proposer, SamplingConfig, TargetModel};
use speculative_candle::{ChatMessage, GgufTokenizer, default_model_path};
use speculative_guidance::{Grammar, GrammarMask, Vocabulary};

use crate::args::{Args, Backend, ProposerKind};
use crate::engines::{self, DynError, Engine};
use crate::proposers::{self, TargetSide};

/// The target's text as the loop's detokenizer (control tokens dropped).
pub(crate) struct TextDetokenizer(pub(crate) TargetText);

impl Detokenizer for TextDetokenizer {
    fn decode(&self, tokens: &[u32]) -> speculative::Result<String> {
        self.0
            .decode(tokens, true)
            .map_err(|e| speculative::Error::Model(Box::new(e)))
    }
}

/// The target's text side: the GGUF tokenizer of a byte-level BPE file, else (the llama
/// engine) llama.cpp's tokenizer and chat template.
pub(crate) fn target_text(a: &Args, path: &Path) -> Result<TargetText, DynError> {
    let backend = if a.backend == Backend::Llama {
        "llama"
    } else {
        "fast"
    };
    Ok(TargetText::load(path, backend)?)
}

/// Runs the command: loads the model, generates speculatively (and plainly with `--compare`)
/// and prints the text and the figures.
///
/// # Errors
/// An empty prompt, and any load, tokenizer, grammar, configuration or generation error.
pub fn run(a: &Args) -> Result<(), DynError> {
    let path = a.model.clone().unwrap_or_else(default_model_path);
    let text = read_prompt(a)?;
    if text.trim().is_empty() {
        return Err("the prompt is empty".into());
    }
    let t0 = Instant::now();
    let engine = engines::load(a, &path)?;
    let tok = target_text(a, &path)?;
    print_loaded(a, &path, t0);
    let prompt = tok.encode(&prompt_text(a, &tok, text)?)?;
    let mask = grammar_mask(a, tok.gguf(), prompt.len())?;
    let params = generation_params(a, &tok, mask.as_ref())?;
    let side = TargetSide {
        engine: &engine,
        vocab: engine.target.vocab_size(),
        path: &path,
        text: &tok,
    };
    let proposer = proposers::build(a, &side, mask.as_ref())?;
    let Engine { mut target, .. } = engine;
    eprintln!(
        "prompt: {} tokens; proposer {:?}, draft {:?}, temperature {}",
        prompt.len(),
        a.proposer(),
        params.draft(),
        a.temperature
    );
    let spec = speculative(a, &mut *target, proposer, &tok, &prompt, &params)?;
    println!();
    report("speculative", &spec);
    if a.compare {
        compare(a, &mut *target, &prompt, &params, &spec)?;
    }
    Ok(())
}

/// The prompt text: `--prompt-file`, `--prompt` or (`--prompt -` or no prompt option) standard
/// input.
fn read_prompt(a: &Args) -> Result<String, DynError> {
    if let Some(p) = &a.prompt_file {
        return Ok(std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?);
    }
    match a.prompt.as_deref() {
        Some("-") | None => {
            if a.prompt.is_none() {
                eprintln!("(reading the prompt from standard input; end with Ctrl-D)");
            }
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s)?;
            Ok(s)
        }
        Some(p) => Ok(p.to_string()),
    }
}

/// Prints which model and engine loaded, and how long it took since `t0`.
pub(crate) fn print_loaded(a: &Args, path: &Path, t0: Instant) {
    eprintln!(
        "loaded {} ({:?} backend, {} weights) in {:.2} s",
        std::fs::canonicalize(path)
            .unwrap_or_else(|_| path.to_path_buf())
            .display(),
        a.backend,
        if a.backend == Backend::Llama {
            "as stored".to_string()
        } else {
            format!("{:?}", a.format)
        },
        t0.elapsed().as_secs_f64()
    );
}

/// `text` in the model's chat template (with `--system` first), or as it is with `--raw`.
fn prompt_text(a: &Args, tok: &TargetText, text: String) -> Result<String, DynError> {
    if a.raw {
        return Ok(text);
    }
    let mut msgs = Vec::new();
    if let Some(s) = &a.system {
        msgs.push(ChatMessage::system(s.clone()));
    }
    msgs.push(ChatMessage::user(text));
    Ok(tok.chat(&msgs)?)
}

/// Structured output: the mask of `--json-schema` / `--grammar` over the tokenizer's
/// vocabulary (a byte-level BPE target's GGUF tokenizer `tok`), for a prompt of `prompt_len`
/// tokens; `None` without either option.
fn grammar_mask(
    a: &Args,
    tok: Option<&GgufTokenizer>,
    prompt_len: usize,
) -> Result<Option<Arc<GrammarMask>>, DynError> {
    let grammar = match (&a.json_schema, &a.grammar) {
        (Some(p), _) => Grammar::json_schema_str(&std::fs::read_to_string(p)?)?,
        (None, Some(p)) => Grammar::Lark(std::fs::read_to_string(p)?),
        (None, None) => return Ok(None),
    };
    let tok =
        tok.ok_or("--json-schema / --grammar need a target with a byte-level BPE tokenizer")?;
    let n = tok.vocab_size() as u32;
    let bytes = (0..n)
        .map(|i| tok.token_bytes(i).unwrap_or_default().to_vec())
        .collect();
    let special = (0..n).map(|i| tok.is_special(i)).collect();
    let vocab = Vocabulary::with_tokenizer(bytes, special, tok.eos_id(), tok.tokenizer().clone())?;
    Ok(Some(Arc::new(GrammarMask::new(
        &vocab, &grammar, prompt_len,
    )?)))
}

/// The generation parameters of the options (sampling under the grammar `mask`, EOS and the
/// stop strings, draft length, trees). Prints the seed when sampling.
pub(crate) fn generation_params(
    a: &Args,
    tok: &TargetText,
    mask: Option<&Arc<GrammarMask>>,
) -> Result<GenerationParams, DynError> {
    let mut sampling = SamplingConfig::builder()
        .temperature(a.temperature)
        .top_k(a.top_k)
        .top_p(a.top_p);
    if let Some(m) = mask {
        sampling = sampling.mask(m.clone());
    }
    let sampling = sampling.build()?;
    let draft = if a.proposer() == ProposerKind::None {
        DraftLength::Off
    } else {
        a.k.clone()
    };
    // One seed for both runs of --compare (the same seed gives the same tokens, C15).
    let seed = a.seed.unwrap_or_else(|| SeedSource::os().next_seed());
    if a.temperature > 0.0 {
        eprintln!("seed {seed}");
    }
    // The target's end-of-generation ids (Gemma 3: `<eos>` and `<end_of_turn>`).
    let stop = tok
        .eos_ids()
        .into_iter()
        .fold(StopConditions::default(), |s, t| s.with_eos(t));
    let stop = a
        .stop
        .iter()
        .fold(stop, |s, t| s.with_stop_string(t.as_str()));
    Ok(GenerationParams::builder()
        .sampling(sampling)
        .seed(seed)
        .max_new_tokens(a.max_tokens)
        .min_tokens(a.min_tokens)
        .stop(stop)
        .draft(draft)
        .tree(TreeDrafts::nodes(a.tree_nodes).with_branch(a.tree_branch))
        .build()?)
}

/// The speculative run: streams the text to standard output as it is verified (with `--quiet`
/// a progress bar counts the tokens and the text is printed at the end).
fn speculative(
    a: &Args,
    target: &mut dyn TargetModel,
    proposer: Box<dyn Proposer>,
    tok: &TargetText,
    prompt: &[u32],
    params: &GenerationParams,
) -> Result<Generation, DynError> {
    let mut g = Generator::new(target, proposer).with_detokenizer(TextDetokenizer(tok.clone()));
    let mut out = std::io::stdout();
    let bar = a.quiet.then(|| progress_bar(a.max_tokens));
    // The text arrives in whole characters; text that could still become a stop string is
    // held back until it cannot.
    let r = g.generate_stream(prompt, params, |chunk| {
        if let Some(b) = &bar {
            b.inc(chunk.tokens.len() as u64);
        }
        if !a.quiet {
            let _ = out.write_all(chunk.text.as_bytes());
            let _ = out.flush();
        }
        ControlFlow::Continue(())
    })?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if a.quiet {
        print!("{}", r.text.as_deref().unwrap_or_default());
    }
    println!();
    Ok(r)
}

/// A progress bar over `max_tokens` tokens.
fn progress_bar(max_tokens: usize) -> indicatif::ProgressBar {
    let b = indicatif::ProgressBar::new(max_tokens as u64);
    if let Ok(st) = indicatif::ProgressStyle::with_template(
        "{elapsed_precise} [{bar:40}] {pos}/{len} tokens {per_sec}",
    ) {
        b.set_style(st);
    }
    b
}

/// `--compare`: decodes `prompt` plainly on `target` with the same parameters (and seed) and
/// prints its figures, the speed-up of `spec` and, for greedy runs, whether the outputs are
/// identical.
fn compare(
    a: &Args,
    target: &mut dyn TargetModel,
    prompt: &[u32],
    params: &GenerationParams,
    spec: &Generation,
) -> Result<(), DynError> {
    let plain_params = params.clone().with_draft(DraftLength::Off);
    let mut g = Generator::new(target, NoProposer);
    let plain = g.generate(prompt, &plain_params)?;
    report("plain", &plain);
    let s = spec.metrics.decode_tokens_per_second();
    let p = plain.metrics.decode_tokens_per_second();
    println!(
        "speed-up (decode tokens/s, prefill excluded): {:.2}x  ({s:.1} vs {p:.1} tokens/s)",
        if p > 0.0 { s / p } else { 0.0 }
    );
    if a.temperature != 0.0 {
        println!(
            "(sampled runs: outputs differ from plain sampling token by token but follow the same distribution)"
        );
    } else {
        println!(
            "greedy outputs identical: {}",
            if spec.tokens == plain.tokens {
                "yes"
            } else {
                "NO"
            }
        );
    }
    Ok(())
}

/// Prints the figures of the run `name`: time and speed, tree shape, acceptance.
fn report(name: &str, g: &Generation) {
    let m = &g.metrics;
    println!(
        "[{name}] {} tokens ({}) in {:.2} s: {:.1} tokens/s end to end, {:.1} decode tokens/s; \
         prefill {:.0} ms, propose {:.0} ms, target forwards {:.0} ms, sampling/verification {:.0} ms",
        g.tokens.len(),
        g.finish,
        m.total_time.as_secs_f64(),
        m.tokens_per_second(),
        m.decode_tokens_per_second(),
        m.prefill_time.as_secs_f64() * 1e3,
        m.propose_time.as_secs_f64() * 1e3,
        m.forward_time.as_secs_f64() * 1e3,
        m.verify_time.as_secs_f64() * 1e3,
    );
    if m.tree_steps > 0 {
        println!(
            "[{name}] {} tree steps: {:.1} nodes and depth {:.1} per tree on average",
            m.tree_steps,
            m.mean_tree_nodes(),
            m.mean_tree_depth()
        );
    }
    if m.proposed > 0 {
        let per: Vec<String> = m
            .position_acceptance()
            .iter()
            .map(|a| format!("{a:.2}"))
            .collect();
        println!(
            "[{name}] acceptance rate {:.3} ({} of {} drafts), mean accepted length {:.2} tokens per target call ({} calls), acceptance by draft position given the earlier ones were accepted [{}]",
            m.acceptance_rate(),
            m.accepted,
            m.proposed,
            m.mean_accepted_length(),
            m.target_calls,
            per.join(", ")
        );
    }
}
