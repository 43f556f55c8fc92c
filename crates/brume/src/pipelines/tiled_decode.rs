//! VAE decoding in overlapping latent tiles, one tile at a time, blended at
//! the seams: the decoder's activations (about 0.8 GB at 512x512 for SD's VAE)
//! shrink to one tile's, at the price of a picture that differs slightly near
//! the seams (the decoder's receptive field, and its mid-block attention, see
//! only the tile). Each tile's pixels are weighted by a linear ramp across the
//! overlap, so neighbours cross-fade instead of meeting at a hard edge.

use candle_core::{DType, Tensor};

use super::model::AnyVaeDecoder;
use crate::error::Result;
use crate::memory::TileSpec;

/// Tile origins along an axis of `len` latent pixels; the last tile ends at the edge.
fn origins(len: usize, spec: TileSpec) -> Vec<usize> {
    let tile = spec.tile();
    if len <= tile {
        return vec![0];
    }
    let mut out: Vec<usize> = (0..).map(|i| i * spec.stride()).take_while(|&o| o + tile < len).collect();
    out.push(len - tile);
    out.dedup();
    out
}

/// Blend weight of pixel `x` (0-based inside a tile of `size` pixels): ramps up
/// over `ramp` pixels from each inner edge, 1 elsewhere; never zero.
fn weight(x: usize, size: usize, ramp: usize, left_inner: bool, right_inner: bool) -> f32 {
    let mut w = 1f32;
    if ramp > 0 {
        if left_inner {
            w = w.min((x as f32 + 0.5) / ramp as f32);
        }
        if right_inner {
            w = w.min((size - x) as f32 / ramp as f32 - 0.5 / ramp as f32);
        }
    }
    w.max(1e-3)
}

/// Decodes unscaled latents [B, C, h, w] tile by tile to images [B, 3, h*f, w*f]
/// (decoder output range, before the [0, 1] mapping).
pub fn decode_tiled(dec: &AnyVaeDecoder, z: &Tensor, spec: TileSpec, f: usize) -> Result<Tensor> {
    let (b, _, h, w) = z.dims4()?;
    let (ys, xs) = (origins(h, spec), origins(w, spec));
    let (th, tw) = (spec.tile().min(h), spec.tile().min(w));
    let (hp, wp) = (h * f, w * f);
    let ramp = spec.overlap() * f;
    let mut acc = vec![0f32; b * 3 * hp * wp];
    let mut wsum = vec![0f32; hp * wp];
    for (iy, &y0) in ys.iter().enumerate() {
        for (ix, &x0) in xs.iter().enumerate() {
            let tile = z.narrow(2, y0, th)?.narrow(3, x0, tw)?.contiguous()?;
            let out = dec.decode(&tile)?.to_dtype(DType::F32)?;
            let (ob, oc, oh, ow) = out.dims4()?;
            if (ob, oc, oh, ow) != (b, 3, th * f, tw * f) {
                return Err(crate::error::RunError::Invalid(format!("tiled decode: a {th}x{tw} tile decoded to {:?}", out.dims())));
            }
            let data = out.flatten_all()?.to_vec1::<f32>()?;
            let (py, px) = (y0 * f, x0 * f);
            let wy: Vec<f32> = (0..oh).map(|y| weight(y, oh, ramp, iy > 0, iy + 1 < ys.len())).collect();
            let wx: Vec<f32> = (0..ow).map(|x| weight(x, ow, ramp, ix > 0, ix + 1 < xs.len())).collect();
            for y in 0..oh {
                for x in 0..ow {
                    wsum[(py + y) * wp + px + x] += wy[y] * wx[x];
                }
            }
            for n in 0..b {
                for c in 0..3 {
                    let src = &data[(n * 3 + c) * oh * ow..][..oh * ow];
                    let dst = &mut acc[(n * 3 + c) * hp * wp..][..hp * wp];
                    for y in 0..oh {
                        let row = &mut dst[(py + y) * wp + px..][..ow];
                        for (x, d) in row.iter_mut().enumerate() {
                            *d += src[y * ow + x] * wy[y] * wx[x];
                        }
                    }
                }
            }
        }
    }
    for plane in acc.chunks_mut(hp * wp) {
        for (v, s) in plane.iter_mut().zip(&wsum) {
            *v /= s;
        }
    }
    Ok(Tensor::from_vec(acc, (b, 3, hp, wp), z.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_every_latent_pixel() {
        let spec = TileSpec::new(8, 2).unwrap();
        for len in [1, 5, 8, 9, 13, 14, 20, 64] {
            let o = origins(len, spec);
            let mut covered = vec![false; len];
            for &s in &o {
                for c in covered.iter_mut().skip(s).take(spec.tile()) {
                    *c = true;
                }
            }
            assert!(covered.iter().all(|&c| c), "len {len}: {o:?}");
            assert!(o.iter().all(|&s| s + spec.tile().min(len) <= len), "len {len}: {o:?}");
        }
        assert!(TileSpec::new(8, 8).is_none() && TileSpec::new(0, 0).is_none());
    }

    #[test]
    fn weights_ramp_only_at_inner_edges() {
        assert_eq!(weight(0, 64, 16, false, false), 1.0);
        assert!(weight(0, 64, 16, true, false) < 0.05);
        assert!(weight(63, 64, 16, false, true) < 0.05);
        assert_eq!(weight(32, 64, 16, true, true), 1.0);
    }
}
