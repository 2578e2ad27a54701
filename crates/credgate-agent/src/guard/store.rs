//! Durable pull records and intents in SQLite, under the state directory.
//!
//! One writer thread owns the write connection. Callers send operations and wait for their
//! acknowledgement; the writer takes every operation waiting at that moment, applies them in one
//! transaction and commits (WAL, `synchronous=FULL`: the commit is on disk before anyone is
//! acknowledged), then publishes the new state to memory. So concurrent recordings share one
//! fsync (group commit), readers never see an uncommitted write, and a pull acknowledged as
//! recorded survives a power cut. Reads are served from memory.
//!
//! Merges happen in the writer, against its authoritative state, so two pulls of one image with
//! different credentials cannot lose each other's update.

use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use credgate_core::guard::{self, stored, Learned, Presented, Record};
use rusqlite::{params, Connection, TransactionBehavior};
use tokio::sync::oneshot;

/// The schema version this build reads and writes.
pub const SCHEMA_VERSION: i64 = 2;

/// Every migration, in order; migration `i` takes the schema from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    "
    CREATE TABLE records (
        image_ref  TEXT PRIMARY KEY,
        body       TEXT NOT NULL,
        changed_ms INTEGER NOT NULL
    );
    CREATE TABLE intents (
        image      TEXT PRIMARY KEY,
        name       TEXT NOT NULL,
        count      INTEGER NOT NULL,
        created_ms INTEGER NOT NULL
    );
",
    "
    -- Version 2: records are an append-only log (last row of an image ID wins, a NULL body
    -- deletes), so a batch of recordings appends a few pages instead of touching one B-tree
    -- leaf per image. The log is compacted when it outgrows the live records.
    CREATE TABLE record_log (
        seq       INTEGER PRIMARY KEY,
        image_ref TEXT NOT NULL,
        body      TEXT
    );
    INSERT INTO record_log (image_ref, body) SELECT image_ref, body FROM records;
    DROP TABLE records;
",
];

/// Why the store cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the guard store {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("the guard store {path} is damaged ({detail}); decisions fail safe (authenticate) until it is repaired or removed")]
    Corrupt { path: PathBuf, detail: String },
    #[error("the guard store {path} is in use by another process (is another agent still running with this state directory?); decisions fail safe until it is free")]
    Locked { path: PathBuf },
    #[error(
        "the disk holding the guard store {path} is full; decisions fail safe until there is room"
    )]
    Full { path: PathBuf },
    #[error(transparent)]
    Untrusted(#[from] credgate_api::trust::TrustError),
    #[error("the guard store {path} has schema version {found}, newer than this credgate ({SCHEMA_VERSION})")]
    TooNew { path: PathBuf, found: i64 },
    #[error("cannot set up the state directory {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing to the guard store failed: {0}")]
    Write(String),
    #[error("the guard store is closed")]
    Closed,
}

/// A pull intent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intent {
    /// The normalized image name.
    pub name: String,
    /// Pulls in flight for this image reference.
    pub count: i64,
    pub created_ms: i64,
}

/// An image the runtime has, for recovery and pruning.
#[derive(Debug, Clone, Default)]
pub struct PresentImage {
    pub image_ref: String,
    /// Normalized references (`name:tag` or `name@digest`) it is known by.
    pub references: Vec<String>,
}

/// What a prune did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pruned {
    pub records_deleted: usize,
    pub intents_recovered: usize,
    pub intents_dropped: usize,
}

/// The in-memory view, replaced piecewise after each commit.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Records by image ID, keyed by the record's own `image_ref` (not a copy of it): a third
/// less memory per record than a map from `String`.
#[derive(Default)]
struct RecordTable {
    table: hashbrown::HashTable<Arc<Record>>,
    hasher: foldhash::fast::RandomState,
}

impl RecordTable {
    fn hash(&self, key: &str) -> u64 {
        std::hash::BuildHasher::hash_one(&self.hasher, key)
    }

    fn get(&self, key: &str) -> Option<&Arc<Record>> {
        self.table.find(self.hash(key), |r| r.image_ref == key)
    }

