//! Cheap previews of the latents while denoising, without running the VAE.

use candle_core::Tensor;

use crate::error::{Result, RunError};

/// Linear map from SD 1.x / 2.x latent channels to RGB: a well-known least-squares
/// fit of the VAE's output colours, good enough to see composition and colour.
const LATENT_RGB: [[f32; 3]; 4] = [
    [0.3512, 0.2297, 0.3227],
    [0.3250, 0.4974, 0.2350],
    [-0.2829, 0.1762, 0.2721],
    [-0.2120, -0.2616, -0.7177],
];

/// An RGB preview of the first image's latents [B, 4, h, w], upscaled by `scale`.
pub fn latent_preview(latents: &Tensor, scale: u32) -> Result<image::RgbImage> {
    let (_, c, h, w) = latents.dims4()?;
    if c != 4 {
        return Err(RunError::Invalid(format!("latent previews need 4 latent channels, got {c}")));
    }
    let l = latents.get(0)?.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut img = image::RgbImage::new(w as u32 * scale, h as u32 * scale);
    for y in 0..h {
        for x in 0..w {
            let mut rgb = [0f32; 3];
            for (ch, row) in LATENT_RGB.iter().enumerate() {
                let v = l[ch * h * w + y * w + x];
                for k in 0..3 {
                    rgb[k] += v * row[k];
                }
            }
            let px = image::Rgb(rgb.map(|v| (((v + 1.0) / 2.0).clamp(0.0, 1.0) * 255.0).round() as u8));
            for dy in 0..scale {
                for dx in 0..scale {
                    img.put_pixel(x as u32 * scale + dx, y as u32 * scale + dy, px);
                }
            }
        }
    }
    Ok(img)
}
