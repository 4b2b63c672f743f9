// Speculative verification on the GPU (WGSL). One workgroup of 256 invocations per verify row.
//
// A row is one target row `i` (0..=k) of one sequence. Every row is processed independently and
// writes what the sequence would emit if verification stopped there: the acceptance flag of
// draft i (i < k), the correction token (residual sample, the position's draw for a point-mass
// draft, or the argmax in greedy mode) or the bonus token (i == k), their log-probabilities and
// the top-n list. The host walks the rows of a sequence and stops at the first rejection, exactly
// as the CPU verifier does. Every row also reports a NaN / +inf in its raw logits (validation:
// the CPU rejects such a sequence whichever rows the step reaches).
//
// Acceptance: a point-mass draft (no q) is accepted iff it equals the token drawn from the
// processed row with the SAMPLE-lane uniform of its position (inverse CDF in id order), which is
// then also the emitted token on rejection (reproducible seeds, case C15); a dense-q draft is
// accepted iff u_ACCEPT < min(1, p(x) / q(x)), else the residual is sampled with u_SAMPLE.
//
// Processing order per row (same as the CPU): penalties -> logit bias -> masks (done once into
// `scratch` when a sequence uses any of them) -> temperature -> top-k -> softmax -> top-p ->
// min-p -> renormalise. Top-k and top-p never sort: the threshold key (the float bit pattern
// made order-preserving) is found by a multi-pivot bisection whose passes count or sum the
// weight at or above 8 pivots; ties at the threshold key go to the lowest ids through an
// id-ordered chunked prefix scan. Random draws are Philox4x32-10 keyed by (seed, position, lane),
// bit-identical to `speculative::rng::Stream::uniform`.

struct Globals {
    vocab: u32,
    qv: u32,
    n_rows: u32,
    row_base: u32,
    patch_base: u32,
    draft_base: u32,
    mask_base: u32,
    mask_words: u32,
    max_top: u32,
    tops_base: u32,
    logits_offset: u32,
    q_dense: u32,
    rows_per_y: u32,
    // 0: verify rows; 1: draft pass (process draft-logit rows into dense q, written at
    // tops_base + logits row * vocab).
    mode: u32,
    // Offset of the dense q rows in qbuf (elements).
    q_offset: u32,
    // Unused (0). The caller's q rows are checked on the host.
    reserved: u32,
}

@group(0) @binding(0) var<uniform> g: Globals;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> qbuf: array<f32>;
@group(0) @binding(3) var<storage, read> params: array<u32>;
@group(0) @binding(4) var<storage, read_write> scratch: array<f32>;
@group(0) @binding(5) var<storage, read_write> outbuf: array<u32>;

const WG: u32 = 256u;
const NP: u32 = 8u;
const NONE: u32 = 0xffffffffu;
const NEG_INF_BITS: u32 = 0xff800000u;

// Sequence record (16 words).
const S_TEMP: u32 = 0u;
const S_TOPK: u32 = 1u;
const S_TOPP: u32 = 2u;
const S_MINP: u32 = 3u;
const S_REP: u32 = 4u;
const S_FREQ: u32 = 5u;
const S_PRES: u32 = 6u;
const S_FLAGS: u32 = 7u;
const S_SEED_LO: u32 = 8u;
const S_SEED_HI: u32 = 9u;
const S_PATCH_OFF: u32 = 10u;
const S_PATCH_LEN: u32 = 11u;
const S_DRAFT_OFF: u32 = 12u;
const S_K: u32 = 13u;
const S_NTOP: u32 = 14u;
const S_QROW0: u32 = 15u;
const F_GREEDY: u32 = 1u;
const F_PENALTIES: u32 = 2u;
// Patch flags.
const P_BIAS: u32 = 1u;
const P_SEEN: u32 = 2u;

// Random stream lanes (`speculative::rng::lane`).
const LANE_ACCEPT: u32 = 0u;
const LANE_SAMPLE: u32 = 1u;

