//! Any bytes as a safetensors file: opened with every entry inside the file, or a typed error.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // `from_static` wants 'static bytes: leaked for the call, then freed once
    // the file (the only holder) is dropped.
    let leaked: &'static mut [u8] = Box::leak(data.to_vec().into_boxed_slice());
    let ptr: *mut [u8] = leaked;
    {
        let bytes: &'static [u8] = unsafe { &*ptr };
        if let Ok(f) = brume::loading::safetensors::SafetensorsFile::from_static(std::path::Path::new("fuzz.safetensors"), bytes) {
            for e in f.entries().values() {
                assert!(f.bytes(e).len() <= bytes.len());
                let _ = e.numel();
            }
            let _ = f.metadata().len();
        }
    }
    // SAFETY: the only reference (inside the dropped file) is gone.
    unsafe { drop(Box::from_raw(ptr)) };
});
