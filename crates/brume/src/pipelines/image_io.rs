//! Turning image tensors into files and back.

use std::path::Path;

use candle_core::Tensor;

use crate::error::{Result, RunError};

/// Converts [1, 3, H, W] in [0, 1] to 8-bit RGB the way diffusers does (`round(x * 255)`).
pub fn to_rgb8(image: &Tensor) -> Result<image::RgbImage> {
    let (n, c, h, w) = image.dims4()?;
    if n != 1 || c != 3 {
        return Err(RunError::Invalid(format!("expected one RGB image, got shape {:?}", image.dims())));
    }
    let data = image.squeeze(0)?.permute((1, 2, 0))?.flatten_all()?.to_vec1::<f32>()?;
    let bytes: Vec<u8> = data.iter().map(|v| (v.clamp(0.0, 1.0) * 255.0).round() as u8).collect();
    image::RgbImage::from_raw(w as u32, h as u32, bytes)
        .ok_or_else(|| RunError::Invalid("image buffer size mismatch".into()))
}

/// Writes a PNG atomically: a failed write (full disk) leaves no partial file.
pub fn save_png(img: &image::RgbImage, path: &Path) -> Result<()> {
    let mut buf = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut buf), image::ImageFormat::Png)
        .map_err(|e| RunError::Invalid(format!("PNG encoding failed: {e}")))?;
    crate::util::atomic_write(path, |w| std::io::Write::write_all(w, &buf)).map_err(|source| RunError::Write {
        path: path.to_path_buf(),
        source,
    })
}