// Status codes written to the row output (`ST_*` in src/gpu/pack.rs).
const ST_OK: u32 = 0u;
// NaN / +inf in the processed row (penalties or bias overflowed).
const ST_NON_FINITE: u32 = 1u;
const ST_NO_TOKEN: u32 = 2u;
// NaN / +inf in the raw row.
const ST_RAW_NON_FINITE: u32 = 3u;
// Draft pass: the draft token has probability 0 under its processed row (greedy: not the argmax).
const ST_DRAFT_ZERO: u32 = 4u;

// Weight modes of the threshold searches and scans.
const M_TOPK: u32 = 0u;
const M_TOPP: u32 = 1u;
const M_SAMPLE: u32 = 2u;
const M_RESID: u32 = 3u;

var<workgroup> sh_f: array<f32, 2048>;
var<workgroup> sh_u: array<u32, 256>;
var<workgroup> sh_v: array<u32, 256>;
var<workgroup> wb_u: u32;
var<workgroup> wb_f: f32;
var<workgroup> sh_atom: atomic<u32>;
var<workgroup> sh_atom2: atomic<u32>;

// Per-invocation copies of the row state (identical in every invocation of a workgroup).
var<private> tid: u32;
var<private> r_seq: u32;
var<private> r_i: u32;
var<private> r_lrow: u32;
var<private> r_draft: u32;
var<private> r_pos_lo: u32;
var<private> r_pos_hi: u32;
var<private> r_mask: u32;
var<private> r_slot: u32;
var<private> sb: u32;
var<private> s_m: f32;
var<private> s_inv_t: f32;
var<private> s_topk: bool;
var<private> s_tk: u32;
var<private> s_cutk: u32;
var<private> s_topp: bool;
var<private> s_tp: u32;
var<private> s_cutp: u32;
var<private> s_minp: f32;
var<private> s_total: f32;
var<private> s_qrow: u32;

fn seqw(f: u32) -> u32 {
    return params[sb + f];
}

fn seqf(f: u32) -> f32 {
    return bitcast<f32>(params[sb + f]);
}

fn neg_inf() -> f32 {
    return bitcast<f32>(NEG_INF_BITS);
}

// Order-preserving key of a float (larger float, larger key; -0 and +0 equal).
fn okey(x: f32) -> u32 {
    var b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) == 0u) {
        b = 0u;
    }
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

fn is_fin(x: f32) -> bool {
    return bitcast<u32>(x) != NEG_INF_BITS;
}

fn is_bad(x: f32) -> bool {
    let b = bitcast<u32>(x) & 0x7fffffffu;
    return b > 0x7f800000u || bitcast<u32>(x) == 0x7f800000u;
}

fn ld(t: u32) -> f32 {
    if (r_slot != NONE) {
        return scratch[r_slot * g.vocab + t];
    }
    return logits[g.logits_offset + r_lrow * g.vocab + t];
}

fn qv_at(t: u32) -> f32 {
    if (g.q_dense == 0u) {
        return select(0.0, 1.0, t == r_draft);
    }
    if (t < g.qv) {
        return qbuf[g.q_offset + s_qrow * g.qv + t];
    }
    return 0.0;
}

// ---- Philox4x32-10 -------------------------------------------------------------------------

fn mulhilo(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let p11 = a1 * b1;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    let hi = p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
    return vec2<u32>(hi, a * b);
}

fn uniform01(pos_lo: u32, pos_hi: u32, lane: u32) -> f32 {
    var c0 = pos_lo;
    var c1 = pos_hi;
    var c2 = lane;
    var c3 = 0u;
    var k0 = seqw(S_SEED_LO);
    var k1 = seqw(S_SEED_HI);
    for (var round = 0u; round < 10u; round++) {
        if (round > 0u) {
            k0 = k0 + 0x9E3779B9u;
            k1 = k1 + 0xBB67AE85u;
        }
        let m0 = mulhilo(0xD2511F53u, c0);
        let m1 = mulhilo(0xCD9E8D57u, c2);
        let n0 = m1.x ^ c1 ^ k0;
        let n2 = m0.x ^ c3 ^ k1;
        c0 = n0;
        c1 = m1.y;
        c2 = n2;
        c3 = m0.y;
    }
    return f32(c0 >> 8u) * (1.0 / 16777216.0);
}

// ---- workgroup reductions (fixed tree order: deterministic) ---------------------------------

