//! Exchange types and how each matches a message against a binding, and
//! the per-message metadata stored in the backing queue.

use bytes::{BufMut as _, Bytes, BytesMut};
use warren_amqp::BasicProperties;
use warren_amqp::amq_protocol::frame::WriteContext;
use warren_amqp::amq_protocol::protocol::basic::gen_properties;
use warren_amqp::amq_protocol::types::{AMQPValue, FieldTable};

/// The four exchange types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Direct,
    Fanout,
    Topic,
    Headers,
}

impl Kind {
    pub(crate) fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "direct" => Self::Direct,
            "fanout" => Self::Fanout,
            "topic" => Self::Topic,
            "headers" => Self::Headers,
            _ => return None,
        })
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Fanout => "fanout",
            Self::Topic => "topic",
            Self::Headers => "headers",
        }
    }
}

/// Whether a topic binding pattern (`*` one word, `#` zero or more) matches a routing key.
///
/// Word by word over the pattern, keeping which prefixes of the key the
/// pattern so far matches: at most (pattern words) × (key words) steps.
/// Trying each split of the key at each `#` took time exponential in the
/// `#`s: one binding of twenty `#` words and one publish with a 40-word key
/// held the broker's lock, and with it the whole node, for good. Routing
/// uses the exchange's trie (`broker/bindings.rs`); this, one pattern at a
/// time, is what the trie is checked against.
#[cfg(test)]
pub(crate) fn topic_matches(pattern: &str, key: &str) -> bool {
    let key: Vec<&str> = key.split('.').collect();
    // reach[j]: the pattern words so far match the key's first j words.
    let mut reach = vec![false; key.len() + 1];
    reach[0] = true;
    for word in pattern.split('.') {
        if word == "#" {
            let mut reached = false;
            for r in &mut reach {
                reached |= *r;
                *r = reached;
            }
        } else {
            for j in (1..=key.len()).rev() {
                reach[j] = reach[j - 1] && (word == "*" || word == key[j - 1]);
            }
            reach[0] = false;
        }
        if !reach.contains(&true) {
            return false;
        }
    }
    reach[key.len()]
}

/// Whether a headers-exchange binding (with `x-match` all/any) matches the message headers.
pub(crate) fn headers_match(binding: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let mode = match binding.inner().get("x-match") {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        Some(AMQPValue::ShortString(s)) => s.as_str().to_owned(),
        _ => "all".to_owned(),
    };
    let any = mode.starts_with("any");
    let with_x = mode.ends_with("-with-x");
    let empty = FieldTable::default();
    let headers = headers.unwrap_or(&empty).inner();
    for (k, v) in binding.inner() {
        if k.as_str() == "x-match" || (!with_x && k.as_str().starts_with("x-")) {
            continue;
        }
        let ok = match (v, headers.get(k)) {
            (_, None) => false,
            (AMQPValue::Void, Some(_)) => true,
            (a, Some(b)) => values_equal(a, b),
        };
        if any && ok {
            return true;
        }
        if !any && !ok {
            return false;
        }
    }
    !any
}

/// RabbitMQ's name of a field value's type, as its error messages give it.
pub(crate) fn type_name(v: &AMQPValue) -> &'static str {
    match v {
        AMQPValue::Boolean(_) => "bool",
        AMQPValue::ShortShortInt(_) => "byte",
        AMQPValue::ShortShortUInt(_) => "unsignedbyte",
        AMQPValue::ShortInt(_) => "short",
        AMQPValue::ShortUInt(_) => "unsignedshort",
        AMQPValue::LongInt(_) => "signedint",
        AMQPValue::LongUInt(_) => "unsignedint",
        AMQPValue::LongLongInt(_) => "long",
        AMQPValue::Float(_) => "float",
        AMQPValue::Double(_) => "double",
        AMQPValue::DecimalValue(_) => "decimal",
        AMQPValue::ShortString(_) => "shortstr",
        AMQPValue::LongString(_) => "longstr",
        AMQPValue::FieldArray(_) => "array",
        AMQPValue::Timestamp(_) => "timestamp",
        AMQPValue::FieldTable(_) => "table",
        AMQPValue::ByteArray(_) => "binary",
        AMQPValue::Void => "void",
    }
}

