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

/// Writes a PNG by the output rule ([`crate::output`]) with `force`: it
/// replaces at most a regular file, never a symlink, folder or device. Prefer
/// [`save_png_to`], which also keeps a file created during the run.
pub fn save_png(img: &image::RgbImage, path: &Path, recipe: Option<&super::recipe::Recipe>) -> Result<()> {
    save_png_to(img, &crate::output::Output::new(path, true), recipe).map(|_| ())
}

/// Writes a PNG by the output rule (see [`crate::output::Output::write`]): a
/// failed write leaves no partial file, and without `force` nothing at the name
/// is replaced (a file that appeared during the run is kept and the result goes
/// next to it: see [`crate::output::Written::notice`]).
pub fn save_png_to(
    img: &image::RgbImage,
    out: &crate::output::Output,
    recipe: Option<&super::recipe::Recipe>,
) -> Result<crate::output::Written> {
    let buf = super::recipe::encode_png(img, recipe)?;
    Ok(out.write_bytes(&buf)?)
}

/// Largest side accepted for an input image.
pub const MAX_SIDE: u32 = 4096;

/// An input image ready for the VAE, and how it was adapted.
pub struct LoadedImage {
    /// [1, 3, H, W] in [-1, 1].
    pub tensor: Tensor,
    /// Size of the file's picture.
    pub original: (u32, u32),
    /// Size used (multiples of 8).
    pub size: (u32, u32),
}

/// The rule for sizes that are not multiples of the VAE factor, as diffusers'
/// image processor does: each side is rounded down to a multiple of `factor` and
/// the picture is resized (Lanczos) to it. A side under `factor` is an error.
pub fn working_size(w: u32, h: u32, factor: u32) -> Result<(u32, u32)> {
    if w > MAX_SIDE || h > MAX_SIDE {
        return Err(RunError::Invalid(format!("image is {w}x{h}; the largest accepted side is {MAX_SIDE}")));
    }
    let (nw, nh) = (w - w % factor, h - h % factor);
    if nw == 0 || nh == 0 {
        return Err(RunError::Invalid(format!("image is {w}x{h}; each side must be at least {factor} pixels")));
    }
    Ok((nw, nh))
}

fn open_image(path: &Path, what: &str) -> Result<image::DynamicImage> {
    let reader = image::ImageReader::open(path)
        .map_err(|e| RunError::Invalid(format!("{what} {}: cannot open: {e}", path.display())))?
        .with_guessed_format()
        .map_err(|e| RunError::Invalid(format!("{what} {}: cannot read: {e}", path.display())))?;
    if reader.format().is_none() {
        return Err(RunError::Invalid(format!(
            "{what} {}: not an image (PNG, JPEG or WebP expected)",
            path.display()
        )));
    }
    reader
        .decode()
        .map_err(|e| RunError::Invalid(format!("{what} {}: cannot decode: {e}", path.display())))
}

fn resize_to(img: image::DynamicImage, size: (u32, u32)) -> image::DynamicImage {
    if (img.width(), img.height()) == size {
        img
    } else {
        img.resize_exact(size.0, size.1, image::imageops::FilterType::Lanczos3)
    }
}

/// Reads an RGB image (alpha dropped) for img2img / inpainting.
pub fn load_image(path: &Path, factor: u32) -> Result<LoadedImage> {
    prepare_image(open_image(path, "image")?, factor)
}

/// Decodes an image held in memory (an upload to the service), with the same
/// limits as a file: `what` names it in errors (e.g. `init_images[0]`).
pub fn decode_image(bytes: &[u8], what: &str) -> Result<image::DynamicImage> {
    let mut reader = image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| RunError::Invalid(format!("{what}: cannot read: {e}")))?;
    if reader.format().is_none() {
        return Err(RunError::Invalid(format!("{what}: not an image (PNG, JPEG or WebP expected)")));
    }
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(MAX_SIDE);
    limits.max_image_height = Some(MAX_SIDE);
    limits.max_alloc = Some(512 * 1024 * 1024);
    reader.limits(limits);
    reader.decode().map_err(|e| RunError::Invalid(format!("{what}: cannot decode: {e}")))
}

/// An already decoded picture, adapted to the VAE as [`load_image`] does.
pub fn prepare_image(img: image::DynamicImage, factor: u32) -> Result<LoadedImage> {
    let original = (img.width(), img.height());
    let size = working_size(original.0, original.1, factor)?;
    let rgb = resize_to(img, size).to_rgb8();
    Ok(LoadedImage {
        tensor: rgb_to_tensor(&rgb)?,
        original,
        size,
    })
}

/// [1, 3, H, W] in [-1, 1] from 8-bit RGB, as diffusers (`x / 255 * 2 - 1`).
pub fn rgb_to_tensor(rgb: &image::RgbImage) -> Result<Tensor> {
    let (w, h) = rgb.dimensions();
    let data: Vec<f32> = rgb.as_raw().iter().map(|&v| v as f32 / 255.0).collect();
    let t = Tensor::from_vec(data, (h as usize, w as usize, 3), &candle_core::Device::Cpu)?;
    Ok(((t.permute((2, 0, 1))?.unsqueeze(0)? * 2.0)? - 1.0)?)
}

/// Reads a mask (white = repaint) of exactly the image's size: [1, 1, H, W] in [0, 1].
pub fn load_mask(path: &Path, image: &LoadedImage) -> Result<Tensor> {
    prepare_mask(open_image(path, "mask")?, &format!("mask {}", path.display()), image)
}

/// A decoded mask (white = repaint) checked against the image's size and adapted
/// as [`load_mask`] does; `what` names it in errors.
pub fn prepare_mask(img: image::DynamicImage, what: &str, image: &LoadedImage) -> Result<Tensor> {
    if (img.width(), img.height()) != image.original {
        return Err(RunError::Invalid(format!(
            "{what} is {}x{} but the image is {}x{}; they must be the same size",
            img.width(),
            img.height(),
            image.original.0,
            image.original.1
        )));
    }
    let gray = resize_to(img, image.size).to_luma8();
    gray_to_mask(&gray)
}

/// [1, 1, H, W] in [0, 1] from 8-bit gray.
pub fn gray_to_mask(gray: &image::GrayImage) -> Result<Tensor> {
    let (w, h) = gray.dimensions();
    let data: Vec<f32> = gray.as_raw().iter().map(|&v| v as f32 / 255.0).collect();
    Ok(Tensor::from_vec(data, (1, 1, h as usize, w as usize), &candle_core::Device::Cpu)?)
}
