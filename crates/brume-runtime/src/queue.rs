//! The job queue: interactive jobs before batch jobs, first come first served
//! within each, with a bound checked by the caller.

use std::collections::VecDeque;

use crate::job::{JobId, Priority};

#[derive(Debug, Default)]
pub struct Queue {
    interactive: VecDeque<JobId>,
    batch: VecDeque<JobId>,
}

impl Queue {
    pub fn len(&self) -> usize {
        self.interactive.len() + self.batch.len()
    }

    pub fn push(&mut self, id: JobId, priority: Priority) {
        match priority {
            Priority::Interactive => self.interactive.push_back(id),
            Priority::Batch => self.batch.push_back(id),
        }
    }

    /// Puts a preempted batch job back at the head of its queue: it was first
    /// among batch jobs and stays first.
    pub fn push_front(&mut self, id: JobId, priority: Priority) {
        match priority {
            Priority::Interactive => self.interactive.push_front(id),
            Priority::Batch => self.batch.push_front(id),
        }
    }

    /// The next job to run.
    pub fn pop(&mut self) -> Option<JobId> {
        self.interactive.pop_front().or_else(|| self.batch.pop_front())
    }

    pub fn remove(&mut self, id: JobId) -> bool {
        if let Some(i) = self.interactive.iter().position(|&j| j == id) {
            self.interactive.remove(i);
            return true;
        }
        if let Some(i) = self.batch.iter().position(|&j| j == id) {
            self.batch.remove(i);
            return true;
        }
        false
    }

    /// In run order.
    pub fn iter(&self) -> impl Iterator<Item = JobId> + '_ {
        self.interactive.iter().chain(self.batch.iter()).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interactive_jobs_run_first_and_preempted_ones_keep_their_place() {
        let mut q = Queue::default();
        q.push(JobId(1), Priority::Batch);
        q.push(JobId(2), Priority::Batch);
        q.push(JobId(3), Priority::Interactive);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![JobId(3), JobId(1), JobId(2)]);
        assert_eq!(q.pop(), Some(JobId(3)));
        assert_eq!(q.pop(), Some(JobId(1)));
        // Job 1 was preempted: back at the head of the batch queue, ahead of 2.
        q.push(JobId(4), Priority::Interactive);
        q.push_front(JobId(1), Priority::Batch);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![JobId(4), JobId(1), JobId(2)]);
        assert!(q.remove(JobId(1)));
        assert!(!q.remove(JobId(1)));
        assert_eq!(q.len(), 2);
    }
}