fn bcast_u(v: u32) -> u32 {
    if (tid == 0u) {
        wb_u = v;
    }
    return workgroupUniformLoad(&wb_u);
}

fn bcast_f(v: f32) -> f32 {
    if (tid == 0u) {
        wb_f = v;
    }
    return workgroupUniformLoad(&wb_f);
}

fn reduce_sum(v: f32) -> f32 {
    sh_f[tid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            sh_f[tid] = sh_f[tid] + sh_f[tid + s];
        }
        workgroupBarrier();
    }
    return bcast_f(sh_f[0]);
}

fn reduce_max(v: f32) -> f32 {
    sh_f[tid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            sh_f[tid] = max(sh_f[tid], sh_f[tid + s]);
        }
        workgroupBarrier();
    }
    return bcast_f(sh_f[0]);
}

fn reduce_min_u(v: u32) -> u32 {
    sh_u[tid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            sh_u[tid] = min(sh_u[tid], sh_u[tid + s]);
        }
        workgroupBarrier();
    }
    return bcast_u(sh_u[0]);
}

fn reduce_add_u(v: u32) -> u32 {
    sh_u[tid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            sh_u[tid] = sh_u[tid] + sh_u[tid + s];
        }
        workgroupBarrier();
    }
    return bcast_u(sh_u[0]);
}

// Lexicographic best of (key, id): larger key first, then lower id. Returns the id (NONE if no
// invocation had a candidate) and leaves the key in sh_u[0].
fn reduce_best(key: u32, id: u32) -> u32 {
    sh_u[tid] = key;
    sh_v[tid] = id;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            let ka = sh_u[tid];
            let kb = sh_u[tid + s];
            let ia = sh_v[tid];
            let ib = sh_v[tid + s];
            if (ib != NONE && (ia == NONE || kb > ka || (kb == ka && ib < ia))) {
                sh_u[tid] = kb;
                sh_v[tid] = ib;
            }
        }
        workgroupBarrier();
    }
    return bcast_u(sh_v[0]);
}

// ---- per-element quantities ----------------------------------------------------------------

fn zval(x: f32) -> f32 {
    let d = x - s_m;
    if (d == 0.0) {
        return 0.0;
    }
    return d * s_inv_t;
}

fn pexp(z: f32) -> f32 {
    if (!is_fin(z)) {
        return 0.0;
    }
    return exp(z);
}

fn elig_k(t: u32, x: f32) -> bool {
    if (!is_fin(x)) {
        return false;
    }
    if (!s_topk) {
        return true;
    }
    let k = okey(x);
    return k > s_tk || (k == s_tk && t <= s_cutk);
}

fn kept(t: u32, x: f32, z: f32, p: f32) -> bool {
    if (!elig_k(t, x)) {
        return false;
    }
    if (s_topp) {
        let k = okey(z);
        if (!(k > s_tp || (k == s_tp && t <= s_cutp))) {
            return false;
        }
    }
    return p >= s_minp && p > 0.0;
}

// Normalised probability of token t under the processed row (0 outside the support).
fn prob(t: u32) -> f32 {
    let x = ld(t);
    if (!is_fin(x)) {
        return 0.0;
    }
    let z = zval(x);
    let p = pexp(z);
    if (!kept(t, x, z, p)) {
        return 0.0;
    }
    return p / s_total;
}

// Key and weight of element t for a search mode.
fn key_w(mode: u32, t: u32) -> vec2<f32> {
    let x = ld(t);
    if (mode == M_TOPK) {
        return vec2<f32>(bitcast<f32>(okey(x)), select(0.0, 1.0, is_fin(x)));
    }
    // M_TOPP
    if (!elig_k(t, x)) {
        return vec2<f32>(bitcast<f32>(0u), 0.0);
    }
    let z = zval(x);
    return vec2<f32>(bitcast<f32>(okey(z)), pexp(z));
}

fn scan_w(mode: u32, t: u32, tie_key: u32) -> f32 {
    if (mode == M_SAMPLE) {
        return prob(t);
    }
    if (mode == M_RESID) {
        return max(prob(t) - qv_at(t), 0.0);
    }
    let kw = key_w(mode, t);
    if (bitcast<u32>(kw.x) != tie_key) {
        return 0.0;
    }
    return kw.y;
}

