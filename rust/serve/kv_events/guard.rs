//! A size guard in front of the `zeromq` crate's codec. The codec reserves
//! a frame's announced length as soon as it reads the frame header
//! (`ZmqCodec::decode` in zeromq 0.7), before any byte of the body arrives,
//! and it takes any number of frames into one message: one header that
//! announces 2^40 bytes aborts the process, and a flood of frames grows
//! memory without end. The crate offers no limit, and its transports are
//! private, so the guard sits on the wire: the socket connects to a
//! loopback listener of the guard (one connection, then the listener is
//! closed), the guard connects to the peer and passes its bytes on after
//! reading each ZMTP frame header (ZMTP 3: a 64-byte greeting, then frames
//! of a flags byte and a 1- or 8-byte length). A frame or message longer
//! than the limit, or a message of more than [`MAX_FRAMES`] frames, cuts the
//! connection before that header reaches the codec: the socket sees the
//! peer disconnect, and the caller counts the cut and connects again.
//!
//! What routecore's socket sends to the peer passes unchanged.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use zeromq::Socket;

/// The ZMTP 3 greeting, in bytes.
const GREETING: usize = 64;
/// Bytes read from the peer at a time (the most the guard holds).
const CHUNK: usize = 64 * 1024;
/// Frames in one message at most: a KV-event message has three (topic, seq,
/// payload), a replay answer four (delimiter, topic, seq, payload).
pub const MAX_FRAMES: usize = 16;

/// Why the guard cut a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// A frame header announced `len` bytes, `total` with the message's
    /// earlier frames, over the limit.
    TooLong { len: u64, total: u64 },
    /// A message of more than [`MAX_FRAMES`] frames.
    TooManyFrames,
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cut::TooLong { len, total } => write!(
                f,
                "a frame of {len} bytes ({total} with its message's earlier frames) is over kv_events.max_message_bytes"
            ),
            Cut::TooManyFrames => write!(f, "a message of more than {MAX_FRAMES} frames"),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum State {
    /// Greeting bytes still to pass.
    Greeting(usize),
    Flags,
    /// A frame's length bytes, `got` of `need` read so far.
    Length {
        command: bool,
        more: bool,
        need: usize,
        got: usize,
        bytes: [u8; 8],
    },
    /// Body bytes still to pass.
    Body(u64),
}

/// Reads the peer's bytes in order and checks each frame header (pure: the
/// proxy feeds it what it read, and passes a chunk on only when it is Ok).
#[derive(Debug, Clone)]
pub struct Scanner {
    max: u64,
    state: State,
    /// Body bytes and frames of the message being read (frames with MORE).
    message: u64,
    frames: usize,
}

impl Scanner {
    pub fn new(max_message_bytes: u64) -> Self {
        Self {
            max: max_message_bytes,
            state: State::Greeting(GREETING),
            message: 0,
            frames: 0,
        }
    }

