//! vLLM's KV-event wire format (`vllm/distributed/kv_events.py`), decoded
//! with `rmpv`.
//!
//! The publisher sends ZeroMQ multipart messages `(topic, seq, payload)`:
//! `seq` an 8-byte big-endian batch number counting from 0, `payload` a
//! msgpack `EventBatch`. msgspec encodes vLLM's structs as arrays
//! (`array_like`), a tagged event with its class name first, trailing fields
//! left at their default omitted:
//!
//! ```text
//! EventBatch       = [ts, events, data_parallel_rank?]
//! BlockStored      = ["BlockStored", block_hashes, parent_block_hash, token_ids,
//!                     block_size, lora_id?, medium?, lora_name?, ...]
//! BlockRemoved     = ["BlockRemoved", block_hashes, medium?, ...]
//! AllBlocksCleared = ["AllBlocksCleared"]
//! ```
//!
//! Versions that encode structs as maps (`{"ts": .., "events": ..}`, events
//! tagged by a `"type"` key) decode too. A block hash is an integer or, in
//! newer vLLM, a byte string (taken by its xxh3-64). The replay socket
//! answers `(seq, payload)` pairs and ends with `(-1, b"")`.

use rmpv::Value;
use xxhash_rust::xxh3::xxh3_64;

use super::index::{Event, Skip, Stored};

/// Nesting deeper than this is not a batch (an event nests three levels).
const MAX_DEPTH: usize = 16;

/// One decoded `EventBatch`: events that could not be read come as `Err`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<std::result::Result<Event, Skip>>,
    pub data_parallel_rank: Option<i64>,
}

/// A sequence-number frame: 8 bytes, big-endian, signed (the replay's end is -1).
pub fn decode_seq(frame: &[u8]) -> Option<i64> {
    Some(i64::from_be_bytes(frame.try_into().ok()?))
}

/// Decodes an `EventBatch`; Err(why) when the payload is not one.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, String> {
    let mut rd = payload;
    let value =
        rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH).map_err(|e| e.to_string())?;
    if !rd.is_empty() {
        return Err(format!("{} bytes after the batch", rd.len()));
    }
    let (ts, events, rank) = match &value {
        Value::Array(a) => (a.first(), a.get(1), a.get(2)),
        Value::Map(_) => (
            field(&value, "ts"),
            field(&value, "events"),
            field(&value, "data_parallel_rank"),
        ),
        _ => return Err("an EventBatch is an array or a map".into()),
    };
    let ts = ts
        .and_then(Value::as_f64)
        .ok_or("EventBatch.ts is not a number")?;
    let events = events
        .and_then(Value::as_array)
        .ok_or("EventBatch.events is not an array")?;
    let data_parallel_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(r) => Some(r.as_i64().ok_or("data_parallel_rank is not an integer")?),
    };
    Ok(Batch {
        ts,
        events: events.iter().map(decode_event).collect(),
        data_parallel_rank,
    })
}

fn field<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    map.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// An event's fields by position (array form) or name (map form).
struct Fields<'a> {
    value: &'a Value,
}

impl<'a> Fields<'a> {
    /// Field `i` (0 = the first after the tag) named `name`; Nil when absent.
    fn get(&self, i: usize, name: &str) -> &'a Value {
        const NIL: &Value = &Value::Nil;
        match self.value {
            Value::Array(a) => a.get(i + 1).unwrap_or(NIL),
            _ => field(self.value, name).unwrap_or(NIL),
        }
    }
}

fn malformed(why: impl Into<String>) -> Skip {
    Skip::Malformed(why.into())
}

fn decode_event(value: &Value) -> std::result::Result<Event, Skip> {
    let tag = match value {
        Value::Array(a) => a.first(),
        Value::Map(_) => field(value, "type"),
        _ => None,
    }
    .and_then(Value::as_str)
    .ok_or_else(|| malformed("an event is a tagged array or map"))?;
    let f = Fields { value };
    match tag {
        "BlockStored" => Ok(Event::Stored(Stored {
            hashes: hashes(f.get(0, "block_hashes"))?,
            parent: opt(f.get(1, "parent_block_hash"), block_hash)?,
            token_ids: token_ids(f.get(2, "token_ids"))?,
            block_size: f
                .get(3, "block_size")
                .as_u64()
                .and_then(|b| usize::try_from(b).ok())
                .ok_or_else(|| malformed("block_size is not a size"))?,
            lora: match opt(f.get(6, "lora_name"), string)? {
                Some(name) => Some(name),
                None => opt(f.get(4, "lora_id"), |v| {
                    v.as_i64()
                        .map(|id| format!("#{id}"))
                        .ok_or_else(|| malformed("lora_id is not an integer"))
                })?,
            },
            medium: opt(f.get(5, "medium"), string)?,
        })),
        "BlockRemoved" => Ok(Event::Removed {
            hashes: hashes(f.get(0, "block_hashes"))?,
            medium: opt(f.get(1, "medium"), string)?,
        }),
        "AllBlocksCleared" => Ok(Event::Cleared),
        other => Err(Skip::UnknownTag(other.to_owned())),
    }
}

fn opt<T>(
    v: &Value,
    read: impl Fn(&Value) -> std::result::Result<T, Skip>,
) -> std::result::Result<Option<T>, Skip> {
    match v {
        Value::Nil => Ok(None),
        v => read(v).map(Some),
    }
}

fn string(v: &Value) -> std::result::Result<String, Skip> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| malformed("expected a string"))
}

fn block_hash(v: &Value) -> std::result::Result<u64, Skip> {
    match v {
        Value::Binary(b) => Ok(xxh3_64(b)),
        v => v
            .as_u64()
            .or_else(|| v.as_i64().map(|i| i as u64))
            .ok_or_else(|| malformed("a block hash is an integer or bytes")),
    }
}

