//! A bound on how deeply field tables and arrays nest, checked on the raw
//! bytes before `amq-protocol` parses them.
//!
//! `amq-protocol`'s parser, and everything that later walks the parsed value
//! (clone, drop, serde), recurses once per nesting level. A 10 KiB field
//! table nested 1,500 deep overflows a thread's stack and aborts the whole
//! process. The checks here walk the encoding iteratively, with an explicit
//! stack bounded by [`MAX_FIELD_DEPTH`], so they are safe on any input; every
//! decoder of client, stored or peer-supplied AMQP bytes calls them first.
//!
//! Only nesting is judged here. Bytes that are malformed in any other way
//! pass, and the codec that runs next refuses them: it walks the same
//! encoding in the same order, so it never reaches a container that these
//! checks did not measure.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::protocol::basic::parse_properties;

/// The deepest nesting of field tables and arrays accepted anywhere: a
/// table's own fields are level 1, a table inside it level 2, and so on.
/// Real clients use two or three levels; the parsers and every later walk
/// of the value stay far inside a thread's stack at this bound.
pub const MAX_FIELD_DEPTH: usize = 32;

/// Input nested deeper than [`MAX_FIELD_DEPTH`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("field tables or arrays nested deeper than {MAX_FIELD_DEPTH} levels")]
pub struct TooDeep;

/// One open container while walking: where it ends, and whether its entries
/// have names (tables) or not (arrays).
#[derive(Clone, Copy)]
struct Open {
    end: usize,
    named: bool,
}

/// A little reader over the bytes; every read is bounds-checked and `None`
/// means "malformed, leave it to the codec".
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn u8(&mut self) -> Option<u8> {
        let b = *self.buf.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    fn u32(&mut self) -> Option<usize> {
        let b = self.buf.get(self.pos..self.pos + 4)?;
        self.pos += 4;
        Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }

    fn skip(&mut self, n: usize) -> Option<()> {
        let end = self.pos.checked_add(n)?;
        if end > self.buf.len() {
            return None;
        }
        self.pos = end;
        Some(())
    }

    fn short_str(&mut self) -> Option<()> {
        let n = self.u8()?;
        self.skip(usize::from(n))
    }

    /// Walks the field table that starts here (its 4-byte length first) and
    /// leaves the cursor after it. `Ok(None)`: malformed.
    fn table(&mut self) -> Result<Option<()>, TooDeep> {
        let Some(len) = self.u32() else {
            return Ok(None);
        };
        let Some(end) = self.pos.checked_add(len).filter(|&e| e <= self.buf.len()) else {
            return Ok(None);
        };
        let mut stack = vec![Open { end, named: true }];
        while let Some(&top) = stack.last() {
            if self.pos == top.end {
                stack.pop();
                continue;
            }
            if self.pos > top.end {
                return Ok(None);
            }
            if top.named && self.short_str().is_none() {
                return Ok(None);
            }
            let Some(kind) = self.u8() else {
                return Ok(None);
            };
            // Widths as `amq-protocol` reads them (RabbitMQ's type letters).
            let fixed = match kind {
                b'V' => 0,
                b't' | b'b' | b'B' => 1,
                b's' | b'U' | b'u' => 2,
                b'I' | b'i' | b'f' => 4,
                b'D' => 5,
                b'l' | b'L' | b'd' | b'T' => 8,
                b'S' | b'x' => match self.u32() {
                    Some(n) => n,
                    None => return Ok(None),
                },
                b'F' | b'A' => {
                    let Some(len) = self.u32() else {
                        return Ok(None);
                    };
                    let Some(end) = self.pos.checked_add(len).filter(|&e| e <= top.end) else {
                        return Ok(None);
                    };
                    if stack.len() == MAX_FIELD_DEPTH {
                        return Err(TooDeep);
                    }
                    stack.push(Open {
                        end,
                        named: kind == b'F',
                    });
                    continue;
                }
                _ => return Ok(None),
            };
            if self.skip(fixed).is_none() {
                return Ok(None);
            }
        }
        Ok(Some(()))
    }
}

/// One field of a method's argument list, in wire order, up to its table.
#[derive(Clone, Copy)]
enum Field {
    Octet,
    Short,
    ShortStr,
    Table,
}

