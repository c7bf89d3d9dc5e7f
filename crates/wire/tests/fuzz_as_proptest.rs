//! The fuzz target's entry point, driven by proptest on every CI run.

use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        warren_wire::fuzz::exercise(&data);
    }

    /// Inputs that start with a plausible length prefix reach deeper.
    #[test]
    fn framed_random_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..600)) {
        let mut data = (body.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(&body);
        warren_wire::fuzz::exercise(&data);
    }
}

proptest! {
    /// Inputs made of pieces with any of the prefix's kinds (whole, first
    /// of a split frame, next, both) reach the joining of split frames.
    #[test]
    fn pieced_random_bytes_never_panic(
        pieces in proptest::collection::vec((0u32..4, proptest::collection::vec(any::<u8>(), 0..80)), 0..12),
    ) {
        let mut data = Vec::new();
        for (kind, body) in pieces {
            data.extend_from_slice(&((kind << 30) | body.len() as u32).to_be_bytes());
            data.extend_from_slice(&body);
        }
        warren_wire::fuzz::exercise(&data);
    }
}
