//! Shared set-up for Warren's criterion benches (see `benches/`).
