//! The length-prefixed envelope that carries every peer frame on a byte stream.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::WireError;

/// Bytes of the length prefix in front of every frame (a big-endian `u32`).
pub const LEN_PREFIX: usize = 4;

/// The default maximum frame size: 16 MiB, room for a batch of large messages.
pub const DEFAULT_MAX_FRAME_LEN: usize = 16 * 1024 * 1024;

/// Appends one frame (length prefix, then `payload`) to `dst`.
///
/// Refuses a payload over `max_frame_len` without touching `dst`.
pub fn encode_frame(
    payload: &[u8],
    max_frame_len: usize,
    dst: &mut BytesMut,
) -> Result<(), WireError> {
    if payload.len() > max_frame_len || payload.len() > u32::MAX as usize {
        return Err(WireError::FrameTooLarge {
            len: payload.len(),
            max: max_frame_len,
        });
    }
    dst.reserve(LEN_PREFIX + payload.len());
    dst.put_u32(payload.len() as u32);
    dst.put_slice(payload);
    Ok(())
}

/// Splits whole frames off the front of a receive buffer.
#[derive(Debug, Clone, Copy)]
pub struct FrameDecoder {
    max_frame_len: usize,
}

impl FrameDecoder {
    /// A decoder that refuses frames over `max_frame_len` bytes.
    pub fn new(max_frame_len: usize) -> Self {
        Self { max_frame_len }
    }

    /// The maximum frame size this decoder accepts.
    pub fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }

    /// Takes the next whole frame off `src`, or `None` if more bytes are needed.
    ///
    /// A frame announced as longer than the maximum is refused as soon as its
    /// prefix arrives, before its body is buffered. When more bytes are needed,
    /// `src` is grown to hold the whole frame, so a reader can fill it in one go.
    pub fn decode(&self, src: &mut BytesMut) -> Result<Option<Bytes>, WireError> {
        if src.len() < LEN_PREFIX {
            return Ok(None);
        }
        let len = u32::from_be_bytes([src[0], src[1], src[2], src[3]]) as usize;
        if len > self.max_frame_len {
            return Err(WireError::FrameTooLarge {
                len,
                max: self.max_frame_len,
            });
        }
        if src.len() < LEN_PREFIX + len {
            src.reserve(LEN_PREFIX + len - src.len());
            return Ok(None);
        }
        src.advance(LEN_PREFIX);
        Ok(Some(src.split_to(len).freeze()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips_empty_and_small_frames() {
        let mut buf = BytesMut::new();
        encode_frame(b"", 16, &mut buf).unwrap();
        encode_frame(b"hello", 16, &mut buf).unwrap();
        let dec = FrameDecoder::new(16);
        assert_eq!(dec.decode(&mut buf).unwrap().unwrap(), Bytes::new());
        assert_eq!(
            dec.decode(&mut buf).unwrap().unwrap(),
            Bytes::from_static(b"hello")
        );
        assert_eq!(dec.decode(&mut buf).unwrap(), None);
    }

    #[test]
    fn refuses_oversized_frames_both_ways() {
        let mut buf = BytesMut::new();
        assert_eq!(
            encode_frame(&[0; 17], 16, &mut buf),
            Err(WireError::FrameTooLarge { len: 17, max: 16 })
        );
        assert!(buf.is_empty());
        encode_frame(&[0; 17], 32, &mut buf).unwrap();
        assert_eq!(
            FrameDecoder::new(16).decode(&mut buf),
            Err(WireError::FrameTooLarge { len: 17, max: 16 })
        );
    }

    #[test]
    fn waits_for_a_partial_frame() {
        let mut whole = BytesMut::new();
        encode_frame(b"abcdef", 64, &mut whole).unwrap();
        let dec = FrameDecoder::new(64);
        let mut partial = BytesMut::from(&whole[..7]);
        assert_eq!(dec.decode(&mut partial).unwrap(), None);
        partial.extend_from_slice(&whole[7..]);
        assert_eq!(
            dec.decode(&mut partial).unwrap().unwrap(),
            Bytes::from_static(b"abcdef")
        );
    }

    proptest! {
        #[test]
        fn any_frames_split_anywhere_round_trip(
            frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..20),
            cut in any::<prop::sample::Index>(),
        ) {
            let mut wire = BytesMut::new();
            for f in &frames {
                encode_frame(f, 1024, &mut wire).unwrap();
            }
            let cut = if wire.is_empty() { 0 } else { cut.index(wire.len()) };
            let dec = FrameDecoder::new(1024);
            let mut buf = BytesMut::from(&wire[..cut]);
            let mut out = Vec::new();
            while let Some(f) = dec.decode(&mut buf).unwrap() { out.push(f.to_vec()); }
            buf.extend_from_slice(&wire[cut..]);
            while let Some(f) = dec.decode(&mut buf).unwrap() { out.push(f.to_vec()); }
            prop_assert_eq!(out, frames);
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512), max in 0usize..256) {
            let dec = FrameDecoder::new(max);
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Some(_)) = dec.decode(&mut buf) {}
        }
    }
}
