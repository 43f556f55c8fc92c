//! One-dimensional weighted k-means: k-means++ seeding, then Lloyd iterations.
//!
//! Palettizing a weight tensor is k-means over scalars. Large tensors are first
//! summarised as a fine histogram (each non-empty bin becomes one point at the
//! exact mean of its values, weighted by its count): Lloyd's algorithm on those
//! points is the same algorithm at a bin's resolution, and costs O(bins) per
//! iteration instead of O(values), so converting a whole SD 1.5 UNet takes
//! seconds per tier rather than hours. Seeding draws from a fixed-seed
//! generator, so a conversion is reproducible bit for bit.

/// Points above which a histogram replaces the raw values.
const HISTOGRAM_THRESHOLD: usize = 16 * 1024;
/// Most Lloyd iterations (they usually stop earlier, when nothing moves).
const MAX_ITERATIONS: usize = 50;

/// splitmix64: a tiny, well-mixed generator for seeding.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Sorted (value, weight) points standing for `values`.
fn points(values: &[f32], k: usize) -> Vec<(f64, f64)> {
    let bins = (64 * k).max(4096);
    if values.len() <= HISTOGRAM_THRESHOLD.max(2 * bins) {
        let mut v: Vec<f64> = values.iter().map(|&x| x as f64).collect();
        v.sort_by(f64::total_cmp);
        let mut out: Vec<(f64, f64)> = Vec::with_capacity(v.len());
        for x in v {
            match out.last_mut() {
                Some(last) if last.0 == x => last.1 += 1.0,
                _ => out.push((x, 1.0)),
            }
        }
        return out;
    }
    let (lo, hi) = values.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    let span = (hi - lo) as f64;
    let mut sum = vec![0f64; bins];
    let mut count = vec![0f64; bins];
    for &x in values {
        let b = if span > 0.0 { (((x - lo) as f64 / span) * bins as f64) as usize } else { 0 };
        let b = b.min(bins - 1);
        sum[b] += x as f64;
        count[b] += 1.0;
    }
    sum.iter().zip(&count).filter(|(_, &c)| c > 0.0).map(|(&s, &c)| (s / c, c)).collect()
}

/// k-means++: the first centre drawn by weight, each next one with probability
/// proportional to weight x squared distance to the nearest centre so far.
fn seed_centres(pts: &[(f64, f64)], k: usize, rng: &mut SplitMix) -> Vec<f64> {
    let mut centres = Vec::with_capacity(k);
    let total: f64 = pts.iter().map(|p| p.1).sum();
    let pick = |weights: &mut dyn Iterator<Item = f64>, target: f64| -> usize {
        let mut acc = 0.0;
        let mut last = 0;
        for (i, w) in weights.enumerate() {
            acc += w;
            last = i;
            if acc > target {
                return i;
            }
        }
        last
    };
    let first = pick(&mut pts.iter().map(|p| p.1), rng.unit() * total);
    centres.push(pts[first].0);
    let mut d2: Vec<f64> = pts.iter().map(|p| (p.0 - pts[first].0).powi(2)).collect();
    while centres.len() < k {
        let mass: f64 = pts.iter().zip(&d2).map(|(p, d)| p.1 * d).sum();
        if mass <= 0.0 {
            break;
        }
        let i = pick(&mut pts.iter().zip(&d2).map(|(p, d)| p.1 * d), rng.unit() * mass);
        let c = pts[i].0;
        centres.push(c);
        for (d, p) in d2.iter_mut().zip(pts) {
            *d = d.min((p.0 - c).powi(2));
        }
    }
    centres
}

/// Lloyd iterations on sorted points with sorted centres: each point goes to the
/// nearest centre (a sweep, since both are sorted), each centre moves to the
/// weighted mean of its points; an emptied centre stays where it was.
fn lloyd(pts: &[(f64, f64)], centres: &mut [f64]) {
    let k = centres.len();
    for _ in 0..MAX_ITERATIONS {
        centres.sort_by(f64::total_cmp);
        let mut sum = vec![0f64; k];
        let mut weight = vec![0f64; k];
        let mut c = 0;
        for &(x, w) in pts {
            while c + 1 < k && (x - centres[c]).abs() > (x - centres[c + 1]).abs() {
                c += 1;
            }
            sum[c] += x * w;
            weight[c] += w;
        }
        let mut moved = false;
        for j in 0..k {
            if weight[j] > 0.0 {
                let m = sum[j] / weight[j];
                moved |= m != centres[j];
                centres[j] = m;
            }
        }
        if !moved {
            break;
        }
    }
    centres.sort_by(f64::total_cmp);
}