    fn insert(&mut self, record: Arc<Record>) {
        let hash = self.hash(&record.image_ref);
        let hasher = &self.hasher;
        match self.table.entry(
            hash,
            |r| r.image_ref == record.image_ref,
            |r| std::hash::BuildHasher::hash_one(hasher, r.image_ref.as_str()),
        ) {
            hashbrown::hash_table::Entry::Occupied(mut e) => *e.get_mut() = record,
            hashbrown::hash_table::Entry::Vacant(e) => {
                e.insert(record);
            }
        }
    }

    fn remove(&mut self, key: &str) {
        if let Ok(e) = self
            .table
            .find_entry(self.hash(key), |r| r.image_ref == key)
        {
            e.remove();
        }
    }

    fn len(&self) -> usize {
        self.table.len()
    }

    fn values(&self) -> impl Iterator<Item = &Arc<Record>> {
        self.table.iter()
    }
}

#[derive(Default)]
struct Mem {
    records: RecordTable,
    /// By normalized image reference.
    intents: FastMap<String, Intent>,
    /// Intents per normalized name.
    intent_names: FastMap<String, usize>,
}

impl Mem {
    fn add_intent(&mut self, image: &str, intent: Intent) {
        if let Some(old) = self.intents.insert(image.to_owned(), intent.clone()) {
            self.drop_name(&old.name);
        }
        *self.intent_names.entry(intent.name).or_default() += 1;
    }

    fn remove_intent(&mut self, image: &str) {
        if let Some(old) = self.intents.remove(image) {
            self.drop_name(&old.name);
        }
    }

    fn drop_name(&mut self, name: &str) {
        if let Some(n) = self.intent_names.get_mut(name) {
            *n -= 1;
            if *n == 0 {
                self.intent_names.remove(name);
            }
        }
    }
}

/// A write.
#[derive(Debug, Clone)]
pub enum Op {
    /// A pull of `image` (normalized reference) of `name` is about to start.
    Intent {
        image: String,
        name: String,
    },
    /// The pull ended. On success the credential that worked is merged into the record of
    /// `image_ref`; the intent is dropped either way (kept if the record cannot be written).
    PullResult {
        image: String,
        name: String,
        image_ref: String,
        used: Option<Presented>,
    },
    /// A decision learned something about `name` of `image_ref`; applied to the record as it
    /// is when written.
    Learn {
        image_ref: String,
        name: String,
        learned: Learned,
    },
    Delete {
        image_ref: String,
    },
    Prune {
        present: Vec<PresentImage>,
        before_ms: i64,
    },
}

/// What a write did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Done {
    Ok,
    Deleted(bool),
    Pruned(Pruned),
}

struct Job {
    op: Op,
    now_ms: i64,
    reply: oneshot::Sender<Result<Done, StoreError>>,
}

/// A message to the writer.
enum Msg {
    Write(Job),
    /// Finish, checkpoint and close the file, then answer.
    Close(oneshot::Sender<()>),
}

