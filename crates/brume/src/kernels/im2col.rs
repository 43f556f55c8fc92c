//! The patch matrix of a convolution (im2col): the layers' general path and the 3x3
//! conv's GEMM route for the smallest maps both multiply by it.

use rayon::prelude::*;

/// Unfolds output rows `oy0..oy0 + rows` of one image into [c * kh * kw, rows * wo]
/// patch columns (zero padding). Channels are unfolded in parallel: on two cores a
/// serial unfold of a 320-channel 3x3 layer costs about a tenth of its GEMM.
#[allow(clippy::too_many_arguments)]
pub(crate) fn im2col(img: &[f32], c: usize, h: usize, w: usize, kh: usize, kw: usize, s: usize, p: usize, oy0: usize, rows: usize, wo: usize, cols: &mut [f32]) {
    let hw = rows * wo;
    let per_channel = kh * kw * hw;
    cols[..c * per_channel].par_chunks_mut(per_channel).enumerate().for_each(|(ci, block)| {
        let plane = &img[ci * h * w..(ci + 1) * h * w];
        for ky in 0..kh {
            for kx in 0..kw {
                let row = &mut block[(ky * kw + kx) * hw..][..hw];
                for r in 0..rows {
                    let iy = ((oy0 + r) * s + ky) as isize - p as isize;
                    let out = &mut row[r * wo..(r + 1) * wo];
                    if iy < 0 || iy >= h as isize {
                        out.fill(0.0);
                        continue;
                    }
                    let src = &plane[iy as usize * w..(iy as usize + 1) * w];
                    if s == 1 {
                        // Stride 1: a shifted copy of the input row, zeros where it overhangs.
                        // Output x reads input x + shift; valid for x in lo..hi.
                        let shift = kx as isize - p as isize;
                        let lo = (-shift).clamp(0, wo as isize) as usize;
                        let hi = (w as isize - shift).clamp(lo as isize, wo as isize) as usize;
                        out[..lo].fill(0.0);
                        out[hi..].fill(0.0);
                        let start = (lo as isize + shift) as usize;
                        out[lo..hi].copy_from_slice(&src[start..start + (hi - lo)]);
                    } else {
                        for (ox, o) in out.iter_mut().enumerate() {
                            let ix = (ox * s + kx) as isize - p as isize;
                            *o = if ix < 0 || ix >= w as isize { 0.0 } else { src[ix as usize] };
                        }
                    }
                }
            }
        }
    });
}
