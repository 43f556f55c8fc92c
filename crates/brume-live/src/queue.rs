//! The bounded queue between two stages. When it is full, [`WhenFull::DropOldest`]
//! throws away the oldest waiting frame instead of making the producer wait: a live
//! source (a camera) cannot be paused, and a frame that waited is worth less than
//! the newest one, so latency stays bounded by the queue's length. Drops are counted.
//! [`WhenFull::Block`] makes the producer wait instead (a file whose every frame is wanted).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};

/// What a full queue does with a new item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenFull {
    /// Drop the oldest waiting item (never blocks the producer).
    DropOldest,
    /// Wait for room.
    Block,
}

struct State<T> {
    items: VecDeque<T>,
    closed: bool,
    dropped: u64,
    pushed: u64,
}

/// A bounded multi-producer, multi-consumer queue (in practice one of each).
pub struct DropQueue<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
    room: Condvar,
    capacity: usize,
    when_full: WhenFull,
}

/// What happened to a pushed item.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed<T> {
    /// Queued, nothing dropped.
    Queued,
    /// Queued; this older item was dropped to make room.
    DroppedOldest(T),
    /// The queue is closed: the item comes back.
    Closed(T),
}

impl<T> DropQueue<T> {
    /// A queue of at most `capacity` items (at least 1).
    pub fn new(capacity: usize, when_full: WhenFull) -> Self {
        Self {
            state: Mutex::new(State {
                items: VecDeque::new(),
                closed: false,
                dropped: 0,
                pushed: 0,
            }),
            ready: Condvar::new(),
            room: Condvar::new(),
            capacity: capacity.max(1),
            when_full,
        }
    }

    /// A poisoned lock only means another stage panicked; its state is still a valid queue.
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `item`; with [`WhenFull::DropOldest`] it never waits.
    pub fn push(&self, item: T) -> Pushed<T> {
        let mut s = self.lock();
        if self.when_full == WhenFull::Block {
            while s.items.len() >= self.capacity && !s.closed {
                s = self.room.wait(s).unwrap_or_else(|p| p.into_inner());
            }
        }
        if s.closed {
            return Pushed::Closed(item);
        }
        let dropped = if s.items.len() >= self.capacity {
            s.dropped += 1;
            s.items.pop_front()
        } else {
            None
        };
        s.items.push_back(item);
        s.pushed += 1;
        drop(s);
        self.ready.notify_one();
        match dropped {
            Some(d) => Pushed::DroppedOldest(d),
            None => Pushed::Queued,
        }
    }

    /// The oldest item, waiting for one; `None` once the queue is closed and empty.
    pub fn pop(&self) -> Option<T> {
        let mut s = self.lock();
        loop {
            if let Some(item) = s.items.pop_front() {
                drop(s);
                self.room.notify_one();
                return Some(item);
            }
            if s.closed {
                return None;
            }
            s = self.ready.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// No more pushes: waiting consumers drain what is left, then get `None`;
    /// a producer's next push gets its item back.
    pub fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
        self.room.notify_all();
    }

    /// Items dropped to make room so far.
    pub fn dropped(&self) -> u64 {
        self.lock().dropped
    }

    /// Items accepted so far.
    pub fn pushed(&self) -> u64 {
        self.lock().pushed
    }

    pub fn len(&self) -> usize {
        self.lock().items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
