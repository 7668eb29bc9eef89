//! Handles on a redb file: opening it for writing, shared with other writing processes
//! (redb's MultiWriter mode) or as its only writer (SingleWriter, a daemon started with
//! a daemon, unless started with `--shared`), without ever panicking on a damaged file; a read-only handle for readers;
//! and a writer's handle that is opened again after an I/O error.

use redb::{Database, ReadTransaction, ReadableDatabase, WriteTransaction};
use std::path::Path;

use super::{Error, Result};

/// The file as this handle opened it: for writing (daemons, decisions, enqueue), or read-only
/// (the read verbs), so a reader never waits for a writer.
pub(super) enum Handle {
    Writer(Reopening),
    Reader(redb::ReadOnlyDatabase),
}

impl Handle {
    pub(super) fn begin_read(
        &self,
    ) -> std::result::Result<ReadTransaction, redb::TransactionError> {
        match self {
            Handle::Writer(db) => match db.get() {
                Ok(db) => db.begin_read(),
                Err(_) => Err(redb::TransactionError::Storage(
                    redb::StorageError::PreviousIo,
                )),
            },
            Handle::Reader(db) => db.begin_read(),
        }
    }

    pub(super) fn begin_write(&self) -> Result<WriteTransaction> {
        match self {
            Handle::Writer(db) => Ok(db.get()?.begin_write()?),
            Handle::Reader(_) => Err(Error::Invalid(
                "this database handle was opened read-only".into(),
            )),
        }
    }
}

pub(super) fn open_error(path: &Path, e: redb::DatabaseError) -> Error {
    match e {
        redb::DatabaseError::DatabaseAlreadyOpen => Error::InUse(path.to_path_buf()),
        redb::DatabaseError::Storage(redb::StorageError::Io(io))
            if io.kind() == std::io::ErrorKind::InvalidData =>
        {
            Error::Corrupt(format!("{}: {io}", path.display()))
        }
        redb::DatabaseError::Storage(redb::StorageError::Io(io)) => Error::Io {
            path: path.to_path_buf(),
            source: io,
        },
        redb::DatabaseError::UpgradeRequired(v) => Error::NewerVersion {
            what: format!("database file {}", path.display()),
            found: v as u64,
            supported: 0,
        },
        redb::DatabaseError::Storage(redb::StorageError::Corrupted(msg)) => {
            Error::Corrupt(format!("{}: {msg}", path.display()))
        }
        other => Error::Corrupt(format!("{}: {other}", path.display())),
    }
}

/// Opens a database file: a fresh handle each call.
pub type Opener = std::sync::Arc<dyn Fn() -> Result<Database> + Send + Sync>;

/// How a writing process shares the file with the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// Any number of processes write it, one write transaction at a time (redb's MultiWriter:
    /// every commit in two phases, with the allocator's state). Daemons started with
    /// `--shared`, `worker enqueue` and the operators' verbs.
    Shared,
    /// This process is its only writer; other processes may read it (redb's SingleWriter). A
    /// daemon (unless started with `--shared`): its commits skip what sharing costs.
    Sole,
}

/// A redb handle that is replaced after an I/O error. redb refuses every later operation of a
/// handle that saw one ("Previous I/O error"), so a full disk that is freed again would stop
/// the process for good; opening the file again recovers its last commit and goes on. What
/// was in flight when the error came is not retried here: its outcome is for the caller.
/// A sole writer's file admits one writing handle, so there the broken handle is closed
/// (once no transaction still uses it) before the new one is opened.
pub struct Reopening {
    current: std::sync::RwLock<Option<std::sync::Arc<Database>>>,
    open: Opener,
    sharing: Sharing,
    /// The current handle saw an I/O error: open the file again before its next use.
    broken: std::sync::atomic::AtomicBool,
}

impl Reopening {
    pub fn new(open: Opener) -> Result<Reopening> {
        Reopening::with(open, Sharing::Shared)
    }

