//! The worker threads of the CPU kernels ([`crate::cpu_linear`]).
//!
//! A decode step calls a linear kernel about 200 times, each a few tens of microseconds of
//! work. Starting threads per call (`std::thread::scope`) cost ~50 microseconds per call here,
//! more than the work; a pool's idle workers pick a job up in a few. The pool is rayon's, built
//! on first use with one thread per CPU, and built again in a forked child (a fork copies only
//! the calling thread, so the parent's workers do not exist there and a job handed to them would
//! never run).

use std::sync::{Arc, Mutex, TryLockError};

use rayon::{ThreadPool, ThreadPoolBuilder};

/// `(pid of the process that built it, the pool)`.
static POOL: Mutex<Option<(u32, Arc<ThreadPool>)>> = Mutex::new(None);

fn pool() -> Option<Arc<ThreadPool>> {
    let pid = std::process::id();
    // `try_lock`: a fork while another thread held the lock leaves it locked for good in the
    // child; the caller then runs its jobs itself rather than wait forever.
    let mut slot = match POOL.try_lock() {
        Ok(guard) => guard,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => return None,
    };
    if let Some((owner, pool)) = slot.as_ref() {
        if *owner == pid {
            return Some(Arc::clone(pool));
        }
        // A forked child: the parent's workers are not here. Dropping the pool would signal
        // them; forgetting it leaks only its bookkeeping.
        if let Some((_, stale)) = slot.take() {
            std::mem::forget(stale);
        }
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("pagedkv-cpu-{i}"))
        .build()
        .ok()
        .map(Arc::new)?;
    *slot = Some((pid, Arc::clone(&pool)));
    Some(pool)
}

/// `[job(0), job(1), ..., job(jobs - 1)]`, job 0 on the calling thread and the others on the
/// pool's workers at the same time (all on the calling thread if there is no pool). A job that
/// panics gives `T::default()` (the callers check their results' sizes and report an error):
/// no panic leaves this function.
pub fn run_jobs<T: Send + Default>(jobs: usize, job: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let job = |i: usize| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(i))).unwrap_or_default()
    };
    let mut results: Vec<T> = (0..jobs).map(|_| T::default()).collect();
    let pool = if jobs > 1 { pool() } else { None };
    match pool {
        Some(pool) => {
            let job = &job;
            pool.in_place_scope(|s| {
                let mut slots = results.iter_mut().enumerate();
                let first = slots.next();
                for (i, slot) in slots {
                    s.spawn(move |_| *slot = job(i));
                }
                if let Some((_, slot)) = first {
                    *slot = job(0);
                }
            });
        }
        None => {
            for (i, slot) in results.iter_mut().enumerate() {
                *slot = job(i);
            }
        }
    }
    results
}
