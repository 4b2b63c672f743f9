// Speculative verification on NVIDIA GPUs (CUDA C, compiled at run time by NVRTC).
//
// The same algorithm as kernels/verify.wgsl, line for line: one block of 256 threads per verify
// row; penalties, bias and masks into a scratch row when a sequence uses them; maximum and
// NaN / +inf screen; greedy argmax (ties to the lowest id) or temperature -> top-k -> softmax ->
// top-p -> min-p -> renormalise, with top-k / top-p thresholds found by multi-pivot bisection on
// order-preserving float keys (no sort) and ties resolved to the lowest ids by an id-ordered
// chunked scan; Philox4x32-10 uniforms keyed by (seed, position, lane); a point-mass draft is
// accepted iff it equals the position's SAMPLE-lane draw from the processed row (which is also
// the emitted token on rejection, case C15); a dense-q draft with u_ACCEPT < min(1, p / q), else
// a residual normalise(max(0, p - q)) sample; the bonus sample by inverse CDF in id order. Every
// row reports a NaN / +inf of its raw logits (validation). Sums are f32 in a fixed order
// (deterministic), as in the WGSL kernel.

#define WG 256u
#define NP 8u
#define NONE 0xffffffffu
#define NEG_INF_BITS 0xff800000u

#define S_TEMP 0u
#define S_TOPK 1u
#define S_TOPP 2u
#define S_MINP 3u
#define S_REP 4u
#define S_FREQ 5u
#define S_PRES 6u
#define S_FLAGS 7u
#define S_SEED_LO 8u
#define S_SEED_HI 9u
#define S_PATCH_OFF 10u
#define S_PATCH_LEN 11u
#define S_DRAFT_OFF 12u
#define S_K 13u
#define S_NTOP 14u
#define S_QROW0 15u
#define F_GREEDY 1u
#define F_PENALTIES 2u
#define P_BIAS 1u
#define P_SEEN 2u

#define LANE_ACCEPT 0u
#define LANE_SAMPLE 1u

#define ST_OK 0u
#define ST_NON_FINITE 1u
#define ST_NO_TOKEN 2u
#define ST_RAW_NON_FINITE 3u
#define ST_DRAFT_ZERO 4u

#define M_TOPK 0u
#define M_TOPP 1u
#define M_SAMPLE 2u
#define M_RESID 3u

// Globals (16 words): vocab, qv, n_rows, row_base, patch_base, draft_base, mask_base,
// mask_words, max_top, tops_base, logits_offset, q_dense, rows_per_y, mode (0 verify, 1 draft
// pass), q_offset (elements), reserved (0: the caller's q rows are checked on the host).
struct G {
    unsigned vocab, qv, n_rows, row_base, patch_base, draft_base, mask_base, mask_words;
    unsigned max_top, tops_base, logits_offset, q_dense, rows_per_y, mode, q_offset, reserved;
};

struct Row {
    const G* g;
    const float* logits;
    const float* q;
    const unsigned* params;
    float* scratch;
    unsigned* out;
    unsigned tid, seq, i, lrow, draft, pos_lo, pos_hi, mask, slot, sb, index, qrow;
    float m, inv_t, minp, total;
    bool topk, topp;
    unsigned tk, cutk, tp, cutp;
};

struct Shared {
    float f[2048];
    unsigned u[256];
    unsigned v[256];
    unsigned bu;
    float bf;
    unsigned atom, atom2;
};

__device__ __forceinline__ unsigned seqw(const Row& r, unsigned f) { return r.params[r.sb + f]; }
__device__ __forceinline__ float seqf(const Row& r, unsigned f) {
    return __uint_as_float(r.params[r.sb + f]);
}
__device__ __forceinline__ float neg_inf() { return __uint_as_float(NEG_INF_BITS); }

__device__ __forceinline__ unsigned okey(float x) {
    unsigned b = __float_as_uint(x);
    if ((b & 0x7fffffffu) == 0u) b = 0u;
    if (b & 0x80000000u) return ~b;
    return b | 0x80000000u;
}
__device__ __forceinline__ bool is_fin(float x) { return __float_as_uint(x) != NEG_INF_BITS; }
__device__ __forceinline__ bool is_bad(float x) {
    unsigned b = __float_as_uint(x) & 0x7fffffffu;
    return b > 0x7f800000u || __float_as_uint(x) == 0x7f800000u;
}

