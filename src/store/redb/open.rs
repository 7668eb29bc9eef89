//! Opening the worker database: creation with mode 0600, the schema check, tables added by
//! later versions, the database id, and the read-only open of the read verbs.

use redb::ReadableTable;
use std::path::Path;

use crate::store::random_u64;

use super::handle::{Handle, Reopening, Sharing, open_error, open_redb_as};
use super::schema::*;
use super::{Error, Opener, RedbStore, Result, create_redb};

impl RedbStore {
    /// Opens (and with `create`, creates with mode 0600) the database at `path`, shared for
    /// writing with other processes.
    pub fn open(path: &Path, create: bool) -> Result<RedbStore> {
        RedbStore::open_as(path, create, Sharing::Shared)
    }

    /// [`RedbStore::open`] in the given sharing mode: [`Sharing::Sole`] for a daemon that is
    /// the file's only writer while it runs.
    pub fn open_as(path: &Path, create: bool, sharing: Sharing) -> Result<RedbStore> {
        if !path.exists() {
            if !create {
                return Err(Error::Missing(path.to_path_buf()));
            }
            create_redb(path)?;
        } else if path.is_dir() {
            return Err(Error::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other("it is a directory"),
            });
        } else {
            check_not_empty(path)?;
        }
        let p = path.to_path_buf();
        let open = std::sync::Arc::new(move || open_redb_as(&p, 32 << 20, sharing));
        RedbStore::open_with_as(path, open, sharing)
    }

    /// Opens the database with `open`, which makes a fresh handle each time it is called
    /// (again after an I/O error); tests pass one over a storage backend that fails on demand.
    pub fn open_with(path: &Path, open: Opener) -> Result<RedbStore> {
        RedbStore::open_with_as(path, open, Sharing::Shared)
    }

    /// [`RedbStore::open_with`], where `open` makes handles in the sharing mode given.
    pub fn open_with_as(path: &Path, open: Opener, sharing: Sharing) -> Result<RedbStore> {
        let mut store = RedbStore {
            db: Handle::Writer(Reopening::with(open, sharing)?),
            path: path.to_path_buf(),
            db_id: String::new(),
            meter: Default::default(),
            limits: Default::default(),
            wake: Default::default(),
            woken: Default::default(),
        };
        store.init()?;
        store.db_id = store.load_db_id()?;
        Ok(store)
    }

    /// Opens an existing database for reading: read-only when redb allows it, else (a file
    /// that needs recovery after a crash, or one that reads oddly) as a writer, which recovers
    /// it or reports the damage with the writer's full checks.
    /// A daemon that is the file's only writer refuses that writer's open while it recovers
    /// the file after a crash (redb refuses readers meanwhile): the read is tried again until
    /// it is done, for up to a minute.
    pub fn open_for_reading(path: &Path) -> Result<RedbStore> {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let tried = match RedbStore::open_read_only(path) {
                Ok(s) => return Ok(s),
                Err(e @ (Error::Missing(_) | Error::NewerVersion { .. })) => return Err(e),
                Err(_) => RedbStore::open(path, false),
            };
            match tried {
                Err(Error::InUse(_)) if std::time::Instant::now() < until => {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                done => return done,
            }
        }
    }

    /// Opens an existing database read-only, beside any writers: a read verb neither takes the
    /// writer lock nor waits for a process that holds a write transaction open.
    pub fn open_read_only(path: &Path) -> Result<RedbStore> {
        if !path.exists() {
            return Err(Error::Missing(path.to_path_buf()));
        }
        if path.is_dir() {
            return Err(Error::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other("it is a directory"),
            });
        }
        check_not_empty(path)?;
        let p = path.to_path_buf();
        let opened = std::panic::catch_unwind(move || {
            redb::Builder::new()
                .set_concurrency_mode(redb::ConcurrencyMode::MultiWriter)
                .set_cache_size(8 << 20)
                .open_read_only(&p)
        });
        let db = match opened {
            Ok(Ok(db)) => db,
            Ok(Err(e)) => return Err(open_error(path, e)),
            Err(_) => {
                return Err(Error::Corrupt(format!(
                    "{} could not be read as a redb database",
                    path.display()
                )));
            }
        };
        let mut store = RedbStore {
            db: Handle::Reader(db),
            path: path.to_path_buf(),
            db_id: String::new(),
            meter: Default::default(),
            limits: Default::default(),
            wake: Default::default(),
            woken: Default::default(),
        };
        let (schema, id) = {
            let r = store.db.begin_read()?;
            match r.open_table(META) {
                Ok(t) => (
                    t.get(META_SCHEMA)?.map(|g| g.value()),
                    t.get(META_DB_ID)?.map(|g| g.value()),
                ),
                Err(redb::TableError::TableDoesNotExist(_)) => (None, None),
                Err(e) => return Err(e.into()),
            }
        };
        match schema {
            Some(v) if v > SCHEMA_VERSION => {
                return Err(Error::NewerVersion {
                    what: format!("database {}", path.display()),
                    found: v,
                    supported: SCHEMA_VERSION,
                });
            }
            Some(SCHEMA_VERSION) => {}
            Some(_) => {
                // An older format: opened as a writer by `open_for_reading`, which migrates it.
                return Err(Error::Conflict(format!(
                    "{} is in an older format and must be migrated by a writer first",
                    path.display()
                )));
            }
            None => {
                return Err(Error::Corrupt(format!(
                    "{} is not a Tether worker database (no schema version)",
                    path.display()
                )));
            }
        }
        store.db_id = id.map_or_else(String::new, |id| format!("{id:012x}"));
        Ok(store)
    }

    /// Called with an error a transaction of this store gave: after an I/O error the handle
    /// is opened again, so the next transaction can succeed once the disk is healthy.
    pub fn after_error(&self, e: &Error) {
        if let Handle::Writer(db) = &self.db {
            db.after(e);
        }
    }

    /// The database id that prefixes every call key of this database.
    /// The file this store reads and writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn db_id(&self) -> &str {
        &self.db_id
    }

    /// Reads the database id, making one if the file has none yet (a file from before ids).
    fn load_db_id(&self) -> Result<String> {
        let found = {
            let r = self.db.begin_read()?;
            r.open_table(META)?.get(META_DB_ID)?.map(|g| g.value())
        };
        let id = match found {
            Some(id) => id,
            None => {
                let w = self.db.begin_write()?;
                let id = {
                    let mut meta = w.open_table(META)?;
                    // Checked again inside the write: another process may have made it.
                    let existing = meta.get(META_DB_ID)?.map(|g| g.value());
                    match existing {
                        Some(id) => id,
                        None => {
                            let id = random_u64() & DB_ID_MASK;
                            meta.insert(META_DB_ID, id)?;
                            id
                        }
                    }
                };
                w.commit()?;
                id
            }
        };
        Ok(format!("{id:012x}"))
    }

    fn init(&self) -> Result<()> {
        let found = {
            let r = self.db.begin_read()?;
            match r.open_table(META) {
                Ok(t) => t.get(META_SCHEMA)?.map(|g| g.value()),
                Err(redb::TableError::TableDoesNotExist(_)) => None,
                Err(e) => return Err(e.into()),
            }
        };
        match found {
            Some(v) if v > SCHEMA_VERSION => Err(Error::NewerVersion {
                what: format!("database {}", self.path.display()),
                found: v,
                supported: SCHEMA_VERSION,
            }),
            Some(SCHEMA_VERSION) if self.has_every_table()? => Ok(()),
            _ => self.create_tables(),
        }
    }

    /// Creates what is missing and rewrites every version-1 record, in one transaction, so
    /// the file is never half migrated. A file with tables but no schema version is a redb
    /// file of another kind (the demo store's, say): refused, never adopted (judged inside the
    /// write, so a process that just created the file beside us is not mistaken for one).
    fn create_tables(&self) -> Result<()> {
        let w = self.db.begin_write()?;
        {
            let was = match w.open_table(META) {
                Ok(t) => t.get(META_SCHEMA)?.map(|g| g.value()),
                Err(e) => return Err(e.into()),
            };
            if was.is_none() {
                use redb::TableHandle;
                let others: Vec<String> = w
                    .list_tables()
                    .map_err(redb::Error::from)?
                    .map(|t| t.name().to_string())
                    .filter(|n| n != META.name())
                    .collect();
                if !others.is_empty() {
                    drop(w);
                    return Err(Error::Io {
                        path: self.path.clone(),
                        source: std::io::Error::other(format!(
                            "it is a redb database of another kind, not a Tether worker database (it has the tables {}); is it the demo shop's file (--store)?",
                            others.join(", ")
                        )),
                    });
                }
            }
            let mut meta = w.open_table(META)?;
            let v1 = was == Some(1);
            meta.insert(META_SCHEMA, SCHEMA_VERSION)?;
            w.open_table(READY)?;
            w.open_table(RUNNING)?;
            w.open_table(ENQUEUE_KEYS)?;
            w.open_table(WAITING)?;
            w.open_table(HELD)?;
            w.open_table(DAMAGED)?;
            w.open_table(CALL_KEYS)?;
            w.open_table(SPANS)?;
            w.open_table(REPLIES)?;
            w.open_table(EVENTS)?;
            w.open_table(NOTES)?;
            drop(super::flow::Flow::open(&w)?);
            let mut tables = super::rows::Tables::open(&w)?;
            if v1 {
                let n = migrate_v1(&w, &mut tables)?;
                tracing::info!(
                    path = %self.path.display(),
                    records = n,
                    "migrated the database from record format 1 (JSON) to 2"
                );
            }
            drop(tables);
            let mut idx = super::list::Indexes::open(&w)?;
            if was.is_some_and(|v| v < 3) {
                let n = idx.rebuild(&w)?;
                tracing::info!(
                    path = %self.path.display(),
                    tasks = n,
                    "built the list indexes (schema version 3)"
                );
            }
        }
        w.commit()?;
        Ok(())
    }
}

