//! A persistent helper thread for two-way parallel matmuls, with no thread spawn per call.
//!
//! [`run2`] runs `job(0)` on the calling thread and `job(1)` on one process-wide helper thread,
//! and returns when both are done. The helper spins for a short while after each job (so the
//! ~120 matmuls of one forward do not pay a wake-up each) and then parks on a condition
//! variable. If the helper is busy with another caller, both parts run on the calling thread.
//! Jobs should split work dynamically (e.g. an atomic counter of tiles) so that a helper that
//! the OS has descheduled does not hold the caller up; results must not depend on which thread
//! computes what (true of our matmuls: every output value is computed by the same code).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long the helper spins for the next job before parking.
const SPIN: Duration = Duration::from_micros(200);

/// A borrowed job, passed to the helper as a raw fat pointer.
#[derive(Clone, Copy)]
struct JobPtr(*const (dyn Fn(usize) + Sync));

// SAFETY: the pointee is `Sync`, and `run2` keeps it alive until the helper reports the job
// done (see `run2`), so sending the pointer to the helper thread is sound.
unsafe impl Send for JobPtr {}

struct Shared {
    /// Held by the caller for the whole of a `run2`.
    busy: Mutex<()>,
    job: Mutex<Option<JobPtr>>,
    /// Number of jobs posted / completed.
    posted: AtomicU64,
    done: AtomicU64,
    /// Whether the helper is parked (guarded by the mutex, signalled by `wake`).
    parked: Mutex<bool>,
    wake: Condvar,
}

fn shared() -> &'static Shared {
    static S: OnceLock<&'static Shared> = OnceLock::new();
    S.get_or_init(|| {
        let s: &'static Shared = Box::leak(Box::new(Shared {
            busy: Mutex::new(()),
            job: Mutex::new(None),
            posted: AtomicU64::new(0),
            done: AtomicU64::new(0),
            parked: Mutex::new(false),
            wake: Condvar::new(),
        }));
        let spawned = std::thread::Builder::new()
            .name("fast-matmul-helper".into())
            .spawn(move || helper(s));
        if spawned.is_err() {
            // No helper: mark the pool permanently busy so that every caller runs alone.
            std::mem::forget(s.busy.lock());
        }
        s
    })
}

fn helper(s: &'static Shared) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        while s.posted.load(Ordering::Acquire) == seen {
            if start.elapsed() > SPIN {
                let mut parked = s.parked.lock().unwrap_or_else(|e| e.into_inner());
                *parked = true;
                while s.posted.load(Ordering::Acquire) == seen {
                    parked = s.wake.wait(parked).unwrap_or_else(|e| e.into_inner());
                }
                *parked = false;
                break;
            }
            std::hint::spin_loop();
        }
        seen = s.posted.load(Ordering::Acquire);
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(f)) = job {
            // SAFETY: the caller of `run2` keeps `*f` alive until it sees `done == seen`,
            // which is stored only after this call returns.
            let f = unsafe { &*f };
            // A panicking job must still report completion, or the caller would wait forever.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(1)));
        }
        s.done.store(seen, Ordering::Release);
    }
}

/// Runs `job(0)` here and `job(1)` on the helper thread (or both here when the helper is busy
/// or unavailable), returning when both have finished.
pub(crate) fn run2(job: &(dyn Fn(usize) + Sync)) {
    let s = shared();
    let Ok(_guard) = s.busy.try_lock() else {
        job(0);
        job(1);
        return;
    };
    let ptr: *const (dyn Fn(usize) + Sync + '_) = job;
    // SAFETY: only the lifetime is erased; the helper dereferences the pointer only while this
    // function waits below (also on unwind) for `done` to reach this job's number, so `job`
    // outlives every use.
    let ptr: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(ptr) };
    *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(ptr));
    let id = s.posted.fetch_add(1, Ordering::AcqRel) + 1;
    if *s.parked.lock().unwrap_or_else(|e| e.into_inner()) {
        s.wake.notify_one();
    }
    /// Waits for the helper even if `job(0)` panics, so the borrowed job outlives its use.
    struct Wait<'a>(&'a Shared, u64);
    impl Drop for Wait<'_> {
        fn drop(&mut self) {
            let mut spins = 0u32;
            while self.0.done.load(Ordering::Acquire) < self.1 {
                spins += 1;
                if spins > 1 << 12 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }
    let _wait = Wait(s, id);
    job(0);
}
