//! The on-disk record format of the segment log.
//!
//! A segment file starts with a 20-byte header: the magic `WRNBQ001`, the
//! next sequence number when the segment was created (u64 LE), and a CRC32C
//! of those 16 bytes (u32 LE). Records follow, each:
//!
//! ```text
//! len: u32 LE      payload length (1 ..= MAX_RECORD_LEN)
//! crc: u32 LE      CRC32C, starting from the segment id, of the 4 length
//!                  bytes followed by the payload
//! payload:         kind: u8, then
//!   1 PUBLISH      seq u64, id u64, expiry_ms u64,
//!                  flags u8 (bit 0: delivered; bit 1: transient, paged out only, not recovered),
//!                  props_len u32, props, body (the rest)
//!   2 REMOVE       n u32, n × seq u64    (acked, rejected, expired, purged)
//!   3 DELIVERED    n u32, n × seq u64    (handed to a consumer at least once)
//!   4 PUBLISH_PRIO seq u64, id u64, expiry_ms u64, flags u8, priority u8,
//!                  props_len u32, props, body (a publish of priority > 0;
//!                  priority 0 is a PUBLISH, as are all messages of queues
//!                  without priorities)
//! ```
//!
//! All integers are little-endian.

/// Segment header magic.
pub(crate) const MAGIC: &[u8; 8] = b"WRNBQ001";
/// Bytes of a segment header.
pub(crate) const SEGMENT_HEADER_LEN: u64 = 20;
/// Bytes of a record header (length and CRC).
pub(crate) const RECORD_HEADER_LEN: usize = 8;
/// The largest payload a record may have.
pub(crate) const MAX_RECORD_LEN: u32 = 1 << 30;
/// Bytes of a publish record besides its properties and body.
pub(crate) const PUBLISH_OVERHEAD: u64 = RECORD_HEADER_LEN as u64 + PUBLISH_FIXED as u64;
const PUBLISH_FIXED: usize = 1 + 8 + 8 + 8 + 1 + 4;

const KIND_PUBLISH: u8 = 1;
const KIND_REMOVE: u8 = 2;
const KIND_DELIVERED: u8 = 3;
const KIND_PUBLISH_PRIO: u8 = 4;

/// Bytes a publish record of a message of `priority` takes besides its
/// properties and body.
pub(crate) fn publish_overhead(priority: u8) -> u64 {
    PUBLISH_OVERHEAD + u64::from(priority != 0)
}

/// A decoded record. Publish bodies are borrowed from the read buffer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Record<'a> {
    Publish {
        meta: PublishMeta,
        props: &'a [u8],
        body: &'a [u8],
    },
    Remove(Vec<u64>),
    Delivered(Vec<u64>),
}

/// The record checksum, seeded with the segment id: a recycled segment file's
/// stale records never pass as records of its new life.
fn crc_of(seed: u32, len: [u8; 4], payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c_append(seed, &len), payload)
}