/// How long [`Store::open`] waits for another process to let go of the file.
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The store. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    mem: Arc<RwLock<Mem>>,
    tx: mpsc::Sender<Msg>,
    commits: Arc<AtomicU64>,
    /// The writer thread, joined by [`Store::close`] (it ends on its own when the store is
    /// dropped unclosed: its channel closes).
    writer: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl Store {
    /// Opens (or creates) `dir/guard.db`, checks it and loads it into memory; waits up to
    /// [`LOCK_WAIT`] for a process that holds it (one stopping) to let go.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        Self::open_waiting(dir, LOCK_WAIT)
    }

    /// [`open`](Self::open), waiting at most `wait` for a holder of the file to let go before
    /// it is [`StoreError::Locked`].
    pub fn open_waiting(dir: &Path, wait: std::time::Duration) -> Result<Store, StoreError> {
        let io = |source| StoreError::Io {
            path: dir.to_owned(),
            source,
        };
        crate::state::state_dir(dir)?;
        let path = dir.join("guard.db");
        // Created 0600 before SQLite opens it; its -wal and -shm files take the same mode. A
        // link or a file someone else can write is refused: the directory is the agent's alone,
        // so what is checked here is what SQLite opens.
        crate::state::create_trusted(&path).map_err(|e| match e {
            crate::state::FileError::Io(source) => io(source),
            crate::state::FileError::Untrusted(e) => StoreError::Untrusted(e),
        })?;
        for side in ["guard.db-wal", "guard.db-shm"] {
            let p = dir.join(side);
            if let Ok(meta) = std::fs::symlink_metadata(&p) {
                credgate_api::trust::check(&p, &meta, credgate_api::trust::Owner::Me)?;
            }
        }
        let open_err = |source| StoreError::Open {
            path: path.clone(),
            source,
        };
        let corrupt = |detail: String| StoreError::Corrupt {
            path: path.clone(),
            detail,
        };
        let conn = Connection::open(&path).map_err(open_err)?;
        let setup = || -> rusqlite::Result<(String, String)> {
            conn.busy_timeout(wait)?;
            let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
            // One process owns the file: exclusive locking spares a lock round trip per
            // transaction.
            conn.execute_batch("PRAGMA synchronous=FULL; PRAGMA locking_mode=EXCLUSIVE;")?;
            let check = conn.query_row("PRAGMA quick_check", [], |r| r.get(0))?;
            Ok((mode, check))
        };
        match setup() {
            Ok((mode, check)) if mode == "wal" && check == "ok" => {}
            Ok((mode, check)) => {
                return Err(corrupt(format!("journal mode {mode}, check {check}")))
            }
            Err(e) => {
                use rusqlite::ErrorCode::{DatabaseBusy, DatabaseLocked, DiskFull};
                return Err(match e.sqlite_error_code() {
                    Some(DatabaseBusy | DatabaseLocked) => StoreError::Locked { path },
                    Some(DiskFull) => StoreError::Full { path },
                    _ => corrupt(e.to_string()),
                });
            }
        }
        migrate(&conn, &path)?;
        let (mem, log_rows) =
            load(&conn).map_err(|e| corrupt(credgate_core::text::error_chain(&e)))?;
        let mem = Arc::new(RwLock::new(mem));
        let (tx, rx) = mpsc::channel::<Msg>();
        let writer_mem = mem.clone();
        let commits = Arc::new(AtomicU64::new(0));
        let writer_commits = commits.clone();
        let writer = std::thread::Builder::new()
            .name("credgate-guard-writer".into())
            .spawn(move || writer(conn, rx, writer_mem, writer_commits, log_rows))
            .map_err(io)?;
        Ok(Store {
            mem,
            tx,
            commits,
            writer: Arc::new(Mutex::new(Some(writer))),
        })
    }

    /// The record of an image ID.
    pub fn record(&self, image_ref: &str) -> Option<Arc<Record>> {
        self.mem.read().records.get(image_ref).cloned()
    }

    /// The record of an image ID and whether an intent exists for `name`, read together.
    pub fn view(&self, image_ref: &str, name: &str) -> (Option<Arc<Record>>, bool) {
        let m = self.mem.read();
        (
            m.records.get(image_ref).cloned(),
            m.intent_names.contains_key(name),
        )
    }

    /// Every record, sorted by image ID.
    pub fn records(&self) -> Vec<Arc<Record>> {
        let mut all: Vec<Arc<Record>> = self.mem.read().records.values().cloned().collect();
        all.sort_by(|a, b| a.image_ref.cmp(&b.image_ref));
        all
    }

    /// Every intent, sorted by image reference.
    pub fn intents(&self) -> Vec<(String, Intent)> {
        let mut all: Vec<(String, Intent)> = self
            .mem
            .read()
            .intents
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Transactions committed so far (each may hold many writes).
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// (records, intents) stored.
    pub fn counts(&self) -> (usize, usize) {
        let m = self.mem.read();
        (m.records.len(), m.intents.len())
    }

    /// Applies a write durably; returns once it is committed.
    pub async fn apply(&self, op: Op, now_ms: i64) -> Result<Done, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Msg::Write(Job { op, now_ms, reply }))
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Commits what is queued, checkpoints and closes the file, and joins the writer thread.
    /// Later writes fail with [`StoreError::Closed`]; reads keep answering from memory.
    pub async fn close(&self) {
        let (done, rx) = oneshot::channel();
        if self.tx.send(Msg::Close(done)).is_ok() {
            let _ = rx.await;
        }
        let writer = self.writer.lock().take();
        if let Some(writer) = writer {
            if tokio::task::spawn_blocking(move || writer.join())
                .await
                .map_or(true, |joined| joined.is_err())
            {
                tracing::error!("the guard store's writer thread panicked");
            }
        }
    }
}