/// `k` centres for `values` (finite), ascending. When the values take fewer than
/// `k` distinct levels the table repeats its last entry (those codes go unused).
pub fn kmeans_1d(values: &[f32], k: usize, seed: u64) -> Vec<f32> {
    if values.is_empty() || k == 0 {
        return vec![0.0; k];
    }
    let pts = points(values, k);
    let mut rng = SplitMix(seed);
    let mut centres = if pts.len() <= k {
        pts.iter().map(|p| p.0).collect()
    } else {
        seed_centres(&pts, k, &mut rng)
    };
    lloyd(&pts, &mut centres);
    let mut out: Vec<f32> = centres.iter().map(|&c| c as f32).collect();
    let last = out.last().copied().unwrap_or(0.0);
    out.resize(k, last);
    out
}

/// Index of the entry of ascending `table` nearest to `x`.
#[inline]
pub fn nearest(table: &[f32], x: f32) -> usize {
    let i = table.partition_point(|&c| c < x);
    if i == 0 {
        0
    } else if i == table.len() {
        table.len() - 1
    } else if (x - table[i - 1]) <= (table[i] - x) {
        i - 1
    } else {
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaussian(n: usize, seed: u64) -> Vec<f32> {
        let mut r = SplitMix(seed);
        (0..n)
            .map(|_| {
                let (u, v) = (r.unit().max(1e-12), r.unit());
                ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
            })
            .collect()
    }

    #[test]
    fn finds_well_separated_clusters() {
        let mut v = Vec::new();
        for (i, c) in [-5.0f32, -1.0, 2.0, 7.0].iter().enumerate() {
            for j in 0..50 {
                v.push(c + (j as f32 - 25.0) * 1e-3 * (i + 1) as f32);
            }
        }
        let t = kmeans_1d(&v, 4, 7);
        for (got, want) in t.iter().zip([-5.0f32, -1.0, 2.0, 7.0]) {
            assert!((got - want).abs() < 0.02, "{t:?}");
        }
    }

    #[test]
    fn deterministic_for_a_seed_on_raw_and_histogram_paths() {
        for n in [1000, 200_000] {
            let v = gaussian(n, 3);
            let a = kmeans_1d(&v, 16, 42);
            let b = kmeans_1d(&v, 16, 42);
            assert_eq!(a, b);
            assert!(a.windows(2).all(|w| w[0] <= w[1]));
        }
    }

    #[test]
    fn matches_lloyd_max_distortion_on_a_gaussian() {
        // Lloyd-Max optimal MSE for a unit Gaussian: 2 levels 0.3634, 4 levels 0.1175, 16 levels 0.009497.
        for (k, optimum) in [(2, 0.3634), (4, 0.1175), (16, 0.009497)] {
            for n in [5000, 300_000] {
                let v = gaussian(n, 11);
                let t = kmeans_1d(&v, k, 1);
                let mse: f64 = v.iter().map(|&x| (x - t[nearest(&t, x)]).powi(2) as f64).sum::<f64>() / n as f64;
                assert!(mse < optimum * 1.1, "k {k} n {n}: mse {mse} vs optimum {optimum}");
            }
        }
    }

    #[test]
    fn few_distinct_values_are_kept_exactly() {
        let v = [0.5f32, -1.0, 0.5, 0.5, 3.0];
        let t = kmeans_1d(&v, 4, 0);
        assert_eq!(t, vec![-1.0, 0.5, 3.0, 3.0]);
        assert_eq!(nearest(&t, 0.6), 1);
        assert_eq!(nearest(&t, -9.0), 0);
        assert_eq!(nearest(&t, 9.0), 3);
    }
}