/// Encodes a segment header.
pub(crate) fn segment_header(base_seq: u64) -> [u8; SEGMENT_HEADER_LEN as usize] {
    let mut h = [0u8; SEGMENT_HEADER_LEN as usize];
    h[..8].copy_from_slice(MAGIC);
    h[8..16].copy_from_slice(&base_seq.to_le_bytes());
    let crc = crc32c::crc32c(&h[..16]);
    h[16..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Parses a segment header; `None` if it is not valid.
pub(crate) fn parse_segment_header(h: &[u8]) -> Option<u64> {
    if h.len() < SEGMENT_HEADER_LEN as usize || &h[..8] != MAGIC {
        return None;
    }
    let crc = u32::from_le_bytes(h[16..20].try_into().ok()?);
    (crc32c::crc32c(&h[..16]) == crc)
        .then(|| u64::from_le_bytes(h[8..16].try_into().unwrap_or_default()))
}

/// The fixed fields of a publish record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PublishMeta {
    pub(crate) seq: u64,
    pub(crate) id: u64,
    pub(crate) expiry_ms: u64,
    pub(crate) delivered: bool,
    /// A transient message paged out: ignored by recovery.
    pub(crate) transient: bool,
    /// Its priority in a priority queue (0 otherwise).
    pub(crate) priority: u8,
}

/// Appends a publish record to `out`.
pub(crate) fn encode_publish(
    out: &mut Vec<u8>,
    seed: u32,
    meta: PublishMeta,
    props: &[u8],
    body: &[u8],
) {
    out.reserve(publish_overhead(meta.priority) as usize + props.len() + body.len());
    encode_publish_head(out, seed, meta, props, body);
    out.extend_from_slice(body);
}

/// Appends a publish record to `out` without its body, which the caller
/// writes right after (so that a large body is never copied into a buffer).
/// The checksum covers the body.
pub(crate) fn encode_publish_head(
    out: &mut Vec<u8>,
    seed: u32,
    meta: PublishMeta,
    props: &[u8],
    body: &[u8],
) {
    let prio = meta.priority != 0;
    let payload_len = PUBLISH_FIXED + usize::from(prio) + props.len() + body.len();
    let start = out.len();
    out.extend_from_slice(&(payload_len as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.push(if prio {
        KIND_PUBLISH_PRIO
    } else {
        KIND_PUBLISH
    });
    out.extend_from_slice(&meta.seq.to_le_bytes());
    out.extend_from_slice(&meta.id.to_le_bytes());
    out.extend_from_slice(&meta.expiry_ms.to_le_bytes());
    out.push(u8::from(meta.delivered) | (u8::from(meta.transient) << 1));
    if prio {
        out.push(meta.priority);
    }
    out.extend_from_slice(&(props.len() as u32).to_le_bytes());
    out.extend_from_slice(props);
    let len: [u8; 4] = [out[start], out[start + 1], out[start + 2], out[start + 3]];
    let crc = crc32c::crc32c_append(crc_of(seed, len, &out[start + RECORD_HEADER_LEN..]), body);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// Appends a remove or delivered record listing `seqs` to `out`.
pub(crate) fn encode_seqs(out: &mut Vec<u8>, seed: u32, delivered: bool, seqs: &[u64]) {
    let payload_len = 1 + 4 + 8 * seqs.len();
    let start = out.len();
    out.reserve(RECORD_HEADER_LEN + payload_len);
    out.extend_from_slice(&(payload_len as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.push(if delivered {
        KIND_DELIVERED
    } else {
        KIND_REMOVE
    });
    out.extend_from_slice(&(seqs.len() as u32).to_le_bytes());
    for s in seqs {
        out.extend_from_slice(&s.to_le_bytes());
    }
    seal(out, seed, start);
}

fn seal(out: &mut [u8], seed: u32, start: usize) {
    let len: [u8; 4] = [out[start], out[start + 1], out[start + 2], out[start + 3]];
    let crc = crc_of(seed, len, &out[start + RECORD_HEADER_LEN..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// Why the bytes at an offset are not a valid record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Invalid {
    /// The record runs past the end of the data (a torn write, if at the tail).
    Truncated,
    /// The bytes are there but wrong.
    Bad(String),
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Checks the record at the start of `buf` (of the segment whose id is
/// `seed`); returns its total length (header included) and its payload.
pub(crate) fn check(buf: &[u8], seed: u32) -> Result<(usize, &[u8]), Invalid> {
    let len = u32_at(buf, 0).ok_or(Invalid::Truncated)?;
    if len == 0 || len > MAX_RECORD_LEN {
        return Err(Invalid::Bad(format!("impossible record length {len}")));
    }
    let total = RECORD_HEADER_LEN + len as usize;
    let Some(payload) = buf.get(RECORD_HEADER_LEN..total) else {
        return Err(Invalid::Truncated);
    };
    if !matches!(payload[0], KIND_PUBLISH..=KIND_PUBLISH_PRIO) {
        return Err(Invalid::Bad(format!("unknown record kind {}", payload[0])));
    }
    let crc = u32_at(buf, 4).ok_or(Invalid::Truncated)?;
    let actual = crc_of(seed, len.to_le_bytes(), payload);
    if crc != actual {
        return Err(Invalid::Bad(format!(
            "checksum mismatch (stored {crc:#010x}, computed {actual:#010x})"
        )));
    }
    Ok((total, payload))
}

/// Decodes a payload that passed [`check`].
pub(crate) fn decode(payload: &[u8]) -> Result<Record<'_>, Invalid> {
    let bad = |what: &str| Invalid::Bad(format!("malformed {what} record"));
    match payload.first() {
        Some(&kind @ (KIND_PUBLISH | KIND_PUBLISH_PRIO)) => {
            let seq = u64_at(payload, 1).ok_or_else(|| bad("publish"))?;
            let id = u64_at(payload, 9).ok_or_else(|| bad("publish"))?;
            let expiry_ms = u64_at(payload, 17).ok_or_else(|| bad("publish"))?;
            let flags = *payload.get(25).ok_or_else(|| bad("publish"))?;
            let (priority, at) = if kind == KIND_PUBLISH_PRIO {
                (*payload.get(26).ok_or_else(|| bad("publish"))?, 27)
            } else {
                (0, 26)
            };
            let props_len = u32_at(payload, at).ok_or_else(|| bad("publish"))? as usize;
            let rest = &payload[at + 4..];
            if props_len > rest.len() {
                return Err(bad("publish"));
            }
            let (props, body) = rest.split_at(props_len);
            Ok(Record::Publish {
                meta: PublishMeta {
                    seq,
                    id,
                    expiry_ms,
                    delivered: flags & 1 != 0,
                    transient: flags & 2 != 0,
                    priority,
                },
                props,
                body,
            })
        }
        Some(&kind @ (KIND_REMOVE | KIND_DELIVERED)) => {
            let n = u32_at(payload, 1).ok_or_else(|| bad("seq list"))? as usize;
            if payload.len() != 5 + 8 * n {
                return Err(bad("seq list"));
            }
            let seqs = payload[5..]
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect();
            Ok(if kind == KIND_REMOVE {
                Record::Remove(seqs)
            } else {
                Record::Delivered(seqs)
            })
        }
        _ => Err(bad("unknown")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_round_trip() {
        // Priority 0 is a plain PUBLISH; any other a PUBLISH_PRIO, a byte longer.
        for (priority, kind) in [(0, KIND_PUBLISH), (200, KIND_PUBLISH_PRIO)] {
            let mut buf = Vec::new();
            let meta = PublishMeta {
                seq: 7,
                id: 9,
                expiry_ms: 11,
                delivered: true,
                transient: false,
                priority,
            };
            encode_publish(&mut buf, 3, meta, b"pp", b"body");
            assert_eq!(buf.len() as u64, publish_overhead(priority) + 6);
            assert_eq!(buf[RECORD_HEADER_LEN], kind);
            assert!(check(&buf, 4).is_err(), "another segment's seed");
            let (total, payload) = check(&buf, 3).unwrap();
            assert_eq!(total, buf.len());
            assert_eq!(
                decode(payload).unwrap(),
                Record::Publish {
                    meta,
                    props: b"pp",
                    body: b"body"
                }
            );
            assert!(matches!(decode(&payload[..27]), Err(Invalid::Bad(_))));
            assert_eq!(check(&buf[..buf.len() - 1], 3), Err(Invalid::Truncated));
            buf[12] ^= 1;
            assert!(matches!(check(&buf, 3), Err(Invalid::Bad(_))));
        }
        assert_eq!(publish_overhead(0), PUBLISH_OVERHEAD);
    }

    #[test]
    fn seqs_round_trip() {
        let mut buf = Vec::new();
        encode_seqs(&mut buf, 0, false, &[1, 2, 3]);
        let (_, payload) = check(&buf, 0).unwrap();
        assert_eq!(decode(payload).unwrap(), Record::Remove(vec![1, 2, 3]));
        assert_eq!(parse_segment_header(&segment_header(42)), Some(42));
    }
}
