//! Scaled dot-product attention, whole or in query chunks.

use std::num::NonZeroUsize;

use candle_core::{Result, Tensor, D};

/// Which positions a query may attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionMask {
    None,
    /// Query i sees keys 0..=i (CLIP's text transformer).
    Causal,
}

/// How the score matrix is formed. `Full` materialises all `n_q x n_k` scores
/// per head at once (two buffers of them: the scaled scores and the softmax); at
/// SD 1.5's 64x64 latent with guidance that is 2 x 1.07 GB. `Chunked` processes
/// that many queries at a time, so the score buffers shrink by `n_q / chunk`
/// while every query still sees every key: softmax rows are independent, so
/// the result is the full one (each row is computed by the same kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionMode {
    #[default]
    Full,
    Chunked(NonZeroUsize),
}

/// Scaled dot-product attention: `softmax(q k^T * scale) v`.
///
/// `q` is [batch, heads, n_q, d], `k` and `v` are [batch, heads, n_k, d]. Scores
/// and softmax run in f32 whatever the input dtype, which is what diffusers'
/// `upcast_attention` / `upcast_softmax` ask for and costs nothing in f32.
///
/// On the CPU in [`KernelMode::Fast`](crate::kernels::KernelMode), where it pays
/// ([`crate::kernels::attention_pays`]), this runs the fused kernel ([`crate::kernels::flash_attention`], no `n_q x n_k` buffer;
/// under `--compute bf16` its bf16 versions, [`crate::kernels::attention_amx`] on AMX,
/// else [`crate::kernels::attention_bf16`]); otherwise
/// [`attention_reference`].
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, mask: AttentionMask) -> Result<Tensor> {
    attention_with(q, k, v, scale, mask, AttentionMode::Full)
}

/// [`attention`] with the score matrix formed as `mode` says. The fused kernel
/// never forms it (its scratch is one tile), so where it runs `mode` changes nothing.
pub fn attention_with(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, mask: AttentionMask, mode: AttentionMode) -> Result<Tensor> {
    if q.device().is_cpu() && crate::kernels::fused_attention_on_cpu() {
        let f32 = |t: &Tensor| t.to_dtype(candle_core::DType::F32);
        let (q32, k32, v32, causal) = (f32(q)?, f32(k)?, f32(v)?, mask == AttentionMask::Causal);
        // `--compute bf16`: both products on AMX tiles or with AVX512-BF16.
        use crate::kernels::{attention_amx::attention_amx, attention_bf16::attention_bf16, flash_attention::flash_attention, Bf16Attention};
        let o = match crate::kernels::bf16_attention() {
            Some(Bf16Attention::Tiles) => attention_amx(&q32, &k32, &v32, scale, causal)?,
            Some(Bf16Attention::Vectors) => attention_bf16(&q32, &k32, &v32, scale, causal)?,
            None => flash_attention(&q32, &k32, &v32, scale, causal)?,
        };
        return o.to_dtype(q.dtype());
    }
    attention_reference_with(q, k, v, scale, mask, mode)
}

/// The plain candle path: full score matrix, softmax, matmul. What the kernel is
/// proven against, and what runs on other devices or with `--kernels reference`.
pub fn attention_reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, mask: AttentionMask) -> Result<Tensor> {
    attention_reference_with(q, k, v, scale, mask, AttentionMode::Full)
}

/// The plain path with the queries taken `mode`'s chunk at a time, so the score
/// buffer is bounded where the fused kernel does not run.
pub fn attention_reference_with(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, mask: AttentionMask, mode: AttentionMode) -> Result<Tensor> {
    let dtype = q.dtype();
    let k = k.to_dtype(candle_core::DType::F32)?.contiguous()?;
    let v = v.to_dtype(candle_core::DType::F32)?.contiguous()?;
    let kt = k.t()?;
    let nq = q.dim(D::Minus2)?;
    let chunk = match mode {
        AttentionMode::Full => nq,
        AttentionMode::Chunked(c) => c.get().min(nq),
    };
    if chunk >= nq {
        let q = q.to_dtype(candle_core::DType::F32)?.contiguous()?;
        return attend_rows(&q, &kt, &v, scale, mask, 0)?.to_dtype(dtype);
    }
    let mut outs = Vec::with_capacity(nq.div_ceil(chunk));
    let mut start = 0;
    while start < nq {
        let len = chunk.min(nq - start);
        let qc = q.narrow(D::Minus2, start, len)?.to_dtype(candle_core::DType::F32)?.contiguous()?;
        outs.push(attend_rows(&qc, &kt, &v, scale, mask, start)?);
        start += len;
    }
    Tensor::cat(&outs, D::Minus2)?.to_dtype(dtype)
}

/// Attention for the queries `first..first + q.rows` (the offset places the causal mask).
fn attend_rows(q: &Tensor, kt: &Tensor, v: &Tensor, scale: f64, mask: AttentionMask, first: usize) -> Result<Tensor> {
    let scores = (q.matmul(kt)? * scale)?;
    let scores = match mask {
        AttentionMask::None => scores,
        AttentionMask::Causal => {
            let (nq, nk) = (scores.dim(D::Minus2)?, scores.dim(D::Minus1)?);
            let mask: Vec<f32> = (first..first + nq)
                .flat_map(|i| (0..nk).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
                .collect();
            let mask = Tensor::from_vec(mask, (nq, nk), scores.device())?;
            scores.broadcast_add(&mask)?
        }
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    probs.matmul(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn chunked_attention_equals_full() {
        // Self-attention (odd sizes so the last chunk is short), cross-attention, and causal.
        for (nq, nk, mask) in [(37, 37, AttentionMask::None), (50, 7, AttentionMask::None), (23, 23, AttentionMask::Causal)] {
            let q = rand(&[2, 3, nq, 8], 1);
            let k = rand(&[2, 3, nk, 8], 2);
            let v = rand(&[2, 3, nk, 8], 3);
            let full = attention_reference(&q, &k, &v, 0.35, mask).unwrap();
            for chunk in [1, 5, 16, nq - 1, nq, 4 * nq] {
                let mode = AttentionMode::Chunked(NonZeroUsize::new(chunk).unwrap());
                let got = attention_reference_with(&q, &k, &v, 0.35, mask, mode).unwrap();
                assert_eq!(got.dims(), full.dims());
                let d = max_diff(&got, &full);
                assert!(d <= 1e-6, "nq {nq} nk {nk} {mask:?} chunk {chunk}: max diff {d}");
            }
        }
    }

    #[test]
    fn chunks_see_every_key() {
        // A key only the last query chunk would miss if keys were chunked too.
        let q = Tensor::ones((1, 1, 8, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let mut kd = vec![0f32; 16];
        kd[14] = 10.0;
        let k = Tensor::from_vec(kd, (1, 1, 8, 2), &Device::Cpu).unwrap();
        let v = rand(&[1, 1, 8, 2], 9);
        let mode = AttentionMode::Chunked(NonZeroUsize::new(3).unwrap());
        let got = attention_reference_with(&q, &k, &v, 1.0, AttentionMask::None, mode).unwrap();
        let full = attention_reference(&q, &k, &v, 1.0, AttentionMask::None).unwrap();
        assert!(max_diff(&got, &full) <= 1e-6);
    }
}
