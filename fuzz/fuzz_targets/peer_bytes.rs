//! Coverage-guided fuzzing of every peer-facing decoder:
//! `cargo +nightly fuzz run peer_bytes -- -max_total_time=60`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    warren_wire::fuzz::exercise(data);
});
