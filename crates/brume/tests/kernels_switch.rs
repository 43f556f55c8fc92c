//! The process-wide kernel switch: `KernelMode::Reference` runs candle's plain
//! path bit for bit, `Fast` the kernels, and a whole UNet gives the same answer
//! both ways. One test in its own binary, because the switch is process-wide.

mod common;

use brume::kernels::{mode, set_mode, KernelMode};
use brume::layers::{attention, attention_reference, AttentionMask, GroupNorm};
use brume::samplers::Rng;
use candle_core::{Device, Tensor};
use common::{assert_close, rel_err};

fn bit_equal(a: &Tensor, b: &Tensor) -> bool {
    let f = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    f(a) == f(b)
}

fn unet_sd1() -> (Tensor, Tensor) {
    let (unet, io) = common::unet_fixture("unet_sd1");
    (common::unet_forward(&unet, &io), io.f32("out.sample"))
}

#[test]
fn switch_selects_the_path_and_a_whole_unet_agrees() {
    assert_eq!(mode(), KernelMode::Fast, "fast is the default");
    let dev = Device::Cpu;
    let mut rng = Rng::new(7);
    let q = rng.randn(&[2, 4, 70, 40], &dev).unwrap();
    let k = rng.randn(&[2, 4, 77, 40], &dev).unwrap();
    let x = rng.randn(&[2, 64, 9, 9], &dev).unwrap();
    let gn = GroupNorm::from_tensors(rng.randn(&[64], &dev).unwrap(), rng.randn(&[64], &dev).unwrap(), 32, 1e-5).unwrap();
    let plain_attn = attention_reference(&q, &k, &k, 0.15, AttentionMask::None).unwrap();
    let plain_gn = gn.forward_reference(&x).unwrap();

    let fast_attn = attention(&q, &k, &k, 0.15, AttentionMask::None).unwrap();
    let fast_gn = gn.forward(&x).unwrap();
    // The kernels ran: close, but not the plain path's bits (attention keeps the
    // plain path where the kernel does not pay: an x86-64 without AVX2).
    assert_eq!(bit_equal(&fast_attn, &plain_attn), !brume::kernels::attention_pays());
    assert!(rel_err(&fast_attn, &plain_attn) <= 1e-5);
    assert!(!bit_equal(&fast_gn, &plain_gn) && rel_err(&fast_gn, &plain_gn) <= 1e-5);
    let (fast_unet, want) = unet_sd1();
    assert_close("unet_sd1, fast kernels vs diffusers", &fast_unet, &want, 1e-4);

    set_mode(KernelMode::Reference);
    assert!(bit_equal(&attention(&q, &k, &k, 0.15, AttentionMask::None).unwrap(), &plain_attn));
    assert!(bit_equal(&gn.forward(&x).unwrap(), &plain_gn));
    let (plain_unet, _) = unet_sd1();
    set_mode(KernelMode::Fast);
    assert_close("unet_sd1, plain path vs diffusers", &plain_unet, &want, 1e-4);
    assert_close("unet_sd1, fast kernels vs plain path", &fast_unet, &plain_unet, 1e-5);
}
