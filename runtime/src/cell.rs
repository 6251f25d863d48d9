//! The newest generation seen, shared between the async watcher and the thread that works
//! through generations (the trainer's, or a launcher's).

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ductile_cluster::records::Generation;

/// How to abort the work of one generation (its communicator), so a call blocked in it returns
/// at once when a newer generation appears.
pub type AbortFn = Arc<dyn Fn() + Send + Sync>;

#[derive(Default)]
pub struct GenCell {
    latest: Mutex<Option<Generation>>,
    cv: Condvar,
    abort: Mutex<Option<(u64, AbortFn)>>,
}

impl GenCell {
    /// A newer generation: remember it and abort the work of any older one.
    pub fn publish(&self, g: Generation) {
        let mut l = self.latest.lock().unwrap();
        if l.as_ref().is_some_and(|o| o.number >= g.number) {
            return;
        }
        let n = g.number;
        *l = Some(g);
        drop(l);
        self.cv.notify_all();
        if let Some((gen, abort)) = &*self.abort.lock().unwrap() {
            if *gen < n {
                tracing::info!(
                    generation = gen,
                    newer = n,
                    "new generation: aborting the communicator"
                );
                abort();
            }
        }
    }

    /// The newest generation's number (0 before the first).
    pub fn newest(&self) -> u64 {
        self.latest
            .lock()
            .unwrap()
            .as_ref()
            .map(|g| g.number)
            .unwrap_or(0)
    }

    /// The newest generation seen, if any.
    pub fn latest(&self) -> Option<Generation> {
        self.latest.lock().unwrap().clone()
    }

    /// The newest generation, once there is one newer than `than`.
    pub fn wait_newer(&self, than: u64) -> Generation {
        let mut l = self.latest.lock().unwrap();
        loop {
            if let Some(g) = l.as_ref().filter(|g| g.number > than) {
                return g.clone();
            }
            l = self.cv.wait(l).unwrap();
        }
    }

    /// A generation newer than `than`, or None after `bound`.
    pub fn wait_newer_for(&self, than: u64, bound: Duration) -> Option<Generation> {
        let deadline = Instant::now() + bound;
        let mut l = self.latest.lock().unwrap();
        loop {
            if let Some(g) = l.as_ref().filter(|g| g.number > than) {
                return Some(g.clone());
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            l = self.cv.wait_timeout(l, left).unwrap().0;
        }
    }

    /// The work of `generation` is aborted by `abort` from now on (at once if a newer
    /// generation is already here).
    pub fn install(&self, generation: u64, abort: AbortFn) {
        // installed first, then checked: a generation published in between aborts it either
        // way
        *self.abort.lock().unwrap() = Some((generation, abort.clone()));
        if self.newest() > generation {
            abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn gen(number: u64) -> Generation {
        Generation::data_parallel("j", number, &[])
    }

    #[test]
    fn a_newer_generation_aborts_the_installed_work_once_and_an_older_one_is_ignored() {
        let cell = GenCell::default();
        cell.publish(gen(3));
        let aborts = Arc::new(AtomicU32::new(0));
        let a = aborts.clone();
        cell.install(
            3,
            Arc::new(move || {
                a.fetch_add(1, Ordering::SeqCst);
            }),
        );
        cell.publish(gen(2));
        assert_eq!(aborts.load(Ordering::SeqCst), 0, "an older generation");
        assert_eq!(cell.newest(), 3);
        cell.publish(gen(4));
        assert_eq!(aborts.load(Ordering::SeqCst), 1);
        assert_eq!(cell.wait_newer(3).number, 4);
        assert!(cell.wait_newer_for(4, Duration::from_millis(20)).is_none());
        // work installed for a generation already superseded is aborted at once
        let late = Arc::new(AtomicU32::new(0));
        let l = late.clone();
        cell.install(
            3,
            Arc::new(move || {
                l.fetch_add(1, Ordering::SeqCst);
            }),
        );
        assert_eq!(late.load(Ordering::SeqCst), 1);
    }
}
