//! Where [`CountingAllocator`](super::memory::CountingAllocator) puts tensors: large
//! blocks carved out of one reserved address range, so a denoising loop's
//! activations land on pages that are already resident.
//!
//! The system allocator maps each block of a MiB or more afresh and unmaps it on
//! free (brume sets that threshold on purpose, so private memory follows what is
//! alive), and every step of a UNet then faulted its activations in again page by
//! page: an SD 1.5 step at 512 px took ~185 000 page faults (~720 MB of pages zeroed
//! and charged by the kernel). Keeping freed blocks by exact size recovered part of
//! it, but a step's sizes come and go in varying mixes and a kept block of one size
//! cannot serve another. Here freed blocks become free ranges that merge with their
//! neighbours and are carved again best-fit, so after the first step the same pages
//! serve nearly every later one: ~41 000 faults a step (what the peak rule below
//! makes it give back and fault in again), system CPU time of a 4-step 512 px run
//! 3.9 -> 1.9 s, median step 5.57 -> 5.44 s (five runs each, alternated, this
//! 2-core Intel host; the pictures byte-identical). `brume bench memory` on the
//! built-in model measured 1-2 MiB more private memory at 256 px and 4-6 MiB more
//! at 512 px than the exact-size cache did (40-41 / 119 against 39.5 / 113-115 MiB;
//! SD 1.5 at 256 px: 232 against 229-231), still within the counted peak: mincore
//! puts the range's resident pages at live + kept bytes. The difference is pages
//! that used to be counted but never touched: a fresh zeroed block from the system
//! reads the shared zero page until written, so a tensor that stays partly zero
//! (padding, a buffer written in part) was counted in full but only partly
//! resident, while a block carved from reused pages is zeroed by writing it
//! (smaps at step 5 of a 512 px built-in run: anonymous memory 18.6 -> 28.3 MB,
//! glibc's heap 12.8 -> 8.8 MB, with the same live and kept counts).
//!
//! The rule that keeps memory reports true stays the exact-size cache's: resident
//! free bytes plus live heap bytes never exceed the counted heap peak. A range is
//! given back to the OS (`madvise(MADV_DONTNEED)`, the addresses stay reserved) when
//! keeping it would break that, so private memory stays within what the count
//! reports and the estimator predicts. The bookkeeping ([`Ranges`]) knows only how
//! many bytes of a free range may be resident, not which: a block carved from a
//! range with any is assumed dirty (zeroed on request), and the remainder keeps as
//! many of the resident bytes as fit in it, so residency is never undercounted.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};

/// Free ranges the bookkeeping holds; a block freed when all are taken (and that
/// merges with none) is given back to the OS and its addresses are not reused.
const MAX_FREE: usize = 512;

/// A free range, in bytes from the reservation's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Free {
    start: usize,
    len: usize,
    /// How many of its bytes may be resident (unknown which).
    resident: usize,
}

const NONE: Free = Free { start: 0, len: 0, resident: 0 };

/// A block carved out of the reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Carved {
    pub offset: usize,
    /// Whether any of its pages may hold old data (else they read as zero).
    pub dirty: bool,
}

/// The free ranges of a reservation of `cap` bytes, of which `top` have ever been
/// handed out. Pure bookkeeping: no memory is touched here.
pub(crate) struct Ranges {
    free: [Free; MAX_FREE],
    n: usize,
    top: usize,
    cap: usize,
    resident: usize,
}

impl Ranges {
    pub(crate) const fn new(cap: usize) -> Self {
        Self { free: [NONE; MAX_FREE], n: 0, top: 0, cap, resident: 0 }
    }

    /// Bytes of free ranges that may be resident.
    pub(crate) fn resident(&self) -> usize {
        self.resident
    }

    fn remove(&mut self, i: usize) -> Free {
        let r = self.free[i];
        self.n -= 1;
        self.free[i] = self.free[self.n];
        self.free[self.n] = NONE;
        r
    }

