//! vLLM's KV-event wire format (`vllm/distributed/kv_events.py`), decoded
//! with `rmp` straight from the payload's bytes into events: no value tree
//! is built, and every count is checked against [`Limits`] before anything
//! of that size is allocated, so a batch costs its payload plus its decoded
//! events (hashes 8 bytes, token ids 4 bytes each), never a multiple of it.
//!
//! The publisher sends ZeroMQ multipart messages `(topic, seq, payload)`:
//! `seq` an 8-byte big-endian batch number counting from 0, `payload` a
//! msgpack `EventBatch`. vLLM 0.32 encodes the batch as an array
//! (`array_like`) and each event as a map tagged by its class name under
//! `"type"`, fields with a default (`extra_keys`, `group_idx`, ...) omitted
//! while at it:
//!
//! ```text
//! EventBatch       = [ts, events, data_parallel_rank?]
//! BlockStored      = {"type": "BlockStored", "block_hashes", "parent_block_hash",
//!                     "token_ids", "block_size", "lora_id", "medium", "lora_name", ...}
//! BlockRemoved     = {"type": "BlockRemoved", "block_hashes", "medium", ...}
//! AllBlocksCleared = {"type": "AllBlocksCleared"}
//! ```
//!
//! Earlier versions encode events as arrays (`["BlockStored", block_hashes,
//! parent_block_hash, token_ids, block_size, lora_id?, medium?, lora_name?]`),
//! and a batch may be a map (`{"ts", "events", "data_parallel_rank"}`): all
//! decode. A block hash is an integer over the whole u64 range (vLLM's
//! default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`) or a byte string (taken
//! by its xxh3-64); a negative integer is taken by its 64-bit pattern.

use rmp::decode::{read_array_len, read_bin_len, read_int, read_map_len, read_str_len};
use rmp::decode::{read_f32, read_f64, read_nil, MessageLen};
use rmp::Marker;
use xxhash_rust::xxh3::xxh3_64;

use crate::kv::{Event, Skip, Stored};

/// Nesting deeper than this is not a batch (an event nests three levels).
const MAX_DEPTH: usize = 16;

/// What one batch may hold; past any of them it is refused whole, before
/// its events are allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Events per batch.
    pub max_events: usize,
    /// Block hashes per batch, over all its events.
    pub max_blocks: usize,
    /// Token ids per batch, over all its `BlockStored` events.
    pub max_tokens: usize,
}

impl Limits {
    /// No limit but the payload's own size (tests, replays of trusted data).
    pub const NONE: Limits = Limits {
        max_events: usize::MAX,
        max_blocks: usize::MAX,
        max_tokens: usize::MAX,
    };
}

/// One decoded `EventBatch`: events that could not be read come as `Err`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<std::result::Result<Event, Skip>>,
    pub data_parallel_rank: Option<i64>,
}

/// Why a payload was refused whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// Not an `EventBatch` (bad msgpack or shape).
    Garbage(String),
    /// More events, blocks or token ids than [`Limits`] allow.
    TooLarge(String),
}

impl Refused {
    /// The fault kind it is counted as (`routecore_faults_total`).
    pub fn kind(&self) -> &'static str {
        match self {
            Refused::Garbage(_) => "garbage-batch",
            Refused::TooLarge(_) => "batch-too-large",
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Garbage(why) | Refused::TooLarge(why) => f.write_str(why),
        }
    }
}

/// A sequence-number frame: 8 bytes, big-endian, signed (the replay's end is -1).
pub fn decode_seq(frame: &[u8]) -> Option<i64> {
    Some(i64::from_be_bytes(frame.try_into().ok()?))
}

/// Decodes an `EventBatch` within `limits`.
pub fn decode_batch(payload: &[u8], limits: &Limits) -> Result<Batch, Refused> {
    let mut rd = Reader {
        buf: payload,
        limits,
        blocks: 0,
        tokens: 0,
    };
    let batch = rd.batch()?;
    if !rd.buf.is_empty() {
        return Err(Refused::Garbage(format!(
            "{} bytes after the batch",
            rd.buf.len()
        )));
    }
    Ok(batch)
}