    /// A handle that `open` makes in the given sharing mode.
    pub fn with(open: Opener, sharing: Sharing) -> Result<Reopening> {
        let db = open()?;
        Ok(Reopening {
            current: std::sync::RwLock::new(Some(std::sync::Arc::new(db))),
            open,
            sharing,
            broken: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The current handle, opened again first if the last one saw an I/O error (while the
    /// disk still fails, that open fails too and the broken handle keeps reporting it).
    pub fn get(&self) -> Result<std::sync::Arc<Database>> {
        use std::sync::atomic::Ordering;
        if self.broken.load(Ordering::SeqCst) {
            let mut g = match self.current.write() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            if self.broken.load(Ordering::SeqCst) {
                self.reopen(&mut g);
            }
        }
        let g = match self.current.read() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        g.as_ref()
            .map(std::sync::Arc::clone)
            .ok_or(Error::Db(redb::Error::PreviousIo))
    }

    /// Opens the file again in place of the broken handle in `current` (held for writing).
    fn reopen(&self, current: &mut Option<std::sync::Arc<Database>>) {
        if self.sharing == Sharing::Sole {
            match current {
                // A transaction still uses the broken handle: the file stays locked by it, so
                // the new open waits for a later call.
                Some(db) if std::sync::Arc::strong_count(db) > 1 => return,
                _ => *current = None,
            }
        }
        match (self.open)() {
            Ok(db) => {
                *current = Some(std::sync::Arc::new(db));
                self.broken
                    .store(false, std::sync::atomic::Ordering::SeqCst);
                tracing::warn!("database handle reopened after an I/O error");
            }
            Err(e) => tracing::error!(error = %e, "reopening the database failed"),
        }
    }

    /// Called with an error the handle gave: after an I/O error, the next use opens the file
    /// again. Returns whether the error was one.
    pub fn after(&self, e: &Error) -> bool {
        let io = is_io(e);
        if io {
            self.broken.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        io
    }
}

/// Whether an error came from the storage below (the disk), not from the data.
fn is_io(e: &Error) -> bool {
    matches!(
        e,
        Error::Db(redb::Error::Io(_) | redb::Error::PreviousIo) | Error::Io { .. }
    )
}

/// Opens a redb file for writing, shared with other writing processes. redb documents that a
/// plain open of an altered file may panic; a damaged file must give an error, never take the
/// process down.
pub(crate) fn open_redb(path: &Path, cache_bytes: usize) -> Result<Database> {
    open_redb_as(path, cache_bytes, Sharing::Shared)
}

/// [`open_redb`] in the given sharing mode. A file another process writes in a mode that
/// excludes this one is [`Error::InUse`].
pub(crate) fn open_redb_as(path: &Path, cache_bytes: usize, sharing: Sharing) -> Result<Database> {
    let p = path.to_path_buf();
    let mode = match sharing {
        Sharing::Shared => redb::ConcurrencyMode::MultiWriter,
        Sharing::Sole => redb::ConcurrencyMode::SingleWriter,
    };
    let opened = std::panic::catch_unwind(move || {
        Database::builder()
            .set_concurrency_mode(mode)
            .set_cache_size(cache_bytes)
            .create(&p)
    });
    match opened {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(e)) => Err(open_error(path, e)),
        Err(_) => Err(Error::Corrupt(format!(
            "{} could not be read as a redb database",
            path.display()
        ))),
    }
}

/// Makes `path` a new redb database, readable and writable by its owner only, if nothing is
/// there yet: whole or not at all. redb initializes a new file in place and writes its magic
/// number last, so a process killed in between (a daemon killed as it first starts) leaves a
/// file that every later open refuses ("Not a redb database"). The file is made under a
/// temporary name beside `path`, initialized and flushed there, then linked to `path`; if
/// another process linked its own first, that one is used. A crash leaves only the temporary
/// file (`.NAME.new-PID-NANOS`), which nothing reads.
pub(crate) fn create_redb(path: &Path) -> Result<()> {
    create_redb_with(path, |tmp| open_redb(tmp, 1 << 20).map(drop))
}

/// [`create_redb`] with the step that initializes the temporary file given (tests make it
/// fail half-way, as a kill would).
fn create_redb_with(path: &Path, init: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tmp = dir.join(format!(".{name}.new-{}-{nanos}", std::process::id()));
    create_private(&tmp)?;
    let made = init(&tmp).and_then(|()| match std::fs::hard_link(&tmp, path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        // A file system without hard links: a rename, which would replace a file another
        // process made meanwhile, so only while there is none.
        Err(_) if !path.exists() => std::fs::rename(&tmp, path).map_err(|e| Error::Io {
            path: path.to_path_buf(),
            source: e,
        }),
        Err(e) => Err(Error::Io {
            path: path.to_path_buf(),
            source: e,
        }),
    });
    let _ = std::fs::remove_file(&tmp);
    made?;
    // The new name, durable as the file's contents are.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Creates an empty file readable and writable by its owner only (nothing if it exists).
fn create_private(path: &Path) -> Result<()> {
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    match opts.open(path) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(Error::Io {
            path: path.to_path_buf(),
            source: e,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A creation cut off half-way (as a kill during redb's initialization would) leaves
    /// nothing at the database's path, so the next start creates it; redb initializing the
    /// file in place left one that every later open refused.
    #[test]
    fn a_creation_cut_off_half_way_leaves_nothing_at_the_path() {
        let dir = std::env::temp_dir().join(format!(
            "tether-create-redb-{}-{}",
            std::process::id(),
            crate::store::random_u64()
        ));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("worker.redb");
        let cut = create_redb_with(&path, |tmp| {
            // What redb has written when it is killed before its magic number: a file of
            // the database's length, its header not yet marked.
            std::fs::write(tmp, vec![0u8; 64 << 10]).expect("write");
            Err(Error::Conflict("killed".into()))
        });
        assert!(cut.is_err());
        assert!(
            !path.exists(),
            "nothing at the path after a cut-off creation"
        );
        create_redb(&path).expect("the next start creates the database");
        let db = open_redb(&path, 1 << 20).expect("a whole redb database");
        drop(db);
        // A second creation (another process that lost the race) keeps the first file.
        create_redb(&path).expect("created again: nothing changes");
        open_redb(&path, 1 << 20).expect("still a whole database");
        let left: Vec<_> = std::fs::read_dir(&dir)
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("worker.redb")]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "tether-{name}-{}-{}",
            std::process::id(),
            crate::store::random_u64()
        ));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("worker.redb");
        create_redb(&path).expect("create");
        path
    }

    /// A sole writer's file refuses every other writer, shared or sole, with an error that
    /// says the file is in use (not that it is damaged), and still admits readers.
    #[test]
    fn a_sole_writer_refuses_other_writers_and_admits_readers() {
        let path = scratch("sole-writer");
        let sole = open_redb_as(&path, 1 << 20, Sharing::Sole).expect("the sole writer");
        for other in [Sharing::Shared, Sharing::Sole] {
            match open_redb_as(&path, 1 << 20, other) {
                Err(Error::InUse(p)) => assert_eq!(p, path),
                Err(e) => panic!("{other:?}: {e}"),
                Ok(_) => panic!("{other:?} opened beside a sole writer"),
            }
        }
        let reader = redb::Builder::new()
            .set_concurrency_mode(redb::ConcurrencyMode::MultiWriter)
            .open_read_only(&path)
            .expect("a reader beside the sole writer");
        drop(reader);
        drop(sole);
        // And a shared writer keeps a sole one out while it has the file.
        let shared = open_redb(&path, 1 << 20).expect("shared");
        assert!(matches!(
            open_redb_as(&path, 1 << 20, Sharing::Sole),
            Err(Error::InUse(_))
        ));
        drop(shared);
        open_redb_as(&path, 1 << 20, Sharing::Sole).expect("sole once the file is free");
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// After an I/O error a sole writer's handle is opened again: the broken handle is closed
    /// first (the file admits one writing handle), once no transaction still holds it.
    #[test]
    fn a_sole_writers_handle_is_opened_again_after_an_io_error() {
        let path = scratch("sole-reopen");
        let p = path.clone();
        let open: Opener = std::sync::Arc::new(move || open_redb_as(&p, 1 << 20, Sharing::Sole));
        let handle = Reopening::with(open, Sharing::Sole).expect("open");
        let first = handle.get().expect("the handle");
        let old = std::sync::Arc::downgrade(&first);
        assert!(handle.after(&Error::Db(redb::Error::PreviousIo)));
        // A transaction still holds the broken handle: it is kept until that one ends.
        let held = handle.get().expect("still the broken handle");
        assert!(std::sync::Arc::ptr_eq(&first, &held));
        drop((first, held));
        let again = handle.get().expect("opened again");
        assert!(old.upgrade().is_none(), "the broken handle was closed");
        assert!(!handle.broken.load(std::sync::atomic::Ordering::SeqCst));
        let w = again.begin_write().expect("the new handle writes");
        w.commit().expect("commit");
        drop(again);
        // Not broken any more: the same handle from now on.
        let a = handle.get().expect("handle");
        let b = handle.get().expect("handle");
        assert!(std::sync::Arc::ptr_eq(&a, &b));
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }
}
