//! The accounts of a `MeasuredMutex` against what real threads did to it.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use warren_lock::MeasuredMutex;

#[test]
fn counts_takes_and_the_time_held() {
    let m = MeasuredMutex::new(0u32);
    for _ in 0..3 {
        *m.lock() += 1;
    }
    {
        let _g = m.lock();
        thread::sleep(Duration::from_millis(30));
    }
    let s = m.stats();
    assert_eq!(s.acquisitions, 4);
    assert_eq!(s.contended, 0);
    assert_eq!(s.wait, Duration::ZERO);
    assert!(s.held >= Duration::from_millis(30), "{s:?}");
    assert_eq!(m.into_inner(), 3);
}

#[test]
fn a_taker_that_finds_it_held_waits_and_is_counted() {
    let m = Arc::new(MeasuredMutex::new(Vec::new()));
    // The waiter may be descheduled until the holder is done (then it
    // waits for nothing): tried again until it did wait.
    for round in 1.. {
        let held = Arc::new(Barrier::new(2));
        let holder = {
            let (m, held) = (Arc::clone(&m), Arc::clone(&held));
            thread::spawn(move || {
                let mut g = m.lock();
                held.wait();
                thread::sleep(Duration::from_millis(50));
                g.push("holder");
            })
        };
        held.wait();
        m.lock().push("waiter");
        holder.join().unwrap();
        assert_eq!(m.lock()[2 * (round - 1)..], ["holder", "waiter"]);
        let s = m.stats();
        // Each round: the holder, the waiter, and the look above.
        assert_eq!(s.acquisitions, 3 * round as u64);
        if s.contended > 0 {
            assert_eq!(s.contended, 1);
            assert!(s.wait > Duration::ZERO, "{s:?}");
            assert!(s.held >= Duration::from_millis(50 * round as u64), "{s:?}");
            break;
        }
        assert_eq!(s.wait, Duration::ZERO);
    }
}

#[test]
fn a_poisoned_lock_is_still_taken_and_counted() {
    let m = Arc::new(MeasuredMutex::new(7u8));
    let m2 = Arc::clone(&m);
    let _ = thread::spawn(move || {
        let _g = m2.lock();
        panic!("poison it");
    })
    .join();
    assert_eq!(*m.lock(), 7);
    assert_eq!(m.stats().acquisitions, 2);
}