// Sum of the weights with key >= piv[j] for 8 pivots at once; results in sh_f[j * WG].
fn pivot_sums(mode: u32, piv: array<u32, 8>) {
    var part: array<f32, 8>;
    for (var j = 0u; j < NP; j++) {
        part[j] = 0.0;
    }
    for (var t = tid; t < g.vocab; t += WG) {
        let kw = key_w(mode, t);
        let k = bitcast<u32>(kw.x);
        for (var j = 0u; j < NP; j++) {
            if (k >= piv[j]) {
                part[j] = part[j] + kw.y;
            }
        }
    }
    for (var j = 0u; j < NP; j++) {
        sh_f[j * WG + tid] = part[j];
    }
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            for (var j = 0u; j < NP; j++) {
                sh_f[j * WG + tid] = sh_f[j * WG + tid] + sh_f[j * WG + tid + s];
            }
        }
        workgroupBarrier();
    }
}

// Largest key T with S(T) >= W, where S(T) is the weight at or above T and W = target (when
// frac < 0) or frac * S(0). Returns (T, S(T + 1)) with S(T + 1) < W.
fn select_threshold(mode: u32, want: f32, frac: f32) -> vec2<u32> {
    var piv: array<u32, 8>;
    for (var j = 0u; j < NP; j++) {
        piv[j] = 0u;
    }
    pivot_sums(mode, piv);
    let total = bcast_f(sh_f[0]);
    var w = want;
    if (frac >= 0.0) {
        w = frac * total;
    }
    var lo = 0u;
    var hi = NONE;
    var s_hi = 0.0;
    for (var it = 0u; it < 40u; it++) {
        if (hi - lo <= 1u) {
            break;
        }
        let step = max((hi - lo) / (NP + 1u), 1u);
        for (var j = 0u; j < NP; j++) {
            piv[j] = min(lo + step * (j + 1u), hi - 1u);
        }
        pivot_sums(mode, piv);
        var nlo = lo;
        var nhi = hi;
        var nshi = s_hi;
        for (var j = 0u; j < NP; j++) {
            let s = sh_f[j * WG];
            if (s >= w) {
                nlo = max(nlo, piv[j]);
            } else if (piv[j] < nhi) {
                nhi = piv[j];
                nshi = s;
            }
        }
        lo = bcast_u(nlo);
        hi = bcast_u(nhi);
        s_hi = bcast_f(nshi);
    }
    // Remaining weight to take among the elements whose key equals lo.
    return vec2<u32>(lo, bitcast<u32>(w - s_hi));
}

// Id-ordered scan: the first id whose cumulative weight (in id order) reaches `need`
// (`>=`, or `>` when strict). Invocation j owns the contiguous ids [j * C, (j + 1) * C).
// Returns (id or NONE, last id with weight > 0 or NONE). Leaves the total weight in wb_f.
fn id_scan(mode: u32, tie_key: u32, need_in: f32, strict: bool, need_frac: bool) -> vec2<u32> {
    let c = (g.vocab + WG - 1u) / WG;
    let lo = min(tid * c, g.vocab);
    let hi = min(lo + c, g.vocab);
    var part = 0.0;
    var last = NONE;
    for (var t = lo; t < hi; t++) {
        let w = scan_w(mode, t, tie_key);
        if (w > 0.0) {
            part = part + w;
            last = t;
        }
    }
    sh_f[tid] = part;
    if (tid == 0u) {
        atomicStore(&sh_atom, NONE);
        atomicStore(&sh_atom2, 0u);
    }
    workgroupBarrier();
    if (tid == 0u) {
        var acc = 0.0;
        for (var j = 0u; j < WG; j++) {
            acc = acc + sh_f[j];
            sh_f[WG + j] = acc;
        }
        wb_f = acc;
    }
    workgroupBarrier();
    if (last != NONE) {
        atomicMax(&sh_atom2, last + 1u);
    }
    let total = sh_f[2u * WG - 1u];
    var need = need_in;
    if (need_frac) {
        need = need_in * total;
    }
    let incl = sh_f[WG + tid];
    var excl = 0.0;
    if (tid > 0u) {
        excl = sh_f[WG + tid - 1u];
    }
    var mine = false;
    if (strict) {
        mine = excl <= need && incl > need && part > 0.0;
    } else {
        mine = excl < need && incl >= need && part > 0.0;
    }
    if (mine) {
        var acc = excl;
        var found = NONE;
        for (var t = lo; t < hi; t++) {
            let w = scan_w(mode, t, tie_key);
            if (w > 0.0) {
                acc = acc + w;
                found = t;
                if ((strict && acc > need) || (!strict && acc >= need)) {
                    break;
                }
            }
        }
        atomicMin(&sh_atom, found);
    }
    workgroupBarrier();
    let found = atomicLoad(&sh_atom);
    let last_all = atomicLoad(&sh_atom2);
    workgroupBarrier();
    var l = NONE;
    if (last_all > 0u) {
        l = last_all - 1u;
    }
    return vec2<u32>(bcast_u(found), bcast_u(l));
}