/// Brings the schema of the store at `path` to [`SCHEMA_VERSION`], one transaction a step; a
/// store of a newer version is refused, never downgraded.
fn migrate(conn: &Connection, path: &Path) -> Result<(), StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt {
        path: path.to_owned(),
        detail,
    };
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(|e| corrupt(e.to_string()))?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::TooNew {
            path: path.to_owned(),
            found: version,
        });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        let next = i as i64 + 1;
        conn.execute_batch(&format!(
            "BEGIN IMMEDIATE; {sql} PRAGMA user_version = {next}; COMMIT;"
        ))
        .map_err(|e| corrupt(format!("migration to version {next}: {e}")))?;
    }
    Ok(())
}

/// Why the stored state could not be read (the store is then damaged).
#[derive(Debug, thiserror::Error)]
enum LoadError {
    #[error("reading it failed")]
    Sql(#[from] rusqlite::Error),
    #[error("record {image_ref:?} does not decode")]
    Decode {
        image_ref: String,
        #[source]
        source: credgate_core::guard::stored::StoredError,
    },
    #[error("record {image_ref:?} holds {holds:?}")]
    Elsewhere { image_ref: String, holds: String },
}

/// Reads the state; also returns the length of the record log.
fn load(conn: &Connection) -> Result<(Mem, usize), LoadError> {
    let mut mem = Mem::default();
    let mut log_rows = 0usize;
    let mut stmt = conn.prepare("SELECT image_ref, body FROM record_log ORDER BY seq")?;
    let rows = stmt.query_map([], |r| {
        Ok((r.get::<_, String>(0)?, r.get::<_, Option<String>>(1)?))
    })?;
    for row in rows {
        let (image_ref, body) = row?;
        log_rows += units(body.as_deref().map_or(0, str::len));
        let Some(body) = body else {
            mem.records.remove(&image_ref);
            continue;
        };
        let record = match stored::decode(body.as_bytes()) {
            Ok(record) => record,
            Err(source) => return Err(LoadError::Decode { image_ref, source }),
        };
        if record.image_ref != image_ref {
            return Err(LoadError::Elsewhere {
                image_ref,
                holds: record.image_ref,
            });
        }
        mem.records.insert(Arc::new(record));
    }
    let mut stmt = conn.prepare("SELECT image, name, count, created_ms FROM intents")?;
    let rows = stmt.query_map([], |r| {
        Ok((
            r.get::<_, String>(0)?,
            Intent {
                name: r.get(1)?,
                count: r.get(2)?,
                created_ms: r.get(3)?,
            },
        ))
    })?;
    for row in rows {
        let (image, intent) = row?;
        mem.add_intent(&image, intent);
    }
    Ok((mem, log_rows))
}

/// What a row of the record log weighs: one, and one more per 4 KiB of its body, so that a
/// log of a few large records (every pull rewrites its record) is compacted as soon as one of
/// many small ones would be, and the file stays within a few times what is live.
fn units(body_len: usize) -> usize {
    1 + body_len / 4096
}

/// Whether a log of `units` (see [`units`]) holding `live` records should be rewritten.
fn needs_compaction(units: usize, live: usize) -> bool {
    units > 2 * live + 1024
}

/// Rewrites the record log with one row per live record, in one transaction; the units it
/// wrote.
fn compact(conn: &mut Connection, mem: &Mem) -> rusqlite::Result<usize> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    tx.execute("DELETE FROM record_log", [])?;
    let mut written = 0;
    {
        let mut insert = tx.prepare("INSERT INTO record_log (image_ref, body) VALUES (?1, ?2)")?;
        for r in mem.records.values() {
            let body = stored::encode(r);
            written += units(body.len());
            insert.execute(params![r.image_ref, body])?;
        }
    }
    tx.commit()?;
    Ok(written)
}

/// The most operations committed in one transaction.
const MAX_BATCH: usize = 1024;

