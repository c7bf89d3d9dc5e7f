//! The length-prefixed envelope that carries every peer frame on a byte stream.
//!
//! Every frame is sent as one or more *pieces*, each a 4-byte big-endian
//! prefix and at most [`MAX_CHUNK_LEN`] bytes. The prefix's two high bits
//! say what the piece is; the other 30 are its length:
//!
//! - `00`: a whole frame of that length (every frame of at most one chunk:
//!   the bytes are those of the earlier protocol);
//! - `10`: the first piece of a *split* frame: the whole frame's length (a
//!   4-byte big-endian number), then its first bytes;
//! - `01`: the next bytes of the split frame in progress, which is whole
//!   once it has them all.
//!
//! One split frame at a time is in progress on a stream, and whole frames
//! may come between its pieces ([`FrameEncoder`] lets frames of other lanes
//! overtake it). A receiver joins the pieces into one buffer of the
//! announced length, refused at once when over its maximum
//! ([`FrameDecoder`]); a receiver of the earlier protocol reads a piece's
//! prefix as a frame over its maximum and closes the connection.

use std::collections::VecDeque;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::WireError;

/// Bytes of the length prefix in front of every piece (a big-endian `u32`).
pub const LEN_PREFIX: usize = 4;

/// The longest piece a receiver accepts (16 MiB), and the size a sender
/// splits longer frames at unless told a smaller one.
pub const MAX_CHUNK_LEN: usize = 16 * 1024 * 1024;

/// The default maximum frame size: 257 MiB, two messages of the default
/// largest AMQP message size (128 MiB) and their envelopes.
pub const DEFAULT_MAX_FRAME_LEN: usize = 257 * 1024 * 1024;

/// The smallest chunk a [`FrameEncoder`] splits at (a first piece holds the
/// frame's length, then at least some of its bytes).
const MIN_CHUNK_LEN: usize = 16;

/// Prefix bit: the first piece of a split frame.
const FIRST: u32 = 1 << 31;
/// Prefix bit: a further piece of the split frame in progress.
const NEXT: u32 = 1 << 30;
/// The prefix's length bits.
const LEN_MASK: u32 = NEXT - 1;
/// Bytes of a split frame's whole length, at the start of its first piece.
const TOTAL_LEN: usize = 4;

/// Appends one whole frame (length prefix, then `payload`) to `dst`.
///
/// Refuses a payload over `max_frame_len` (or over one piece,
/// [`MAX_CHUNK_LEN`]) without touching `dst`; [`FrameEncoder`] splits
/// longer frames.
pub fn encode_frame(
    payload: &[u8],
    max_frame_len: usize,
    dst: &mut BytesMut,
) -> Result<(), WireError> {
    let max = max_frame_len.min(MAX_CHUNK_LEN);
    if payload.len() > max {
        return Err(WireError::FrameTooLarge {
            len: payload.len(),
            max,
        });
    }
    dst.reserve(LEN_PREFIX + payload.len());
    dst.put_u32(payload.len() as u32);
    dst.put_slice(payload);
    Ok(())
}

/// Turns frames into the bytes of a stream: a frame of at most one chunk
/// whole, a longer one (up to the maximum frame size) in pieces of at most
/// one chunk, which whole frames of other lanes may go between.
///
/// Frames of one lane go out in the order they were pushed. Only one split
/// frame is on the stream at a time: while it is, later frames of its lane
/// and later long frames wait, and whole frames of other lanes go at once.
///
/// Sans-IO: after [`next_piece`](Self::next_piece) the caller writes
/// [`head`](Self::head) (whole frames and the piece's prefix, copied as they
/// were pushed) and then the piece it returned (a slice of the frame, not
/// copied).
#[derive(Debug)]
pub struct FrameEncoder {
    chunk_len: usize,
    max_frame_len: usize,
    head: BytesMut,
    split: Option<Split>,
    held: VecDeque<(u64, Bytes)>,
    held_len: usize,
}

/// The split frame on the stream and how much of it has gone.
#[derive(Debug)]
struct Split {
    lane: u64,
    frame: Bytes,
    sent: usize,
}

