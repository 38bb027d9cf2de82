//! The byte format every stateful object uses for `to_bytes` / `from_bytes`.
//!
//! A snapshot is `magic (4 bytes) ++ version (u16 LE) ++ fields`, every number
//! little-endian, floats as their IEEE-754 bits (so a round trip is exact),
//! strings as `u32 length ++ UTF-8`. `Reader` checks every length against what
//! is left, so truncated or hostile input gives `Error::Snapshot`, never a panic
//! or a huge allocation, and `finish` rejects trailing bytes. `restore` reads a
//! whole snapshot and makes whatever a bad one trips (a failed check of a
//! restored setting, an unknown name) `Error::Snapshot`: one error for bad
//! bytes, whatever the object.

use crate::error::{Error, Result};

pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub fn new(magic: &[u8; 4], version: u16) -> Self {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(magic);
        buf.extend_from_slice(&version.to_le_bytes());
        Self { buf }
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.u64(v.to_bits())
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        // Every string the core stores is bounded far below 4 GiB.
        self.u32(s.len() as u32);
        self.buf.extend_from_slice(s.as_bytes());
        self
    }
    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads a snapshot with `read` (after checking the header; then checking
/// that nothing trails). Any error is reported as `Error::Snapshot`.
pub fn restore<T>(
    bytes: &[u8],
    magic: &[u8; 4],
    version: u16,
    what: &str,
    read: impl FnOnce(&mut Reader<'_>) -> Result<T>,
) -> Result<T> {
    restore_since(bytes, magic, version..=version, what, |r, _| read(r))
}

/// `restore` for an object whose older snapshot versions still load: any
/// version in `versions`, given to `read` (which reads that version's fields).
pub fn restore_since<T>(
    bytes: &[u8],
    magic: &[u8; 4],
    versions: std::ops::RangeInclusive<u16>,
    what: &str,
    read: impl FnOnce(&mut Reader<'_>, u16) -> Result<T>,
) -> Result<T> {
    let (mut r, version) = Reader::versioned(bytes, magic, versions, what)?;
    let value = read(&mut r, version).map_err(|e| match e {
        Error::Snapshot(_) => e,
        other => err(other.to_string()),
    })?;
    r.finish()?;
    Ok(value)
}

pub struct Reader<'a> {
    rest: &'a [u8],
}

fn err(msg: impl Into<String>) -> Error {
    Error::Snapshot(msg.into())
}

impl<'a> Reader<'a> {
    /// Checks the magic and that the version is one this build reads.
    pub fn new(bytes: &'a [u8], magic: &[u8; 4], version: u16, what: &str) -> Result<Self> {
        Ok(Self::versioned(bytes, magic, version..=version, what)?.0)
    }

    /// Checks the magic and that the version is in `versions`; returns it.
    pub fn versioned(
        bytes: &'a [u8],
        magic: &[u8; 4],
        versions: std::ops::RangeInclusive<u16>,
        what: &str,
    ) -> Result<(Self, u16)> {
        if bytes.len() < 6 || &bytes[..4] != magic {
            return Err(err(format!("not a {what} snapshot (bad magic)")));
        }
        let v = u16::from_le_bytes([bytes[4], bytes[5]]);
        if !versions.contains(&v) {
            let reads = if versions.start() == versions.end() {
                versions.start().to_string()
            } else {
                format!("{} to {}", versions.start(), versions.end())
            };
            return Err(err(format!(
                "{what} snapshot version {v} is not supported (this build reads {reads})"
            )));
        }
        Ok((Self { rest: &bytes[6..] }, v))
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.rest.len() < n {
            return Err(err("truncated"));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_bits(self.u64()?))
    }
    pub fn str(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| err("string is not UTF-8"))
    }
    /// A count of items that follow, each at least `min_item_bytes` long:
    /// refused when the rest of the input cannot hold that many.
    pub fn count(&mut self, min_item_bytes: usize) -> Result<usize> {
        let n = self.u64()?;
        let fits = (self.rest.len() / min_item_bytes.max(1)) as u64;
        if n > fits {
            return Err(err(format!("count {n} does not fit in the snapshot")));
        }
        Ok(n as usize)
    }
    pub fn finish(self) -> Result<()> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(err(format!("{} trailing bytes", self.rest.len())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_errors() {
        let mut w = Writer::new(b"TEST", 3);
        w.u8(7).u32(9).u64(u64::MAX).f64(-0.1).str("héllo");
        let bytes = w.finish();
        let mut r = Reader::new(&bytes, b"TEST", 3, "test").expect("header");
        assert_eq!(r.u8(), Ok(7));
        assert_eq!(r.u32(), Ok(9));
        assert_eq!(r.u64(), Ok(u64::MAX));
        assert_eq!(r.f64().map(f64::to_bits), Ok((-0.1f64).to_bits()));
        assert_eq!(r.str().as_deref(), Ok("héllo"));
        assert!(r.finish().is_ok());

        assert!(Reader::new(&bytes, b"NOPE", 3, "test").is_err());
        assert!(Reader::new(&bytes, b"TEST", 4, "test").is_err());
        for cut in 6..bytes.len() {
            let mut r = Reader::new(&bytes[..cut], b"TEST", 3, "test").expect("header");
            let all = (|| -> Result<()> {
                r.u8()?;
                r.u32()?;
                r.u64()?;
                r.f64()?;
                r.str()?;
                Ok(())
            })();
            assert!(all.is_err(), "cut at {cut} must fail");
        }
        let mut w = Writer::new(b"TEST", 3);
        w.u64(1 << 60);
        let bytes = w.finish();
        let mut r = Reader::new(&bytes, b"TEST", 3, "test").expect("header");
        assert!(r.count(8).is_err());
    }
}
