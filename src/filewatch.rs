//! Wake-ups when a file is written, by any process: Linux's inotify, read by a thread that
//! sleeps in `poll(2)` until the file changes or the watch is dropped, so a waiter costs no
//! CPU while nothing happens. The redb engine uses it to tell waiters that the worker database
//! changed (a commit writes the file); elsewhere than Linux there is no watch and callers poll.

use crossbeam_channel::Receiver;
use std::path::Path;

/// A watch on one file: `changes` receives a message (coalesced: at most one waits) after each
/// burst of writes to the file. Dropping it stops its thread.
pub struct FileWatch {
    pub changes: Receiver<()>,
    #[cfg(target_os = "linux")]
    stop_fd: libc::c_int,
}

#[cfg(target_os = "linux")]
mod imp {
    use super::FileWatch;
    use crossbeam_channel::{TrySendError, bounded};
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;

    fn last_error(what: &str) -> std::io::Error {
        let e = std::io::Error::last_os_error();
        std::io::Error::new(e.kind(), format!("{what}: {e}"))
    }

    /// Both ends of a pipe, or the error.
    fn pipe() -> std::io::Result<(libc::c_int, libc::c_int)> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            return Err(last_error("cannot make a pipe"));
        }
        Ok((fds[0], fds[1]))
    }

    fn close(fd: libc::c_int) {
        // SAFETY: closing a descriptor this module opened and owns.
        unsafe { libc::close(fd) };
    }

    /// Reads whatever is there without blocking (the descriptor is non-blocking).
    fn drain(fd: libc::c_int) {
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: `buf` is valid for `buf.len()` bytes.
            let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return;
            }
        }
    }

    pub fn watch(path: &Path) -> std::io::Result<FileWatch> {
        let name = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::other("the path has a NUL byte"))?;
        // SAFETY: plain system call; the descriptor is owned by the thread below.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        if fd < 0 {
            return Err(last_error("cannot start an inotify watch"));
        }
        let mask = libc::IN_MODIFY | libc::IN_CLOSE_WRITE | libc::IN_ATTRIB;
        // SAFETY: `name` is a valid NUL-terminated string for the call's duration.
        if unsafe { libc::inotify_add_watch(fd, name.as_ptr(), mask) } < 0 {
            let e = last_error(&format!("cannot watch {}", path.display()));
            close(fd);
            return Err(e);
        }
        let (stop_rx, stop_tx) = match pipe() {
            Ok(p) => p,
            Err(e) => {
                close(fd);
                return Err(e);
            }
        };
        let (tx, rx) = bounded::<()>(1);
        let spawned = std::thread::Builder::new()
            .name("file-watch".into())
            .spawn(move || {
                loop {
                    let mut fds = [
                        libc::pollfd {
                            fd,
                            events: libc::POLLIN,
                            revents: 0,
                        },
                        libc::pollfd {
                            fd: stop_rx,
                            events: libc::POLLIN,
                            revents: 0,
                        },
                    ];
                    // SAFETY: `fds` is a valid array of two pollfd; no timeout: the thread
                    // sleeps until the file changes or the watch is dropped.
                    let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
                    if n < 0 {
                        if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                        {
                            continue;
                        }
                        break;
                    }
                    if fds[1].revents != 0 {
                        break;
                    }
                    if fds[0].revents != 0 {
                        drain(fd);
                        if let Err(TrySendError::Disconnected(_)) = tx.try_send(()) {
                            break;
                        }
                    }
                }
                close(fd);
                close(stop_rx);
            });
        if let Err(e) = spawned {
            close(fd);
            close(stop_rx);
            close(stop_tx);
            return Err(e);
        }
        Ok(FileWatch {
            changes: rx,
            stop_fd: stop_tx,
        })
    }

    impl Drop for FileWatch {
        fn drop(&mut self) {
            // The watch thread wakes on the pipe's end and exits.
            // SAFETY: writing one byte from a valid buffer to the pipe this watch owns.
            unsafe { libc::write(self.stop_fd, [1u8].as_ptr().cast(), 1) };
            close(self.stop_fd);
        }
    }
}

/// A watch on `path`, or why there is none (not Linux, no inotify, no such file).
pub fn watch(path: &Path) -> std::io::Result<FileWatch> {
    #[cfg(target_os = "linux")]
    {
        imp::watch(path)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "file watches need Linux's inotify",
        ))
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::io::Write;
    use std::time::Duration;

    #[test]
    fn a_write_by_anyone_wakes_the_watch_and_nothing_else_does() {
        let dir = std::env::temp_dir().join(format!("tether-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("f");
        std::fs::write(&path, b"a").expect("write");
        let w = watch(&path).expect("a watch");
        assert!(
            w.changes.recv_timeout(Duration::from_millis(200)).is_err(),
            "woken with nothing written"
        );
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("open");
        f.write_all(b"b").expect("write");
        w.changes
            .recv_timeout(Duration::from_secs(10))
            .expect("woken by the write");
        drop(w);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