// Inverse-CDF sample of the processed row (mode M_SAMPLE) or of the residual (M_RESID) with a
// uniform u, in id order: the first token whose cumulative weight exceeds u * total.
fn sample(mode: u32, u: f32) -> u32 {
    let r = id_scan(mode, 0u, u, true, true);
    if (r.x != NONE) {
        return r.x;
    }
    return r.y;
}

fn write_out(f: u32, v: u32) {
    if (tid == 0u) {
        outbuf[r_lrow_out() * 8u + f] = v;
    }
}

var<private> r_index: u32;

fn r_lrow_out() -> u32 {
    return r_index;
}

// The top-n list: n passes, each finding the best element ranked strictly after the previous.
// Greedy rows rank the processed logits (values = logit - lse), stochastic rows the support
// of the processed distribution (values = z - log_norm).
fn top_list(n: u32, greedy: bool, norm: f32) {
    var pkey = NONE;
    var pid = NONE;
    var first = true;
    var written = 0u;
    for (var j = 0u; j < n; j++) {
        var bk = 0u;
        var bi = NONE;
        for (var t = tid; t < g.vocab; t += WG) {
            let x = ld(t);
            if (!is_fin(x)) {
                continue;
            }
            var key = 0u;
            if (greedy) {
                key = okey(x);
            } else {
                let z = zval(x);
                let p = pexp(z);
                if (!kept(t, x, z, p)) {
                    continue;
                }
                key = okey(z);
            }
            if (!first && !(key < pkey || (key == pkey && t > pid))) {
                continue;
            }
            if (bi == NONE || key > bk || (key == bk && t < bi)) {
                bk = key;
                bi = t;
            }
        }
        let best = reduce_best(bk, bi);
        if (best == NONE) {
            break;
        }
        let bkey = bcast_u(sh_u[0]);
        let x = ld(best);
        var v = 0.0;
        if (greedy) {
            v = x - norm;
        } else {
            v = zval(x) - norm;
        }
        if (tid == 0u) {
            let o = g.tops_base + (r_index * g.max_top + j) * 2u;
            outbuf[o] = best;
            outbuf[o + 1u] = bitcast<u32>(v);
        }
        pkey = bkey;
        pid = best;
        first = false;
        written = j + 1u;
    }
    write_out(7u, written);
}

fn fail(code: u32, tok: u32, val: f32) {
    write_out(0u, code);
    write_out(1u, tok);
    write_out(2u, bitcast<u32>(val));
}

fn raw(t: u32) -> f32 {
    return logits[g.logits_offset + r_lrow * g.vocab + t];
}

