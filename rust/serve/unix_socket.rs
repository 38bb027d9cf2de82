//! The ext_proc server's Unix domain socket (`server.unix_socket`), for an
//! Envoy on the same host (a sidecar): Envoy's cluster addresses it with
//! `pipe: {path: ...}`.
//!
//! Binding checks what is at the path first: a missing directory is named,
//! a socket nobody listens on (a stale one, left by a process that was
//! killed) is replaced, a socket another process serves or a file that is
//! not a socket is refused. The socket gets `mode` (0600 or 0660: the
//! directory's own permissions should guard it too, since the mode is set
//! right after the bind) and is removed when the data plane stops, unless
//! another file has taken its place since.

use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::error::{invalid, Result};

/// The modes a socket may be given: its owner, or its owner and group.
pub const MODES: [u32; 2] = [0o600, 0o660];

/// A bound socket's file: removed when dropped, if it is still this socket.
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    /// Its inode and status-change time (an inode number alone is reused by
    /// the next file made).
    id: (u64, i64, i64),
}

fn id(m: &std::fs::Metadata) -> (u64, i64, i64) {
    (m.ino(), m.ctime(), m.ctime_nsec())
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| m.file_type().is_socket() && id(&m) == self.id);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds a non-blocking listener at `path` with permissions `mode`.
pub fn bind(path: &Path, mode: u32) -> Result<(UnixListener, SocketFile)> {
    let fail = |what: String| invalid(format!("server.unix_socket {}: {what}", path.display()));
    if !MODES.contains(&mode) {
        return Err(fail(format!("mode must be 0600 or 0660, got {mode:o}")));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(fail(format!(
            "the directory {} does not exist",
            dir.display()
        )));
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_socket() => {
            return Err(fail("exists and is not a socket".into()));
        }
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => return Err(fail("another process is listening on it".into())),
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                std::fs::remove_file(path)
                    .map_err(|e| fail(format!("cannot remove the stale socket: {e}")))?;
            }
            Err(e) => return Err(fail(format!("cannot check the socket there: {e}"))),
        },
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e.to_string())),
    }
    let listener = UnixListener::bind(path).map_err(|e| fail(format!("cannot listen: {e}")))?;
    let mut file = SocketFile {
        path: path.to_path_buf(),
        id: std::fs::symlink_metadata(path).map_or((0, 0, 0), |m| id(&m)),
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| fail(format!("cannot set its mode: {e}")))?;
    // The mode changed its status-change time.
    file.id = id(&std::fs::symlink_metadata(path).map_err(|e| fail(e.to_string()))?);
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(format!("cannot listen: {e}")))?;
    Ok((listener, file))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("routecore-uds-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    #[test]
    fn binds_with_its_mode_and_is_removed_when_dropped() {
        let d = dir("mode");
        for mode in MODES {
            let path = d.join("rc.sock");
            let (listener, file) = bind(&path, mode).expect("bind");
            let m = std::fs::metadata(&path).expect("exists");
            assert!(m.file_type().is_socket());
            assert_eq!(m.permissions().mode() & 0o777, mode);
            UnixStream::connect(&path).expect("connects");
            drop(listener);
            drop(file);
            assert!(!path.exists(), "removed");
        }
    }

    #[test]
    fn a_stale_socket_is_replaced_and_a_live_one_refused() {
        let d = dir("stale");
        let path = d.join("rc.sock");
        // Stale: bound, then its listener gone without removing the file.
        drop(UnixListener::bind(&path).expect("bind"));
        assert!(path.exists());
        let (_live, _file) = bind(&path, 0o600).expect("the stale socket is replaced");
        let e = bind(&path, 0o600).expect_err("in use").to_string();
        assert!(e.contains("another process is listening"), "{e}");
        assert!(e.contains("rc.sock"), "{e}");
    }

    #[test]
    fn bad_paths_and_modes_are_named() {
        let d = dir("bad");
        let e = bind(&d.join("missing/rc.sock"), 0o600)
            .expect_err("no dir")
            .to_string();
        assert!(e.contains("does not exist") && e.contains("missing"), "{e}");
        let file = d.join("plain");
        std::fs::write(&file, b"x").expect("write");
        let e = bind(&file, 0o600).expect_err("not a socket").to_string();
        assert!(e.contains("is not a socket"), "{e}");
        assert_eq!(std::fs::read(&file).expect("left alone"), b"x");
        let e = bind(&d.join("rc.sock"), 0o666)
            .expect_err("mode")
            .to_string();
        assert!(e.contains("0600 or 0660"), "{e}");
        assert!(!d.join("rc.sock").exists());
    }

    #[test]
    fn a_file_put_in_its_place_is_not_removed() {
        let d = dir("replaced");
        let path = d.join("rc.sock");
        let (listener, file) = bind(&path, 0o600).expect("bind");
        drop(listener);
        std::fs::remove_file(&path).expect("rm");
        std::fs::write(&path, b"other").expect("write");
        drop(file);
        assert_eq!(std::fs::read(&path).expect("kept"), b"other");
    }
}