    /// `size` bytes: the smallest free range that holds them (resident ones first
    /// among equals), else the free range that ends at the top grown past it, else
    /// fresh bytes from the top. Moving the top first asks `grow(new_top)`, which
    /// may refuse. `None` when the reservation cannot hold them (nothing changes).
    pub(crate) fn carve(&mut self, size: usize, grow: impl FnOnce(usize) -> bool) -> Option<Carved> {
        let best = (0..self.n)
            .filter(|&i| self.free[i].len >= size)
            .min_by_key(|&i| (self.free[i].len, self.free[i].resident == 0));
        if let Some(i) = best {
            let r = self.free[i];
            let rest = r.len - size;
            if rest == 0 {
                self.remove(i);
            } else {
                self.free[i] = Free { start: r.start + size, len: rest, resident: r.resident.min(rest) };
            }
            self.resident -= r.resident - r.resident.min(rest);
            return Some(Carved { offset: r.start, dirty: r.resident > 0 });
        }
        if let Some(i) = (0..self.n).find(|&i| self.free[i].start + self.free[i].len == self.top) {
            let r = self.free[i];
            if r.start + size > self.cap || !grow(r.start + size) {
                return None;
            }
            self.remove(i);
            self.resident -= r.resident;
            self.top = r.start + size;
            return Some(Carved { offset: r.start, dirty: r.resident > 0 });
        }
        if self.top + size > self.cap || !grow(self.top + size) {
            return None;
        }
        let offset = self.top;
        self.top += size;
        Some(Carved { offset, dirty: false })
    }

    /// Takes back the block at `offset` (all of it may be resident), merged with the
    /// free ranges on either side. `false` when no slot was left for it: the caller
    /// then gives its pages back to the OS, and its addresses are not used again.
    pub(crate) fn put(&mut self, offset: usize, size: usize) -> bool {
        let mut r = Free { start: offset, len: size, resident: size };
        if let Some(i) = (0..self.n).find(|&i| self.free[i].start + self.free[i].len == offset) {
            let left = self.remove(i);
            r = Free { start: left.start, len: left.len + r.len, resident: left.resident + r.resident };
        }
        if let Some(i) = (0..self.n).find(|&i| self.free[i].start == offset + size) {
            let right = self.remove(i);
            r = Free { start: r.start, len: r.len + right.len, resident: r.resident + right.resident };
        }
        if self.n == MAX_FREE {
            // Only possible when nothing merged (a merge frees a slot); the neighbours' residency is unchanged.
            return false;
        }
        self.resident += size;
        self.free[self.n] = r;
        self.n += 1;
        true
    }

    /// Gives back the tails of free ranges, the most resident range first, until at
    /// most `limit` bytes may be resident; `give_back(start, len)` is called for each
    /// tail. Only what is needed goes: at the peak of a step the deficit is a few MiB
    /// of fragmentation, and giving back whole ranges then re-faulted ~800 MB a step.
    /// Which bytes of a range are resident is not known, so a tail is long enough
    /// that the rest could not hold more than the range's resident bytes less the
    /// deficit; `page` rounds it (tails are whole pages, and so are ranges).
    pub(crate) fn release_to(&mut self, limit: usize, page: usize, mut give_back: impl FnMut(usize, usize)) {
        while self.resident > limit {
            let Some(i) = (0..self.n).filter(|&i| self.free[i].resident > 0).max_by_key(|&i| self.free[i].resident) else {
                break;
            };
            let need = self.resident - limit;
            let r = &mut self.free[i];
            let tail = ((r.len - r.resident) + need).div_ceil(page).saturating_mul(page).min(r.len);
            give_back(r.start + r.len - tail, tail);
            let kept = r.resident.min(r.len - tail);
            self.resident -= r.resident - kept;
            r.resident = kept;
        }
    }
}

/// The process's reservation: mapped on first use; `BASE` is 0 until then and
/// `FAILED` when it could not be (then every block goes to the system allocator).
static BASE: AtomicUsize = AtomicUsize::new(0);
const FAILED: usize = 1;
static PAGE: AtomicUsize = AtomicUsize::new(4096);
/// The reservation's length (written before `BASE` is published).
static CAP: AtomicUsize = AtomicUsize::new(0);
static LOCK: AtomicBool = AtomicBool::new(false);
static HITS: AtomicUsize = AtomicUsize::new(0);

struct Shared(UnsafeCell<Ranges>);
// SAFETY: the ranges are only touched while LOCK is held.
unsafe impl Sync for Shared {}
static RANGES: Shared = Shared(UnsafeCell::new(Ranges::new(0)));

/// Runs `f` on the ranges under the spin lock (an allocator must not allocate,
/// so no Mutex that might).
fn locked<R>(f: impl FnOnce(&mut Ranges) -> R) -> R {
    while LOCK.compare_exchange_weak(false, true, Acquire, Relaxed).is_err() {
        std::hint::spin_loop();
    }
    // SAFETY: the lock is held, so no other thread touches the ranges.
    let r = f(unsafe { &mut *RANGES.0.get() });
    LOCK.store(false, Release);
    r
}

