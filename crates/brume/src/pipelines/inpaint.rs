//! Inpainting and outpainting: repaint where the mask is white, keep the rest.
//!
//! Two ways, as diffusers' `StableDiffusionInpaintPipeline`: 9-channel
//! inpainting UNets see the mask and the masked image's latents as extra input
//! channels; ordinary UNets denoise freely and, after every step, the original
//! re-noised to the next step's level replaces the sample outside the mask.
//! Either way brume then pastes the result back over the original through a
//! feathered mask, so pixels outside the mask come back exactly as they were.

use candle_core::{DType, Tensor};

use super::conditioning::{conditioning, ConditioningCache};
use super::decode::decode;
use super::denoise::{denoise, load_unet, Inpainting, RunOptions};
use super::img2img::{encode_image, load_encoder, start_index};
use super::model::SdModel;
use super::request::{GenerationRequest, Generated, ProgressFn};
use crate::error::{Result, RunError};
use crate::samplers::NoiseSource;

/// How the result is composited over the original.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PasteBack {
    /// Blur radius (pixels) of the mask edge, inside the mask only.
    pub feather: usize,
}

/// Inpaints `image` ([1, 3, H, W] in [-1, 1]) where `mask` ([1, 1, H, W] in [0, 1])
/// is >= 0.5. `paste_back: None` returns diffusers' output as is.
#[allow(clippy::too_many_arguments)]
pub fn inpaint(
    model: &SdModel,
    req: &GenerationRequest,
    image: &Tensor,
    mask: &Tensor,
    strength: f64,
    paste_back: Option<PasteBack>,
    opts: &RunOptions,
    noise: &mut dyn NoiseSource,
    cache: Option<&mut ConditioningCache>,
    progress: ProgressFn,
) -> Result<Generated> {
    let (_, _, h, w) = image.dims4()?;
    if mask.dims() != [1, 1, h, w] {
        return Err(RunError::Invalid(format!("mask has shape {:?}; expected [1, 1, {h}, {w}]", mask.dims())));
    }
    let req = GenerationRequest {
        width: w,
        height: h,
        ..req.clone()
    };
    req.validate(model)?;
    let lat = model.vae_config.latent_channels();
    let concat = match model.unet_config.in_channels {
        c if c == lat => false,
        c if c == 2 * lat + 1 => true,
        c => return Err(RunError::Invalid(format!("a UNet with {c} input channels cannot inpaint"))),
    };
    // diffusers' mask processor: binarise at 0.5.
    let mask_bin = mask.ge(0.5)?.to_dtype(DType::F32)?;
    if mask_bin.sum_all()?.to_scalar::<f32>()? == 0.0 {
        return Err(RunError::Invalid("the mask is empty: paint white where the image should change".into()));
    }
    let masked_image = image.broadcast_mul(&mask_bin.lt(0.5)?.to_dtype(DType::F32)?)?;
    opts.check(crate::memory::Checkpoint::BeforeSegment(crate::loading::Segment::TextEncoder))?;
    let cond = conditioning(model, &req, &opts.device, opts.dtype, cache, progress)?;
    opts.done_with(model, crate::loading::Segment::TextEncoder);
    let mut sampler = req.build_sampler(model)?;
    let start = start_index(req.steps, strength, sampler.order())?;
    let full_strength = strength >= 1.0;
    let f = model.vae_config.scale_factor();
    let shape = [req.batch, lat, h / f, w / f];

    // Random draws in diffusers' order: image latents (when used), the noise,
    // then the masked image's latents.
    let (image_latents, n, masked_latents) = {
        let enc = load_encoder(model, opts, progress)?;
        let image_latents = if !concat || !full_strength {
            Some(encode_image(model, &enc, image, req.batch, opts, noise)?)
        } else {
            None
        };
        let n = noise.randn(&shape, &opts.device)?;
        let masked_latents = encode_image(model, &enc, &masked_image, req.batch, opts, noise)?;
        (image_latents, n, masked_latents)
    };
    opts.done_with(model, crate::loading::Segment::VaeEncoder);
    let latents = match (&image_latents, full_strength) {
        (Some(il), false) => sampler.add_noise(il, &n, start)?,
        _ => (&n * sampler.init_noise_sigma())?,
    };
    let mask_latent = Tensor::cat(&vec![&mask_bin.upsample_nearest2d(h / f, w / f)?; req.batch], 0)?;
    let extra = if concat {
        Inpainting::Concat {
            mask: mask_latent,
            masked_image_latents: masked_latents,
        }
    } else {
        Inpainting::Blend {
            image_latents: image_latents.ok_or_else(|| RunError::Invalid("image latents missing".into()))?,
            mask: mask_latent,
            noise: n,
        }
    };
    let latents = {
        let unet = load_unet(model, opts, progress)?;
        denoise(&unet, &cond, req.guidance_scale, sampler.as_mut(), latents, start, Some(&extra), noise, opts, progress)?
    };
    opts.done_with(model, crate::loading::Segment::Unet);
    let generated = decode(model, &latents, opts, progress)?;
    let image = match paste_back {
        Some(p) => composite(image, &generated, &mask_bin, p.feather)?,
        None => generated,
    };
    Ok(Generated { image, latents })
}

