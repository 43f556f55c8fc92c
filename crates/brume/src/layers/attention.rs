use candle_core::{Result, Tensor, D};

/// Which positions a query may attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionMask {
    None,
    /// Query i sees keys 0..=i (CLIP's text transformer).
    Causal,
}

/// Scaled dot-product attention: `softmax(q k^T * scale) v`.
///
/// `q` is [batch, heads, n_q, d], `k` and `v` are [batch, heads, n_k, d]. Scores
/// and softmax run in f32 whatever the input dtype, which is what diffusers'
/// `upcast_attention` / `upcast_softmax` ask for and costs nothing in f32.
///
/// On the CPU in [`KernelMode::Fast`](crate::kernels::KernelMode), where it pays
/// ([`crate::kernels::attention_pays`]), this runs the fused kernel ([`crate::kernels::flash_attention`], no `n_q x n_k` buffer);
/// otherwise [`attention_reference`].
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, mask: AttentionMask) -> Result<Tensor> {
    if crate::kernels::mode() == crate::kernels::KernelMode::Fast && q.device().is_cpu() && crate::kernels::attention_pays() {
        let f32 = |t: &Tensor| t.to_dtype(candle_core::DType::F32);
        let o = crate::kernels::flash_attention::flash_attention(&f32(q)?, &f32(k)?, &f32(v)?, scale, mask == AttentionMask::Causal)?;
        return o.to_dtype(q.dtype());
    }
    attention_reference(q, k, v, scale, mask)
}

/// The plain candle path: full score matrix, softmax, matmul. What the kernel is
/// proven against, and what runs on other devices or with `--kernels reference`.
pub fn attention_reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, mask: AttentionMask) -> Result<Tensor> {
    let dtype = q.dtype();
    let q = q.to_dtype(candle_core::DType::F32)?.contiguous()?;
    let k = k.to_dtype(candle_core::DType::F32)?.contiguous()?;
    let v = v.to_dtype(candle_core::DType::F32)?.contiguous()?;
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let scores = match mask {
        AttentionMask::None => scores,
        AttentionMask::Causal => {
            let (nq, nk) = (scores.dim(D::Minus2)?, scores.dim(D::Minus1)?);
            let mask: Vec<f32> = (0..nq)
                .flat_map(|i| (0..nk).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
                .collect();
            let mask = Tensor::from_vec(mask, (nq, nk), scores.device())?;
            scores.broadcast_add(&mask)?
        }
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    probs.matmul(&v)?.to_dtype(dtype)
}