// Penalties, bias and masks into this row's scratch slot. Returns the first raw entry that is
// NaN or +inf (NONE if none); then the slot is not complete.
fn modify_row() -> u32 {
    let base = r_slot * g.vocab;
    var bad = NONE;
    for (var t = tid; t < g.vocab; t += WG) {
        var x = raw(t);
        if (is_bad(x)) {
            bad = min(bad, t);
        }
        if (r_mask != NONE) {
            let w = params[g.mask_base + r_mask + (t >> 5u)];
            if (((w >> (t & 31u)) & 1u) != 0u) {
                x = neg_inf();
            }
        }
        scratch[base + t] = x;
    }
    storageBarrier();
    let first_bad = reduce_min_u(bad);
    if (first_bad != NONE) {
        return first_bad;
    }
    let n = seqw(S_PATCH_LEN);
    let pen = (seqw(S_FLAGS) & F_PENALTIES) != 0u;
    let rep = seqf(S_REP);
    let freq = seqf(S_FREQ);
    let pres = seqf(S_PRES);
    let doff = seqw(S_DRAFT_OFF);
    for (var e = tid; e < n; e += WG) {
        let pb = g.patch_base + (seqw(S_PATCH_OFF) + e) * 4u;
        let t = params[pb];
        let flags = params[pb + 3u];
        // Frequency / presence count (generated tokens, or all with the whole-context scope)
        // plus the earlier drafts of the block, which are generated tokens.
        var count = params[pb + 1u];
        var seen = (flags & P_SEEN) != 0u;
        for (var j = 0u; j < r_i; j++) {
            if (params[g.draft_base + doff + j] == t) {
                count = count + 1u;
                seen = true;
            }
        }
        var l = scratch[base + t];
        if (!is_fin(l)) {
            continue;
        }
        if (pen) {
            if (seen && rep != 1.0) {
                if (l > 0.0) {
                    l = l / rep;
                } else {
                    l = l * rep;
                }
            }
            if (count > 0u) {
                l = l - (f32(count) * freq + pres);
            }
        }
        if ((flags & P_BIAS) != 0u) {
            l = l + bitcast<f32>(params[pb + 2u]);
        }
        scratch[base + t] = l;
    }
    storageBarrier();
    workgroupBarrier();
    return NONE;
}