impl FrameEncoder {
    /// Frames up to `max_frame_len` bytes, split above `chunk_len` (kept
    /// within 16 bytes and [`MAX_CHUNK_LEN`]); `head` starts with room for
    /// `capacity` bytes.
    pub fn new(chunk_len: usize, max_frame_len: usize, capacity: usize) -> Self {
        Self {
            chunk_len: chunk_len.clamp(MIN_CHUNK_LEN, MAX_CHUNK_LEN),
            max_frame_len: max_frame_len.min(u32::MAX as usize),
            head: BytesMut::with_capacity(capacity),
            split: None,
            held: VecDeque::new(),
            held_len: 0,
        }
    }

    /// Queues `frame` on `lane`; refuses a frame over the maximum size
    /// without queueing it.
    pub fn push(&mut self, lane: u64, frame: Bytes) -> Result<(), WireError> {
        if frame.len() > self.max_frame_len {
            return Err(WireError::FrameTooLarge {
                len: frame.len(),
                max: self.max_frame_len,
            });
        }
        if self.blocked(lane) {
            self.hold(lane, frame);
        } else if frame.len() <= self.chunk_len {
            encode_frame(&frame, self.chunk_len, &mut self.head)?;
        } else if self.split.is_none() && self.held.is_empty() {
            self.split = Some(Split {
                lane,
                frame,
                sent: 0,
            });
        } else {
            self.hold(lane, frame);
        }
        Ok(())
    }

    /// Bytes pushed and not yet handed out for writing.
    pub fn pending(&self) -> usize {
        self.head.len() + self.split.as_ref().map_or(0, |s| s.frame.len() - s.sent) + self.held_len
    }

    /// Readies the next write: lets go the frames that waited for a split
    /// frame now gone, then appends the next piece's prefix to
    /// [`head`](Self::head) and returns that piece, if a split frame is in
    /// progress. Once it returns `None` and `head` is written, nothing is
    /// pending.
    pub fn next_piece(&mut self) -> Option<Bytes> {
        if self.split.is_none() {
            self.release();
        }
        let split = self.split.as_mut()?;
        let (kind, total, room) = if split.sent == 0 {
            (FIRST, TOTAL_LEN, self.chunk_len - TOTAL_LEN)
        } else {
            (NEXT, 0, self.chunk_len)
        };
        let len = room.min(split.frame.len() - split.sent);
        self.head.reserve(LEN_PREFIX + total);
        self.head.put_u32(kind | (total + len) as u32);
        if kind == FIRST {
            self.head.put_u32(split.frame.len() as u32);
        }
        let piece = split.frame.slice(split.sent..split.sent + len);
        split.sent += len;
        if split.sent == split.frame.len() {
            // Frames pushed from now on follow its last piece; the held
            // ones go at the next call, after it.
            self.split = None;
        }
        Some(piece)
    }

    /// The bytes to write before the piece [`next_piece`](Self::next_piece)
    /// returned.
    pub fn head(&self) -> &[u8] {
        &self.head
    }

    /// Forgets the head once written (keeping its buffer).
    pub fn clear_head(&mut self) {
        self.head.clear();
    }

    fn blocked(&self, lane: u64) -> bool {
        self.split.as_ref().is_some_and(|s| s.lane == lane)
            || self.held.iter().any(|(l, _)| *l == lane)
    }

    fn hold(&mut self, lane: u64, frame: Bytes) {
        self.held_len += frame.len();
        self.held.push_back((lane, frame));
    }

    /// Pushes the held frames again, in order.
    fn release(&mut self) {
        self.held_len = 0;
        for (lane, frame) in std::mem::take(&mut self.held) {
            // Every held frame was accepted once: it fits the maximum.
            let _ = self.push(lane, frame);
        }
    }
}

/// Splits whole frames off the front of a receive buffer, joining split
/// frames from their pieces.
#[derive(Debug)]
pub struct FrameDecoder {
    max_piece_len: usize,
    max_frame_len: usize,
    joining: Option<Joining>,
}

/// A split frame being joined.
#[derive(Debug)]
struct Joining {
    total: usize,
    bytes: BytesMut,
}

impl FrameDecoder {
    /// A decoder that refuses frames over `max_frame_len` bytes (and pieces
    /// over that or [`MAX_CHUNK_LEN`]).
    pub fn new(max_frame_len: usize) -> Self {
        Self {
            max_piece_len: max_frame_len.min(MAX_CHUNK_LEN),
            max_frame_len,
            joining: None,
        }
    }

