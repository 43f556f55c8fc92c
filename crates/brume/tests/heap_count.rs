//! The counting allocator gives memory reports the exact private-memory peak:
//! an allocation that lives far shorter than the sampling interval still counts.

use std::time::Duration;

use brume::runtime::memory::{heap, release_reused_blocks, reset_heap_peak, reuse_stats, CountingAllocator, PeakWatch};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const MIB: u64 = 1 << 20;

/// The counters are process-wide: the tests take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_spike_between_samples_is_in_the_peak() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (live_before, _) = heap().expect("the counting allocator is installed");
    // One sample at the start, the next after an hour: only the count can see the spike.
    let watch = PeakWatch::start(Duration::from_secs(3600));
    std::thread::sleep(Duration::from_millis(50));
    {
        let spike = vec![1u8; (64 * MIB) as usize];
        std::hint::black_box(&spike);
    }
    let (live_after, peak) = heap().unwrap();
    assert!(peak >= live_before + 64 * MIB, "heap peak {peak} misses the 64 MiB spike (live before {live_before})");
    assert!(live_after < live_before + MIB, "the spike was freed: live {live_after} vs {live_before}");
    let (_, dirty) = watch.finish();
    if let Some(dirty) = dirty {
        // Linux reports private dirty memory; the peak includes the spike.
        assert!(dirty >= 64 * MIB, "private dirty peak {dirty} misses the spike");
    }
}

/// Bytes other threads may allocate or free while a test measures: the counters
/// are process-wide, and the test harness's own threads keep running (a run once
/// saw the live count 24 bytes short of an exact 16 MiB). Far below the sizes the
/// tests allocate, so an allocation path that is not counted still fails them.
const OTHERS: u64 = 256 << 10;

#[test]
fn realloc_and_zeroed_allocations_are_counted() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (before, _) = heap().unwrap();
    let mut v: Vec<u8> = Vec::with_capacity(MIB as usize);
    v.resize((8 * MIB) as usize, 7);
    let (grown, _) = heap().unwrap();
    assert!(grown + OTHERS >= before + 8 * MIB, "realloc not counted: live {grown} vs before {before}");
    let z = vec![0u64; MIB as usize];
    let (live, _) = heap().unwrap();
    assert!(live + OTHERS >= grown + 8 * MIB, "zeroed allocation not counted: live {live} vs {grown}");
    drop((v, z));
    let (after, _) = heap().unwrap();
    assert!(after < before + MIB, "freed: {after} vs {before}");
}

/// Freed large blocks come back for the same size (zeroed when asked), but only
/// while kept plus live bytes stay within the counted peak: a new peak releases
/// them, so the count still bounds private memory.
#[test]
fn freed_large_blocks_are_reused_within_the_peak() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    reset_heap_peak();
    assert_eq!(reuse_stats().0, 0, "a new peak releases every kept block");
    let within_peak = || {
        let (held, _) = reuse_stats();
        let (live, peak) = heap().unwrap();
        assert!(held + live <= peak + OTHERS, "kept {held} + live {live} past the peak {peak}");
    };
    let a = vec![1u8; (8 * MIB) as usize];
    std::hint::black_box(&a);
    drop(a);
    let (held, hits) = reuse_stats();
    assert!(held >= 8 * MIB, "the freed 8 MiB block was not kept ({held} bytes held)");
    within_peak();
    // Same size, zeroed: the kept block (full of ones) comes back cleared.
    let b = vec![0u8; (8 * MIB) as usize];
    assert!(reuse_stats().1 > hits, "the kept block was not reused");
    assert!(b.iter().all(|&x| x == 0), "a reused block asked for zeroed must be zeroed");
    within_peak();
    drop(b);
    // Past the peak: kept blocks go back to the system first.
    let c = vec![2u8; (16 * MIB) as usize];
    std::hint::black_box(&c);
    assert!(reuse_stats().0 < MIB, "a new peak must release what is kept");
    within_peak();
    drop(c);
    within_peak();
    release_reused_blocks();
    assert_eq!(reuse_stats().0, 0);
}

/// Freed neighbours merge: two 4 MiB blocks freed side by side serve an 8 MiB one
/// from their resident pages (zeroed when asked), not from fresh ones.
#[test]
fn freed_neighbours_serve_a_larger_block() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    reset_heap_peak();
    let a = vec![3u8; (4 * MIB) as usize];
    let b = vec![4u8; (4 * MIB) as usize];
    let adjacent = a.as_ptr() as u64 + 4 * MIB == b.as_ptr() as u64;
    std::hint::black_box((&a, &b));
    drop((a, b));
    let (held, hits) = reuse_stats();
    assert!(held >= 8 * MIB, "both freed blocks are kept resident ({held} bytes)");
    let c = vec![0u8; (8 * MIB) as usize];
    // Unix reserves the range the blocks are carved from; elsewhere they are the system's.
    if cfg!(unix) {
        assert!(adjacent, "two large blocks asked for in a row lie side by side");
        assert!(reuse_stats().1 > hits, "the merged range was not reused");
    }
    assert!(c.iter().all(|&x| x == 0), "a reused block asked for zeroed must be zeroed");
    let (held, _) = reuse_stats();
    let (live, peak) = heap().unwrap();
    assert!(held + live <= peak + OTHERS, "kept {held} + live {live} past the peak {peak}");
}
