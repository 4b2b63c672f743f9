//! The goodness-of-fit test of the statistical check: Pearson's chi-square over the cells of
//! expected count `>= 5`, a Poisson upper tail for the pooled small cells, combined by
//! Bonferroni ([`super::ALPHA`] documents it). The special functions are written here (the
//! library takes no statistics dependency).

/// The test's result: statistic, degrees of freedom, p-value, observations in impossible cells.
pub(crate) struct Test {
    pub(crate) statistic: f64,
    pub(crate) df: usize,
    pub(crate) p_value: f64,
    pub(crate) impossible: u64,
}

/// Tests `observed` counts against `expected` probabilities (same length, summing to 1);
/// `extra` counts observations outside every cell (impossible).
pub(crate) fn fit(observed: &[u64], expected: &[f64], extra: u64) -> Test {
    let n: u64 = observed.iter().sum::<u64>() + extra;
    let nf = n as f64;
    let mut impossible = extra;
    let (mut stat, mut bins) = (0.0f64, 0usize);
    let (mut pool_o, mut pool_e) = (0u64, 0.0f64);
    for (&o, &p) in observed.iter().zip(expected) {
        let e = p * nf;
        if p <= 0.0 {
            impossible += o;
        } else if e < 5.0 {
            pool_o += o;
            pool_e += e;
        } else {
            stat += (o as f64 - e) * (o as f64 - e) / e;
            bins += 1;
        }
    }
    let df = bins.saturating_sub(1).max(1);
    let p_chi = if bins >= 2 {
        upper_gamma(df as f64 / 2.0, stat / 2.0)
    } else {
        1.0
    };
    let p_pool = if pool_o == 0 {
        1.0
    } else {
        lower_gamma(pool_o as f64, pool_e)
    };
    let p_value = if impossible > 0 {
        0.0
    } else {
        (2.0 * p_chi.min(p_pool)).min(1.0)
    };
    Test {
        statistic: stat,
        df,
        p_value,
        impossible,
    }
}

/// `ln Γ(x)` for `x > 0` (Lanczos, g = 7, 9 terms).
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let t = x + 7.5;
    let mut a = C[0];
    for (i, &c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// The regularised lower incomplete gamma `P(a, x)`; for integer `a = o` it is the Poisson
/// upper tail `P(X >= o)` of mean `x`.
fn lower_gamma(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x < a + 1.0 {
        // Series: x^a e^-x / Γ(a + 1) * sum x^k / ((a + 1) .. (a + k)).
        let (mut term, mut sum, mut d) = (1.0 / a, 1.0 / a, a);
        for _ in 0..1000 {
            d += 1.0;
            term *= x / d;
            sum += term;
            if term.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        (sum.ln() + a * x.ln() - x - ln_gamma(a))
            .exp()
            .clamp(0.0, 1.0)
    } else {
        1.0 - upper_gamma(a, x)
    }
}

/// The regularised upper incomplete gamma `Q(a, x) = 1 - P(a, x)`: the chi-square survival
/// function at `2x` with `2a` degrees of freedom.
fn upper_gamma(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    if x < a + 1.0 {
        return 1.0 - lower_gamma(a, x);
    }
    // Continued fraction (modified Lentz).
    let tiny = 1e-300;
    let mut b = x + 1.0 - a;
    let mut c = 1.0 / tiny;
    let mut d = 1.0 / b;
    let mut h = d;
    for i in 1..1000 {
        let an = -(i as f64) * (i as f64 - a);
        b += 2.0;
        d = an * d + b;
        if d.abs() < tiny {
            d = tiny;
        }
        c = b + an / c;
        if c.abs() < tiny {
            c = tiny;
        }
        d = 1.0 / d;
        let delta = d * c;
        h *= delta;
        if (delta - 1.0).abs() < 1e-15 {
            break;
        }
    }
    (a * x.ln() - x - ln_gamma(a) + h.ln())
        .exp()
        .clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chi_square_survival_matches_known_values() {
        // sf(3.841, df 1) = 0.05; sf(9.488, df 4) = 0.05; sf(2, df 2) = e^-1.
        assert!((upper_gamma(0.5, 3.841_458 / 2.0) - 0.05).abs() < 1e-5);
        assert!((upper_gamma(2.0, 9.487_729 / 2.0) - 0.05).abs() < 1e-5);
        assert!((upper_gamma(1.0, 1.0) - (-1.0f64).exp()).abs() < 1e-12);
        // Poisson(2): P(X >= 3) = 1 - e^-2 (1 + 2 + 2).
        let want = 1.0 - (-2.0f64).exp() * 5.0;
        assert!((lower_gamma(3.0, 2.0) - want).abs() < 1e-12);
        assert!((ln_gamma(5.0) - 24f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn fit_accepts_a_fair_count_and_rejects_a_skewed_one() {
        let e = [0.5, 0.3, 0.2];
        assert!(fit(&[500, 300, 200], &e, 0).p_value > 0.5);
        assert!(fit(&[700, 200, 100], &e, 0).p_value < 1e-6);
        assert_eq!(fit(&[500, 300, 200], &e, 1).p_value, 0.0);
        // A small cell seen far too often.
        assert!(fit(&[480, 300, 200, 20], &[0.5, 0.3, 0.199, 0.001], 0).p_value < 1e-6);
    }
}