    /// Refuses frames over `max_frame_len` from now on (a split frame in
    /// progress carries on).
    pub fn set_max_frame_len(&mut self, max_frame_len: usize) {
        self.max_piece_len = max_frame_len.min(MAX_CHUNK_LEN);
        self.max_frame_len = max_frame_len;
    }

    /// The maximum frame size this decoder accepts.
    pub fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }

    /// Bytes of a split frame received so far (0: none in progress). A
    /// stream that ends while it is in progress ends inside a frame.
    pub fn joining(&self) -> usize {
        self.joining.as_ref().map_or(0, |j| j.bytes.len())
    }

    /// Takes the next whole frame off `src`, or `None` if more bytes are needed.
    ///
    /// A piece announced as longer than one piece may be, or a split frame
    /// announced as longer than the maximum, is refused as soon as its
    /// prefix arrives, before its bytes are buffered. When more bytes are
    /// needed, `src` is grown to hold the whole piece, so a reader can fill
    /// it in one go.
    pub fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Bytes>, WireError> {
        loop {
            if src.len() < LEN_PREFIX {
                return Ok(None);
            }
            let prefix = u32::from_be_bytes([src[0], src[1], src[2], src[3]]);
            let len = (prefix & LEN_MASK) as usize;
            if len > self.max_piece_len {
                return Err(WireError::FrameTooLarge {
                    len,
                    max: self.max_piece_len,
                });
            }
            let first = prefix & FIRST != 0;
            if first && src.len() >= LEN_PREFIX + TOTAL_LEN && len >= TOTAL_LEN {
                self.check_total(src)?;
            }
            if src.len() < LEN_PREFIX + len {
                src.reserve(LEN_PREFIX + len - src.len());
                return Ok(None);
            }
            match (first, prefix & NEXT != 0) {
                (false, false) => {
                    src.advance(LEN_PREFIX);
                    return Ok(Some(src.split_to(len).freeze()));
                }
                (true, true) => return Err(malformed("a piece marked both first and next")),
                (true, false) => self.begin(src, len)?,
                (false, true) => self.extend(src, len)?,
            }
            if let Some(j) = self.joining.take_if(|j| j.bytes.len() == j.total) {
                return Ok(Some(j.bytes.freeze()));
            }
        }
    }

    /// The announced length of the split frame whose first piece starts `src`.
    fn check_total(&self, src: &[u8]) -> Result<usize, WireError> {
        let total = u32::from_be_bytes([src[4], src[5], src[6], src[7]]) as usize;
        if total > self.max_frame_len {
            return Err(WireError::FrameTooLarge {
                len: total,
                max: self.max_frame_len,
            });
        }
        Ok(total)
    }

    /// Starts joining from the first piece (`len` bytes) at the front of `src`.
    fn begin(&mut self, src: &mut BytesMut, len: usize) -> Result<(), WireError> {
        if self.joining.is_some() {
            return Err(malformed("a split frame began inside another"));
        }
        if len < TOTAL_LEN {
            return Err(malformed("a first piece without the frame's length"));
        }
        let total = self.check_total(src)?;
        let data = &src[LEN_PREFIX + TOTAL_LEN..LEN_PREFIX + len];
        if data.len() > total {
            return Err(malformed("a first piece longer than its frame"));
        }
        let mut bytes = BytesMut::with_capacity(total);
        bytes.extend_from_slice(data);
        self.joining = Some(Joining { total, bytes });
        src.advance(LEN_PREFIX + len);
        Ok(())
    }

    /// Appends the next piece (`len` bytes) at the front of `src`.
    fn extend(&mut self, src: &mut BytesMut, len: usize) -> Result<(), WireError> {
        let Some(j) = self.joining.as_mut() else {
            return Err(malformed("a next piece with no split frame in progress"));
        };
        if j.bytes.len() + len > j.total {
            return Err(malformed("pieces longer than their frame"));
        }
        j.bytes
            .extend_from_slice(&src[LEN_PREFIX..LEN_PREFIX + len]);
        src.advance(LEN_PREFIX + len);
        Ok(())
    }
}