fn writer(
    mut conn: Connection,
    rx: mpsc::Receiver<Msg>,
    mem: Arc<RwLock<Mem>>,
    commits: Arc<AtomicU64>,
    mut log_rows: usize,
) {
    let mut closing = None;
    while let Ok(first) = rx.recv() {
        let mut batch = Vec::new();
        let mut next = Some(first);
        while let Some(msg) = next.take() {
            match msg {
                Msg::Write(job) => batch.push(job),
                Msg::Close(done) => {
                    closing = Some(done);
                    break;
                }
            }
            if batch.len() < MAX_BATCH {
                next = rx.try_recv().ok();
            }
        }
        if !batch.is_empty() {
            log_rows += commit(&mut conn, batch, &mem);
            commits.fetch_add(1, Ordering::Relaxed);
            let m = mem.read();
            if needs_compaction(log_rows, m.records.len()) {
                match compact(&mut conn, &m) {
                    Ok(rows) => log_rows = rows,
                    Err(e) => tracing::warn!(error = %e, "cannot compact the guard's record log"),
                }
            }
        }
        if closing.is_some() {
            break;
        }
    }
    let _ = conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE);");
    drop(conn);
    if let Some(done) = closing {
        let _ = done.send(());
    }
}

/// What one operation changes in memory once committed.
enum Effect {
    /// A record and the units its row weighs.
    PutRecord(Arc<Record>, usize),
    DeleteRecord(String),
    PutIntent(String, Intent),
    DeleteIntent(String),
}

/// Applies a batch in one transaction and answers every job. When an operation fails, the
/// transaction is rolled back and each job is retried in a transaction of its own, so one bad
/// operation fails alone.
fn commit(conn: &mut Connection, batch: Vec<Job>, mem: &Arc<RwLock<Mem>>) -> usize {
    match run(conn, &batch, mem) {
        Ok((results, appended)) => {
            for (job, result) in batch.into_iter().zip(results) {
                let _ = job.reply.send(Ok(result));
            }
            appended
        }
        Err(_) if batch.len() > 1 => batch
            .into_iter()
            .map(|job| commit(conn, vec![job], mem))
            .sum(),
        Err(e) => {
            for job in batch {
                let _ = job.reply.send(Err(StoreError::Write(e.to_string())));
            }
            0
        }
    }
}

/// One transaction for `batch`; once it is committed the effects are published to memory.
/// Returns the answers and how many units (see [`units`]) the record log grew by.
fn run(
    conn: &mut Connection,
    batch: &[Job],
    mem: &Arc<RwLock<Mem>>,
) -> Result<(Vec<Done>, usize), StoreError> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(|e| StoreError::Write(e.to_string()))?;
    // A staged view: the writer's own reads see the batch's earlier operations.
    let mut staged_records: HashMap<String, Option<Arc<Record>>> = HashMap::new();
    let mut staged_intents: HashMap<String, Option<Intent>> = HashMap::new();
    let mut results = Vec::with_capacity(batch.len());
    let mut effects = Vec::new();
    {
        let snapshot = mem.read();
        for job in batch {
            let ctx = Ctx {
                mem: &snapshot,
                records: &staged_records,
                intents: &staged_intents,
            };
            let (done, eff) = apply(&tx, &ctx, &job.op, job.now_ms)?;
            for e in &eff {
                match e {
                    Effect::PutRecord(r, _) => {
                        staged_records.insert(r.image_ref.clone(), Some(r.clone()));
                    }
                    Effect::DeleteRecord(k) => {
                        staged_records.insert(k.clone(), None);
                    }
                    Effect::PutIntent(k, i) => {
                        staged_intents.insert(k.clone(), Some(i.clone()));
                    }
                    Effect::DeleteIntent(k) => {
                        staged_intents.insert(k.clone(), None);
                    }
                }
            }
            effects.extend(eff);
            results.push(done);
        }
    }
    tx.commit().map_err(|e| StoreError::Write(e.to_string()))?;
    let appended = effects
        .iter()
        .map(|e| match e {
            Effect::PutRecord(_, weight) => *weight,
            Effect::DeleteRecord(_) => 1,
            _ => 0,
        })
        .sum();
    let mut m = mem.write();
    for e in effects {
        match e {
            Effect::PutRecord(r, _) => {
                m.records.insert(r);
            }
            Effect::DeleteRecord(k) => {
                m.records.remove(&k);
            }
            Effect::PutIntent(k, i) => m.add_intent(&k, i),
            Effect::DeleteIntent(k) => m.remove_intent(&k),
        }
    }
    Ok((results, appended))
}