/// The reservation's start once it is made (never maps it).
fn reserved() -> Option<usize> {
    match BASE.load(Acquire) {
        0 | FAILED => None,
        b => Some(b),
    }
}

/// The reservation's start, mapping it on first use (as much address space as the
/// machine has memory: a live set larger than that could not be resident anyway;
/// without access until [`commit`]).
#[cfg(unix)]
fn base() -> Option<usize> {
    match BASE.load(Acquire) {
        FAILED => return None,
        0 => {}
        b => return Some(b),
    }
    locked(|ranges| {
        let b = BASE.load(Acquire);
        if b != 0 {
            return (b != FAILED).then_some(b);
        }
        // SAFETY: sysconf and an anonymous private mapping have no preconditions.
        let (page, pages) = unsafe { (libc::sysconf(libc::_SC_PAGESIZE), libc::sysconf(libc::_SC_PHYS_PAGES)) };
        let cap = if page > 0 && pages > 0 { (page as usize).saturating_mul(pages as usize) } else { 0 };
        let p = if cap == 0 {
            libc::MAP_FAILED
        } else {
            // SAFETY: as above; the mapping is ours alone.
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    cap,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            }
        };
        if p == libc::MAP_FAILED {
            BASE.store(FAILED, Release);
            return None;
        }
        PAGE.store(page as usize, Relaxed);
        CAP.store(cap, Relaxed);
        *ranges = Ranges::new(cap);
        BASE.store(p as usize, Release);
        Some(p as usize)
    })
}

#[cfg(not(unix))]
fn base() -> Option<usize> {
    None
}

/// Bytes at the reservation's start made writable so far (under the lock).
static COMMITTED: AtomicUsize = AtomicUsize::new(0);

/// Makes the reservation writable up to `top`. The reservation is mapped without
/// access, so it is address space only: a writable private mapping counts in full
/// against RLIMIT_DATA (which `brume bench memory` sets to each row's budget) even
/// where no page is touched, and a reservation of the machine's memory made every
/// row fail over to the system allocator. Writable bytes now follow the top, the
/// high-water mark of the live large blocks. `false` (the limit reached) sends the
/// block to the system allocator, which will meet the same limit.
#[cfg(unix)]
fn commit(base: usize, top: usize) -> bool {
    let from = COMMITTED.load(Relaxed);
    if top <= from {
        return true;
    }
    // SAFETY: [from, top) lies in the reservation and is not in use (past the top).
    let ok = unsafe { libc::mprotect((base + from) as *mut libc::c_void, top - from, libc::PROT_READ | libc::PROT_WRITE) } == 0;
    if ok {
        COMMITTED.store(top, Relaxed);
    }
    ok
}

#[cfg(not(unix))]
fn commit(_base: usize, _top: usize) -> bool {
    false
}

/// Gives pages back to the OS; on Linux they read as zero afterwards.
#[cfg(unix)]
fn give_back(base: usize, start: usize, len: usize) {
    // SAFETY: the range lies in the reservation and no block uses it (it is free
    // and the lock is held, so nobody carves it meanwhile).
    unsafe { libc::madvise((base + start) as *mut libc::c_void, len, libc::MADV_DONTNEED) };
}

#[cfg(not(unix))]
fn give_back(_base: usize, _start: usize, _len: usize) {}

/// Whether pages given back read as zero (Linux's MADV_DONTNEED); elsewhere a
/// block carved from them is zeroed on request like any dirty one.
const GIVEN_BACK_READ_ZERO: bool = cfg!(any(target_os = "linux", target_os = "android"));

/// The bytes a block of `size` takes in the reservation (whole pages; the page size
/// is read when the reservation is made, before any block is carved).
pub(crate) fn rounded(size: usize) -> usize {
    let page = PAGE.load(Relaxed);
    size.div_ceil(page) * page
}

/// A block of at least `size` bytes, aligned to `align`, zeroed when asked; `None`
/// when the reservation cannot serve it. `count(bytes)` is called once the block is
/// carved, with its [`rounded`] size: it counts the block live and says how many
/// free bytes may stay resident (the counted peak less the live bytes).
pub(crate) fn alloc(size: usize, align: usize, zeroed: bool, count: impl FnOnce(usize) -> usize) -> Option<*mut u8> {
    // The reservation first: it sets the page size that sizes are rounded to.
    let base = base()?;
    if align > PAGE.load(Relaxed) {
        return None;
    }
    let size = rounded(size);
    let carved = locked(|ranges| {
        let c = ranges.carve(size, |top| commit(base, top))?;
        let limit = count(size);
        ranges.release_to(limit, PAGE.load(Relaxed), |s, l| give_back(base, s, l));
        Some(c)
    })?;
    let p = (base + carved.offset) as *mut u8;
    if carved.dirty {
        HITS.fetch_add(1, Relaxed);
    }
    if zeroed && (carved.dirty || !GIVEN_BACK_READ_ZERO) {
        // SAFETY: the block is ours alone and `size` bytes long.
        unsafe { std::ptr::write_bytes(p, 0, size) };
    }
    Some(p)
}

