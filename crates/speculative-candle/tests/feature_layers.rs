//! Multi-layer features of the fast forward (`FastTarget::with_feature_layout`): the rows equal
//! a fresh full forward's layer states bit for bit, call by call (prefill, chains, rejected
//! tokens and truncation, trees and their commit), and through the decoding loop the rows the
//! proposer receives are the fresh forward's rows of its context, across chain, tree and
//! k = 0 steps with rollbacks. Tiny random weights (cheap) and one real-model check.

mod common;

use std::sync::{Arc, Mutex};

use common::{chat, fast_weights};
use speculative::conformance::{self, KitConfig};
use speculative::decode::{GenerationParams, Generator, TreeDrafts};
use speculative::{
    Draft, DraftBlock, FeatureLayer, FeatureLayout, ProposeRequest, Proposer, TargetModel,
    check_feature_layouts,
};
use speculative_candle::fast::RandomSpec;
use speculative_candle::fast::head::{DraftHead, DraftHeadWeights};
use speculative_candle::{FastFormat, FastTarget, FastWeights, default_head_path};

fn tiny() -> Arc<FastWeights> {
    FastWeights::random(&RandomSpec::default(), FastFormat::Q8).unwrap()
}

/// Every state of the tiny 2-layer model, out of order on purpose.
fn all_layers(h: usize) -> FeatureLayout {
    use FeatureLayer::*;
    FeatureLayout::new(vec![Residual(2), Final, Residual(0), Residual(1)], h).unwrap()
}

fn rows(t: &FastTarget) -> Vec<f32> {
    t.hidden_states().unwrap().last_hidden().unwrap().to_vec()
}

/// The rows of a fresh forward of `tokens`.
fn fresh(w: &Arc<FastWeights>, layout: &FeatureLayout, tokens: &[u32]) -> Vec<f32> {
    let mut t = FastTarget::new(w.clone())
        .with_feature_layout(layout.clone())
        .unwrap();
    t.forward(tokens, &mut Vec::new()).unwrap();
    rows(&t)
}

#[test]
fn layout_is_reported_and_blocks_are_the_layer_states() {
    let w = tiny();
    let h = w.config().hidden_size;
    let layout = all_layers(h);
    let toks = [5u32, 9, 200, 17, 4, 4, 31];
    let mut t = FastTarget::new(w.clone())
        .with_feature_layout(layout.clone())
        .unwrap();
    let hs = t.hidden_states().unwrap();
    assert_eq!(
        (hs.hidden_size(), hs.feature_layout()),
        (4 * h, layout.clone())
    );
    t.forward(&toks, &mut Vec::new()).unwrap();
    let got = rows(&t);
    let block = |j: usize| -> Vec<f32> {
        let r = layout.block(j).unwrap();
        got.chunks_exact(4 * h)
            .flat_map(|row| row[r.clone()].to_vec())
            .collect()
    };
    // Final: the default hand-over's rows, bit for bit.
    let mut plain = FastTarget::new(w.clone());
    plain.forward(&toks, &mut Vec::new()).unwrap();
    assert_eq!(block(1), rows(&plain));
    assert_eq!(
        plain.hidden_states().unwrap().feature_layout(),
        FeatureLayout::final_only(h)
    );
    // Residual(1): the end of the stack of a 1-layer model over the same weights.
    let one = FeatureLayout::new(vec![FeatureLayer::Residual(1)], h).unwrap();
    let mut early = FastTarget::early_exit(w.clone(), 1)
        .unwrap()
        .with_feature_layout(one)
        .unwrap();
    early.forward(&toks, &mut Vec::new()).unwrap();
    assert_eq!(block(3), rows(&early));
    assert_ne!(block(3), block(0), "layers differ");
    assert_ne!(block(2), block(3));
}

#[test]
fn bad_layouts_are_refused() {
    let w = tiny();
    let h = w.config().hidden_size;
    let past = FeatureLayout::new(vec![FeatureLayer::Residual(3)], h).unwrap();
    assert!(
        FastTarget::new(w.clone())
            .with_feature_layout(past)
            .is_err()
    );
    let narrow = FeatureLayout::final_only(h - 1);
    assert!(
        FastTarget::new(w.clone())
            .with_feature_layout(narrow)
            .is_err()
    );
    let deep = FeatureLayout::new(vec![FeatureLayer::Residual(2)], h).unwrap();
    let early = FastTarget::early_exit(w, 1).unwrap();
    assert!(
        early.with_feature_layout(deep).is_err(),
        "past the early exit"
    );
}

#[test]
fn incremental_rows_equal_a_fresh_forward() {
    let w = tiny();
    let h = w.config().hidden_size;
    let layout = all_layers(h);
    let rw = layout.row_width();
    let toks: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % 301).collect();
    let full = fresh(&w, &layout, &toks);
    let want = |a: usize, b: usize| full[a * rw..b * rw].to_vec();
    let mut t = FastTarget::new(w.clone())
        .with_feature_layout(layout.clone())
        .unwrap();
    let mut logits = Vec::new();
    t.prefill(&toks[..9]).unwrap();
    assert_eq!(rows(&t), want(0, 9), "prefill");
    t.forward(&toks[9..12], &mut logits).unwrap();
    assert_eq!(rows(&t), want(9, 12), "chain");
    // Rejected drafts, rolled back: the next rows are the fresh forward's.
    t.forward(&[1, 2, 3], &mut logits).unwrap();
    t.truncate(12).unwrap();
    t.forward(&toks[12..13], &mut logits).unwrap();
    assert_eq!(rows(&t), want(12, 13), "k = 0 step after a rollback");
    // A tree at root toks[13]: node 0 and its child node 2 are the true path, node 1 a sibling.
    let nodes = [toks[14], 7, toks[15]];
    let block = DraftBlock::tree(&nodes, &[0, 0, 1]);
    let tree = t.tree().unwrap();
    tree.forward_tree(toks[13], &block, &mut logits).unwrap();
    let got = rows(&t);
    assert_eq!(got.len(), 4 * rw);
    assert_eq!(got[..rw], want(13, 14)[..], "root");
    assert_eq!(got[rw..2 * rw], want(14, 15)[..], "node on the path");
    assert_eq!(got[3 * rw..], want(15, 16)[..], "its child");
    t.tree().unwrap().commit_tree(&[0, 2]).unwrap();
    t.forward(&toks[16..], &mut logits).unwrap();
    assert_eq!(rows(&t), want(16, 24), "after the commit");
}