/// The writer's view: committed memory overlaid with this batch's staged changes.
struct Ctx<'a> {
    mem: &'a Mem,
    records: &'a HashMap<String, Option<Arc<Record>>>,
    intents: &'a HashMap<String, Option<Intent>>,
}

impl Ctx<'_> {
    fn record(&self, image_ref: &str) -> Option<Arc<Record>> {
        match self.records.get(image_ref) {
            Some(staged) => staged.clone(),
            None => self.mem.records.get(image_ref).cloned(),
        }
    }

    fn intent(&self, image: &str) -> Option<Intent> {
        match self.intents.get(image) {
            Some(staged) => staged.clone(),
            None => self.mem.intents.get(image).cloned(),
        }
    }

    fn all_records(&self) -> Vec<Arc<Record>> {
        let committed = self.mem.records.values().map(|r| (r.image_ref.as_str(), r));
        overlay(committed, self.records).into_values().collect()
    }

    fn all_intents(&self) -> Vec<(String, Intent)> {
        let committed = self.mem.intents.iter().map(|(k, v)| (k.as_str(), v));
        overlay(committed, self.intents)
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect()
    }
}

/// Committed values with a batch's staged changes on top (`None` staged: removed).
fn overlay<'a, V: Clone + 'a>(
    committed: impl Iterator<Item = (&'a str, &'a V)>,
    staged: &'a HashMap<String, Option<V>>,
) -> HashMap<&'a str, V> {
    let mut out: HashMap<&str, V> = committed.map(|(k, v)| (k, v.clone())).collect();
    for (k, v) in staged {
        match v {
            Some(v) => {
                out.insert(k, v.clone());
            }
            None => {
                out.remove(k.as_str());
            }
        }
    }
    out
}

/// Appends `r`; the units (see [`units`]) the log grew by.
fn put_record(db: &Connection, r: &Record) -> Result<usize, StoreError> {
    let body = stored::encode(r);
    db.prepare_cached("INSERT INTO record_log (image_ref, body) VALUES (?1, ?2)")
        .and_then(|mut st| st.execute(params![r.image_ref, body]))
        .map_err(|e| StoreError::Write(e.to_string()))?;
    Ok(units(body.len()))
}

fn delete_record(db: &Connection, image_ref: &str) -> Result<(), StoreError> {
    db.prepare_cached("INSERT INTO record_log (image_ref, body) VALUES (?1, NULL)")
        .and_then(|mut st| st.execute(params![image_ref]))
        .map_err(|e| StoreError::Write(e.to_string()))?;
    Ok(())
}

fn put_intent(db: &Connection, image: &str, i: &Intent) -> Result<(), StoreError> {
    db.prepare_cached(
        "INSERT INTO intents (image, name, count, created_ms) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT(image) DO UPDATE SET count = excluded.count",
    )
    .and_then(|mut st| st.execute(params![image, i.name, i.count, i.created_ms]))
    .map_err(|e| StoreError::Write(e.to_string()))?;
    Ok(())
}

fn delete_intent(db: &Connection, image: &str) -> Result<(), StoreError> {
    db.prepare_cached("DELETE FROM intents WHERE image = ?1")
        .and_then(|mut st| st.execute(params![image]))
        .map_err(|e| StoreError::Write(e.to_string()))?;
    Ok(())
}

/// One intent fewer for `image`: the effect to publish.
fn release_intent(
    db: &Connection,
    ctx: &Ctx<'_>,
    image: &str,
) -> Result<Option<Effect>, StoreError> {
    let Some(mut intent) = ctx.intent(image) else {
        return Ok(None);
    };
    if intent.count > 1 {
        intent.count -= 1;
        put_intent(db, image, &intent)?;
        Ok(Some(Effect::PutIntent(image.to_owned(), intent)))
    } else {
        delete_intent(db, image)?;
        Ok(Some(Effect::DeleteIntent(image.to_owned())))
    }
}

