//! Any bytes as an edit's image and mask: decoded within the image limits and
//! adapted to the VAE, or refused.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(img) = brume::pipelines::image_io::decode_image(data, "fuzz") else { return };
    // The same picture as image and as mask, and as a mask for a fixed 32x32 image.
    let Ok(loaded) = brume::pipelines::image_io::prepare_image(img.clone(), 8) else { return };
    let _ = brume::pipelines::image_io::prepare_mask(img.clone(), "mask", &loaded);
    let base = image::DynamicImage::ImageRgb8(image::RgbImage::new(32, 32));
    if let Ok(fixed) = brume::pipelines::image_io::prepare_image(base, 8) {
        let _ = brume::pipelines::image_io::prepare_mask(img, "mask", &fixed);
    }
});