__device__ __forceinline__ float ld(const Row& r, unsigned t) {
    if (r.slot != NONE) return r.scratch[(size_t)r.slot * r.g->vocab + t];
    return r.logits[(size_t)r.g->logits_offset + (size_t)r.lrow * r.g->vocab + t];
}

__device__ __forceinline__ float qv_at(const Row& r, unsigned t) {
    if (r.g->q_dense == 0u) return t == r.draft ? 1.0f : 0.0f;
    if (t < r.g->qv) return r.q[(size_t)r.g->q_offset + (size_t)r.qrow * r.g->qv + t];
    return 0.0f;
}

__device__ float uniform01(const Row& r, unsigned pos_lo, unsigned pos_hi, unsigned lane) {
    unsigned c0 = pos_lo, c1 = pos_hi, c2 = lane, c3 = 0u;
    unsigned k0 = seqw(r, S_SEED_LO), k1 = seqw(r, S_SEED_HI);
    for (unsigned round = 0; round < 10u; ++round) {
        if (round > 0u) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        unsigned n0 = hi1 ^ c1 ^ k0;
        unsigned n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    return (float)(c0 >> 8) * (1.0f / 16777216.0f);
}

// ---- block reductions (fixed tree order) ---------------------------------------------------

__device__ float bcast_f(Row& r, Shared& s, float v) {
    __syncthreads();
    if (r.tid == 0u) s.bf = v;
    __syncthreads();
    float x = s.bf;
    __syncthreads();
    return x;
}

__device__ unsigned bcast_u(Row& r, Shared& s, unsigned v) {
    __syncthreads();
    if (r.tid == 0u) s.bu = v;
    __syncthreads();
    unsigned x = s.bu;
    __syncthreads();
    return x;
}

__device__ float reduce_sum(Row& r, Shared& s, float v) {
    s.f[r.tid] = v;
    __syncthreads();
    for (unsigned k = WG / 2u; k > 0u; k >>= 1u) {
        if (r.tid < k) s.f[r.tid] = s.f[r.tid] + s.f[r.tid + k];
        __syncthreads();
    }
    return bcast_f(r, s, s.f[0]);
}

__device__ float reduce_max(Row& r, Shared& s, float v) {
    s.f[r.tid] = v;
    __syncthreads();
    for (unsigned k = WG / 2u; k > 0u; k >>= 1u) {
        if (r.tid < k) s.f[r.tid] = fmaxf(s.f[r.tid], s.f[r.tid + k]);
        __syncthreads();
    }
    return bcast_f(r, s, s.f[0]);
}

__device__ unsigned reduce_min_u(Row& r, Shared& s, unsigned v) {
    s.u[r.tid] = v;
    __syncthreads();
    for (unsigned k = WG / 2u; k > 0u; k >>= 1u) {
        if (r.tid < k) s.u[r.tid] = min(s.u[r.tid], s.u[r.tid + k]);
        __syncthreads();
    }
    return bcast_u(r, s, s.u[0]);
}

__device__ unsigned reduce_add_u(Row& r, Shared& s, unsigned v) {
    s.u[r.tid] = v;
    __syncthreads();
    for (unsigned k = WG / 2u; k > 0u; k >>= 1u) {
        if (r.tid < k) s.u[r.tid] = s.u[r.tid] + s.u[r.tid + k];
        __syncthreads();
    }
    return bcast_u(r, s, s.u[0]);
}

// Best (key desc, id asc); returns the id (NONE if none) and the key in *key_out.
__device__ unsigned reduce_best(Row& r, Shared& s, unsigned key, unsigned id, unsigned* key_out) {
    s.u[r.tid] = key;
    s.v[r.tid] = id;
    __syncthreads();
    for (unsigned k = WG / 2u; k > 0u; k >>= 1u) {
        if (r.tid < k) {
            unsigned ka = s.u[r.tid], kb = s.u[r.tid + k];
            unsigned ia = s.v[r.tid], ib = s.v[r.tid + k];
            if (ib != NONE && (ia == NONE || kb > ka || (kb == ka && ib < ia))) {
                s.u[r.tid] = kb;
                s.v[r.tid] = ib;
            }
        }
        __syncthreads();
    }
    unsigned best = s.v[0];
    unsigned bk = s.u[0];
    __syncthreads();
    *key_out = bk;
    return best;
}

// ---- per-element quantities ----------------------------------------------------------------

__device__ __forceinline__ float zval(const Row& r, float x) {
    float d = __fsub_rn(x, r.m);
    if (d == 0.0f) return 0.0f;
    return __fmul_rn(d, r.inv_t);
}

__device__ __forceinline__ float pexp(float z) {
    if (!is_fin(z)) return 0.0f;
    return expf(z);
}

__device__ __forceinline__ bool elig_k(const Row& r, unsigned t, float x) {
    if (!is_fin(x)) return false;
    if (!r.topk) return true;
    unsigned k = okey(x);
    return k > r.tk || (k == r.tk && t <= r.cutk);
}

__device__ __forceinline__ bool kept(const Row& r, unsigned t, float x, float z, float p) {
    if (!elig_k(r, t, x)) return false;
    if (r.topp) {
        unsigned k = okey(z);
        if (!(k > r.tp || (k == r.tp && t <= r.cutp))) return false;
    }
    return p >= r.minp && p > 0.0f;
}

__device__ float prob(const Row& r, unsigned t) {
    float x = ld(r, t);
    if (!is_fin(x)) return 0.0f;
    float z = zval(r, x);
    float p = pexp(z);
    if (!kept(r, t, x, z, p)) return 0.0f;
    return p / r.total;
}

__device__ __forceinline__ void key_w(const Row& r, unsigned mode, unsigned t, unsigned* key, float* w) {
    float x = ld(r, t);
    if (mode == M_TOPK) {
        *key = okey(x);
        *w = is_fin(x) ? 1.0f : 0.0f;
        return;
    }
    if (!elig_k(r, t, x)) {
        *key = 0u;
        *w = 0.0f;
        return;
    }
    float z = zval(r, x);
    *key = okey(z);
    *w = pexp(z);
}

__device__ float scan_w(const Row& r, unsigned mode, unsigned t, unsigned tie_key) {
    if (mode == M_SAMPLE) return prob(r, t);
    if (mode == M_RESID) return fmaxf(__fsub_rn(prob(r, t), qv_at(r, t)), 0.0f);
    unsigned key;
    float w;
    key_w(r, mode, t, &key, &w);
    if (key != tie_key) return 0.0f;
    return w;
}

__device__ void pivot_sums(Row& r, Shared& s, unsigned mode, const unsigned* piv) {
    float part[NP];
    for (unsigned j = 0; j < NP; ++j) part[j] = 0.0f;
    for (unsigned t = r.tid; t < r.g->vocab; t += WG) {
        unsigned k;
        float w;
        key_w(r, mode, t, &k, &w);
        for (unsigned j = 0; j < NP; ++j)
            if (k >= piv[j]) part[j] = __fadd_rn(part[j], w);
    }
    __syncthreads();
    for (unsigned j = 0; j < NP; ++j) s.f[j * WG + r.tid] = part[j];
    __syncthreads();
    for (unsigned k = WG / 2u; k > 0u; k >>= 1u) {
        if (r.tid < k)
            for (unsigned j = 0; j < NP; ++j)
                s.f[j * WG + r.tid] = __fadd_rn(s.f[j * WG + r.tid], s.f[j * WG + r.tid + k]);
        __syncthreads();
    }
}

// Largest key T with S(T) >= W; returns T and the remaining need W - S(T + 1) (as bits).
__device__ void select_threshold(Row& r, Shared& s, unsigned mode, float want, float frac,
                                 unsigned* t_out, float* need_out) {
    unsigned piv[NP];
    for (unsigned j = 0; j < NP; ++j) piv[j] = 0u;
    pivot_sums(r, s, mode, piv);
    float total = bcast_f(r, s, s.f[0]);
    float w = frac >= 0.0f ? __fmul_rn(frac, total) : want;
    unsigned lo = 0u, hi = NONE;
    float s_hi = 0.0f;
    for (unsigned it = 0; it < 40u; ++it) {
        if (hi - lo <= 1u) break;
        unsigned step = max((hi - lo) / (NP + 1u), 1u);
        for (unsigned j = 0; j < NP; ++j) piv[j] = min(lo + step * (j + 1u), hi - 1u);
        pivot_sums(r, s, mode, piv);
        unsigned nlo = lo, nhi = hi;
        float nshi = s_hi;
        for (unsigned j = 0; j < NP; ++j) {
            float v = s.f[j * WG];
            if (v >= w) {
                nlo = max(nlo, piv[j]);
            } else if (piv[j] < nhi) {
                nhi = piv[j];
                nshi = v;
            }
        }
        lo = bcast_u(r, s, nlo);
        hi = bcast_u(r, s, nhi);
        s_hi = bcast_f(r, s, nshi);
    }
    *t_out = lo;
    *need_out = __fsub_rn(w, s_hi);
}

// Id-ordered scan: first id whose cumulative weight reaches need (>=, or > when strict).
// Returns the id (NONE if none) and the last weighted id in *last_out, the total in *total_out.
__device__ unsigned id_scan(Row& r, Shared& s, unsigned mode, unsigned tie_key, float need_in,
                            bool strict, bool need_frac, unsigned* last_out, float* total_out) {
    unsigned c = (r.g->vocab + WG - 1u) / WG;
    unsigned lo = min(r.tid * c, r.g->vocab);
    unsigned hi = min(lo + c, r.g->vocab);
    float part = 0.0f;
    unsigned last = NONE;
    for (unsigned t = lo; t < hi; ++t) {
        float w = scan_w(r, mode, t, tie_key);
        if (w > 0.0f) {
            part = __fadd_rn(part, w);
            last = t;
        }
    }
    __syncthreads();
    s.f[r.tid] = part;
    if (r.tid == 0u) {
        s.atom = NONE;
        s.atom2 = 0u;
    }
    __syncthreads();
    if (r.tid == 0u) {
        float acc = 0.0f;
        for (unsigned j = 0; j < WG; ++j) {
            acc = __fadd_rn(acc, s.f[j]);
            s.f[WG + j] = acc;
        }
        s.bf = acc;
    }
    __syncthreads();
    if (last != NONE) atomicMax(&s.atom2, last + 1u);
    float total = s.f[2u * WG - 1u];
    float need = need_frac ? __fmul_rn(need_in, total) : need_in;
    float incl = s.f[WG + r.tid];
    float excl = r.tid > 0u ? s.f[WG + r.tid - 1u] : 0.0f;
    bool mine = strict ? (excl <= need && incl > need && part > 0.0f)
                       : (excl < need && incl >= need && part > 0.0f);
    if (mine) {
        float acc = excl;
        unsigned found = NONE;
        for (unsigned t = lo; t < hi; ++t) {
            float w = scan_w(r, mode, t, tie_key);
            if (w > 0.0f) {
                acc = __fadd_rn(acc, w);
                found = t;
                if ((strict && acc > need) || (!strict && acc >= need)) break;
            }
        }
        atomicMin(&s.atom, found);
    }
    __syncthreads();
    unsigned found = s.atom;
    unsigned last_all = s.atom2;
    *total_out = s.bf;
    __syncthreads();
    *last_out = last_all > 0u ? last_all - 1u : NONE;
    return found;
}

__device__ unsigned sample(Row& r, Shared& s, unsigned mode, float u) {
    unsigned last;
    float total;
    unsigned f = id_scan(r, s, mode, 0u, u, true, true, &last, &total);
    return f != NONE ? f : last;
}

__device__ __forceinline__ void write_out(const Row& r, unsigned f, unsigned v) {
    if (r.tid == 0u) r.out[r.index * 8u + f] = v;
}

__device__ void top_list(Row& r, Shared& s, unsigned n, bool greedy, float norm) {
    unsigned pkey = NONE, pid = NONE;
    bool first = true;
    unsigned written = 0u;
    for (unsigned j = 0; j < n; ++j) {
        unsigned bk = 0u, bi = NONE;
        for (unsigned t = r.tid; t < r.g->vocab; t += WG) {
            float x = ld(r, t);
            if (!is_fin(x)) continue;
            unsigned key;
            if (greedy) {
                key = okey(x);
            } else {
                float z = zval(r, x);
                float p = pexp(z);
                if (!kept(r, t, x, z, p)) continue;
                key = okey(z);
            }
            if (!first && !(key < pkey || (key == pkey && t > pid))) continue;
            if (bi == NONE || key > bk || (key == bk && t < bi)) {
                bk = key;
                bi = t;
            }
        }
        unsigned bkey;
        unsigned best = reduce_best(r, s, bk, bi, &bkey);
        if (best == NONE) break;
        float x = ld(r, best);
        float v = greedy ? __fsub_rn(x, norm) : __fsub_rn(zval(r, x), norm);
        if (r.tid == 0u) {
            unsigned o = r.g->tops_base + (r.index * r.g->max_top + j) * 2u;
            r.out[o] = best;
            r.out[o + 1u] = __float_as_uint(v);
        }
        pkey = bkey;
        pid = best;
        first = false;
        written = j + 1u;
    }
    write_out(r, 7u, written);
}

__device__ void fail(const Row& r, unsigned code, unsigned tok, float val) {
    write_out(r, 0u, code);
    write_out(r, 1u, tok);
    write_out(r, 2u, __float_as_uint(val));
}

__device__ __forceinline__ float raw(const Row& r, unsigned t) {
    return r.logits[(size_t)r.g->logits_offset + (size_t)r.lrow * r.g->vocab + t];
}

// Penalties, bias and masks into this row's scratch slot. Returns the first raw entry that is
// NaN or +inf (NONE if none); then the slot is not complete.
__device__ unsigned modify_row(Row& r, Shared& s) {
    const G* g = r.g;
    size_t base = (size_t)r.slot * g->vocab;
    unsigned bad = NONE;
    for (unsigned t = r.tid; t < g->vocab; t += WG) {
        float x = raw(r, t);
        if (is_bad(x)) bad = min(bad, t);
        if (r.mask != NONE) {
            unsigned w = r.params[g->mask_base + r.mask + (t >> 5u)];
            if ((w >> (t & 31u)) & 1u) x = neg_inf();
        }
        r.scratch[base + t] = x;
    }
    __threadfence_block();
    unsigned first_bad = reduce_min_u(r, s, bad);
    if (first_bad != NONE) return first_bad;
    unsigned n = seqw(r, S_PATCH_LEN);
    bool pen = (seqw(r, S_FLAGS) & F_PENALTIES) != 0u;
    float rep = seqf(r, S_REP), freq = seqf(r, S_FREQ), pres = seqf(r, S_PRES);
    unsigned doff = seqw(r, S_DRAFT_OFF);
    for (unsigned e = r.tid; e < n; e += WG) {
        unsigned pb = g->patch_base + (seqw(r, S_PATCH_OFF) + e) * 4u;
        unsigned t = r.params[pb];
        unsigned flags = r.params[pb + 3u];
        // Frequency / presence count (generated tokens, or all with the whole-context scope)
        // plus the earlier drafts of the block, which are generated tokens.
        unsigned count = r.params[pb + 1u];
        bool seen = (flags & P_SEEN) != 0u;
        for (unsigned j = 0; j < r.i; ++j)
            if (r.params[g->draft_base + doff + j] == t) {
                count++;
                seen = true;
            }
        float l = r.scratch[base + t];
        if (!is_fin(l)) continue;
        if (pen) {
            if (seen && rep != 1.0f) l = l > 0.0f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
            if (count > 0u) l = __fsub_rn(l, __fadd_rn(__fmul_rn((float)count, freq), pres));
        }
        if (flags & P_BIAS) l = __fadd_rn(l, __uint_as_float(r.params[pb + 2u]));
        r.scratch[base + t] = l;
    }
    __threadfence_block();
    __syncthreads();
    return NONE;
}

extern "C" __global__ void __launch_bounds__(256) verify_rows(
    const unsigned* __restrict__ globals, const float* __restrict__ logits,
    const float* __restrict__ qbuf, const unsigned* __restrict__ params, float* scratch,
    unsigned* out) {
    __shared__ Shared s;
    const G* g = reinterpret_cast<const G*>(globals);
    unsigned rr = blockIdx.x + blockIdx.y * g->rows_per_y;
    if (rr >= g->n_rows) return;
    Row r;
    r.g = g;
    r.logits = logits;
    r.q = qbuf;
    r.params = params;
    r.scratch = scratch;
    r.out = out;
    r.tid = threadIdx.x;
    r.index = rr;
    unsigned rb = g->row_base + rr * 8u;
    r.seq = params[rb];
    r.i = params[rb + 1u];
    r.lrow = params[rb + 2u];
    r.draft = params[rb + 3u];
    r.pos_lo = params[rb + 4u];
    r.pos_hi = params[rb + 5u];
    r.mask = params[rb + 6u];
    r.slot = params[rb + 7u];
    r.sb = r.seq * 16u;
    r.topk = false;
    r.topp = false;
    r.tk = r.cutk = r.tp = r.cutp = 0u;
    r.m = 0.0f;
    r.inv_t = 1.0f;
    r.minp = 0.0f;
    r.total = 1.0f;
    unsigned k = seqw(r, S_K);
    bool greedy = (seqw(r, S_FLAGS) & F_GREEDY) != 0u;
    unsigned ntop = seqw(r, S_NTOP);
    r.qrow = seqw(r, S_QROW0) + r.i;
    write_out(r, 0u, ST_OK);
    write_out(r, 3u, 0u);
    write_out(r, 7u, 0u);
    if (r.slot != NONE) {
        unsigned raw_bad = modify_row(r, s);
        if (raw_bad != NONE) {
            fail(r, ST_RAW_NON_FINITE, raw_bad, raw(r, raw_bad));
            return;
        }
    }

    // Pass 1: maximum, argmax (ties to the lowest id), first NaN / +inf, number of finite
    // entries. Greedy rows need no other pass over the row.
    float mx = neg_inf();
    unsigned bad = NONE, nfin = 0u, bk = 0u, bi = NONE;
    for (unsigned t = r.tid; t < g->vocab; t += WG) {
        float x = ld(r, t);
        if (is_bad(x)) {
            bad = min(bad, t);
        } else if (is_fin(x)) {
            mx = fmaxf(mx, x);
            nfin++;
            unsigned key = okey(x);
            if (bi == NONE || key > bk) {
                bk = key;
                bi = t;
            }
        }
    }
    unsigned first_bad = reduce_min_u(r, s, bad);
    if (first_bad != NONE) {
        // Without a scratch slot the row read is the raw row.
        fail(r, r.slot == NONE ? ST_RAW_NON_FINITE : ST_NON_FINITE, first_bad, ld(r, first_bad));
        return;
    }
    unsigned n_fin = reduce_add_u(r, s, nfin);
    if (n_fin == 0u) {
        fail(r, ST_NO_TOKEN, 0u, 0.0f);
        return;
    }
    r.m = reduce_max(r, s, mx);

    if (greedy) {
        unsigned bkey;
        unsigned best = reduce_best(r, s, bk, bi, &bkey);
        if (g->mode == 1u) {
            // Draft pass: a greedy draft must be its processed row's argmax.
            if (best != r.draft) fail(r, ST_DRAFT_ZERO, 0u, 0.0f);
            return;
        }
        write_out(r, 4u, best);
        write_out(r, 3u, (r.i < k && r.draft == best) ? 1u : 0u);
        if (ntop != NONE) {
            float se = 0.0f;
            for (unsigned t = r.tid; t < g->vocab; t += WG) {
                float x = ld(r, t);
                if (is_fin(x)) se = __fadd_rn(se, expf(__fsub_rn(x, r.m)));
            }
            float lse = __fadd_rn(r.m, logf(reduce_sum(r, s, se)));
            float lp = __fsub_rn(ld(r, best), lse);
            write_out(r, 5u, __float_as_uint(lp));
            write_out(r, 6u, __float_as_uint(lp));
            top_list(r, s, ntop, true, lse);
        }
        return;
    }

    r.inv_t = fminf(__fdiv_rn(1.0f, seqf(r, S_TEMP)), 3.4028234663852886e38f);
    unsigned topk = seqw(r, S_TOPK);
    if (topk > 0u && topk < g->vocab && topk < n_fin) {
        unsigned t;
        float need;
        select_threshold(r, s, M_TOPK, (float)topk, -1.0f, &t, &need);
        unsigned last;
        float tot;
        unsigned cut = id_scan(r, s, M_TOPK, t, need, false, false, &last, &tot);
        r.tk = t;
        r.cutk = cut;
        r.topk = true;
    }
    float topp = seqf(r, S_TOPP);
    if (topp < 1.0f) {
        unsigned t;
        float need;
        select_threshold(r, s, M_TOPP, 0.0f, topp, &t, &need);
        unsigned last;
        float tot;
        unsigned cut = id_scan(r, s, M_TOPP, t, need, false, false, &last, &tot);
        r.tp = t;
        r.cutp = cut;
        r.topp = true;
    }
    r.minp = seqf(r, S_MINP);
    float tot = 0.0f;
    for (unsigned t = r.tid; t < g->vocab; t += WG) {
        float x = ld(r, t);
        if (!is_fin(x)) continue;
        float z = zval(r, x);
        float p = pexp(z);
        if (kept(r, t, x, z, p)) tot = __fadd_rn(tot, p);
    }
    r.total = reduce_sum(r, s, tot);
    float log_norm = logf(r.total);
    if (g->mode == 1u) {
        for (unsigned t = r.tid; t < g->vocab; t += WG)
            out[(size_t)g->tops_base + (size_t)r.lrow * g->vocab + t] = __float_as_uint(prob(r, t));
        if (!(prob(r, r.draft) > 0.0f)) fail(r, ST_DRAFT_ZERO, 0u, 0.0f);
        return;
    }

    unsigned emit = 0u;
    if (r.i < k) {
        unsigned x = r.draft;
        float px = prob(r, x);
        float lpx = neg_inf();
        if (px > 0.0f) lpx = __fsub_rn(zval(r, ld(r, x)), log_norm);
        write_out(r, 5u, __float_as_uint(lpx));
        float u2 = uniform01(r, r.pos_lo, r.pos_hi, LANE_SAMPLE);
        if (g->q_dense == 0u) {
            // Point mass: the position's draw decides (accepted iff it is the draft).
            emit = sample(r, s, M_SAMPLE, u2);
            if (emit == x) write_out(r, 3u, 1u);
        } else {
            // Dense q (the host and the draft pass checked q(x) > 0).
            float qx = qv_at(r, x);
            float u = uniform01(r, r.pos_lo, r.pos_hi, LANE_ACCEPT);
            if (u < fminf(__fdiv_rn(px, qx), 1.0f)) {
                write_out(r, 3u, 1u);
                emit = x;
            } else {
                unsigned last;
                float rtot;
                unsigned f = id_scan(r, s, M_RESID, 0u, u2, true, true, &last, &rtot);
                if (rtot > 0.0f) {
                    emit = f != NONE ? f : last;
                } else {
                    emit = sample(r, s, M_SAMPLE, u2);
                }
            }
        }
    } else {
        float u = uniform01(r, r.pos_lo, r.pos_hi, LANE_SAMPLE);
        emit = sample(r, s, M_SAMPLE, u);
    }
    write_out(r, 4u, emit);
    float lpe = __fsub_rn(zval(r, ld(r, emit)), log_norm);
    write_out(r, 6u, __float_as_uint(lpe));
    if (ntop != NONE) top_list(r, s, ntop, false, log_norm);
}

// One read of the logits: the baseline of the benchmarks (sum of every element, per block).
extern "C" __global__ void read_logits(const float* __restrict__ x, unsigned long long n,
                                       float* out) {
    __shared__ float sh[256];
    float acc = 0.0f;
    for (unsigned long long i = (unsigned long long)blockIdx.x * 256ull + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * 256ull)
        acc += x[i];
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned k = 128u; k > 0u; k >>= 1u) {
        if (threadIdx.x < k) sh[threadIdx.x] += sh[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0u) out[blockIdx.x] = sh[0];
}
