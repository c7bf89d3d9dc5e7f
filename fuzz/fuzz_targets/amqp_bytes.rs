//! Coverage-guided fuzzing of every decoder an AMQP client can reach:
//! `cargo +nightly fuzz run amqp_bytes -- -max_total_time=60`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    warren_amqp::fuzz::exercise(data);
});