fn malformed(reason: &str) -> WireError {
    WireError::Malformed {
        what: "split frame",
        reason: reason.into(),
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
        let mut dec = FrameDecoder::new(16);
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
        let mut dec = FrameDecoder::new(64);
        let mut partial = BytesMut::from(&whole[..7]);
        assert_eq!(dec.decode(&mut partial).unwrap(), None);
        partial.extend_from_slice(&whole[7..]);
        assert_eq!(
            dec.decode(&mut partial).unwrap().unwrap(),
            Bytes::from_static(b"abcdef")
        );
    }

    /// Everything `enc` has pending, as the bytes a stream carries, taking
    /// at most `pieces` pieces (all with `usize::MAX`).
    fn drain(enc: &mut FrameEncoder, pieces: usize, wire: &mut BytesMut) {
        for _ in 0..pieces {
            let piece = enc.next_piece();
            wire.extend_from_slice(enc.head());
            enc.clear_head();
            match piece {
                Some(p) => wire.extend_from_slice(&p),
                None => break,
            }
        }
    }

    fn frame(len: usize, seed: u8) -> Bytes {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect::<Vec<u8>>()
            .into()
    }

    #[test]
    fn a_frame_over_one_chunk_goes_in_pieces_and_is_joined() {
        let mut enc = FrameEncoder::new(64, 1000, 0);
        let big = frame(1000, 1);
        enc.push(0, big.clone()).unwrap();
        assert_eq!(enc.pending(), 1000);
        let mut wire = BytesMut::new();
        drain(&mut enc, usize::MAX, &mut wire);
        assert_eq!(enc.pending(), 0);
        // 1000 bytes: 60 in the first piece (after the length), then 64 each.
        let pieces = 1 + (1000 - 60usize).div_ceil(64);
        assert_eq!(wire.len(), 1000 + TOTAL_LEN + pieces * LEN_PREFIX);
        let mut dec = FrameDecoder::new(1000);
        assert_eq!(dec.decode(&mut wire).unwrap(), Some(big));
        assert!(wire.is_empty());
        assert_eq!(dec.joining(), 0);
    }

    #[test]
    fn whole_frames_of_other_lanes_overtake_a_split_frame_and_its_lane_waits() {
        let mut enc = FrameEncoder::new(64, 1000, 0);
        let (big, after, other) = (frame(300, 1), frame(5, 2), frame(6, 3));
        enc.push(1, big.clone()).unwrap();
        enc.push(1, after.clone()).unwrap();
        let mut wire = BytesMut::new();
        drain(&mut enc, 1, &mut wire);
        enc.push(2, other.clone()).unwrap();
        drain(&mut enc, usize::MAX, &mut wire);
        let mut dec = FrameDecoder::new(1000);
        let mut got = Vec::new();
        while let Some(f) = dec.decode(&mut wire).unwrap() {
            got.push(f);
        }
        assert_eq!(got, [other, big, after]);
    }

    #[test]
    fn split_frames_over_the_maximum_are_refused_at_their_first_bytes() {
        let mut enc = FrameEncoder::new(64, 1000, 0);
        assert_eq!(
            enc.push(0, frame(1001, 0)),
            Err(WireError::FrameTooLarge {
                len: 1001,
                max: 1000
            })
        );
        assert_eq!(enc.pending(), 0);
        enc.push(0, frame(1000, 0)).unwrap();
        let mut wire = BytesMut::new();
        drain(&mut enc, 1, &mut wire);
        // The receiver's maximum is smaller: refused at the prefix and the length.
        let mut first = BytesMut::from(&wire[..LEN_PREFIX + TOTAL_LEN]);
        assert_eq!(
            FrameDecoder::new(999).decode(&mut first),
            Err(WireError::FrameTooLarge {
                len: 1000,
                max: 999
            })
        );
        // A receiver whose pieces are smaller refuses the piece.
        assert_eq!(
            FrameDecoder::new(32).decode(&mut wire),
            Err(WireError::FrameTooLarge { len: 64, max: 32 })
        );
    }

    #[test]
    fn broken_piece_sequences_are_refused() {
        let piece = |prefix: u32, body: &[u8]| {
            let mut b = BytesMut::new();
            b.put_u32(prefix);
            b.put_slice(body);
            b
        };
        let first = |total: u32, data: &[u8]| {
            let mut body = total.to_be_bytes().to_vec();
            body.extend_from_slice(data);
            piece(FIRST | body.len() as u32, &body)
        };
        let cases = [
            ("next without first", piece(NEXT | 2, b"ab")),
            ("both bits", piece(FIRST | NEXT | 2, b"ab")),
            ("first without length", piece(FIRST | 2, b"ab")),
            ("first longer than its frame", first(1, b"ab")),
            ("two firsts", {
                let mut b = first(10, b"ab");
                b.extend_from_slice(&first(10, b"cd"));
                b
            }),
            ("pieces longer than their frame", {
                let mut b = first(3, b"ab");
                b.extend_from_slice(&piece(NEXT | 2, b"cd"));
                b
            }),
        ];
        for (what, mut bytes) in cases {
            let mut dec = FrameDecoder::new(100);
            let err = loop {
                match dec.decode(&mut bytes) {
                    Ok(Some(_)) => {}
                    Ok(None) => panic!("{what}: accepted"),
                    Err(e) => break e,
                }
            };
            assert!(
                matches!(err, WireError::Malformed { .. }),
                "{what}: {err:?}"
            );
        }
        // A truncated sequence waits, showing a frame in progress.
        let mut dec = FrameDecoder::new(100);
        let mut bytes = first(10, b"ab");
        assert_eq!(dec.decode(&mut bytes), Ok(None));
        assert_eq!(dec.joining(), 2);
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
            let mut dec = FrameDecoder::new(1024);
            let mut buf = BytesMut::from(&wire[..cut]);
            let mut out = Vec::new();
            while let Some(f) = dec.decode(&mut buf).unwrap() { out.push(f.to_vec()); }
            buf.extend_from_slice(&wire[cut..]);
            while let Some(f) = dec.decode(&mut buf).unwrap() { out.push(f.to_vec()); }
            prop_assert_eq!(out, frames);
            prop_assert!(buf.is_empty());
        }

        /// Frames of any size on a few lanes, pushed between writes of any
        /// number of pieces, and the stream cut into reads anywhere: every
        /// frame arrives whole, each lane's in order, and with one lane all
        /// in order.
        #[test]
        fn split_and_interleaved_frames_round_trip(
            chunk in 16usize..200,
            steps in proptest::collection::vec((0u64..3, 0usize..700, 0usize..4), 0..40),
            reads in proptest::collection::vec(1usize..500, 1..20),
        ) {
            let mut enc = FrameEncoder::new(chunk, 702, 0);
            let mut wire = BytesMut::new();
            let mut sent = Vec::new();
            for (i, &(lane, len, pieces)) in steps.iter().enumerate() {
                // Each frame says its lane and its place.
                let mut f = vec![lane as u8, i as u8];
                f.extend_from_slice(&frame(len, i as u8));
                enc.push(lane, Bytes::from(f.clone())).unwrap();
                sent.push(f);
                drain(&mut enc, pieces, &mut wire);
            }
            drain(&mut enc, usize::MAX, &mut wire);
            prop_assert_eq!(enc.pending(), 0);
            let mut dec = FrameDecoder::new(702);
            let mut buf = BytesMut::new();
            let mut got = Vec::new();
            let mut at = 0;
            for n in reads.iter().cycle() {
                let end = (at + n).min(wire.len());
                buf.extend_from_slice(&wire[at..end]);
                at = end;
                while let Some(f) = dec.decode(&mut buf).unwrap() { got.push(f.to_vec()); }
                if at == wire.len() { break; }
            }
            prop_assert!(buf.is_empty());
            prop_assert_eq!(dec.joining(), 0);
            for lane in 0..3u8 {
                let of_lane = |fs: &[Vec<u8>]| fs.iter().filter(|f| f[0] == lane).cloned().collect::<Vec<_>>();
                prop_assert_eq!(of_lane(&got), of_lane(&sent));
            }
            if steps.iter().all(|s| s.0 == 0) {
                prop_assert_eq!(got, sent);
            } else {
                prop_assert_eq!(got.len(), sent.len());
            }
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512), max in 0usize..256) {
            let mut dec = FrameDecoder::new(max);
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Some(_)) = dec.decode(&mut buf) {}
        }
    }
}