/// An integer argument, whatever integer type the client encoded it as.
pub(crate) fn as_i64(v: &AMQPValue) -> Option<i64> {
    Some(match v {
        AMQPValue::ShortShortInt(x) => i64::from(*x),
        AMQPValue::ShortShortUInt(x) => i64::from(*x),
        AMQPValue::ShortInt(x) => i64::from(*x),
        AMQPValue::ShortUInt(x) => i64::from(*x),
        AMQPValue::LongInt(x) => i64::from(*x),
        AMQPValue::LongUInt(x) => i64::from(*x),
        AMQPValue::LongLongInt(x) => *x,
        AMQPValue::Timestamp(x) => i64::try_from(*x).ok()?,
        _ => return None,
    })
}

/// A string argument.
pub(crate) fn as_str(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// Equality of two field values, with integers compared by value and
/// short/long strings alike.
pub(crate) fn values_equal(a: &AMQPValue, b: &AMQPValue) -> bool {
    if let (Some(x), Some(y)) = (as_i64(a), as_i64(b)) {
        return x == y;
    }
    if let (Some(x), Some(y)) = (as_str(a), as_str(b)) {
        return x == y;
    }
    a == b
}

/// A value shown in an error text.
pub(crate) fn show_value(v: Option<&AMQPValue>) -> String {
    match v {
        None => "none".to_owned(),
        Some(v) => match (as_i64(v), as_str(v)) {
            (Some(i), _) => i.to_string(),
            (_, Some(s)) => s,
            _ => format!("{v:?}"),
        },
    }
}

/// What a queue keeps with each message besides its body: the exchange and
/// routing key it was published with and its encoded properties.
pub(crate) fn encode_meta(exchange: &str, routing_key: &str, props: &BasicProperties) -> Bytes {
    let mut b = BytesMut::with_capacity(4 + exchange.len() + routing_key.len() + 16);
    put_short(&mut b, exchange);
    put_short(&mut b, routing_key);
    match gen_properties(props)(WriteContext::from(Vec::new())) {
        Ok(ctx) => b.extend_from_slice(&ctx.into_inner().0),
        Err(_) => b.put_u16(0),
    }
    b.freeze()
}

fn put_short(b: &mut BytesMut, s: &str) {
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    b.put_u8(end as u8);
    b.extend_from_slice(&s.as_bytes()[..end]);
}

/// The decoded form of [`encode_meta`], borrowing the names.
#[derive(Debug)]
pub(crate) struct Meta<'a> {
    pub(crate) exchange: &'a str,
    pub(crate) routing_key: &'a str,
    pub(crate) properties: BasicProperties,
}

fn get_short(b: &[u8]) -> Option<(&str, &[u8])> {
    let (&n, rest) = b.split_first()?;
    let n = usize::from(n);
    if rest.len() < n {
        return None;
    }
    Some((std::str::from_utf8(&rest[..n]).ok()?, &rest[n..]))
}