/// `original * (1 - soft) + generated * soft`, with `soft` the binary mask blurred
/// by `feather` pixels and cut to the mask, so it is exactly 0 outside the mask
/// (those pixels are the original's, bit for bit) and ramps up inside the edge.
pub fn composite(original: &Tensor, generated: &Tensor, mask_bin: &Tensor, feather: usize) -> Result<Tensor> {
    let orig01 = ((original + 1.0)? / 2.0)?.clamp(0f32, 1f32)?;
    let soft = if feather == 0 {
        mask_bin.clone()
    } else {
        (box_blur(mask_bin, feather)? * mask_bin)?
    };
    let keep = (soft.ones_like()? - &soft)?;
    Ok((orig01.broadcast_mul(&keep)? + generated.broadcast_mul(&soft)?)?)
}

/// Separable box blur of a [1, 1, H, W] map with edge clamping.
fn box_blur(m: &Tensor, r: usize) -> Result<Tensor> {
    let (_, _, h, w) = m.dims4()?;
    let v = m.flatten_all()?.to_vec1::<f32>()?;
    let pass = |src: &[f32], horizontal: bool| -> Vec<f32> {
        let mut out = vec![0f32; src.len()];
        let (outer, inner) = if horizontal { (h, w) } else { (w, h) };
        for o in 0..outer {
            for i in 0..inner {
                let lo = i.saturating_sub(r);
                let hi = i.saturating_add(r).min(inner - 1);
                let mut acc = 0f32;
                for j in lo..=hi {
                    acc += if horizontal { src[o * w + j] } else { src[j * w + o] };
                }
                let idx = if horizontal { o * w + i } else { i * w + o };
                out[idx] = acc / (hi - lo + 1) as f32;
            }
        }
        out
    };
    let blurred = pass(&pass(&v, true), false);
    Ok(Tensor::from_vec(blurred, (1, 1, h, w), m.device())?)
}

/// Outpainting's canvas: the image placed on a larger one extended by
/// (left, top, right, bottom) pixels (then rounded up to the VAE factor on the
/// right and bottom), the new border filled by repeating the edge pixels, and a
/// mask that is white on the new area plus `overlap` pixels into the original so
/// the seam is repainted too.
pub fn outpaint_canvas(image: &Tensor, extend: [usize; 4], overlap: usize, factor: usize) -> Result<(Tensor, Tensor)> {
    let (_, c, h, w) = image.dims4()?;
    let [l, t, r, b] = extend;
    if extend.iter().all(|&x| x == 0) {
        return Err(RunError::Invalid("outpainting needs at least one side to extend".into()));
    }
    // Sides come from the user: sums checked so a huge one is the size error below, not an overflow.
    let too_big = || RunError::Invalid(format!("extending {w}x{h} by {extend:?} is over the size limit"));
    let (sw, sh) = (w.checked_add(l).and_then(|x| x.checked_add(r)).ok_or_else(too_big)?, h.checked_add(t).and_then(|x| x.checked_add(b)).ok_or_else(too_big)?);
    if sw > super::image_io::MAX_SIDE as usize || sh > super::image_io::MAX_SIDE as usize {
        return Err(too_big());
    }
    let round_up = |x: usize| x.div_ceil(factor) * factor;
    let (nw, nh) = (round_up(sw), round_up(sh));
    let (r, b) = (nw - w - l, nh - h - t);
    if nw > super::image_io::MAX_SIDE as usize || nh > super::image_io::MAX_SIDE as usize {
        return Err(RunError::Invalid(format!("the extended canvas {nw}x{nh} is over the size limit")));
    }
    // Edge replication: index maps into the original.
    let cols: Vec<u32> = (0..nw).map(|x| x.saturating_sub(l).min(w - 1) as u32).collect();
    let rows: Vec<u32> = (0..nh).map(|y| y.saturating_sub(t).min(h - 1) as u32).collect();
    let dev = image.device();
    let canvas = image
        .index_select(&Tensor::new(rows.as_slice(), dev)?, 2)?
        .index_select(&Tensor::new(cols.as_slice(), dev)?, 3)?;
    debug_assert_eq!(canvas.dims(), [1, c, nh, nw]);
    let ov = |extended: usize| if extended > 0 { overlap } else { 0 };
    let (x0, y0) = (l + ov(l), t + ov(t));
    let (x1, y1) = ((l + w).saturating_sub(ov(r)), (t + h).saturating_sub(ov(b)));
    let mask: Vec<f32> = (0..nh)
        .flat_map(|y| (0..nw).map(move |x| if x >= x0 && x < x1 && y >= y0 && y < y1 { 0.0 } else { 1.0 }))
        .collect();
    Ok((canvas, Tensor::from_vec(mask, (1, 1, nh, nw), dev)?))
}