impl RedbStore {
    /// Whether every table of this version exists (a table may have been added since the file
    /// was made, or dropped by hand).
    fn has_every_table(&self) -> Result<bool> {
        use redb::TableHandle;
        let r = self.db.begin_read()?;
        let names: std::collections::BTreeSet<String> = r
            .list_tables()
            .map_err(redb::Error::from)?
            .map(|t| t.name().to_string())
            .collect();
        Ok(ALL_TABLES.iter().all(|t| names.contains(*t)))
    }
}

/// Rewrites every record of a version-1 file: a task record becomes its row, its spec and its
/// blobs; every other record is re-encoded. Returns how many records were rewritten.
fn migrate_v1(w: &redb::WriteTransaction, tables: &mut super::rows::Tables<'_>) -> Result<u64> {
    use crate::store::codec::{decode_legacy, is_legacy, migrate_table};
    let mut n = 0;
    let legacy: Vec<(String, Vec<u8>)> = {
        let mut out = Vec::new();
        for entry in tables.tasks.iter()? {
            let (k, v) = entry?;
            if is_legacy(v.value()) {
                out.push((k.value().to_string(), v.value().to_vec()));
            }
        }
        out
    };
    for (id, bytes) in legacy {
        match decode_legacy::<crate::store::TaskRecord>(&format!("task {id}"), &bytes) {
            Ok(rec) => {
                tables.insert_new(&rec)?;
                n += 1;
            }
            Err(e) => {
                w.open_table(DAMAGED)?
                    .insert(id.as_str(), e.to_string().as_str())?;
            }
        }
    }
    n += migrate_table::<_, crate::store::CallRecord>(&mut w.open_table(CALL_KEYS)?, "call key")?;
    n += migrate_table::<_, crate::kernel::Span>(&mut w.open_table(SPANS)?, "span")?;
    n += migrate_table::<_, crate::model::RecordedReply>(&mut w.open_table(REPLIES)?, "reply")?;
    n += migrate_table::<_, crate::store::Event>(&mut w.open_table(EVENTS)?, "event")?;
    n += migrate_table::<_, crate::kernel::memory::Note>(&mut w.open_table(NOTES)?, "note")?;
    Ok(n)
}

/// An existing file of 0 bytes is a truncated database, never taken for a new one. A file
/// another process has just created is empty only until redb writes its header, so an empty
/// file is looked at again for up to a second before it is called truncated.
pub(crate) fn check_not_empty(path: &Path) -> Result<()> {
    if let Ok(m) = std::fs::metadata(path)
        && !m.is_file()
    {
        // A FIFO, a device or a socket: reading it would block or mean nothing.
        return Err(Error::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(
                "it is not a regular file (a FIFO, a device or a socket?); give the path of a database file",
            ),
        });
    }
    for _ in 0..20 {
        match std::fs::metadata(path) {
            Ok(m) if m.len() == 0 => std::thread::sleep(std::time::Duration::from_millis(50)),
            _ => return Ok(()),
        }
    }
    Err(Error::Corrupt(format!(
        "{} is empty (0 bytes): a truncated database, not a new one",
        path.display()
    )))
}

/// Database ids are 48 bits: 12 hex digits in every call key.
const DB_ID_MASK: u64 = (1 << 48) - 1;