/// Whether `ptr` came from [`alloc`].
pub(crate) fn owns(ptr: *mut u8) -> bool {
    reserved().is_some_and(|b| (ptr as usize) >= b && (ptr as usize) < b + CAP.load(Relaxed))
}

/// Takes back a block from [`alloc`] of `size` bytes ([`rounded`]); `limit` as there,
/// after the caller counted it freed.
pub(crate) fn free(ptr: *mut u8, size: usize, limit: usize) {
    let base = BASE.load(Acquire);
    locked(|ranges| {
        let offset = ptr as usize - base;
        if !ranges.put(offset, size) {
            give_back(base, offset, size);
        }
        ranges.release_to(limit, PAGE.load(Relaxed), |s, l| give_back(base, s, l));
    });
}

/// Gives resident free bytes back until at most `limit` remain.
pub(crate) fn release_to(limit: usize) {
    let Some(base) = reserved() else { return };
    locked(|ranges| ranges.release_to(limit, PAGE.load(Relaxed), |s, l| give_back(base, s, l)));
}

/// Resident free bytes, and how many blocks were carved from reused pages.
pub(crate) fn stats() -> (usize, usize) {
    (locked(|r| r.resident()), HITS.load(Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: usize = 1 << 20;

    #[test]
    fn freed_neighbours_merge_and_serve_a_larger_block() {
        let mut r = Ranges::new(100 * M);
        let a = r.carve(4 * M, |_| true).unwrap();
        let b = r.carve(8 * M, |_| true).unwrap();
        let c = r.carve(4 * M, |_| true).unwrap();
        assert_eq!((a.offset, b.offset, c.offset), (0, 4 * M, 12 * M));
        assert!(!a.dirty && !b.dirty && !c.dirty, "fresh bytes read as zero");
        assert!(r.put(a.offset, 4 * M) && r.put(b.offset, 8 * M));
        assert_eq!(r.n, 1, "adjacent free blocks are one range");
        assert_eq!(r.resident(), 12 * M);
        // 10 MiB fits the merged 12 MiB range, not the top.
        let d = r.carve(10 * M, |_| true).unwrap();
        assert_eq!(d, Carved { offset: 0, dirty: true });
        assert_eq!(r.resident(), 2 * M, "the 2 MiB left keeps its share of resident bytes");
        assert_eq!(r.top, 16 * M);
    }

    #[test]
    fn best_fit_prefers_the_smallest_range_and_grows_the_top_range() {
        let mut r = Ranges::new(100 * M);
        let blocks: Vec<_> = [6, 1, 3, 1, 2].iter().map(|&s| (r.carve(s * M, |_| true).unwrap().offset, s * M)).collect();
        r.put(blocks[0].0, blocks[0].1); // 6 MiB at 0
        r.put(blocks[2].0, blocks[2].1); // 3 MiB at 7
        r.put(blocks[4].0, blocks[4].1); // 2 MiB at 11, ending at the top
        assert_eq!(r.carve(3 * M, |_| true).unwrap().offset, 7 * M, "the exact fit, not the first");
        // 5 MiB: the 6 MiB range is the only one that holds it.
        assert_eq!(r.carve(5 * M, |_| true).unwrap().offset, 0);
        // 9 MiB: nothing holds it; the 2 MiB range at the top grows by 7 MiB.
        let big = r.carve(9 * M, |_| true).unwrap();
        assert_eq!(big, Carved { offset: 11 * M, dirty: true });
        assert_eq!(r.top, 20 * M);
        assert_eq!(r.resident(), M, "the 1 MiB left of the 6 MiB range");
        assert!(r.carve(81 * M, |_| true).is_none(), "past the reservation");
        assert_eq!(r.carve(80 * M, |_| true).unwrap().offset, 20 * M);
    }

    #[test]
    fn release_gives_back_only_the_deficit_from_the_most_resident_range() {
        let mut r = Ranges::new(100 * M);
        let a = r.carve(8 * M, |_| true).unwrap();
        let _keep = r.carve(M, |_| true).unwrap();
        let b = r.carve(2 * M, |_| true).unwrap();
        let _keep2 = r.carve(M, |_| true).unwrap();
        r.put(a.offset, 8 * M);
        r.put(b.offset, 2 * M);
        let mut given = Vec::new();
        r.release_to(3 * M, 4096, |s, l| given.push((s, l)));
        assert_eq!(given, vec![(M, 7 * M)], "the tail of the largest range, 7 MiB of its 8");
        assert_eq!(r.resident(), 3 * M);
        // Its first MiB may still be resident: a block carved there is dirty.
        let c = r.carve(8 * M, |_| true).unwrap();
        assert_eq!(c, Carved { offset: 0, dirty: true });
        assert_eq!(r.resident(), 2 * M);
        r.release_to(0, 4096, |s, l| given.push((s, l)));
        assert_eq!(r.resident(), 0);
        assert_eq!(given.last(), Some(&(9 * M, 2 * M)));
        // A range given back whole reads as zero.
        r.put(c.offset, 8 * M);
        r.release_to(0, 4096, |s, l| given.push((s, l)));
        assert_eq!(given.last(), Some(&(0, 8 * M)));
        assert_eq!(r.carve(8 * M, |_| true).unwrap(), Carved { offset: 0, dirty: false });
        // A partly resident range gives back enough that the rest cannot hold the deficit:
        // 4 MiB range with 1 MiB possibly resident, limit 0 -> all 4 MiB.
        let mut r = Ranges::new(100 * M);
        let d = r.carve(M, |_| true).unwrap();
        let e = r.carve(3 * M, |_| true).unwrap();
        let _f = r.carve(M, |_| true).unwrap();
        r.put(e.offset, 3 * M);
        r.release_to(0, 4096, |_, _| {});
        r.put(d.offset, M);
        assert_eq!((r.n, r.resident()), (1, M));
        let mut tails = Vec::new();
        r.release_to(0, 4096, |s, l| tails.push((s, l)));
        assert_eq!(tails, vec![(0, 4 * M)]);
    }

    #[test]
    fn a_refused_grow_changes_nothing() {
        let mut r = Ranges::new(100 * M);
        let a = r.carve(2 * M, |top| top == 2 * M).unwrap();
        r.put(a.offset, 2 * M);
        let asked = std::cell::Cell::new(0);
        assert!(r.carve(5 * M, |top| { asked.set(top); false }).is_none());
        assert_eq!(asked.get(), 5 * M, "the range at the top would grow to 5 MiB");
        assert_eq!((r.n, r.top, r.resident()), (1, 2 * M, 2 * M));
        // A block that fits a free range never asks.
        assert_eq!(r.carve(M, |_| panic!("no growth needed")).unwrap().offset, 0);
    }

    #[test]
    fn a_merged_range_counts_both_sides_residency() {
        let mut r = Ranges::new(100 * M);
        let a = r.carve(4 * M, |_| true).unwrap();
        let b = r.carve(4 * M, |_| true).unwrap();
        let _c = r.carve(M, |_| true).unwrap();
        r.put(a.offset, 4 * M);
        r.release_to(0, 4096, |_, _| {});
        r.put(b.offset, 4 * M);
        assert_eq!((r.n, r.resident()), (1, 4 * M), "given-back 4 MiB + resident 4 MiB");
        // A 6 MiB block may hold all 4 resident MiB; the 2 MiB left is counted as fully resident.
        let d = r.carve(6 * M, |_| true).unwrap();
        assert!(d.dirty);
        assert_eq!(r.resident(), 2 * M);
    }

    #[test]
    fn a_full_table_refuses_a_block_that_merges_with_nothing() {
        let mut r = Ranges::new(10_000 * M);
        let blocks: Vec<_> = (0..2 * MAX_FREE + 2).map(|_| r.carve(M, |_| true).unwrap().offset).collect();
        for &b in blocks.iter().step_by(2).take(MAX_FREE) {
            assert!(r.put(b, M));
        }
        assert_eq!(r.n, MAX_FREE);
        assert!(!r.put(blocks[2 * MAX_FREE], M), "no slot and no neighbour");
        assert_eq!(r.resident(), MAX_FREE * M);
        // A neighbour of a free range still merges.
        assert!(r.put(blocks[1], M));
        assert_eq!(r.n, MAX_FREE - 1);
    }
}