@compute @workgroup_size(256)
fn verify_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    tid = lid.x;
    let r = wid.x + wid.y * g.rows_per_y;
    if (r >= g.n_rows) {
        return;
    }
    r_index = r;
    let rb = g.row_base + r * 8u;
    r_seq = params[rb];
    r_i = params[rb + 1u];
    r_lrow = params[rb + 2u];
    r_draft = params[rb + 3u];
    r_pos_lo = params[rb + 4u];
    r_pos_hi = params[rb + 5u];
    r_mask = params[rb + 6u];
    r_slot = params[rb + 7u];
    sb = r_seq * 16u;
    let k = seqw(S_K);
    let greedy = (seqw(S_FLAGS) & F_GREEDY) != 0u;
    let ntop = seqw(S_NTOP);
    s_qrow = seqw(S_QROW0) + r_i;
    write_out(0u, ST_OK);
    write_out(3u, 0u);
    write_out(7u, 0u);
    if (r_slot != NONE) {
        let raw_bad = modify_row();
        if (raw_bad != NONE) {
            fail(ST_RAW_NON_FINITE, raw_bad, raw(raw_bad));
            return;
        }
    }

    // Pass 1: maximum, argmax (ties to the lowest id), first NaN / +inf, number of finite
    // entries. Greedy rows need no other pass over the row.
    var mx = neg_inf();
    var bad = NONE;
    var nfin = 0u;
    var bk = 0u;
    var bi = NONE;
    for (var t = tid; t < g.vocab; t += WG) {
        let x = ld(t);
        if (is_bad(x)) {
            bad = min(bad, t);
        } else if (is_fin(x)) {
            mx = max(mx, x);
            nfin = nfin + 1u;
            let key = okey(x);
            if (bi == NONE || key > bk) {
                bk = key;
                bi = t;
            }
        }
    }
    let first_bad = reduce_min_u(bad);
    if (first_bad != NONE) {
        // Without a scratch slot the row read is the raw row.
        fail(select(ST_NON_FINITE, ST_RAW_NON_FINITE, r_slot == NONE), first_bad, ld(first_bad));
        return;
    }
    let n_fin = reduce_add_u(nfin);
    if (n_fin == 0u) {
        fail(ST_NO_TOKEN, 0u, 0.0);
        return;
    }
    s_m = reduce_max(mx);

    if (greedy) {
        let best = reduce_best(bk, bi);
        if (g.mode == 1u) {
            // Draft pass: a greedy draft must be its processed row's argmax.
            if (best != r_draft) {
                fail(ST_DRAFT_ZERO, 0u, 0.0);
            }
            return;
        }
        write_out(4u, best);
        write_out(3u, select(0u, 1u, r_i < k && r_draft == best));
        if (ntop != NONE) {
            var se = 0.0;
            for (var t = tid; t < g.vocab; t += WG) {
                let x = ld(t);
                if (is_fin(x)) {
                    se = se + exp(x - s_m);
                }
            }
            let lse = s_m + log(reduce_sum(se));
            let lp = ld(best) - lse;
            write_out(5u, bitcast<u32>(lp));
            write_out(6u, bitcast<u32>(lp));
            top_list(ntop, true, lse);
        }
        return;
    }

    // Temperature: z = (x - max) / T <= 0; tiny T gives -inf (probability 0), never NaN.
    s_inv_t = min(1.0 / seqf(S_TEMP), 3.4028234663852886e38);
    let topk = seqw(S_TOPK);
    s_topk = false;
    if (topk > 0u && topk < g.vocab && topk < n_fin) {
        let sel = select_threshold(M_TOPK, f32(topk), -1.0);
        let cut = id_scan(M_TOPK, sel.x, bitcast<f32>(sel.y), false, false);
        s_tk = sel.x;
        s_cutk = cut.x;
        s_topk = true;
    }
    let topp = seqf(S_TOPP);
    s_topp = false;
    if (topp < 1.0) {
        let sel = select_threshold(M_TOPP, 0.0, topp);
        let cut = id_scan(M_TOPP, sel.x, bitcast<f32>(sel.y), false, false);
        s_tp = sel.x;
        s_cutp = cut.x;
        s_topp = true;
    }
    s_minp = seqf(S_MINP);
    var tot = 0.0;
    for (var t = tid; t < g.vocab; t += WG) {
        let x = ld(t);
        if (!is_fin(x)) {
            continue;
        }
        let z = zval(x);
        let p = pexp(z);
        if (kept(t, x, z, p)) {
            tot = tot + p;
        }
    }
    s_total = reduce_sum(tot);
    let log_norm = log(s_total);
    if (g.mode == 1u) {
        // Draft pass: the processed draft row as dense probabilities.
        for (var t = tid; t < g.vocab; t += WG) {
            outbuf[g.tops_base + r_lrow * g.vocab + t] = bitcast<u32>(prob(t));
        }
        if (!(prob(r_draft) > 0.0)) {
            fail(ST_DRAFT_ZERO, 0u, 0.0);
        }
        return;
    }

    var emit = 0u;
    if (r_i < k) {
        let x = r_draft;
        let px = bcast_f(prob(x));
        var lpx = neg_inf();
        if (px > 0.0) {
            lpx = zval(ld(x)) - log_norm;
        }
        write_out(5u, bitcast<u32>(lpx));
        let u2 = uniform01(r_pos_lo, r_pos_hi, LANE_SAMPLE);
        if (g.q_dense == 0u) {
            // Point mass: the position's draw decides (accepted iff it is the draft).
            emit = sample(M_SAMPLE, u2);
            if (emit == x) {
                write_out(3u, 1u);
            }
        } else {
            // Dense q (the host and the draft pass checked q(x) > 0).
            let qx = qv_at(x);
            let u = uniform01(r_pos_lo, r_pos_hi, LANE_ACCEPT);
            if (u < min(px / qx, 1.0)) {
                write_out(3u, 1u);
                emit = x;
            } else {
                let rr = id_scan(M_RESID, 0u, u2, true, true);
                let rtot = bcast_f(wb_f);
                if (rtot > 0.0) {
                    if (rr.x != NONE) {
                        emit = rr.x;
                    } else {
                        emit = rr.y;
                    }
                } else {
                    emit = sample(M_SAMPLE, u2);
                }
            }
        }
    } else {
        let u = uniform01(r_pos_lo, r_pos_hi, LANE_SAMPLE);
        emit = sample(M_SAMPLE, u);
    }
    write_out(4u, emit);
    let lpe = zval(ld(emit)) - log_norm;
    write_out(6u, bitcast<u32>(lpe));
    if (ntop != NONE) {
        top_list(ntop, false, log_norm);
    }
}