fn hashes(v: &Value) -> std::result::Result<Vec<u64>, Skip> {
    v.as_array()
        .ok_or_else(|| malformed("block_hashes is not an array"))?
        .iter()
        .map(block_hash)
        .collect()
}

fn token_ids(v: &Value) -> std::result::Result<Vec<u32>, Skip> {
    v.as_array()
        .ok_or_else(|| malformed("token_ids is not an array"))?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| malformed("a token id is not a u32"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).expect("encode");
        out
    }

    fn arr(v: Vec<Value>) -> Value {
        Value::Array(v)
    }

    fn ints(v: &[u64]) -> Value {
        arr(v.iter().map(|&x| Value::from(x)).collect())
    }

    #[test]
    fn array_form_batches_decode_every_event_kind() {
        let stored = arr(vec![
            "BlockStored".into(),
            ints(&[11, 12]),
            Value::Nil,
            ints(&[1, 2, 3, 4]),
            2.into(),
            Value::Nil,
            "GPU".into(),
        ]);
        let removed = arr(vec!["BlockRemoved".into(), ints(&[11]), "GPU".into()]);
        let batch = arr(vec![
            Value::F64(1.5),
            arr(vec![stored, removed, arr(vec!["AllBlocksCleared".into()])]),
            3.into(),
        ]);
        let b = decode_batch(&enc(&batch)).expect("batch");
        assert_eq!(b.ts, 1.5);
        assert_eq!(b.data_parallel_rank, Some(3));
        assert_eq!(
            b.events,
            vec![
                Ok(Event::Stored(Stored {
                    hashes: vec![11, 12],
                    parent: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    lora: None,
                    medium: Some("GPU".into()),
                })),
                Ok(Event::Removed {
                    hashes: vec![11],
                    medium: Some("GPU".into())
                }),
                Ok(Event::Cleared),
            ]
        );
    }

    #[test]
    fn trailing_defaults_may_be_omitted_and_lora_name_wins_over_lora_id() {
        let old = arr(vec![
            "BlockStored".into(),
            ints(&[1]),
            7.into(),
            ints(&[5, 6]),
            2.into(),
        ]);
        let named = arr(vec![
            "BlockStored".into(),
            arr(vec![Value::Binary(b"h1".to_vec())]),
            Value::from(-2i64),
            ints(&[5, 6]),
            2.into(),
            4.into(),
            Value::Nil,
            "sql-lora".into(),
        ]);
        let b = decode_batch(&enc(&arr(vec![0.into(), arr(vec![old, named])]))).expect("batch");
        assert_eq!(b.data_parallel_rank, None);
        let Ok(Event::Stored(s)) = &b.events[0] else {
            panic!("stored")
        };
        assert_eq!(
            (s.parent, s.lora.clone(), s.medium.clone()),
            (Some(7), None, None)
        );
        let Ok(Event::Stored(s)) = &b.events[1] else {
            panic!("stored")
        };
        assert_eq!(s.hashes, vec![xxh3_64(b"h1")]);
        assert_eq!(s.parent, Some(-2i64 as u64));
        assert_eq!(s.lora.as_deref(), Some("sql-lora"));
    }

    #[test]
    fn map_form_batches_decode() {
        let ev = Value::Map(vec![
            ("type".into(), "BlockRemoved".into()),
            ("block_hashes".into(), ints(&[9])),
        ]);
        let batch = Value::Map(vec![
            ("ts".into(), Value::F64(2.0)),
            ("events".into(), arr(vec![ev])),
        ]);
        let b = decode_batch(&enc(&batch)).expect("batch");
        assert_eq!(
            b.events,
            vec![Ok(Event::Removed {
                hashes: vec![9],
                medium: None
            })]
        );
    }

    #[test]
    fn unknown_tags_and_bad_fields_are_per_event_skips() {
        let batch = arr(vec![
            0.into(),
            arr(vec![
                arr(vec!["BlockMoved".into()]),
                arr(vec![
                    "BlockStored".into(),
                    ints(&[1]),
                    Value::Nil,
                    ints(&[1 << 40]),
                    1.into(),
                ]),
                Value::from(3),
                arr(vec!["AllBlocksCleared".into()]),
            ]),
        ]);
        let b = decode_batch(&enc(&batch)).expect("batch");
        assert_eq!(b.events[0], Err(Skip::UnknownTag("BlockMoved".into())));
        assert!(matches!(b.events[1], Err(Skip::Malformed(_))));
        assert!(matches!(b.events[2], Err(Skip::Malformed(_))));
        assert_eq!(b.events[3], Ok(Event::Cleared));
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(decode_batch(b"").is_err());
        assert!(decode_batch(b"\xc1garbage").is_err());
        assert!(decode_batch(&enc(&Value::from("not a batch"))).is_err());
        let mut two = enc(&arr(vec![0.into(), arr(vec![])]));
        two.push(0);
        assert!(decode_batch(&two).is_err(), "trailing bytes");
        assert!(decode_batch(&enc(&arr(vec!["x".into(), arr(vec![])]))).is_err());
        let deep = (0..100).fold(Value::Nil, |v, _| arr(vec![v]));
        assert!(decode_batch(&enc(&deep)).is_err());
    }

    #[test]
    fn sequence_frames_are_8_byte_big_endian() {
        assert_eq!(decode_seq(&5u64.to_be_bytes()), Some(5));
        assert_eq!(decode_seq(&(-1i64).to_be_bytes()), Some(-1));
        assert_eq!(decode_seq(b"1234"), None);
    }
}