/// What stops an event: a skip (the event alone) or a refusal (the batch).
enum Bad {
    Skip(Skip),
    Refused(Refused),
}

impl From<Skip> for Bad {
    fn from(s: Skip) -> Self {
        Bad::Skip(s)
    }
}

fn malformed(why: impl Into<String>) -> Bad {
    Bad::Skip(Skip::Malformed(why.into()))
}

fn garbage(e: impl std::fmt::Display) -> Refused {
    Refused::Garbage(e.to_string())
}

/// A cursor over the payload and the counts charged against the limits.
struct Reader<'a> {
    buf: &'a [u8],
    limits: &'a Limits,
    blocks: usize,
    tokens: usize,
}

/// The field names of an array-encoded event, by position after its tag.
fn positional(tag: &str) -> &'static [&'static str] {
    match tag {
        "BlockStored" => &[
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
        ],
        "BlockRemoved" => &["block_hashes", "medium"],
        _ => &[],
    }
}

/// An event's fields as read (by name or position), before its tag decides.
#[derive(Default)]
struct Raw<'a> {
    tag: Option<&'a str>,
    hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    tokens: Option<Vec<u32>>,
    block_size: Option<u64>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<Marker> {
        self.buf.first().map(|&b| Marker::from_u8(b))
    }

    /// The length of the next value, however deep (never past `MAX_DEPTH`).
    fn value_len(&self) -> Result<usize, Refused> {
        MessageLen::with_limits(MAX_DEPTH, usize::MAX)
            .incremental_len(self.buf)
            .map_err(|_| garbage("not msgpack, truncated or nested too deep"))
    }

    fn skip(&mut self) -> Result<(), Refused> {
        let n = self.value_len()?;
        self.buf = &self.buf[n..];
        Ok(())
    }

    /// True (and consumed) when the next value is nil.
    fn nil(&mut self) -> bool {
        self.peek() == Some(Marker::Null) && read_nil(&mut self.buf).is_ok()
    }

    fn str(&mut self) -> Option<&'a str> {
        let len = usize::try_from(read_str_len(&mut self.buf).ok()?).ok()?;
        if len > self.buf.len() {
            return None;
        }
        let (s, rest) = self.buf.split_at(len);
        self.buf = rest;
        std::str::from_utf8(s).ok()
    }

    fn batch(&mut self) -> Result<Batch, Refused> {
        let (mut ts, mut events, mut rank) = (None, None, None);
        match self.peek() {
            Some(Marker::FixArray(_) | Marker::Array16 | Marker::Array32) => {
                let n = read_array_len(&mut self.buf).map_err(garbage)?;
                for i in 0..n {
                    match i {
                        0 => ts = Some(self.number()?),
                        1 => events = Some(self.events()?),
                        2 => rank = self.rank()?,
                        _ => self.skip()?,
                    }
                }
            }
            Some(Marker::FixMap(_) | Marker::Map16 | Marker::Map32) => {
                let n = read_map_len(&mut self.buf).map_err(garbage)?;
                for _ in 0..n {
                    match self.str() {
                        Some("ts") => ts = Some(self.number()?),
                        Some("events") => events = Some(self.events()?),
                        Some("data_parallel_rank") => rank = self.rank()?,
                        Some(_) => self.skip()?,
                        None => return Err(garbage("an EventBatch key is not a string")),
                    }
                }
            }
            _ => return Err(garbage("an EventBatch is an array or a map")),
        }
        Ok(Batch {
            ts: ts.ok_or_else(|| garbage("EventBatch.ts is missing"))?,
            events: events.ok_or_else(|| garbage("EventBatch.events is missing"))?,
            data_parallel_rank: rank,
        })
    }

    fn number(&mut self) -> Result<f64, Refused> {
        let n = match self.peek() {
            Some(Marker::F64) => read_f64(&mut self.buf).ok(),
            Some(Marker::F32) => read_f32(&mut self.buf).ok().map(f64::from),
            _ => read_int::<i64, _>(&mut self.buf).ok().map(|i| i as f64),
        };
        n.ok_or_else(|| garbage("EventBatch.ts is not a number"))
    }

    fn rank(&mut self) -> Result<Option<i64>, Refused> {
        if self.nil() {
            return Ok(None);
        }
        read_int(&mut self.buf)
            .map(Some)
            .map_err(|_| garbage("data_parallel_rank is not an integer"))
    }

    fn events(&mut self) -> Result<Vec<Result<Event, Skip>>, Refused> {
        let n = read_array_len(&mut self.buf)
            .map_err(|_| garbage("EventBatch.events is not an array"))? as usize;
        if n > self.limits.max_events {
            return Err(Refused::TooLarge(format!(
                "{n} events (the limit is {})",
                self.limits.max_events
            )));
        }
        // Every event takes at least a byte: a count past the payload is a lie.
        let mut events = Vec::with_capacity(n.min(self.buf.len()));
        for _ in 0..n {
            // The event's extent first: a bad field skips it alone.
            let len = self.value_len()?;
            let mut event = Reader {
                buf: &self.buf[..len],
                limits: self.limits,
                blocks: self.blocks,
                tokens: self.tokens,
            };
            let decoded = event.event();
            (self.blocks, self.tokens) = (event.blocks, event.tokens);
            self.buf = &self.buf[len..];
            match decoded {
                Ok(e) => events.push(Ok(e)),
                Err(Bad::Skip(s)) => events.push(Err(s)),
                Err(Bad::Refused(r)) => return Err(r),
            }
        }
        Ok(events)
    }

    fn event(&mut self) -> Result<Event, Bad> {
        let mut raw = Raw::default();
        match self.peek() {
            Some(Marker::FixArray(_) | Marker::Array16 | Marker::Array32) => {
                let n = read_array_len(&mut self.buf).map_err(|e| malformed(e.to_string()))?;
                if n == 0 {
                    return Err(malformed("an event is a tagged array or map"));
                }
                let tag = self
                    .str()
                    .ok_or_else(|| malformed("an event's tag is not a string"))?;
                raw.tag = Some(tag);
                let names = positional(tag);
                for i in 1..n as usize {
                    match names.get(i - 1) {
                        Some(name) => self.field(&mut raw, name)?,
                        None => self.skip().map_err(Bad::Refused)?,
                    }
                }
            }
            Some(Marker::FixMap(_) | Marker::Map16 | Marker::Map32) => {
                let n = read_map_len(&mut self.buf).map_err(|e| malformed(e.to_string()))?;
                for _ in 0..n {
                    let key = self
                        .str()
                        .ok_or_else(|| malformed("an event's key is not a string"))?;
                    self.field(&mut raw, key)?;
                }
            }
            _ => return Err(malformed("an event is a tagged array or map")),
        }
        let tag = raw
            .tag
            .ok_or_else(|| malformed("an event has no \"type\""))?;
        let hashes = |h: Option<Vec<u64>>| h.ok_or_else(|| malformed("block_hashes is missing"));
        match tag {
            "BlockStored" => Ok(Event::Stored(Stored {
                hashes: hashes(raw.hashes)?,
                parent: raw.parent,
                token_ids: raw
                    .tokens
                    .ok_or_else(|| malformed("token_ids is missing"))?,
                block_size: raw
                    .block_size
                    .and_then(|b| usize::try_from(b).ok())
                    .ok_or_else(|| malformed("block_size is not a size"))?,
                lora: raw
                    .lora_name
                    .or_else(|| raw.lora_id.map(|id| format!("#{id}"))),
                medium: raw.medium,
            })),
            "BlockRemoved" => Ok(Event::Removed {
                hashes: hashes(raw.hashes)?,
                medium: raw.medium,
            }),
            "AllBlocksCleared" => Ok(Event::Cleared),
            other => Err(Skip::UnknownTag(other.to_owned()).into()),
        }
    }

    /// Reads field `name` into `raw` (an unknown one is skipped).
    fn field(&mut self, raw: &mut Raw<'a>, name: &str) -> Result<(), Bad> {
        match name {
            "type" => {
                raw.tag = Some(
                    self.str()
                        .ok_or_else(|| malformed("type is not a string"))?,
                );
            }
            "block_hashes" => raw.hashes = Some(self.hashes()?),
            "parent_block_hash" if !self.nil() => raw.parent = Some(self.block_hash()?),
            "token_ids" => raw.tokens = Some(self.tokens()?),
            "block_size" => {
                raw.block_size = Some(
                    read_int(&mut self.buf).map_err(|_| malformed("block_size is not a size"))?,
                );
            }
            "lora_id" if !self.nil() => {
                raw.lora_id = Some(
                    read_int(&mut self.buf).map_err(|_| malformed("lora_id is not an integer"))?,
                );
            }
            "medium" if !self.nil() => raw.medium = Some(self.string(name)?),
            "lora_name" if !self.nil() => raw.lora_name = Some(self.string(name)?),
            "parent_block_hash" | "lora_id" | "medium" | "lora_name" => {}
            _ => self.skip().map_err(Bad::Refused)?,
        }
        Ok(())
    }

    fn string(&mut self, name: &str) -> Result<String, Bad> {
        self.str()
            .map(str::to_owned)
            .ok_or_else(|| malformed(format!("{name} is not a string")))
    }

    /// An array's length, charged to `count` against `limit` before any
    /// element is read.
    fn counted(&mut self, what: &str, charged: usize, limit: usize) -> Result<usize, Bad> {
        let n = read_array_len(&mut self.buf)
            .map_err(|_| malformed(format!("{what} is not an array")))? as usize;
        if charged.saturating_add(n) > limit {
            return Err(Bad::Refused(Refused::TooLarge(format!(
                "more than {limit} {what} in a batch"
            ))));
        }
        Ok(n)
    }

    fn hashes(&mut self) -> Result<Vec<u64>, Bad> {
        let n = self.counted("block hashes", self.blocks, self.limits.max_blocks)?;
        self.blocks += n;
        let mut out = Vec::with_capacity(n.min(self.buf.len()));
        for _ in 0..n {
            out.push(self.block_hash()?);
        }
        Ok(out)
    }

    fn block_hash(&mut self) -> Result<u64, Bad> {
        let hash = match self.peek() {
            Some(Marker::Bin8 | Marker::Bin16 | Marker::Bin32) => {
                let len = read_bin_len(&mut self.buf).map_err(|e| malformed(e.to_string()))?;
                let len = (len as usize).min(self.buf.len());
                let (bytes, rest) = self.buf.split_at(len);
                self.buf = rest;
                Some(xxh3_64(bytes))
            }
            Some(Marker::U64) => read_int::<u64, _>(&mut self.buf).ok(),
            _ => read_int::<i64, _>(&mut self.buf).ok().map(|i| i as u64),
        };
        hash.ok_or_else(|| malformed("a block hash is an integer or bytes"))
    }

    fn tokens(&mut self) -> Result<Vec<u32>, Bad> {
        let n = self.counted("token ids", self.tokens, self.limits.max_tokens)?;
        self.tokens += n;
        let mut out = Vec::with_capacity(n.min(self.buf.len()));
        for _ in 0..n {
            out.push(read_int(&mut self.buf).map_err(|_| malformed("a token id is not a u32"))?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A msgpack value for the tests, written with `rmp`'s encoder.
    enum V<'a> {
        Nil,
        U(u64),
        I(i64),
        F(f64),
        S(&'a str),
        B(&'a [u8]),
        A(Vec<V<'a>>),
        M(Vec<(&'a str, V<'a>)>),
    }
    use V::*;

    fn put(v: &V<'_>, out: &mut Vec<u8>) {
        use rmp::encode::*;
        let r = match v {
            Nil => write_nil(out).map_err(|_| ()),
            U(u) => write_uint(out, *u).map(|_| ()).map_err(|_| ()),
            I(i) => write_sint(out, *i).map(|_| ()).map_err(|_| ()),
            F(f) => write_f64(out, *f).map_err(|_| ()),
            S(s) => write_str(out, s).map_err(|_| ()),
            B(b) => write_bin(out, b).map_err(|_| ()),
            A(a) => {
                let r = write_array_len(out, a.len() as u32)
                    .map(|_| ())
                    .map_err(|_| ());
                a.iter().for_each(|x| put(x, out));
                r
            }
            M(m) => {
                let r = write_map_len(out, m.len() as u32)
                    .map(|_| ())
                    .map_err(|_| ());
                for (k, x) in m {
                    let _ = write_str(out, k);
                    put(x, out);
                }
                r
            }
        };
        assert!(r.is_ok(), "encode");
    }

    fn enc(v: &V<'_>) -> Vec<u8> {
        let mut out = Vec::new();
        put(v, &mut out);
        out
    }

    fn ints(v: &[u64]) -> V<'static> {
        A(v.iter().map(|&x| U(x)).collect())
    }

    fn decode(v: &V<'_>) -> Result<Batch, Refused> {
        decode_batch(&enc(v), &Limits::NONE)
    }

    /// vLLM 0.32's `BlockStored` (a map, every field without a default written).
    fn stored_map<'a>(hashes: V<'a>, parent: V<'a>, tokens: &[u64], bs: u64) -> V<'a> {
        M(vec![
            ("type", S("BlockStored")),
            ("block_hashes", hashes),
            ("parent_block_hash", parent),
            ("token_ids", ints(tokens)),
            ("block_size", U(bs)),
            ("lora_id", Nil),
            ("medium", S("GPU")),
            ("lora_name", Nil),
        ])
    }

    #[test]
    fn vllm_batches_of_map_events_decode_with_full_range_hashes() {
        let top = u64::MAX - 1;
        let batch = A(vec![
            F(1.5),
            A(vec![
                stored_map(ints(&[top, 1 << 63]), Nil, &[1, 2, 3, 4], 2),
                M(vec![
                    ("type", S("BlockRemoved")),
                    ("block_hashes", ints(&[top])),
                    ("medium", S("GPU")),
                    ("group_idx", U(0)),
                ]),
                M(vec![("type", S("AllBlocksCleared"))]),
            ]),
            U(3),
        ]);
        let b = decode(&batch).expect("batch");
        assert_eq!((b.ts, b.data_parallel_rank), (1.5, Some(3)));
        assert_eq!(
            b.events,
            vec![
                Ok(Event::Stored(Stored {
                    hashes: vec![top, 1 << 63],
                    parent: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    lora: None,
                    medium: Some("GPU".into()),
                })),
                Ok(Event::Removed {
                    hashes: vec![top],
                    medium: Some("GPU".into())
                }),
                Ok(Event::Cleared),
            ]
        );
    }

    #[test]
    fn array_events_and_map_batches_decode_too() {
        let old = A(vec![
            S("BlockStored"),
            ints(&[1]),
            U(7),
            ints(&[5, 6]),
            U(2),
        ]);
        let named = A(vec![
            S("BlockStored"),
            A(vec![B(b"h1")]),
            I(-2),
            ints(&[5, 6]),
            U(2),
            U(4),
            Nil,
            S("sql-lora"),
            S("a later field"),
        ]);
        let by_id = M(vec![
            ("type", S("BlockStored")),
            ("block_hashes", ints(&[2])),
            ("parent_block_hash", Nil),
            ("token_ids", ints(&[5, 6])),
            ("block_size", U(2)),
            ("lora_id", U(4)),
            ("extra_keys", A(vec![A(vec![S("x"), U(1)])])),
        ]);
        let batch = M(vec![("events", A(vec![old, named, by_id])), ("ts", U(0))]);
        let b = decode(&batch).expect("batch");
        assert_eq!(b.data_parallel_rank, None);
        let stored = |i: usize| match &b.events[i] {
            Ok(Event::Stored(s)) => s.clone(),
            other => panic!("event {i}: {other:?}"),
        };
        assert_eq!(
            (stored(0).parent, stored(0).lora, stored(0).medium),
            (Some(7), None, None)
        );
        assert_eq!(stored(1).hashes, vec![xxh3_64(b"h1")]);
        assert_eq!(stored(1).parent, Some(-2i64 as u64));
        assert_eq!(stored(1).lora.as_deref(), Some("sql-lora"));
        assert_eq!(stored(2).lora.as_deref(), Some("#4"));
    }

    #[test]
    fn unknown_tags_and_bad_fields_are_per_event_skips() {
        let batch = A(vec![
            U(0),
            A(vec![
                A(vec![S("BlockMoved")]),
                stored_map(ints(&[1]), Nil, &[1 << 40], 1),
                U(3),
                M(vec![("block_hashes", ints(&[1]))]),
                stored_map(A(vec![S("not a hash")]), Nil, &[1], 1),
                M(vec![("type", S("AllBlocksCleared"))]),
            ]),
        ]);
        let b = decode(&batch).expect("batch");
        assert_eq!(b.events[0], Err(Skip::UnknownTag("BlockMoved".into())));
        for i in 1..5 {
            assert!(
                matches!(b.events[i], Err(Skip::Malformed(_))),
                "{i}: {:?}",
                b.events[i]
            );
        }
        assert_eq!(b.events[5], Ok(Event::Cleared));
    }

    #[test]
    fn garbage_is_refused_whole() {
        let bad =
            |bytes: &[u8]| matches!(decode_batch(bytes, &Limits::NONE), Err(Refused::Garbage(_)));
        assert!(bad(b""));
        assert!(bad(b"\xc1garbage"));
        assert!(bad(&enc(&S("not a batch"))));
        let mut two = enc(&A(vec![U(0), A(vec![])]));
        two.push(0);
        assert!(bad(&two), "trailing bytes");
        assert!(bad(&enc(&A(vec![S("x"), A(vec![])]))));
        assert!(bad(&enc(&A(vec![U(0)]))), "no events");
        let deep = (0..100).fold(Nil, |v, _| A(vec![v]));
        assert!(bad(&enc(&A(vec![U(0), A(vec![deep])]))));
        // An array announcing 2^32 - 1 events in a few bytes: refused, nothing reserved.
        assert!(bad(&[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0]));
        let mut cut = enc(&A(vec![
            U(0),
            A(vec![stored_map(ints(&[1, 2]), Nil, &[1, 2], 1)]),
        ]));
        cut.truncate(cut.len() - 3);
        assert!(bad(&cut), "truncated");
    }

    #[test]
    fn limits_refuse_a_batch_before_its_events_are_read() {
        let batch = |n: usize, blocks: usize| {
            enc(&A(vec![
                F(0.0),
                A((0..n)
                    .map(|i| stored_map(ints(&vec![i as u64; blocks]), Nil, &vec![1; blocks], 1))
                    .collect()),
            ]))
        };
        let limits = Limits {
            max_events: 4,
            max_blocks: 10,
            max_tokens: 10,
        };
        assert!(decode_batch(&batch(4, 2), &limits).is_ok());
        assert!(
            decode_batch(&batch(2, 5), &limits).is_ok(),
            "exactly the limit"
        );
        for (n, blocks) in [(5, 0), (3, 4), (1, 11)] {
            let r = decode_batch(&batch(n, blocks), &limits);
            assert!(
                matches!(r, Err(Refused::TooLarge(_))),
                "{n} x {blocks}: {r:?}"
            );
        }
        // Token ids count on their own (a BlockStored with more ids than blocks).
        let tokens = enc(&A(vec![
            F(0.0),
            A(vec![stored_map(ints(&[1]), Nil, &[1; 11], 1)]),
        ]));
        assert!(matches!(
            decode_batch(&tokens, &limits),
            Err(Refused::TooLarge(_))
        ));
        // A removal announcing 2^32 - 1 hashes in a few bytes: refused, nothing reserved.
        let mut removal = vec![0x92];
        put(&F(0.0), &mut removal);
        removal.extend([0x91, 0x82]);
        for s in ["type", "BlockRemoved", "block_hashes"] {
            put(&S(s), &mut removal);
        }
        removal.extend([0xdd, 0xff, 0xff, 0xff, 0xff]);
        assert!(decode_batch(&removal, &Limits::NONE).is_err());
    }

    #[test]
    fn sequence_frames_are_8_byte_big_endian() {
        assert_eq!(decode_seq(&5u64.to_be_bytes()), Some(5));
        assert_eq!(decode_seq(&(-1i64).to_be_bytes()), Some(-1));
        assert_eq!(decode_seq(b"1234"), None);
    }
}