/// Records, at every proposal, whether the rows it got are the fresh forward's rows of its
/// context but the last token; drafts chains of mixed quality, empty drafts and trees.
struct Checker {
    w: Arc<FastWeights>,
    layout: FeatureLayout,
    calls: Arc<Mutex<Vec<bool>>>,
}

impl Checker {
    fn check(&self, req: &ProposeRequest<'_>) {
        let ctx = req.context;
        let ok = match req.target_hidden_rows {
            Some(r) => r == fresh(&self.w, &self.layout, &ctx[..ctx.len() - 1]).as_slice(),
            None => false,
        };
        self.calls.lock().unwrap().push(ok);
    }
}

impl Proposer for Checker {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> speculative::Result<()> {
        self.check(req);
        draft.clear();
        let n = self.calls.lock().unwrap().len();
        let last = *req.context.last().unwrap();
        // Every third step k = 0; else the last token repeated (mostly rejected: a rollback).
        if !n.is_multiple_of(3) {
            draft
                .tokens
                .extend(std::iter::repeat_n(last, req.max_draft.min(3)));
        }
        Ok(())
    }

    fn propose_tree(
        &mut self,
        req: &ProposeRequest<'_>,
        draft: &mut Draft,
    ) -> speculative::Result<()> {
        self.check(req);
        draft.clear();
        let n = self.calls.lock().unwrap().len();
        let last = *req.context.last().unwrap();
        if n.is_multiple_of(3) || req.max_draft == 0 || req.max_nodes == 0 {
            return Ok(()); // a k = 0 step
        }
        if req.max_draft >= 2 && req.max_nodes >= 3 && req.max_branch >= 2 {
            draft.tokens.extend([last, (last + 1) % 301, last]);
            draft.parents.extend([0, 0, 1]);
        } else {
            draft.tokens.push(last);
            draft.parents.push(0);
        }
        Ok(())
    }
}

fn run_loop(tree: bool) {
    let w = tiny();
    let layout = all_layers(w.config().hidden_size);
    let calls = Arc::new(Mutex::new(Vec::new()));
    let target = FastTarget::new(w.clone())
        .with_feature_layout(layout.clone())
        .unwrap();
    let checker = Checker {
        w,
        layout,
        calls: calls.clone(),
    };
    let mut g = Generator::new(target, checker);
    let mut params = GenerationParams::greedy(24);
    if tree {
        params = GenerationParams::builder()
            .max_new_tokens(24)
            .tree(TreeDrafts::nodes(3))
            .build()
            .unwrap();
    }
    let out = g.generate(&[3, 1, 4, 1, 5, 9, 2, 6], &params).unwrap();
    assert_eq!(out.tokens.len(), 24);
    // The next turn reuses the cached prefix (its rows are kept, not recomputed).
    let mut next = vec![3, 1, 4, 1, 5, 9, 2, 6];
    next.extend(&out.tokens);
    next.extend([8, 8, 7]);
    g.generate(&next, &params).unwrap();
    let calls = calls.lock().unwrap();
    assert!(calls.len() >= 8, "{} proposals", calls.len());
    assert!(calls.iter().all(|&ok| ok), "rows per proposal: {calls:?}");
}

#[test]
fn the_loop_hands_the_proposer_the_rows_of_its_context_with_chains() {
    run_loop(false);
}

#[test]
fn the_loop_hands_the_proposer_the_rows_of_its_context_with_trees() {
    run_loop(true);
}

/// The kit's HiddenStates family (layout, shape, rows per position, rollback) on the real
/// model with EAGLE-3's default layers.
#[test]
fn conformance_on_the_real_model_with_eagle3_layers() {
    let w = fast_weights();
    let c = w.config();
    let layout = FeatureLayout::eagle3(c.n_layers, c.hidden_size).unwrap();
    let make = || {
        FastTarget::new(w.clone())
            .with_feature_layout(layout.clone())
            .unwrap()
    };
    let prompts = vec![chat("Name a river."), vec![1, 2, 3]];
    let cfg = KitConfig::builder().samples(50).build().unwrap();
    conformance::check_hidden(make, &prompts, &cfg).assert_passed();
    // The shipped EAGLE head reads the final hidden state: it pairs with the default target
    // only.
    let mut head = DraftHead::new(DraftHeadWeights::load(default_head_path(), w.clone()).unwrap());
    let plain = FastTarget::new(w.clone());
    let eagle3 = make();
    let feats = head.target_features().unwrap();
    assert!(check_feature_layouts(plain.hidden_states().unwrap(), &*feats).is_ok());
    assert!(check_feature_layouts(eagle3.hidden_states().unwrap(), &*feats).is_err());
}
