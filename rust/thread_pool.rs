//! The worker threads of the CPU kernels ([`crate::cpu_linear`], [`crate::cpu_attention`]).
//!
//! A decode step calls a linear kernel about 200 times, each a few tens of microseconds of
//! work, with a few microseconds of Python between two calls. Starting threads per call
//! (`std::thread::scope`) cost ~50 microseconds a call here, more than the work; rayon's pool,
//! whose idle workers sleep after a few microseconds, still took tens of microseconds to wake
//! one for the next call. So this pool's workers *spin* for [`SPIN`] after their last job
//! (the length of a step's gaps between kernel calls) and only then sleep.
//!
//! One batch of jobs at a time. The submitter publishes the batch in [`Shared::state`], one
//! word: the batch's epoch, its job count and the next unclaimed job. The submitter and every
//! worker claim jobs by compare-and-swap on that word, so a job runs exactly once, and a
//! worker that wakes late (or a submitter whose workers sleep) finds nothing left to claim
//! rather than delaying anyone: the submitter runs whatever nobody else took. It returns once
//! every claimed job has finished, so the batch's closure (which borrows the caller's data)
//! outlives every use of it.
//!
//! A second thread submitting while a batch runs (the lock is taken) runs its jobs itself. A
//! forked child builds a new pool (a fork copies only the calling thread: the parent's workers
//! are not there). A job that panics yields `T::default()`; no panic leaves [`run_jobs`].

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(300);

/// `epoch << 32 | jobs << 16 | next`.
fn pack(epoch: u64, jobs: u64, next: u64) -> u64 {
    (epoch << 32) | (jobs << 16) | next
}

fn unpack(word: u64) -> (u64, u64, u64) {
    (word >> 32, (word >> 16) & 0xffff, word & 0xffff)
}

/// The running batch's job, its lifetime erased (see the module docs for why that is sound).
type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    state: AtomicU64,
    /// Written by the submitter before it publishes the batch's epoch (release), read by a
    /// claimer after its claim (acquire), never written while a claimed job is unfinished.
    job: UnsafeCell<Option<Job>>,
    /// Jobs of the current batch finished.
    done: AtomicUsize,
    /// Workers asleep (or about to be) on `wake`.
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is only written by the single submitter (under `Pool::submit`) while no claimed
// job is running, and read by claimers after their claim; the closure it points to is `Sync`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

impl Shared {
    /// Claims and runs jobs of batch `epoch` until none is left; returns how many it ran.
    fn work(&self, epoch: u64) -> usize {
        let mut ran = 0;
        loop {
            let word = self.state.load(Ordering::Acquire);
            let (e, jobs, next) = unpack(word);
            if e != epoch || next >= jobs {
                return ran;
            }
            if self
                .state
                .compare_exchange_weak(word, word + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            // SAFETY: the claim succeeded for this epoch, so the batch's submitter is still
            // waiting for this job and its closure is alive and published in `job`.
            if let Some(job) = unsafe { *self.job.get() } {
                let job = unsafe { &*job };
                let _ = catch_unwind(AssertUnwindSafe(|| job(next as usize)));
            }
            self.done.fetch_add(1, Ordering::Release);
            ran += 1;
        }
    }

    fn worker_loop(&self) {
        let mut seen = unpack(self.state.load(Ordering::Acquire)).0;
        loop {
            let epoch = self.wait_for_batch(seen);
            seen = epoch;
            self.work(epoch);
        }
    }

    /// Spins (then sleeps) until a batch newer than `seen` is published; returns its epoch.
    fn wait_for_batch(&self, seen: u64) -> u64 {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let epoch = unpack(self.state.load(Ordering::Acquire)).0;
            if epoch != seen {
                return epoch;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            if start.elapsed() < SPIN {
                // Let another runnable thread of this core (torch's, the caller's) go first.
                std::thread::yield_now();
                continue;
            }
            let guard = self.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            if unpack(self.state.load(Ordering::SeqCst)).0 == seen {
                // The timeout is a backstop only: a publisher that saw `sleepers` notifies.
                let _ = self.wake.wait_timeout(guard, Duration::from_millis(100));
            }
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            // Woken (or timed out): the loop looks again, and sleeps again without spinning
            // if nothing came.
        }
    }
}

struct Pool {
    pid: u32,
    workers: usize,
    shared: Arc<Shared>,
    submit: Mutex<u64>,
}

static POOL: Mutex<Option<Arc<Pool>>> = Mutex::new(None);

fn pool() -> Option<Arc<Pool>> {
    let pid = std::process::id();
    // `try_lock`: a fork while another thread held the lock leaves it locked for good in the
    // child; the caller then runs its jobs itself rather than wait forever.
    let mut slot = match POOL.try_lock() {
        Ok(guard) => guard,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => return None,
    };
    if let Some(pool) = slot.as_ref() {
        if pool.pid == pid {
            return Some(Arc::clone(pool));
        }
        // A forked child: the parent's workers are not here; forget their pool.
        if let Some(stale) = slot.take() {
            std::mem::forget(stale);
        }
    }
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()) - 1;
    let shared = Arc::new(Shared {
        state: AtomicU64::new(0),
        job: UnsafeCell::new(None),
        done: AtomicUsize::new(0),
        sleepers: AtomicUsize::new(0),
        sleep_lock: Mutex::new(()),
        wake: Condvar::new(),
    });
    let mut started = 0;
    for i in 0..workers {
        let s = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name(format!("pagedkv-cpu-{i}"))
            .spawn(move || s.worker_loop());
        if spawned.is_ok() {
            started += 1;
        }
    }
    let pool = Arc::new(Pool {
        pid,
        workers: started,
        shared,
        submit: Mutex::new(0),
    });
    *slot = Some(Arc::clone(&pool));
    Some(pool)
}