fn apply(
    db: &Connection,
    ctx: &Ctx<'_>,
    op: &Op,
    now_ms: i64,
) -> Result<(Done, Vec<Effect>), StoreError> {
    let mut effects = Vec::new();
    let done = match op {
        Op::Intent { image, name } => {
            let intent = match ctx.intent(image) {
                Some(mut i) => {
                    i.count += 1;
                    i
                }
                None => Intent {
                    name: name.clone(),
                    count: 1,
                    created_ms: now_ms,
                },
            };
            put_intent(db, image, &intent)?;
            effects.push(Effect::PutIntent(image.clone(), intent));
            Done::Ok
        }
        Op::PullResult {
            image,
            name,
            image_ref,
            used,
        } => {
            if let Some(used) = used {
                let current = ctx.record(image_ref);
                let merged = guard::merge(current.as_deref(), image_ref, name, used, now_ms);
                let weight = put_record(db, &merged)?;
                effects.push(Effect::PutRecord(Arc::new(merged), weight));
            }
            effects.extend(release_intent(db, ctx, image)?);
            Done::Ok
        }
        Op::Learn {
            image_ref,
            name,
            learned,
        } => {
            let updated = ctx
                .record(image_ref)
                .and_then(|current| guard::learn(&current, name, learned, now_ms));
            if let Some(r) = updated {
                let weight = put_record(db, &r)?;
                effects.push(Effect::PutRecord(Arc::new(r), weight));
            }
            Done::Ok
        }
        Op::Delete { image_ref } => {
            let existed = ctx.record(image_ref).is_some();
            if existed {
                delete_record(db, image_ref)?;
                effects.push(Effect::DeleteRecord(image_ref.clone()));
            }
            Done::Deleted(existed)
        }
        Op::Prune { present, before_ms } => {
            Done::Pruned(prune(db, ctx, present, *before_ms, now_ms, &mut effects)?)
        }
    };
    Ok((done, effects))
}

/// Prune: leftover intents of present images become records with no credentials, and those of
/// absent images older than the horizon go; records of absent images older than it go.
fn prune(
    db: &Connection,
    ctx: &Ctx<'_>,
    present: &[PresentImage],
    before_ms: i64,
    now_ms: i64,
    effects: &mut Vec<Effect>,
) -> Result<Pruned, StoreError> {
    let mut pruned = Pruned::default();
    let present_refs: HashMap<&str, &PresentImage> =
        present.iter().map(|p| (p.image_ref.as_str(), p)).collect();
    let by_reference: HashMap<&str, &str> = present
        .iter()
        .flat_map(|p| {
            p.references
                .iter()
                .map(move |r| (r.as_str(), p.image_ref.as_str()))
        })
        .collect();
    // Leftover intents: present images become records with no credentials; absent
    // ones older than the horizon are dropped.
    let mut recovered: HashMap<String, Record> = HashMap::new();
    for (image, intent) in ctx.all_intents() {
        if let Some(image_ref) = by_reference.get(image.as_str()) {
            let current = recovered
                .get(*image_ref)
                .cloned()
                .or_else(|| ctx.record(image_ref).map(|r| (*r).clone()));
            let r = guard::recovered(current.as_ref(), image_ref, &intent.name, now_ms);
            recovered.insert((*image_ref).to_owned(), r);
            delete_intent(db, &image)?;
            effects.push(Effect::DeleteIntent(image));
            pruned.intents_recovered += 1;
        } else if intent.created_ms < before_ms {
            delete_intent(db, &image)?;
            effects.push(Effect::DeleteIntent(image));
            pruned.intents_dropped += 1;
        }
    }
    for r in recovered.into_values() {
        let weight = put_record(db, &r)?;
        effects.push(Effect::PutRecord(Arc::new(r), weight));
    }
    for r in ctx.all_records() {
        if !present_refs.contains_key(r.image_ref.as_str()) && r.changed_ms < before_ms {
            delete_record(db, &r.image_ref)?;
            effects.push(Effect::DeleteRecord(r.image_ref.clone()));
            pruned.records_deleted += 1;
        }
    }
    Ok(pruned)
}