/// The fields of every AMQP 0-9-1 method that carries a field table, up to
/// and including the table (bits share one octet). A method the client
/// should never send (connection.start) is listed too: the codec parses a
/// method before the connection judges whether it may arrive.
fn layout(class_id: u16, method_id: u16) -> Option<&'static [Field]> {
    use Field::{Octet, Short, ShortStr, Table};
    Some(match (class_id, method_id) {
        // connection.start: version-major, version-minor, server-properties.
        (10, 10) => &[Octet, Octet, Table],
        // connection.start-ok: client-properties first.
        (10, 11) => &[Table],
        // exchange.declare: reserved, exchange, type, bits, arguments.
        (40, 10) => &[Short, ShortStr, ShortStr, Octet, Table],
        // exchange.bind / unbind: reserved, destination, source, key, no-wait, arguments.
        (40, 30 | 40) => &[Short, ShortStr, ShortStr, ShortStr, Octet, Table],
        // queue.declare: reserved, queue, bits, arguments.
        (50, 10) => &[Short, ShortStr, Octet, Table],
        // queue.bind: reserved, queue, exchange, key, no-wait, arguments.
        (50, 20) => &[Short, ShortStr, ShortStr, ShortStr, Octet, Table],
        // queue.unbind: reserved, queue, exchange, key, arguments (no bits).
        (50, 50) => &[Short, ShortStr, ShortStr, ShortStr, Table],
        // basic.consume: reserved, queue, consumer-tag, bits, arguments.
        (60, 20) => &[Short, ShortStr, ShortStr, Octet, Table],
        _ => return None,
    })
}

/// Checks a method frame's payload (class id, method id, arguments).
pub(crate) fn check_method(payload: &[u8]) -> Result<(), TooDeep> {
    let [c0, c1, m0, m1, ..] = *payload else {
        return Ok(());
    };
    let Some(fields) = layout(u16::from_be_bytes([c0, c1]), u16::from_be_bytes([m0, m1])) else {
        return Ok(());
    };
    let mut cur = Cursor {
        buf: payload,
        pos: 4,
    };
    for field in fields {
        let read = match field {
            Field::Octet => cur.skip(1),
            Field::Short => cur.skip(2),
            Field::ShortStr => cur.short_str(),
            Field::Table => cur.table()?,
        };
        if read.is_none() {
            return Ok(());
        }
    }
    Ok(())
}

/// Checks a content header frame's payload (class, weight, body size,
/// property flags, properties): the `headers` property is the only table.
pub(crate) fn check_content_header(payload: &[u8]) -> Result<(), TooDeep> {
    let mut cur = Cursor {
        buf: payload,
        pos: 12,
    };
    check_properties(&mut cur)
}

/// Checks encoded properties (flags first), as stored with a message.
fn check_properties(cur: &mut Cursor<'_>) -> Result<(), TooDeep> {
    let Some(flags) = cur.buf.get(cur.pos..cur.pos + 2) else {
        return Ok(());
    };
    let flags = u16::from_be_bytes([flags[0], flags[1]]);
    cur.pos += 2;
    // Continuation words (bit 0) are not used by the basic class; the codec
    // refuses what it cannot read.
    const CONTENT_TYPE: u16 = 1 << 15;
    const CONTENT_ENCODING: u16 = 1 << 14;
    const HEADERS: u16 = 1 << 13;
    for bit in [CONTENT_TYPE, CONTENT_ENCODING] {
        if flags & bit != 0 && cur.short_str().is_none() {
            return Ok(());
        }
    }
    if flags & HEADERS != 0 {
        cur.table()?;
    }
    Ok(())
}

/// Checks a field table encoded with its 4-byte length prefix.
pub(crate) fn check_table(buf: &[u8]) -> Result<(), TooDeep> {
    Cursor { buf, pos: 0 }.table().map(drop)
}

/// Decodes message properties as stored with a message (flags, then the
/// properties): `None` if they are malformed or nested deeper than
/// [`MAX_FIELD_DEPTH`].
#[must_use]
pub fn decode_properties(buf: &[u8]) -> Option<BasicProperties> {
    check_properties(&mut Cursor { buf, pos: 0 }).ok()?;
    parse_properties(buf).ok().map(|(_, p)| p)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table of `depth` levels: each level holds one table field "k".
    pub(crate) fn nested_table(depth: usize) -> Vec<u8> {
        let mut out = ((7 * (depth - 1)) as u32).to_be_bytes().to_vec();
        for level in 1..depth {
            out.extend_from_slice(&[1, b'k', b'F']);
            out.extend_from_slice(&((7 * (depth - 1 - level)) as u32).to_be_bytes());
        }
        out
    }

    #[test]
    fn depth_is_counted_from_the_outer_table() {
        assert_eq!(check_table(&nested_table(MAX_FIELD_DEPTH)), Ok(()));
        assert_eq!(
            check_table(&nested_table(MAX_FIELD_DEPTH + 1)),
            Err(TooDeep)
        );
        assert_eq!(check_table(&nested_table(100_000)), Err(TooDeep));
    }

    #[test]
    fn malformed_bytes_are_left_to_the_codec() {
        for bytes in [
            &[][..],
            &[0, 0, 0, 9],
            &[0, 0, 0, 2, 1, b'k'],
            &[0, 0, 0, 3, 0, b'?', 0],
        ] {
            assert_eq!(check_table(bytes), Ok(()));
        }
    }
}