/// `[job(0), job(1), ..., job(jobs - 1)]`, run at the same time on the calling thread and the
/// pool's workers (all on the calling thread if there is no pool, it is busy with another
/// caller's batch, or the workers are asleep and slow to wake). A job that panics gives
/// `T::default()` (the callers check their results' sizes and report an error).
pub fn run_jobs<T: Send + Default>(jobs: usize, job: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let results: Vec<Mutex<T>> = (0..jobs).map(|_| Mutex::new(T::default())).collect();
    let run = |i: usize| {
        if let Ok(v) = catch_unwind(AssertUnwindSafe(|| job(i))) {
            *results[i].lock().unwrap_or_else(|p| p.into_inner()) = v;
        }
    };
    let pool = if jobs > 1 && jobs <= 0xffff {
        pool()
    } else {
        None
    };
    let guard = pool
        .as_ref()
        .filter(|p| p.workers > 0)
        .and_then(|p| p.submit.try_lock().ok().map(|g| (p, g)));
    match guard {
        Some((pool, mut epoch)) => {
            let shared = &pool.shared;
            let erased: &(dyn Fn(usize) + Sync) = &run;
            // SAFETY: the pointer is only used by claimers of this batch's jobs, and this
            // function does not return before every claimed job has finished (below).
            let erased: Job =
                unsafe { std::mem::transmute(erased as *const (dyn Fn(usize) + Sync)) };
            *epoch = (*epoch + 1) & 0xffff_ffff;
            // SAFETY: no job of an earlier batch is running (each batch waited for its own).
            unsafe { *shared.job.get() = Some(erased) };
            shared.done.store(0, Ordering::Relaxed);
            shared
                .state
                .store(pack(*epoch, jobs as u64, 0), Ordering::SeqCst);
            if shared.sleepers.load(Ordering::SeqCst) > 0 {
                let _lock = shared.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
                shared.wake.notify_all();
            }
            shared.work(*epoch);
            let mut spins = 0u32;
            while shared.done.load(Ordering::Acquire) < jobs {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            // SAFETY: every job of the batch has finished; nobody reads `job` any more.
            unsafe { *shared.job.get() = None };
        }
        None => (0..jobs).for_each(run),
    }
    results
        .into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::run_jobs;

    #[test]
    fn every_job_runs_once_in_order_and_panics_give_the_default() {
        for round in 0..200 {
            let jobs = 1 + round % 5;
            let out = run_jobs(jobs, |i| i * 10 + round);
            assert_eq!(out, (0..jobs).map(|i| i * 10 + round).collect::<Vec<_>>());
        }
        let out = run_jobs(3, |i| if i == 1 { panic!("job 1") } else { i + 1 });
        assert_eq!(out, vec![1, 0, 3]);
    }

    #[test]
    fn callers_on_several_threads_each_get_their_own_results() {
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for _ in 0..100 {
                        assert_eq!(run_jobs(2, |i| t * 100 + i), vec![t * 100, t * 100 + 1]);
                    }
                });
            }
        });
    }
}