    /// Reads `buf`, the peer's next bytes; Err as soon as a frame header is
    /// over a limit.
    pub fn feed(&mut self, mut buf: &[u8]) -> Result<(), Cut> {
        while let Some(&first) = buf.first() {
            match &mut self.state {
                State::Greeting(left) => {
                    let n = (*left).min(buf.len());
                    *left -= n;
                    buf = &buf[n..];
                    if *left == 0 {
                        self.state = State::Flags;
                    }
                }
                State::Flags => {
                    buf = &buf[1..];
                    self.state = State::Length {
                        command: first & 0b100 != 0,
                        more: first & 0b001 != 0,
                        need: if first & 0b010 != 0 { 8 } else { 1 },
                        got: 0,
                        bytes: [0; 8],
                    };
                }
                State::Length {
                    command,
                    more,
                    need,
                    got,
                    bytes,
                } => {
                    let n = (*need - *got).min(buf.len());
                    bytes[8 - *need + *got..8 - *need + *got + n].copy_from_slice(&buf[..n]);
                    *got += n;
                    buf = &buf[n..];
                    if *got == *need {
                        let (command, more, len) = (*command, *more, u64::from_be_bytes(*bytes));
                        self.frame(command, more, len)?;
                        self.state = if len == 0 {
                            State::Flags
                        } else {
                            State::Body(len)
                        };
                    }
                }
                State::Body(left) => {
                    let n = (*left).min(buf.len() as u64);
                    *left -= n;
                    buf = &buf[n as usize..];
                    if *left == 0 {
                        self.state = State::Flags;
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks one frame header (a command is a message of its own).
    fn frame(&mut self, command: bool, more: bool, len: u64) -> Result<(), Cut> {
        let (earlier, frames) = if command {
            (0, 0)
        } else {
            (self.message, self.frames)
        };
        let total = earlier.saturating_add(len);
        if total > self.max {
            return Err(Cut::TooLong { len, total });
        }
        if frames + 1 > MAX_FRAMES {
            return Err(Cut::TooManyFrames);
        }
        if !command {
            (self.message, self.frames) = if more { (total, frames + 1) } else { (0, 0) };
        }
        Ok(())
    }
}

/// How a guarded connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// The peer or the socket closed it (or an I/O error did).
    Closed(String),
    /// The guard cut it: the peer went past a limit.
    Cut(Cut),
}

/// A guarded connection; dropping it closes both sides.
pub struct Guard {
    task: JoinHandle<Ended>,
}

impl Guard {
    /// Whether the connection has ended already.
    pub fn is_closed(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits until the connection ends.
    pub async fn ended(&mut self) -> Ended {
        (&mut self.task)
            .await
            .unwrap_or_else(|e| Ended::Closed(e.to_string()))
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn io(what: &str, e: impl std::fmt::Display) -> String {
    format!("{what}: {e}")
}

/// Connects `socket` to the ZeroMQ peer at `addr` (`tcp://host:port`)
/// through a guard (see the module docs), each step within `timeout`.
pub async fn connect<S: Socket>(
    socket: &mut S,
    addr: &str,
    max_message_bytes: u64,
    timeout: Duration,
) -> Result<Guard, String> {
    let (host, port) = match addr.parse::<zeromq::Endpoint>() {
        Ok(zeromq::Endpoint::Tcp(host, port)) => (host.to_string(), port),
        _ => return Err(format!("{addr:?} is not a tcp:// address")),
    };
    let peer = tokio::time::timeout(timeout, TcpStream::connect((host.as_str(), port)))
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| io("connect", e))?;
    let _ = peer.set_nodelay(true);
    let listener = TcpListener::bind(("127.0.0.1", 0))
        .await
        .map_err(|e| io("guard listener", e))?;
    let local = listener.local_addr().map_err(|e| io("guard listener", e))?;
    let task = tokio::spawn(async move {
        let inner = match listener.accept().await {
            Ok((inner, _)) => inner,
            Err(e) => return Ended::Closed(io("guard accept", e)),
        };
        drop(listener);
        let _ = inner.set_nodelay(true);
        pump(inner, peer, Scanner::new(max_message_bytes)).await
    });
    let guard = Guard { task };
    match tokio::time::timeout(timeout, socket.connect(&format!("tcp://{local}"))).await {
        Ok(Ok(())) => Ok(guard),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("handshake timed out".into()),
    }
}

/// Passes bytes both ways until either side closes or the scanner cuts.
async fn pump(inner: TcpStream, peer: TcpStream, mut scanner: Scanner) -> Ended {
    let (mut from_socket, mut to_socket) = inner.into_split();
    let (mut from_peer, mut to_peer) = peer.into_split();
    let up = async {
        match tokio::io::copy(&mut from_socket, &mut to_peer).await {
            Ok(_) => Ended::Closed("routecore's socket closed".into()),
            Err(e) => Ended::Closed(io("to the peer", e)),
        }
    };
    let down = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match from_peer.read(&mut buf).await {
                Ok(0) => return Ended::Closed("the peer closed the connection".into()),
                Ok(n) => n,
                Err(e) => return Ended::Closed(io("from the peer", e)),
            };
            if let Err(cut) = scanner.feed(&buf[..n]) {
                return Ended::Cut(cut);
            }
            if let Err(e) = to_socket.write_all(&buf[..n]).await {
                return Ended::Closed(io("to the socket", e));
            }
        }
    };
    tokio::select! {
        ended = up => ended,
        ended = down => ended,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// A frame as ZMTP 3 writes it (`more`, `command` flags; short or long length).
    fn frame(body_len: u64, more: bool, command: bool, long: bool) -> Vec<u8> {
        let flags = u8::from(more) | (u8::from(long) << 1) | (u8::from(command) << 2);
        let mut out = vec![flags];
        if long {
            out.extend(body_len.to_be_bytes());
        } else {
            out.push(u8::try_from(body_len).expect("a short frame"));
        }
        out
    }

    /// Feeds `bytes` to a scanner in the chunks `cuts` makes.
    fn scan(max: u64, bytes: &[u8], rng: &mut Rng) -> Result<(), Cut> {
        let mut s = Scanner::new(max);
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = 1 + rng.below(rest.len() as u64) as usize;
            s.feed(&rest[..n])?;
            rest = &rest[n..];
        }
        Ok(())
    }

    fn message(lens: &[u64]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            out.extend(frame(len, i + 1 < lens.len(), false, len > 255));
            out.extend(std::iter::repeat_n(0xAB, len as usize));
        }
        out
    }

    #[test]
    fn frames_and_messages_within_the_limit_pass_in_any_chunking() {
        let mut rng = Rng::new(11);
        let mut wire = vec![0xFF; GREETING];
        wire.extend(frame(40, false, true, false)); // READY
        wire.extend([0u8; 40]);
        wire.extend(message(&[2, 8, 990])); // a KV-event message, exactly 1000
        wire.extend(message(&[0, 2, 8, 990])); // a replay answer
        wire.extend(message(&[]));
        for _ in 0..200 {
            assert_eq!(scan(1000, &wire, &mut rng), Ok(()));
        }
    }

    #[test]
    fn a_header_over_the_limit_is_cut_before_its_body() {
        let mut rng = Rng::new(12);
        let mut wire = vec![0xFF; GREETING];
        wire.extend(frame(1 << 40, false, false, true));
        for _ in 0..100 {
            assert_eq!(
                scan(1 << 20, &wire, &mut rng),
                Err(Cut::TooLong {
                    len: 1 << 40,
                    total: 1 << 40
                })
            );
        }
        // The message's frames add up; a command counts alone.
        let mut wire = vec![0xFF; GREETING];
        wire.extend(message(&[600, 600]));
        assert!(matches!(
            scan(1000, &wire, &mut rng),
            Err(Cut::TooLong {
                len: 600,
                total: 1200
            })
        ));
        let mut wire = vec![0xFF; GREETING];
        wire.extend(message(&[600]));
        wire.extend(frame(900, false, true, true));
        wire.extend([0; 900]);
        wire.extend(message(&[600]));
        assert_eq!(scan(1000, &wire, &mut rng), Ok(()));
    }

    #[test]
    fn a_flood_of_empty_frames_is_cut() {
        let mut wire = vec![0xFF; GREETING];
        wire.extend(message(&[0; MAX_FRAMES]));
        assert_eq!(scan(10, &wire, &mut Rng::new(1)), Ok(()));
        wire.extend(message(&[0; MAX_FRAMES + 1]));
        assert_eq!(scan(10, &wire, &mut Rng::new(1)), Err(Cut::TooManyFrames));
    }

    #[test]
    fn random_streams_are_cut_exactly_when_a_message_is_over_the_limit() {
        let mut rng = Rng::new(13);
        for _ in 0..300 {
            let max = 1 + rng.below(4096);
            let mut wire = vec![0xFF; GREETING];
            let mut over = false;
            for _ in 0..rng.below(6) {
                let lens: Vec<u64> = (0..1 + rng.below(4)).map(|_| rng.below(2 * max)).collect();
                if !over && lens.iter().sum::<u64>() > max {
                    over = true;
                }
                wire.extend(message(&lens));
            }
            assert_eq!(scan(max, &wire, &mut rng).is_err(), over);
        }
    }
}