/// Decodes what [`encode_meta`] made (empty values if it is damaged).
pub(crate) fn decode_meta(b: &[u8]) -> Meta<'_> {
    let parsed = (|| {
        let (exchange, rest) = get_short(b)?;
        let (routing_key, rest) = get_short(rest)?;
        // Most messages have no properties: skip the parser for them.
        let properties = if rest == [0, 0] {
            BasicProperties::default()
        } else {
            warren_amqp::decode_properties(rest)?
        };
        Some(Meta {
            exchange,
            routing_key,
            properties,
        })
    })();
    parsed.unwrap_or(Meta {
        exchange: "",
        routing_key: "",
        properties: BasicProperties::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_amqp::amq_protocol::types::ShortString;

    #[test]
    fn topics() {
        assert!(topic_matches("a.*.c", "a.b.c"));
        assert!(!topic_matches("a.*.c", "a.b.b.c"));
        assert!(topic_matches("a.#.c", "a.b.b.c"));
        assert!(topic_matches("a.#.c", "a.c"));
        assert!(topic_matches("#", ""));
        assert!(topic_matches("#", "x.y"));
        assert!(topic_matches("*.x.#", "q.x"));
        assert!(!topic_matches("*", "a.b"));
        assert!(topic_matches("a", "a"));
    }

    /// The definition: each `#` tried at every split of the rest of the key.
    fn topic_spec(p: &[&str], k: &[&str]) -> bool {
        match p.split_first() {
            None => k.is_empty(),
            Some((&"#", rest)) => (0..=k.len()).any(|i| topic_spec(rest, &k[i..])),
            Some((&w, rest)) => match k.split_first() {
                Some((&kw, krest)) => (w == "*" || w == kw) && topic_spec(rest, krest),
                None => false,
            },
        }
    }

    /// Every sequence of up to four words with every empty word and
    /// separator shape, joined with dots.
    fn phrases(words: &[&str]) -> Vec<String> {
        let mut out = vec![String::new()];
        let mut last = vec![String::new()];
        for _ in 0..4 {
            let mut next = Vec::new();
            for p in &last {
                for w in words {
                    next.push(if p.is_empty() {
                        (*w).to_owned()
                    } else {
                        format!("{p}.{w}")
                    });
                }
            }
            out.extend(next.iter().cloned());
            last = next;
        }
        out
    }

    #[test]
    fn topic_matching_agrees_with_its_definition() {
        let patterns = phrases(&["a", "b", "*", "#", ""]);
        let keys = phrases(&["a", "b", ""]);
        for p in &patterns {
            let pw: Vec<&str> = p.split('.').collect();
            for k in &keys {
                let kw: Vec<&str> = k.split('.').collect();
                assert_eq!(
                    topic_matches(p, k),
                    topic_spec(&pw, &kw),
                    "pattern {p:?}, key {k:?}"
                );
            }
        }
    }

    /// Twenty `#` words before a word the key lacks, against a 40-word key:
    /// about 10^16 splits for the definition, a few thousand steps here.
    #[test]
    fn many_hashes_against_a_long_key_answer_at_once() {
        let pattern = format!("{}nomatch", "#.".repeat(20));
        let key = vec!["w"; 40].join(".");
        assert!(!topic_matches(&pattern, &key));
        assert!(topic_matches(&format!("{}w", "#.".repeat(20)), &key));
    }

    #[test]
    fn headers() {
        let mut b = FieldTable::default();
        b.insert("x-match".into(), AMQPValue::LongString("any".into()));
        b.insert("a".into(), AMQPValue::LongInt(1));
        b.insert("b".into(), AMQPValue::LongString("x".into()));
        let mut h = FieldTable::default();
        h.insert("a".into(), AMQPValue::ShortInt(1));
        assert!(headers_match(&b, Some(&h)));
        b.insert("x-match".into(), AMQPValue::LongString("all".into()));
        assert!(!headers_match(&b, Some(&h)));
        h.insert("b".into(), AMQPValue::ShortString(ShortString::from("x")));
        assert!(headers_match(&b, Some(&h)));
        assert!(!headers_match(&b, None));
    }

    #[test]
    fn meta_roundtrip() {
        let p = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("text/plain".into());
        let encoded = encode_meta("ex", "rk", &p);
        let m = decode_meta(&encoded);
        assert_eq!(m.exchange, "ex");
        assert_eq!(m.routing_key, "rk");
        assert_eq!(m.properties, p);
        let plain = encode_meta("", "q", &BasicProperties::default());
        let m = decode_meta(&plain);
        assert_eq!((m.exchange, m.routing_key), ("", "q"));
        assert_eq!(m.properties, BasicProperties::default());
        assert_eq!(
            decode_meta(&[9, 1]).routing_key,
            "",
            "damaged metadata decodes empty"
        );
    }
}
